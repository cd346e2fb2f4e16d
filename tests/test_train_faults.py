"""What a cluster does to a run: stop signals, a second run on the same directory, a stale lock,
an older resume point, a kill before the first checkpoint, a full disk, a read-only directory, a
changed model, and the command-line slips around them. Each is a one-line error or a clean stop."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnlab.cli.main import main
from attnlab.config import DistConfig, RunConfig
from attnlab.data.files import staging_file
from attnlab.errors import AttnlabError, ConfigError
from attnlab.train import loop
from attnlab.train.checkpoint import list_checkpoints, read_checkpoint, save_checkpoint
from attnlab.train.loop import train
from attnlab.train.metrics import read_metrics
from attnlab.train.run_lock import LOCK_FILE, RunDirectoryInUse, RunLock
from attnlab.train.signals import EXIT_REQUEUE, Stopped, exit_status
from attnlab.train.timeline import split_metrics
from test_train import losses, parameters, tiny


@pytest.fixture
def text_file(tmp_path) -> Path:
    from test_train import TEXT

    path = tmp_path / "corpus.txt"
    path.write_bytes(TEXT)
    return path


def send_at_step(monkeypatch, step: int, *signums: int) -> None:
    """Deliver `signums` to this process while step `step` records its metrics."""
    real = loop.record_metrics

    def record(run, result, elapsed):
        real(run, result, elapsed)
        if run.step == step:
            for signum in signums:
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(loop, "record_metrics", record)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1])
def test_stop_signals_save_the_last_step(tmp_path, text_file, monkeypatch, signum):
    """Preemption signals (SIGTERM twice: torchrun forwards its own) stop after the step that was
    running, save it, and report a requeue status; the run resumes from there exactly."""
    send_at_step(monkeypatch, 3, signum, signum)
    stopped = train(tiny(tmp_path, text_file, "split"))
    assert (stopped.step, stopped.stop_signal, exit_status(stopped.stop_signal)) == (3, signum, EXIT_REQUEUE)
    assert [p.name for p in list_checkpoints(stopped.run_dir)] == ["step-0000003.pt"]
    if signum == signal.SIGTERM:
        monkeypatch.undo()
        whole = train(tiny(tmp_path, text_file, "whole"))
        resumed = train(tiny(tmp_path, text_file, "split"), resume=True)
        assert stopped.interrupted and not whole.interrupted and not resumed.interrupted
        for key, value in parameters(whole.run_dir).items():
            assert torch.equal(value, parameters(resumed.run_dir)[key]), key
        assert losses(whole.run_dir) == losses(resumed.run_dir)


def test_a_signal_during_the_last_step_completes_the_run(tmp_path, text_file, monkeypatch, capsys):
    """A stop signal while the last step is recorded: the run is complete (not interrupted, its
    last step saved, the command's status 0), and the result names the signal, so what was to
    follow the run (a draft after its target) does not start."""
    send_at_step(monkeypatch, 10, signal.SIGTERM)
    result = train(tiny(tmp_path, text_file, "late"))
    assert (result.step, result.interrupted, result.stop_signal) == (10, False, signal.SIGTERM)
    assert list_checkpoints(result.run_dir)[-1].name == "step-0000010.pt"
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file, "late-command")]) == 0
    assert "done: step 10" in capsys.readouterr().out


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 75)])  # SIGINT: test_train.py's Ctrl-C test
def test_signal_to_the_command_saves_and_exits_with_its_status(tmp_path, text_file, signum, status):
    args = [f"out_dir={tmp_path / 'runs'}", "name=signalled", "model.dim=32", "model.depth=2", "model.heads=2",
            "model.dim_head=16", "model.max_seq_len=64", "data.source=file", f"data.path={text_file}",
            "train.seq_len=32", "train.batch_size=4", "train.max_steps=100000", "train.eval_every=0",
            "train.sample_every=0", "train.save_every=100000", "train.log_every=1", "log.progress=false"]
    process = subprocess.Popen([sys.executable, "-m", "attnlab.cli.main", "train", "-p", "demo", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "runs" / "signalled" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count("\n") < 3):
        time.sleep(0.2)
    process.send_signal(signum)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == status, output
    (checkpoint,) = list_checkpoints(tmp_path / "runs" / "signalled")
    step = read_checkpoint(checkpoint)["step"]
    assert step >= 3 and step == read_metrics(tmp_path / "runs" / "signalled")[-1]["step"]
    assert f"stopped at step {step} by {signal.Signals(signum).name}" in output


def test_ctrl_c_during_start_up_is_one_line(tmp_path, text_file, monkeypatch, capsys):
    def interrupted(*args):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)

    monkeypatch.setattr(loop, "load_training_corpus", interrupted)
    with pytest.raises(Stopped):
        train(tiny(tmp_path, text_file))
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file)]) == 130
    error = capsys.readouterr().err
    assert error == "attnlab train: stopped by SIGINT during start-up; nothing to save\n"
    assert not (tmp_path / "runs" / "run" / LOCK_FILE).exists()  # the lock went with the run


def cli_args(tmp_path: Path, text_file: Path, name: str = "run") -> list[str]:
    config = tiny(tmp_path, text_file, name)
    return [f"name={name}", f"out_dir={config.out_dir}", "model.dim=32", "model.depth=2", "model.heads=2",
            "model.dim_head=16", "model.max_seq_len=64", "data.source=file", f"data.path={text_file}",
            "train.seq_len=32", "train.batch_size=4", "train.max_steps=10", "train.warmup_steps=2",
            "train.eval_every=5", "train.eval_batches=1", "train.sample_every=0", "train.save_every=5",
            "train.log_every=1", "log.progress=false"]


def test_a_run_directory_in_use_is_refused(tmp_path, text_file):
    config = tiny(tmp_path, text_file)
    train(config, until_step=5)
    with RunLock(config.run_dir):  # as a live run holds it
        for resume in (None, True):
            with pytest.raises(RunDirectoryInUse, match=rf"{config.run_dir} is in use by pid {os.getpid()} on "):
                train(config, resume=resume)
    assert [r["step"] for r in read_metrics(config.run_dir) if "loss" in r] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("refused", [
    ["data.path=/nowhere/corpus.txt"], ["train.init_from=/nowhere/run"], ["train.distill_from=/nowhere/run"],
    ["--resume", "/nowhere/step-0000005.pt"], ["model.num_tokens=100"],
])
def test_a_run_refused_at_start_up_leaves_no_run_directory(tmp_path, text_file, capsys, refused):
    """The folders a refused run made for itself (its run directory, an out_dir that did not exist)
    are removed again while empty; a folder that was there before, even empty, is kept."""
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), *refused]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs" / "run").mkdir(parents=True)  # the user's own
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), *refused]) == 2
    assert (tmp_path / "runs" / "run").is_dir() and not any((tmp_path / "runs" / "run").iterdir())


def test_a_stale_lock_is_taken_over(tmp_path, text_file, caplog):
    config = tiny(tmp_path, text_file)
    config.run_dir.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = {"pid": int(gone.stdout), "host": "node7", "started": "2026-01-01 00:00:00", "command": "attnlab train"}
    (config.run_dir / LOCK_FILE).write_text(json.dumps(owner) + "\n")  # left by a kill -9: nobody holds it
    with caplog.at_level(logging.WARNING):
        assert train(config).step == 10
    assert f"taking over the lock of pid {owner['pid']} on node7" in caplog.text
    assert not (config.run_dir / LOCK_FILE).exists()


def test_resume_from_an_older_checkpoint_starts_a_clean_timeline(tmp_path, text_file):
    config = tiny(tmp_path, text_file, "run", "train.save_every=2", "train.keep_last=2")
    train(config, until_step=6)  # checkpoints 4, 6
    older = list_checkpoints(config.run_dir)[0]
    resumed = train(tiny(tmp_path, text_file, "run", "train.save_every=2", "train.keep_last=2", "train.lr=1e-4"),
                    resume=str(older))
    assert [p.name for p in list_checkpoints(resumed.run_dir)] == ["step-0000008.pt", "step-0000010.pt"]
    records = [r["step"] for r in read_metrics(resumed.run_dir) if "loss" in r]
    assert records == list(range(1, 11))  # each step once, 5 and 6 from the new timeline
    (aside,) = (resumed.run_dir / "superseded").iterdir()
    assert [p.name for p in (aside / "checkpoints").iterdir()] == ["step-0000006.pt"]
    assert [r["step"] for r in read_metrics(aside) if "loss" in r] == [5, 6]


def test_a_restart_after_a_kill_before_the_first_checkpoint_repeats_no_metrics(tmp_path, text_file, monkeypatch):
    real_step = loop.train_step

    def killed(run):
        if run.step == 6:
            raise SystemExit("killed")
        return real_step(run)

    monkeypatch.setattr(loop, "train_step", killed)
    with pytest.raises(SystemExit):
        train(tiny(tmp_path, text_file, "run", "train.save_every=100"))
    monkeypatch.undo()
    assert list_checkpoints(tmp_path / "runs" / "run") == []
    result = train(tiny(tmp_path, text_file, "run", "train.save_every=100"))
    assert [r["step"] for r in read_metrics(result.run_dir) if "loss" in r] == list(range(1, 11))
    assert [r["step"] for r in read_metrics(result.run_dir) if "val_loss" in r] == [0, 5, 10]


def test_metrics_rewrite_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 9)))
    before = path.read_bytes()

    def killed(fd):
        raise OSError(errno.EIO, "killed mid-write")

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(OSError):
        split_metrics(path, 4, aside=None)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    monkeypatch.undo()
    assert split_metrics(path, 4, aside=None) == 4 and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_temporary_files_of_killed_writes_are_removed(tmp_path, text_file):
    config = tiny(tmp_path, text_file)
    train(config, until_step=5)
    leftover = config.run_dir / "checkpoints" / ".step-0000007.pt.tmp-4242"
    leftover.write_bytes(b"half a checkpoint")
    staged, descriptor = staging_file(config.run_dir / "config.yaml")  # what a kill amid write_atomic leaves
    os.close(descriptor)
    assert train(config, resume=True).step == 10 and not leftover.exists() and not staged.exists()


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path, text_file, monkeypatch, capsys):
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "--until-step", "5"]) == 0
    real_save = torch.save

    def full(obj, handle, *args, **kwargs):
        handle.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 884864 vs 884752")

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("Usage", (), {"free": 0})())
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "--resume"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "step-0000010.pt: no space left on device" in error
    monkeypatch.setattr(torch, "save", real_save)
    checkpoints = list_checkpoints(tmp_path / "runs" / "run")
    assert [p.name for p in checkpoints] == ["step-0000005.pt"] and read_checkpoint(checkpoints[0])["step"] == 5
    assert not list((tmp_path / "runs" / "run" / "checkpoints").glob(".*"))  # no temporary file left


def test_a_read_only_run_directory_is_one_line(tmp_path, text_file, monkeypatch, capsys):
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "runs")):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "cannot write to the run directory" in error and "Read-only file system" in error


def test_resume_with_another_model_is_one_line(tmp_path, text_file, capsys):
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "--until-step", "5"]) == 0
    capsys.readouterr()
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "model.depth=3", "--resume"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "its model differs from this run's: model.depth: 2 there, 3 here" in error


def test_resume_followed_by_an_override(tmp_path, text_file):
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file)]) == 0
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "--resume", "train.max_steps=12"]) == 0
    assert read_checkpoint(list_checkpoints(tmp_path / "runs" / "run")[-1])["step"] == 12


def test_max_steps_zero_is_refused(tmp_path, text_file, capsys):
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "train.max_steps=0"]) == 2
    assert "train.max_steps must be at least 1, got 0" in capsys.readouterr().err


def test_a_deepspeed_config_without_deepspeed_is_refused(tmp_path, text_file, capsys):
    """Not a single-process run that ignores it."""
    args = [*cli_args(tmp_path, text_file), f"dist.deepspeed_config={text_file}"]
    assert main(["train", "-p", "demo", *args]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "dist.deepspeed_config is read by dist.strategy=deepspeed only" in error
    assert not list_checkpoints(tmp_path / "runs" / "run")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
def test_a_distributed_strategy_without_a_launcher_is_one_line(tmp_path, text_file, capsys, strategy):
    """Said how to launch, before the run directory is made (DeepSpeed looked for MPI: a traceback)."""
    extra = [f"dist.deepspeed_config={text_file}"] if strategy == "deepspeed" else []
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), f"dist.strategy={strategy}", *extra]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"dist.strategy={strategy} needs a launcher: `torchrun --nproc_per_node" in error
    assert "without dist.strategy the run trains in this one process" in error
    assert not (tmp_path / "runs" / "run").exists()


def test_deepspeed_not_installed_is_one_line(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    monkeypatch.setenv("RANK", "0")  # as a launcher of one process sets them
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = [*cli_args(tmp_path, text_file), "dist.strategy=deepspeed", f"dist.deepspeed_config={text_file}"]
    assert main(["train", "-p", "demo", *args]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "dist.strategy=deepspeed needs DeepSpeed (" in error
    assert "pip install deepspeed" in error


def test_unsafe_checkpoint_error_keeps_torchs_explanation(tmp_path):
    from test_train import _RunsCode

    path = tmp_path / "step-0000001.pt"
    torch.save({"format_version": 1, "model": {}, "config": {}, "payload": _RunsCode()}, path)
    with pytest.raises(AttnlabError) as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert "\n" not in message and "unsupported GLOBAL posix.system" in message and "weights_only" in message


def test_metrics_lines_and_tqdm_aware_logging_in_a_batch_job(tmp_path, text_file, monkeypatch, caplog):
    """stdout is not a terminal here (pytest captures it): no bar, a metrics line every log_every steps;
    log records go through tqdm while the loop runs."""
    handlers = []
    real_validate = loop.validate

    def validate(run):
        handlers.extend(type(handler).__name__ for handler in logging.getLogger().handlers)
        return real_validate(run)

    monkeypatch.setattr(loop, "validate", validate)
    with caplog.at_level(logging.INFO):
        train(tiny(tmp_path, text_file, "run", "log.progress=true", "train.log_every=5"))
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("step ")]
    assert [line.split(":")[0] for line in lines if "tokens/s" in line] == ["step 5", "step 10"]
    assert "_TqdmLoggingHandler" in handlers


@pytest.mark.parametrize("device, message", [
    ("mps", "train.device=mps but MPS is not available"),
    ("cuda:3", "train.device=cuda:3 but this machine has 1 CUDA device(s)"),
])
def test_a_device_the_machine_lacks_is_one_line(tmp_path, text_file, monkeypatch, capsys, device, message):
    """Refused before the data is loaded, not a traceback from torch when the model moves."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a one-GPU machine, as far as cuda:3 is asked
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), f"train.device={device}"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error


