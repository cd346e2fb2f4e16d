"""The chunked cross-entropy (model.loss_chunk_size) equals the plain loss, with its gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.variants import variant_config

from attnlab.model.loss import IGNORE_INDEX, chunked_linear_cross_entropy
from attnlab.model.transformer import Transformer


def test_equals_plain_cross_entropy_with_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 8, requires_grad=True)
    weight = torch.randn(37, 8, requires_grad=True)
    targets = torch.randint(0, 37, (3, 11))
    targets[0, :4] = IGNORE_INDEX
    plain = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    want = torch.autograd.grad(plain * 1.7, (hidden, weight))
    chunked = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=5)  # 33 rows: 7 chunks, last short
    got = torch.autograd.grad(chunked * 1.7, (hidden, weight))
    torch.testing.assert_close(chunked, plain)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["full", "full-tied-factorised"])
def test_model_loss_and_gradients_unchanged(name):
    torch.manual_seed(0)
    plain = Transformer(variant_config(name))
    chunked = Transformer(variant_config(name, loss_chunk_size=16))
    chunked.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, plain.config.num_tokens, (2, 30))
    mask = torch.ones(2, 29, dtype=torch.long)
    mask[1, 20:] = 0  # padding: counted by neither
    outputs = [model(tokens[:, :-1], targets=tokens[:, 1:], loss_mask=mask) for model in (plain, chunked)]
    assert outputs[1].logits is None  # never built
    torch.testing.assert_close(outputs[1].lm_loss, outputs[0].lm_loss)
    outputs[0].loss.backward()
    outputs[1].loss.backward()
    for (key, a), b in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=key)
    with torch.no_grad():  # without gradients nothing is computed for them, and the value is the same
        again = chunked(tokens[:, :-1], targets=tokens[:, 1:], loss_mask=mask).lm_loss
    torch.testing.assert_close(again, outputs[0].lm_loss)


def test_mask_everything_gives_zero_not_nan():
    hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8)
    loss = chunked_linear_cross_entropy(hidden, weight, torch.full((4,), IGNORE_INDEX), chunk_size=3)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(hidden.grad) == 0
