"""Sinkhorn bucket attention's FlexAttention kernel equals the torch path (forward, CPU)."""

from __future__ import annotations

import pytest
import torch
from tests.variants import flex_twin

from attnlab.attention.kernels.flex_sinkhorn import flex_bucket_attention
from attnlab.attention.sinkhorn import bucket_attention, bucket_means, sort_buckets

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # flex's "compile me" note on CPU


@pytest.mark.parametrize("n_tokens, bucket, n_sortcut", [(48, 8, 2), (45, 6, 1), (40, 8, 4)])
def test_flex_bucket_attention_equals_torch(n_tokens, bucket, n_sortcut):
    torch.manual_seed(n_tokens)
    q, k, v = (torch.randn(2, 3, n_tokens, 8) for _ in range(3))
    chosen, weights = sort_buckets(bucket_means(q, bucket), bucket_means(k, bucket), n_sortcut, 3, 0.75, gumbel=False)
    want = bucket_attention(q, k, v, chosen, weights, bucket)
    torch.testing.assert_close(flex_bucket_attention(q, k, v, chosen, weights, bucket), want, atol=1e-5, rtol=1e-5)


def test_model_with_flex_sinkhorn_equals_torch():
    reference, flex = flex_twin("sinkhorn", "sinkhorn")  # a local head and sorted heads
    tokens = torch.randint(0, reference.config.num_tokens, (2, 45))  # not a multiple of the bucket
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens).logits, reference(tokens).logits, atol=1e-5, rtol=1e-5)