def test_resume_from_a_folder_says_it_wants_a_checkpoint_file(tmp_path, text_file, capsys):
    """A run directory passed to --resume is not reported as missing."""
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "--until-step", "5"]) == 0
    capsys.readouterr()
    run_dir = tmp_path / "runs" / "run"
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "--resume", str(run_dir)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "a folder, not a checkpoint file; --resume alone continues" in error


def written_by(run_dir: Path, strategy: str, n_processes: int) -> Path:
    """Make the latest checkpoint of a one-process run look as `strategy` on `n_processes` writes it:
    FSDP and DeepSpeed leave the file's optimiser state empty (theirs is in their own folders)."""
    path = list_checkpoints(run_dir)[-1]
    state = read_checkpoint(path)
    del state["format_version"]
    state["config"]["dist"]["strategy"] = strategy
    state["rng"] = state["rng"] * n_processes
    if strategy in ("fsdp", "deepspeed"):
        state["optimizer"] = {}
    save_checkpoint(path, state)
    return path


@pytest.mark.parametrize("strategy, n_processes, message", [
    ("fsdp", 2, "written by dist.strategy=fsdp on 2 processes, this run is dist.strategy=single on 1 (its optimiser "
                "state is in RUN/fsdp/, which only fsdp reads); resume it with dist.strategy=fsdp on 2 processes"),
    ("deepspeed", 1, "(its optimiser state is in RUN/deepspeed/, which only deepspeed reads)"),
    ("ddp", 2, "written by dist.strategy=ddp on 2 processes, this run is dist.strategy=single on 1 (each process "
               "resumes its own RNG state and slice of the global batch); resume it with dist.strategy=ddp or "
               "single on 2 processes"),
])
def test_resume_in_one_process_of_a_distributed_checkpoint_is_one_line(tmp_path, text_file, capsys, strategy,
                                                                       n_processes, message):
    """An FSDP or DeepSpeed checkpoint resumed without its engine (a KeyError traceback from the empty
    optimiser state), a DDP one on fewer processes: refused before the data or model is built."""
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "--until-step", "5"]) == 0
    path = written_by(tmp_path / "runs" / "run", strategy, n_processes)
    capsys.readouterr()
    assert main(["train", "-p", "demo", *cli_args(tmp_path, text_file), "--resume"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"--resume {path}: " in error and message in error
    assert f"train.init_from={path}" in error
    assert [record["step"] for record in read_metrics(tmp_path / "runs" / "run") if "loss" in record][-1] == 5


@pytest.mark.parametrize("saved, written_on, here, world_size, refused", [
    ("fsdp", 2, "ddp", 2, "its optimiser state is in RUN/fsdp/, which only fsdp reads"),
    ("deepspeed", 2, "fsdp", 2, "its optimiser state is in RUN/deepspeed/, which only deepspeed reads"),
    ("ddp", 2, "fsdp", 2, "its optimiser state is in the checkpoint file, which only ddp or single reads"),
    ("single", 1, "deepspeed", 1, "its optimiser state is in the checkpoint file, which only ddp or single reads"),
    ("single", 1, "ddp", 2, "each process resumes its own RNG state"),
    ("fsdp", 2, "fsdp", 4, "each process resumes its own RNG state"),
    ("ddp", 2, "ddp", 2, None),
    ("single", 1, "ddp", 1, None),  # torchrun with one process: the same file, the same batches
    ("ddp", 1, "single", 1, None),
    ("deepspeed", 2, "deepspeed", 2, None),
])
def test_a_checkpoint_resumes_under_its_own_engine_and_number_of_processes(saved, written_on, here, world_size,
                                                                            refused):
    """check_distribution, for the launches a one-process test cannot make."""
    from attnlab.train.resume import check_distribution

    state = {"config": {"dist": {"strategy": saved}}, "rng": [{}] * written_on}
    config = RunConfig(dist=DistConfig(strategy=here))
    if refused is None:
        check_distribution(state, config, world_size, Path("step-0000003.pt"))
        return
    with pytest.raises(ConfigError, match=f"this run is dist.strategy={here} on {world_size} .*{refused}"):
        check_distribution(state, config, world_size, Path("step-0000003.pt"))


@pytest.mark.parametrize("content, precision, refused", [
    ('{"zero_optimization": {"stage": 2}}', "bf16",
     "trains in fp32 (its bf16 and fp16 sections) but train.precision=bf16; enable bf16 there, or set "
     "train.precision=auto"),
    ('{"bf16": {"enabled": true}}', "fp32", "trains in bf16 (its bf16 and fp16 sections) but train.precision=fp32"),
    ('{"fp16": {"enabled": true}}', "bf16", "trains in fp16"),
    ('{"zero_optimization": {"stage": 2},}', "auto", "is not valid JSON (Expecting property name"),
    ('[{"zero_optimization": {"stage": 2}}]', "auto", "holds a list, not a JSON object"),
    ('{"bf16": true}', "auto", '"bf16" must be an object such as {"enabled": true}, not True'),
    ('{"bf16": {"enabled": true}}', "bf16", None),
    ('{"bf16": {"enabled": false}}', "fp32", None),
    ('{"fp16": {"enabled": true}}', "auto", None),  # auto: the file's precision
])
def test_a_deepspeed_config_is_checked_before_the_engine_starts(tmp_path, content, precision, refused):
    """The engine trains in its file's precision: a train.precision the file lacks was silently not
    applied; a malformed file was json's traceback on every rank."""
    from attnlab.train.distributed import resolve_deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(content)
    config = RunConfig(dist=DistConfig(strategy="deepspeed", deepspeed_config=str(path)))
    config.train.precision = precision
    if refused is None:
        assert resolve_deepspeed_config(config)["train_micro_batch_size_per_gpu"] == config.train.batch_size
        return
    with pytest.raises(AttnlabError) as caught:
        resolve_deepspeed_config(config)
    message = str(caught.value)
    assert str(path) in message and refused in message and "\n" not in message
