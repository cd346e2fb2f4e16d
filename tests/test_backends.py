"""The back-end layer (attention/kernels/__init__.py): which path runs a call, from the call's
device, dtype, autocast, dropout and length only; one-line errors for a back-end that cannot run;
and every back-end of every variant equal to its reference (torch) in a whole model, loss and
gradients, on the CPU (flex: forward only, FlexAttention has no CPU backward)."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention.kernels import check_backend, choose
from attnlab.attention.kernels.cpu import available
from attnlab.errors import ConfigError
from attnlab.model import Transformer
from variants import variant_config

needs_kernels = pytest.mark.skipif(not available(), reason="no C++ compiler")
ALL = ("torch", "cpu", "flex", "triton")


@needs_kernels
def test_auto_takes_the_cpu_kernels_where_they_serve(monkeypatch):
    x = torch.zeros(1, 2, 10, 8)
    assert choose("auto", ALL, x, whole=True) == "cpu"
    assert choose("auto", ALL, x, whole=False) == "torch"  # a chunk through a cache
    assert choose("auto", ALL, x, whole=True, dropout=0.1) == "torch"
    assert choose("auto", ALL, x.double(), whole=True) == "torch"
    assert choose("auto", ("torch", "flex"), x, whole=True) == "torch"  # a variant that offers no cpu
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert choose("auto", ALL, x, whole=True) == "torch"
    monkeypatch.setenv("ATTNLAB_CPU_KERNELS", "0")
    assert choose("auto", ALL, x, whole=True) == "torch"


@needs_kernels
def test_a_named_back_end_serves_its_calls_and_refuses_what_it_cannot_run():
    x = torch.zeros(1, 2, 10, 8)
    assert choose("cpu", ALL, x, whole=True) == "cpu"
    assert choose("cpu", ALL, x, whole=False) == "torch"  # the reference takes cached chunks
    assert choose("flex", ALL, x, whole=False) == "flex"  # flex takes chunks of 2 or more on the CPU
    assert choose("flex", ALL, x[:, :, :1], whole=False) == "torch"
    assert choose("torch", ALL, x, whole=True) == "torch"
    with pytest.raises(ConfigError, match="float32 CPU tensors"):
        choose("cpu", ALL, x.double(), whole=True)
    with pytest.raises(ConfigError, match="dropout"):
        choose("cpu", ALL, x, whole=True, dropout=0.1)
    with pytest.raises(ConfigError, match="not offered"):
        check_backend("routing", "triton", ("torch", "flex", "cpu"))
    with pytest.raises(ConfigError, match="is not one of"):  # the config itself refuses it
        variant_config("routing", attention={"kind": "routing", "routing": {"backend": "triton"}})


def twin(name: str, backend: str) -> tuple[Transformer, Transformer]:
    """The variant on its reference and on `backend`, with the same weights."""
    config = variant_config(name)
    getattr(config.attention, config.attention.kind).backend = "torch"
    torch.manual_seed(0)
    reference = Transformer(config)
    getattr(config.attention, config.attention.kind).backend = backend
    other = Transformer(config)
    other.load_state_dict(reference.state_dict())
    return reference, other


def step(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)  # the same Gumbel noise (sinkhorn) in both
    output = model(tokens[:, :-1], targets=tokens[:, 1:])
    output.loss.backward()
    return output.loss.detach(), [p.grad for p in model.parameters()]


@needs_kernels
@pytest.mark.parametrize("name", ["routing", "sinkhorn", "nsa", "nsa-shared"])
def test_cpu_back_end_trains_as_the_reference(name):
    reference, other = twin(name, "cpu")
    tokens = torch.randint(0, 61, (2, 46), generator=torch.Generator().manual_seed(2))
    loss, grads = step(reference.train(), tokens)
    other_loss, other_grads = step(other.train(), tokens)
    torch.testing.assert_close(other_loss, loss, atol=1e-5, rtol=1e-5)
    for (parameter_name, _), got, want in zip(reference.named_parameters(), other_grads, grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m, n=parameter_name: f"{n}: {m}")


@pytest.mark.parametrize("name", ["local", "routing", "sinkhorn", "nsa"])
def test_flex_back_end_forward_equals_the_reference(name):
    if name != "local" and variant_config(name).attention.dropout:
        pytest.skip("flex has no attention dropout")
    reference, other = twin(name, "flex")
    tokens = torch.randint(0, 61, (2, 45), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(other.eval()(tokens).logits, reference.eval()(tokens).logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["local", "routing", "sinkhorn", "nsa"])
def test_flex_refuses_training_on_the_cpu_in_one_line(name):
    """FlexAttention runs forward only on the CPU: a training step there is refused naming the
    back-end, not torch's NotImplementedError from inside the backward; evaluation still runs."""
    _, flex = twin(name, "flex")
    tokens = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        flex.eval()(tokens)
    with pytest.raises(ConfigError, match=r"back-end flex has no backward on CPU \(it trains on CUDA\); choose"):
        flex.train()(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
