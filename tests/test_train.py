"""The training loop: exact resume, checkpoints that are atomic, safe and checked, clear stops."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from attnlab.config import load_config
from attnlab.errors import AttnlabError, CheckpointError, ConfigError
from attnlab.train import loop
from attnlab.train.checkpoint import list_checkpoints, load_model, read_checkpoint, save_checkpoint
from attnlab.train.loop import TrainingError, check_training_config, train
from attnlab.train.metrics import read_metrics
from attnlab.train.optim import cosine_lr, minimind_lr, parameter_groups

TEXT = (Path(__file__).parent.parent / "src" / "attnlab" / "model" / "transformer.py").read_bytes() * 4


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes(TEXT)
    return path


def tiny(tmp_path: Path, text_file: Path, name: str = "run", *extra: str):
    return load_config("demo", [
        f"name={name}", f"out_dir={tmp_path / 'runs'}",
        "model.dim=32", "model.depth=2", "model.heads=2", "model.dim_head=16", "model.max_seq_len=64",
        "data.source=file", f"data.path={text_file}",
        "train.seq_len=32", "train.batch_size=4", "train.max_steps=10", "train.warmup_steps=2",
        "train.eval_every=5", "train.eval_batches=1", "train.sample_every=0", "train.save_every=5",
        "train.log_every=1", "log.progress=false", *extra,
    ])


def parameters(run_dir: Path, weights: str = "model") -> dict[str, torch.Tensor]:
    return load_model(run_dir, weights=weights).state_dict()


def assert_resume_matches(whole_dir: Path, tmp_path: Path, text_file: Path, *extra: str) -> None:
    """A run of `extra` stopped after 5 steps and resumed to 10 ends with the weights of the
    uninterrupted run in `whole_dir`, bit for bit."""
    train(tiny(tmp_path, text_file, "split", *extra), until_step=5)
    second = train(tiny(tmp_path, text_file, "split", *extra), resume=True)
    for key, value in parameters(whole_dir).items():
        assert torch.equal(value, parameters(second.run_dir)[key]), key


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.parametrize("extra", [[], ["model.dropout=0.1", "train.ema=true", "train.grad_accum=2",
                                          "train.randomly_truncate_sequence=true"]])
def test_resume_is_bit_exact(tmp_path, text_file, extra):
    whole = train(tiny(tmp_path, text_file, "whole", *extra))
    first = train(tiny(tmp_path, text_file, "split", *extra), until_step=5)
    assert first.step == 5 and [p.name for p in list_checkpoints(first.run_dir)] == ["step-0000005.pt"]
    second = train(tiny(tmp_path, text_file, "split", *extra), resume=True)
    assert second.step == 10
    for key, value in parameters(whole.run_dir).items():
        assert torch.equal(value, parameters(second.run_dir)[key]), key
    if "train.ema=true" in extra:
        for key, value in parameters(whole.run_dir, "ema").items():
            assert torch.equal(value, parameters(second.run_dir, "ema")[key]), key
    assert losses(whole.run_dir) == losses(second.run_dir)
    assert len(losses(second.run_dir)) == 10  # resumed metrics do not repeat steps


def test_a_run_resumes_in_another_precision(tmp_path, text_file):
    """fp16 turns loss scaling on; the checkpoint of an fp32 run has no scaler state to continue."""
    train(tiny(tmp_path, text_file), until_step=5)
    assert train(tiny(tmp_path, text_file, "run", "train.precision=fp16"), resume=True).step == 10
    assert read_checkpoint(list_checkpoints(tmp_path / "runs" / "run")[-1])["scaler"]


def test_a_resume_with_no_step_left_says_so(tmp_path, text_file, caplog):
    """--resume of a run at or past its end trains nothing, and the log says why (it said nothing)."""
    train(tiny(tmp_path, text_file), until_step=5)
    caplog.set_level(logging.INFO, logger="attnlab.train.loop")
    assert train(tiny(tmp_path, text_file), resume=True, until_step=5).step == 5
    assert "no step to train: the run is at step 5, and --until-step 5 ends it there" in caplog.text
    caplog.clear()
    assert train(tiny(tmp_path, text_file, "run", "train.max_steps=4"), resume=True).step == 5
    assert "the run is at step 5, and train.max_steps=4 ends it there" in caplog.text


def test_a_run_that_ends_in_its_warm_up_says_so(tmp_path, text_file, caplog):
    """train.warmup_steps past train.max_steps (a preset shortened for a trial) is allowed, but the
    cosine schedule then never reaches train.lr nor decays: a warning says how far it gets."""
    caplog.set_level(logging.WARNING, logger="attnlab.train.loop")
    loop.warn_if_warm_up_outlasts_the_run(tiny(tmp_path, text_file, "run", "train.warmup_steps=40"))
    assert "warmup_steps=40 exceeds train.max_steps=10: the learning rate ends its warm-up at 0.25 of" in caplog.text
    caplog.clear()
    loop.warn_if_warm_up_outlasts_the_run(tiny(tmp_path, text_file, "run", "train.warmup_steps=40",
                                               "train.schedule=constant"))
    loop.warn_if_warm_up_outlasts_the_run(tiny(tmp_path, text_file))
    assert not caplog.text


def test_a_resumed_run_reports_the_last_evaluation_it_had(tmp_path, text_file):
    """A resumed run that ends before its next evaluation reports the one it had at its checkpoint
    (its last_eval was None, and `attnlab train` printed no validation figure); a checkpoint
    written before checkpoints held it takes it from metrics.jsonl."""
    first = train(tiny(tmp_path, text_file), until_step=5)  # evaluates at step 5
    assert first.last_eval is not None
    assert train(tiny(tmp_path, text_file), resume=True, until_step=5).last_eval == first.last_eval
    assert train(tiny(tmp_path, text_file), resume=True, until_step=7).last_eval == first.last_eval
    latest = list_checkpoints(first.run_dir)[-1]
    older = read_checkpoint(latest)
    del older["last_eval"], older["format_version"]
    save_checkpoint(latest, older)
    assert train(tiny(tmp_path, text_file), resume=True, until_step=8).last_eval == first.last_eval


def test_a_failed_write_of_the_run_files_leaves_the_old_ones_whole(tmp_path, text_file, monkeypatch):
    """model.safetensors and config.yaml are staged and renamed: a write that fails (a full disk, a
    kill) leaves the old file whole and no staging file beside it (the weights were staged under a
    name a next start did not clear, config.yaml written in place)."""
    import safetensors.torch

    from attnlab.config import save_config
    from attnlab.train.portable import write_weights_file

    run_dir = train(tiny(tmp_path, text_file), until_step=5).run_dir
    before = {name: (run_dir / name).read_bytes() for name in ("model.safetensors", "config.yaml")}

    def full_disk(*arguments, **keywords):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", lambda tensors, filename, metadata=None: (
            Path(filename).write_bytes(b"half a file"), full_disk()))
        with pytest.raises(OSError, match="No space"):
            write_weights_file(run_dir)
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", full_disk)
        with pytest.raises(OSError, match="No space"):
            save_config(tiny(tmp_path, text_file, "run", "model.depth=1"), run_dir / "config.yaml")
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    assert [path.name for path in run_dir.iterdir() if path.name.startswith(".")] == []


def test_run_directory_contents(tmp_path, text_file):
    result = train(tiny(tmp_path, text_file))
    for name in ("config.yaml", "run_info.json", "metrics.jsonl"):
        assert (result.run_dir / name).is_file(), name
    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records if "val_bpb" in r] == [0, 5, 10]
    assert all({"lr", "tokens_per_s", "grad_norm"} <= r.keys() for r in records if "loss" in r)
    assert load_config(str(result.run_dir / "config.yaml")) == tiny(tmp_path, text_file)


def test_loss_falls(tmp_path, text_file):
    config = tiny(tmp_path, text_file, "learn", "train.max_steps=60", "train.eval_every=60", "train.lr=3e-3")
    records = read_metrics(train(config).run_dir)
    val = [r["val_bpb"] for r in records if "val_bpb" in r]
    assert val[-1] < val[0] - 1.0, val


def test_keep_last_checkpoints(tmp_path, text_file):
    result = train(tiny(tmp_path, text_file, "keep", "train.save_every=2", "train.keep_last=2"))
    assert [p.name for p in list_checkpoints(result.run_dir)] == ["step-0000008.pt", "step-0000010.pt"]


def test_existing_run_is_not_overwritten(tmp_path, text_file):
    train(tiny(tmp_path, text_file), until_step=5)
    with pytest.raises(AttnlabError, match="--resume"):
        train(tiny(tmp_path, text_file))


def flip_bit_in_largest_tensor(path: Path) -> None:
    """Flip one exponent bit in the middle of the checkpoint's largest tensor (zip records are stored)."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda item: item.file_size)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length
    data[start + (info.file_size // 8) * 4 + 3] ^= 0x40  # a float32's high byte: its exponent
    path.write_bytes(bytes(data))


def test_corrupt_checkpoint_named_and_previous_kept(tmp_path, text_file, caplog):
    result = train(tiny(tmp_path, text_file, "run", "train.keep_last=3"))
    latest = list_checkpoints(result.run_dir)[-1]
    flip_bit_in_largest_tensor(latest)
    for read in (read_checkpoint, load_model):
        with pytest.raises(CheckpointError, match="step-0000010.pt is corrupt: its content does not match its check"):
            read(latest)
    with pytest.raises(CheckpointError, match="step-0000010.pt is corrupt.*step-0000005.pt is intact"):
        train(tiny(tmp_path, text_file, "run", "train.max_steps=12"), resume=str(latest))
    with caplog.at_level(logging.WARNING):
        resumed = train(tiny(tmp_path, text_file, "run", "train.max_steps=12"), resume=True)
    assert "resuming from" in caplog.text and "step-0000005.pt, the newest intact checkpoint" in caplog.text
    assert resumed.step == 12


def test_truncated_checkpoint_is_skipped_on_resume(tmp_path, text_file):
    result = train(tiny(tmp_path, text_file, "run", "train.keep_last=3"))
    latest = list_checkpoints(result.run_dir)[-1]
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    assert train(tiny(tmp_path, text_file, "run", "train.max_steps=12"), resume=True).step == 12


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned-marker",))


def test_crafted_checkpoint_cannot_run_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "step-0000001.pt"
    torch.save({"format_version": 1, "model": {}, "config": {}, "payload": _RunsCode()}, path, pickle_module=pickle)
    with pytest.raises(CheckpointError, match="corrupt or unsafe"):
        read_checkpoint(path)
    assert not (tmp_path / "pwned-marker").exists()


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="neither a run directory nor a checkpoint"):
        load_model(tmp_path / "nowhere")


def test_nonfinite_loss_stops_before_update(tmp_path, text_file, monkeypatch):
    calls = {"n": 0}
    real_forward = loop.Transformer.forward

    def poisoned(self, *args, **kwargs):
        output = real_forward(self, *args, **kwargs)
        if self.training and kwargs.get("targets") is not None:
            calls["n"] += 1
            if calls["n"] == 7:
                output.loss, output.lm_loss = output.loss * float("nan"), output.lm_loss * float("nan")
        return output

    monkeypatch.setattr(loop.Transformer, "forward", poisoned)
    with pytest.raises(TrainingError, match=r"loss became nan at step 7.*step-0000005.pt"):
        train(tiny(tmp_path, text_file))
    assert [p.name for p in list_checkpoints(tmp_path / "runs" / "run")] == ["step-0000005.pt"]


class _InfiniteGradient(torch.autograd.Function):
    """Identity forward, infinite gradient backward: a finite loss whose gradients overflow."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def poison(monkeypatch, at_call: int, how, onwards: bool = False) -> dict[str, int]:
    """Apply `how` to the training loss of the `at_call`-th training forward (onwards: and of every
    later one). Returns the count of training forwards, {"n": ...}, which a test may set back."""
    calls = {"n": 0}
    real_forward = loop.Transformer.forward

    def poisoned(self, *args, **kwargs):
        output = real_forward(self, *args, **kwargs)
        if self.training and kwargs.get("targets") is not None:
            calls["n"] += 1
            if calls["n"] == at_call or (onwards and calls["n"] > at_call):
                output.loss, output.lm_loss = how(output.loss), how(output.lm_loss)  # the loop reads lm_loss
        return output

    monkeypatch.setattr(loop.Transformer, "forward", poisoned)
    return calls


def all_finite(run_dir: Path) -> bool:
    for path in list_checkpoints(run_dir):
        state = read_checkpoint(path)
        for part in ("model", "ema"):
            if any(not torch.isfinite(value).all() for value in (state.get(part) or {}).values()):
                return False
    return True


def test_nonfinite_gradients_stop_before_update_and_no_poisoned_checkpoint(tmp_path, text_file, monkeypatch):
    poison(monkeypatch, 7, _InfiniteGradient.apply)
    with pytest.raises(TrainingError, match=r"gradient norm became (inf|nan) at step 7.*step-0000006.pt"):
        train(tiny(tmp_path, text_file, "run", "train.save_every=1", "train.keep_last=20"))
    run_dir = tmp_path / "runs" / "run"
    assert list_checkpoints(run_dir)[-1].name == "step-0000006.pt" and all_finite(run_dir)


def test_nonfinite_gradients_skipped_when_asked(tmp_path, text_file, monkeypatch):
    poison(monkeypatch, 7, _InfiniteGradient.apply)
    result = train(tiny(tmp_path, text_file, "run", "train.on_nonfinite=skip", "train.log_every=5"))
    assert result.step == 10 and all_finite(result.run_dir)
    assert [r["step"] for r in read_metrics(result.run_dir) if r.get("skipped")] == [7]


def test_a_streak_of_skipped_steps_counts_on_across_a_resume(tmp_path, text_file, monkeypatch):
    """train.on_nonfinite=skip stops after MAX_CONSECUTIVE_SKIPS skipped steps in a row; a run
    stopped and resumed inside the streak stops at the step the uninterrupted one does (the count
    started again at 0)."""
    from attnlab.train.finite import MAX_CONSECUTIVE_SKIPS

    calls = poison(monkeypatch, 3, _InfiniteGradient.apply, onwards=True)  # every step from the third
    last = 2 + MAX_CONSECUTIVE_SKIPS
    for name, until_step in (("whole", None), ("split", 6)):
        config = tiny(tmp_path, text_file, name, "train.on_nonfinite=skip", "train.max_steps=30")
        if until_step is not None:
            assert train(config, until_step=until_step).step == until_step
        with pytest.raises(TrainingError, match=rf"at step {last} \({MAX_CONSECUTIVE_SKIPS} steps in a row\)"):
            train(config, resume=until_step is not None)
        calls["n"] = 0


def test_overflowing_weights_stop_the_run(tmp_path, text_file, monkeypatch):
    """Finite gradients can still overflow a weight: the run stops and nothing non-finite is saved."""
    steps = {"n": 0}
    real_after_step = loop.Transformer.after_optimizer_step

    def overflow(self):
        real_after_step(self)
        steps["n"] += 1
        if steps["n"] == 4:
            self.head.weight.data[0, 0] = float("inf")

    monkeypatch.setattr(loop.Transformer, "after_optimizer_step", overflow)
    with pytest.raises(TrainingError, match=r"weights became non-finite at step 4 \(head.weight\).*step-0000003.pt"):
        train(tiny(tmp_path, text_file, "run", "train.save_every=1", "train.keep_last=20"))
    assert all_finite(tmp_path / "runs" / "run")


def test_nonfinite_state_is_never_written(tmp_path):
    from attnlab.train.checkpoint import save_checkpoint

    path = tmp_path / "step-0000001.pt"
    with pytest.raises(CheckpointError, match=r"not writing .*non-finite values in model.w"):
        save_checkpoint(path, {"config": {}, "model": {"w": torch.tensor([1.0, float("nan")])}, "step": 1})
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_saves_and_resumes(tmp_path, text_file):
    config_args = [
        "name=interrupted", f"out_dir={tmp_path / 'runs'}", "model.dim=32", "model.depth=2", "model.heads=2",
        "model.dim_head=16", "model.max_seq_len=64", "data.source=file", f"data.path={text_file}",
        "train.seq_len=32", "train.batch_size=4", "train.max_steps=100000", "train.eval_every=0",
        "train.sample_every=0", "train.save_every=100000", "train.log_every=1", "log.progress=false",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "attnlab.cli.main", "train", "-p", "demo", *config_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    metrics = tmp_path / "runs" / "interrupted" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count("\n") < 3):
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output
    (checkpoint,) = list_checkpoints(tmp_path / "runs" / "interrupted")
    step = read_checkpoint(checkpoint)["step"]
    assert step >= 3 and checkpoint.name == f"step-{step:07d}.pt"


def test_schedules():
    assert minimind_lr(0, 5e-4, 100) == pytest.approx(5e-5 + 5e-4)
    assert minimind_lr(100, 5e-4, 100) == pytest.approx(5e-5)
    assert cosine_lr(0, 1.0, 100, 10, 0.1) == pytest.approx(0.1)
    assert cosine_lr(9, 1.0, 100, 10, 0.1) == pytest.approx(1.0)
    assert cosine_lr(100, 1.0, 100, 10, 0.1) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices(tmp_path, text_file):
    from attnlab.model import Transformer

    model = Transformer(tiny(tmp_path, text_file).model)
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert any(p is model.token_embedding.embed.weight for p in no_decay["params"])
    n_all = len({id(p) for p in model.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_all


def test_init_from_starts_from_the_source_weights_and_resumes_exactly(tmp_path, text_file):
    source = train(tiny(tmp_path, text_file, "source"))
    extra = [f"train.init_from={source.run_dir}"]
    whole = train(tiny(tmp_path, text_file, "tuned", *extra))
    evaluations = {r["step"]: r["val_loss"] for r in read_metrics(whole.run_dir) if "val_loss" in r}
    source_final = [r["val_loss"] for r in read_metrics(source.run_dir) if "val_loss" in r][-1]
    assert evaluations[0] == pytest.approx(source_final, rel=1e-6)  # step 0 is the source's last step
    assert not torch.equal(parameters(whole.run_dir)["head.weight"], parameters(source.run_dir)["head.weight"])
    assert_resume_matches(whole.run_dir, tmp_path, text_file, *extra)  # from its own checkpoint, not the source


@pytest.mark.parametrize("extra, message", [
    (["model.dim=48"], "none of its .* tensors fits this model"),  # a model that differs only partly: test_portable.py
    (["train.init_from=/nowhere/run"], "train.init_from"),
])
def test_bad_init_from_is_refused(tmp_path, text_file, extra, message):
    source = train(tiny(tmp_path, text_file, "source", "train.max_steps=1"))
    config = tiny(tmp_path, text_file, "tuned", f"train.init_from={source.run_dir}", *extra)
    with pytest.raises(ConfigError, match=message):
        train(config)
    assert not (config.run_dir / "checkpoints").exists()


def test_ema_survives_samples_past_max_seq_len(tmp_path, text_file):
    """A sample longer than model.max_seq_len regrows the EMA copy's rotary table (a buffer it does
    not save); the next EMA update copies only saved buffers, so training goes on."""
    config = tiny(tmp_path, text_file, "ema-sample", "train.ema=true", "train.sample_every=4", "train.max_steps=8",
                  "train.sample_length=80", "train.prime_length=16")
    assert train(config).step == 8


def test_learned_positions_check_the_sample_length_only_where_the_run_samples(tmp_path, text_file):
    """train.sample_every beyond train.max_steps never samples: a sample longer than learned positions
    reach is no reason to refuse it. A resume that raises max_steps past sample_every samples, and is
    refused before it trains."""
    learned = ["model.position=learned", "train.sample_every=20", "train.prime_length=16", "train.sample_length=60"]
    assert train(tiny(tmp_path, text_file, "never-samples", *learned)).step == 10
    with pytest.raises(ConfigError, match="train.sample_length = 76 exceeds model.max_seq_len=64"):
        tiny(tmp_path, text_file, "never-samples", *learned, "train.max_steps=20")


def test_a_prime_longer_than_the_validation_split_is_shortened(tmp_path, text_file):
    """train.prime_length past a short validation split: the sample starts from what the split holds,
    where it stopped the run at its first sample with an error about train.seq_len."""
    config = tiny(tmp_path, text_file, "short-val", "data.val_fraction=0.0002", "train.sample_every=2",
                  "train.max_steps=2", "train.prime_length=48", "train.sample_length=4")
    assert train(config).step == 2


@pytest.mark.parametrize("rank", [0, 1])
def test_start_up_lines_come_from_rank_0_only(rank, monkeypatch, caplog):
    """Every rank of a distributed run loads the data and restores the checkpoint; only rank 0 says
    what it found (the data modules' progress lines, the resume point, the run's summary line) and
    warns of its config (a warm-up longer than the run)."""
    from types import SimpleNamespace

    import numpy as np

    def load_corpus(data):  # as prepare_builtin_tokens finds its cache
        logging.getLogger("attnlab.data.pretrain").info("token shards: cached at /cache")
        return SimpleNamespace(vocab_size=256, val=np.zeros(1000, dtype=np.uint8), description="the data")

    monkeypatch.setattr(loop, "load_corpus", load_corpus)
    config = load_config("demo", ["train.warmup_steps=800"])
    strategy = SimpleNamespace(is_main=rank == 0, barrier=lambda: None, device=torch.device("cpu"), world_size=2)
    with caplog.at_level(logging.INFO):
        corpus = loop.load_training_corpus(config, strategy)
        run = SimpleNamespace(config=config, strategy=strategy, corpus=corpus, step=5, autocast_dtype=None,
                              model=SimpleNamespace(num_parameters=lambda: 2e6))
        loop.log_start(run, Path("RUN/checkpoints/step-0000005.pt"))
        check_training_config(config)  # every rank checks the config
    expected = ["token shards: cached at /cache", "resumed from RUN/checkpoints/step-0000005.pt at step 5",
                "demo: full, 2.00M parameters, the data on cpu (fp32, single x 2)",
                "train.warmup_steps=800 exceeds train.max_steps=400: the learning rate ends its warm-up at 0.5 of "
                "train.lr and never decays (shorten train.warmup_steps for the whole schedule)"]
    assert caplog.messages == (expected if rank == 0 else [])
