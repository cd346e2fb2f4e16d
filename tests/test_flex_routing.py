"""Routed attention's FlexAttention kernel equals the torch path's functional core (forward, CPU)."""

from __future__ import annotations

import pytest
import torch
from tests.variants import flex_twin

from attnlab.attention.kernels.flex_routing import flex_routed_attention
from attnlab.attention.routing import routed_attention

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # flex's "compile me" note on CPU


@pytest.mark.parametrize("n_tokens, window, n_clusters", [(37, 4, 3), (64, 8, 2), (50, 16, 5)])
def test_flex_routed_equals_torch(n_tokens, window, n_clusters):
    torch.manual_seed(n_tokens)
    q, k, v = (torch.randn(2, 3, n_tokens, 8) for _ in range(3))
    clusters = torch.randint(0, n_clusters, (2, 3, n_tokens))
    clusters[0, 0] = 0  # one head with a single cluster: the window alone limits it
    got = flex_routed_attention(q, k, v, clusters, window)
    torch.testing.assert_close(got, routed_attention(q, k, v, clusters, window), atol=1e-5, rtol=1e-5)


def test_model_with_flex_routing_equals_torch():
    reference, flex = flex_twin("routing", "routing")  # layers mix local and routed heads
    tokens = torch.randint(0, reference.config.num_tokens, (2, 45))
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens).logits, reference(tokens).logits, atol=1e-5, rtol=1e-5)
