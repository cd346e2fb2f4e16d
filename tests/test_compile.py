"""torch.compile traces every attention type whole: a training step (forward + backward) compiles
with fullgraph=True, so with zero graph breaks, and its loss and gradients equal eager's; and
train.compile=true trains to the same losses as eager (CPU, tiny sizes).

The per-variant tests compile with the aot_eager back-end: dynamo's tracing (where graph breaks
happen), the fake implementations and autograd registrations of attnlab's custom ops, and
AOTAutograd's joint graph, without inductor's code generation (a few seconds each). One variant
goes through inductor as well, and train.compile uses it."""

from __future__ import annotations

import pytest
import torch

from attnlab.model import Transformer
from attnlab.train.loop import train
from attnlab.train.metrics import read_metrics
from test_train import text_file, tiny  # noqa: F401  (the fixture is shared)
from variants import variant_config

pytestmark = pytest.mark.slow


def training_step(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and every parameter's gradient of one step; the same random state each call (dropout,
    sinkhorn's Gumbel noise)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    output = model(tokens[:, :-1], targets=tokens[:, 1:])
    output.loss.backward()
    return output.loss.detach(), [parameter.grad.clone() for parameter in model.parameters()]


def compiled_equals_eager(name: str, backend: str, **overrides) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(variant_config(name, **overrides)).train()
    tokens = torch.randint(0, 61, (2, 46), generator=torch.Generator().manual_seed(2))
    eager_loss, eager_grads = training_step(model, tokens)
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # any graph break raises
    loss, grads = training_step(compiled, tokens)
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    for (parameter_name, _), got, want in zip(model.named_parameters(), grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m, n=parameter_name: f"{n}: {m}")


@pytest.mark.parametrize("name", ["full", "local", "routing", "sinkhorn", "nsa"])
def test_training_step_compiles_whole_and_equals_eager(name, cpu_path):
    compiled_equals_eager(name, "aot_eager")


def test_training_step_through_inductor_equals_eager(monkeypatch):
    """Routing on the cpu back-end (custom ops, centroid statistics as buffer mutations) through
    inductor's generated code; one block (an inductor compile's time grows with the blocks it
    traces; the aot_eager test above traces both of the variant's)."""
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    compiled_equals_eager("routing", "inductor", depth=1)


def test_compiled_matches_eager(tmp_path, text_file, monkeypatch):  # noqa: F811
    """train.compile=true compiles the model's forward once and trains to eager's losses. Compiled
    here by aot_eager (dynamo's graph and AOTAutograd's joint one, as inductor gets them): a training
    step's code through inductor is test_training_step_through_inductor_equals_eager's."""
    compiles = []
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **options: compiles.append(options) or compile_(
        model, **{**options, "backend": "aot_eager"}))

    def losses(name: str, *extra: str) -> list[float]:
        config = tiny(tmp_path, text_file, name, "model.depth=1", "train.max_steps=3", "train.eval_every=0", *extra)
        return [r["loss"] for r in read_metrics(train(config).run_dir) if "loss" in r]

    eager = losses("eager")
    assert compiles == []
    compiled = losses("compiled", "train.compile=true")
    assert compiles == [{}]  # inductor, torch.compile's default, for users
    assert compiled == pytest.approx(eager, abs=1e-4)


def test_constant_marks_are_torchs_own_and_import_no_dynamo(monkeypatch):
    """attnlab.compiler.assume_constant_result marks a function as torch.compiler's does, with
    dynamo loaded or not; importing the model, sampling and the sample command loads no dynamo
    (2-3 s of every such process's start)."""
    import subprocess
    import sys

    from attnlab.compiler import assume_constant_result

    def marked_by_torch() -> bool:
        return True

    def marked_by_attnlab() -> bool:
        return True

    def marked_without_dynamo() -> bool:
        return True

    torch.compiler.assume_constant_result(marked_by_torch)
    assume_constant_result(marked_by_attnlab)
    monkeypatch.delitem(sys.modules, "torch._dynamo")  # as before anything imported it
    assume_constant_result(marked_without_dynamo)
    assert vars(marked_by_torch) == vars(marked_by_attnlab) == vars(marked_without_dynamo) != {}
    code = ("import sys, attnlab.model, attnlab.generate.sampling, attnlab.generate.speculative, attnlab.cli.sample; "
            "print('torch._dynamo' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
