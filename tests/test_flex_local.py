"""Local attention's FlexAttention back-end gives the torch path's outputs (forward; on CPU flex has
no backward in this torch), over a whole sequence and through the cache in chunks."""

from __future__ import annotations

import pytest
import torch
from tests.variants import flex_twin, variant_config

from attnlab.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # flex's "compile me" note on CPU


@pytest.mark.parametrize("length", [5, 21, 40])
def test_flex_forward_equals_torch(length):
    reference, flex = flex_twin("local", "local")  # window 8, 4 query heads over 2 key/value heads
    tokens = torch.randint(0, reference.config.num_tokens, (2, length))
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens).logits, reference(tokens).logits, atol=1e-5, rtol=1e-5)


def test_flex_through_the_cache_in_chunks():
    reference, flex = flex_twin("local", "local")
    tokens = torch.randint(0, reference.config.num_tokens, (1, 30))
    cache = flex.new_cache(1, 30)
    with torch.no_grad():
        chunks = [flex(tokens[:, a:b], cache=cache).logits for a, b in [(0, 11), (11, 12), (12, 20), (20, 30)]]
        torch.testing.assert_close(torch.cat(chunks, dim=1), reference(tokens).logits, atol=1e-5, rtol=1e-5)


def test_flex_refuses_attention_dropout():
    with pytest.raises(ConfigError, match="no attention dropout"):  # with the config, which builds the model
        variant_config("local", attention={"kind": "local", "dropout": 0.1, "local": {"backend": "flex"}})
