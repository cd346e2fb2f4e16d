"""Reversible residual stack: same gradients as the plainly evaluated two-stream network, saved
activations flat in depth, state statistics counted once."""

from __future__ import annotations

import pytest
import torch

import attnlab.model.transformer as transformer_module
from attnlab.model import Transformer
from attnlab.model.reversible import two_stream
from variants import variant_config

X = torch.randint(0, 61, (2, 46), generator=torch.Generator().manual_seed(7))


def gradients(name: str, plain: bool, monkeypatch, **overrides) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(variant_config(name, reversible=True, **overrides)).train()
    with monkeypatch.context() as patch:
        if plain:  # autograd through the two-stream network, activations kept
            patch.setattr(transformer_module, "reversible_blocks", two_stream)
        torch.manual_seed(1)  # same dropout masks in both runs
        output = model(X[:, :-1], targets=X[:, 1:])
        output.loss.backward()
    return output.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["full", "local", "routing-reversible"])
def test_gradients_equal_plain_two_stream(name, monkeypatch):
    loss, grads = gradients(name, plain=False, monkeypatch=monkeypatch, dropout=0.1)
    reference_loss, reference = gradients(name, plain=True, monkeypatch=monkeypatch, dropout=0.1)
    torch.testing.assert_close(loss, reference_loss, atol=1e-6, rtol=1e-6)
    for parameter_name, grad in grads.items():
        torch.testing.assert_close(grad, reference[parameter_name], atol=1e-5, rtol=1e-4, msg=parameter_name)


def saved_bytes(depth: int, reversible: bool) -> int:
    """Bytes of every tensor autograd saves for backward in one training forward (deterministic)."""
    torch.manual_seed(0)
    model = Transformer(variant_config("full", depth=depth, reversible=reversible)).train()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not isinstance(tensor, torch.nn.Parameter):  # weights exist anyway; count activations
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(X[:, :-1], targets=X[:, 1:])
    return total


def test_activation_memory_flat_in_depth():
    assert saved_bytes(8, reversible=True) < 2 * saved_bytes(2, reversible=True)
    # the probe sees the difference: the plain stack grows with depth
    assert saved_bytes(8, reversible=False) > 3 * saved_bytes(2, reversible=False)


def test_cached_decoding_matches_parallel():
    torch.manual_seed(0)
    model = Transformer(variant_config("local", reversible=True)).eval()
    with torch.no_grad():
        parallel = model(X).logits
        cache = model.new_cache(2, 64)
        steps = [model(X[:, start : start + 5], cache=cache).logits for start in range(0, 46, 5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), parallel, atol=1e-5, rtol=1e-5)
