"""Benchmarks and plots run end to end (figures themselves are never asserted: machines are noisy)."""

from __future__ import annotations

import json

import pytest

from attnlab.cli.main import main
from attnlab.train.loop import train
from test_train import text_file, tiny  # noqa: F401  (the fixture is shared)


def test_bench_decode_and_train_tables(tmp_path, capsys):
    out = tmp_path / "decode.jsonl"
    # every measurement is a fresh process (a few seconds each): one variant, one context
    assert main(["bench", "decode", "--attention", "local", "--dim", "32", "--depth", "1", "--heads", "2",
                 "--context", "8", "--new-tokens", "3", "--out", str(out),
                 "--markdown", str(tmp_path / "decode.md")]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["attention"], r["context"], r["cache"]) for r in records} == {("local", 8, True), ("local", 8, False)}
    assert "cache speedup" in (tmp_path / "decode.md").read_text()
    assert main(["bench", "train", "--attention", "local", "--dim", "32", "--depth", "1", "--heads", "2",
                 "--seq-len", "32", "--steps", "1", "--warmup", "1"]) == 0
    assert "| local | 32 | 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("command, message", [
    (["decode", "--attention", "full", "routnig"], "unknown attention 'routnig'. Did you mean 'routing'?"),
    (["train", "--attention", "local", "--set", "attention.local.window_size=0"],
     "attention.local.window_size must be >= 1"),
    (["suite", "--quick", "--attention", "full", "bogus"], "unknown attention 'bogus'"),
])
def test_bench_refuses_a_bad_model_in_one_line_before_measuring(command, message, tmp_path, monkeypatch, capsys):
    """A variant no model can be built from is refused before the first measurement's process starts
    (the earlier variants not measured in vain, no error buried in a worker's output)."""
    import attnlab.bench.runner as runner

    monkeypatch.setattr(runner, "_worker", lambda *arguments, **keywords: pytest.fail("a benchmark ran"))
    out = ["--out", str(tmp_path / "suite")] if command[0] == "suite" else []
    assert main(["bench", *command, *out]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"attnlab bench: error: {message}") and "\n" not in error


def _no_measurement(monkeypatch):
    import attnlab.bench.runner as runner

    monkeypatch.setattr(runner, "_worker", lambda *arguments, **keywords: pytest.fail("a benchmark ran"))


TINY_DECODE = ["decode", "--attention", "full", "--dim", "16", "--depth", "1", "--heads", "2", "--context", "4",
               "--new-tokens", "1", "--no-uncached"]


@pytest.mark.parametrize("option, where, message", [
    ("--out", "folder", "is a folder, not a file"),
    ("--markdown", "folder", "is a folder, not a file"),
    ("--out", "under a file", "cannot make its folder"),
    ("--markdown", "under a file", "cannot make its folder"),
])
def test_bench_refuses_an_output_file_it_cannot_write_before_measuring(option, where, message, tmp_path,
                                                                        monkeypatch, capsys):
    """An --out or --markdown that cannot be written is refused before the first measurement, not
    after every one of them (the figures then lost)."""
    _no_measurement(monkeypatch)
    (tmp_path / "a-file").write_text("kept\n")
    path = tmp_path if where == "folder" else tmp_path / "a-file" / "results"
    assert main(["bench", *TINY_DECODE, option, str(path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("attnlab bench: error: ") and message in error and "\n" not in error
    assert (tmp_path / "a-file").read_text() == "kept\n"


def test_bench_makes_the_folders_of_its_output_files(tmp_path, monkeypatch):
    """A missing folder of --out or --markdown is made, as `bench suite --out` and `plot --out` make
    theirs, instead of an error after the measurements."""
    import attnlab.bench.runner as runner

    record = {"kind": "decode", "attention": "full", "context": 4, "cache": True, "ms_per_token": 1.0}
    monkeypatch.setattr(runner, "run_jobs", lambda jobs, threads: iter([dict(record)]))
    out, markdown = tmp_path / "new" / "decode.jsonl", tmp_path / "other" / "deeper" / "decode.md"
    assert main(["bench", *TINY_DECODE, "--out", str(out), "--markdown", str(markdown)]) == 0
    assert json.loads(out.read_text())["ms_per_token"] == 1.0 and "| full | 4 |" in markdown.read_text()


def test_bench_refused_for_its_settings_makes_no_output_folder(tmp_path, monkeypatch, capsys):
    """Settings are checked before --out's missing folders are made: a refused run leaves none."""
    _no_measurement(monkeypatch)
    out = tmp_path / "new" / "decode.jsonl"
    assert main(["bench", *TINY_DECODE, "--set", "attention.no_such_key=1", "--out", str(out)]) == 2
    assert "no_such_key" in capsys.readouterr().err and not (tmp_path / "new").exists()


@pytest.mark.parametrize("kind", [TINY_DECODE, ["suite", "--quick", "--attention", "full"]])
def test_bench_refuses_a_device_before_measuring(kind, tmp_path, monkeypatch, capsys):
    """--device is a device name (refused by argparse otherwise), and one this machine has: not a
    failure in every measurement's process (the suite went on through all of them)."""
    import torch

    _no_measurement(monkeypatch)
    out = ["--out", str(tmp_path / "suite")] if kind[0] == "suite" else []
    with pytest.raises(SystemExit) as exit_status:
        main(["bench", *kind, *out, "--device", "gpu"])
    assert exit_status.value.code == 2 and "'gpu' is not a device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", *kind, *out, "--device", "cuda"]) == 2
        assert "CUDA is not available on this machine" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    (None, "is not a file"),
    ("# Benchmarks\n\nno block here\n", "block to put the report in"),
])
def test_bench_suite_checks_its_doc_before_measuring(text, message, tmp_path, monkeypatch, capsys):
    """`bench suite --doc FILE` whose file is missing or has no report block is refused before the
    suite runs, not once it has measured everything."""
    _no_measurement(monkeypatch)
    doc = tmp_path / "benchmarks.md"
    if text is not None:
        doc.write_text(text)
    assert main(["bench", "suite", "--quick", "--attention", "full", "--out", str(tmp_path / "suite"),
                 "--doc", str(doc)]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error
    assert not (tmp_path / "suite").exists()


def test_bench_decode_keeps_its_cache_in_the_dtype_asked_for(monkeypatch):
    """`attnlab bench decode --cache-dtype bf16`: the timed cache holds bfloat16 keys and values beside
    float32 weights, and the record says so (in-process: the measurement the worker runs)."""
    import torch

    from attnlab.bench.measure import measure_decode
    from attnlab.bench.runner import decode_jobs, model_values
    from attnlab.model import Transformer

    caches = []
    new_cache = Transformer.new_cache
    monkeypatch.setattr(Transformer, "new_cache", lambda *args, **kwargs: caches.append(new_cache(*args, **kwargs))
                        or caches[-1])
    values = model_values(32, 1, 2, "local", [])
    [(task, arguments)] = decode_jobs(values, [8], 3, False, "cpu", "fp32", cache_dtype="bf16")
    result = measure_decode(**arguments)
    assert task == "decode" and result["cache_dtype"] == "bf16" and result["dtype"] == "fp32"
    assert [cache.layers[0].keys.dtype for cache in caches] == [torch.bfloat16]


def test_bench_decode_records_whether_its_steps_ran_compiled(monkeypatch):
    """A decode record's `compiled` says whether the compiled step served the timed tokens (not only
    that it was asked for), and `linear` names its products; an eager run records neither."""
    from attnlab.bench.measure import measure_decode
    from attnlab.bench.runner import model_values
    from attnlab.model import Transformer

    compile_decoding = Transformer.compile_decoding
    monkeypatch.setattr(Transformer, "compile_decoding", lambda self: compile_decoding(self, backend="eager"))
    values = model_values(32, 1, 2, "full", [])
    compiled = measure_decode(values, context=8, new_tokens=3, use_cache=True, compile=True)
    assert (compiled["compiled"], compiled["linear"]) == (True, "library")  # dynamo alone: ATen's products
    eager = measure_decode(values, context=8, new_tokens=3, use_cache=True)
    assert (eager["compiled"], eager["linear"]) == (False, None)
    # a compile that fails leaves the decoding eager (one warning): the record says it did not run compiled
    monkeypatch.setattr(Transformer, "compile_decoding", lambda self: compile_decoding(self, backend="no-such-backend"))
    fallen_back = measure_decode(values, context=8, new_tokens=3, use_cache=True, compile=True)
    assert (fallen_back["compiled"], fallen_back["linear"]) == (False, None)


def test_cpu_training_times_with_the_default_allocator(monkeypatch):
    """Peak memory comes from a run whose allocator follows live memory; the timing from a run with
    the allocator users have (the memory setting slows some variants more than others)."""
    from attnlab.bench import runner

    runs = []

    def fake_run(command, env, **_):
        follows = env.get("MALLOC_MMAP_THRESHOLD_") == "65536"
        arguments = json.loads(command[-1])
        runs.append((follows, arguments.get("steps")))
        result = {"tokens_per_s": 1.0 if follows else 2.0, "peak_memory_mb": 7.0 if follows else 99.0}
        return type("Completed", (), {"returncode": 0, "stdout": json.dumps(result), "stderr": ""})()

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited settings must not leak into timing
    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    result = runner.run_isolated("train", {"steps": 3, "device": "cpu"}, threads=2)
    assert result == {"tokens_per_s": 2.0, "peak_memory_mb": 7.0}
    assert sorted(runs) == [(False, 3), (True, 1)]
    runs.clear()
    assert runner.run_isolated("decode", {"device": "cpu"}, threads=2)["tokens_per_s"] == 1.0
    assert runs == [(True, None)]


@pytest.mark.slow
def test_suite_writes_report_and_plots(tmp_path, monkeypatch):
    from attnlab.bench import suite

    def tiny_plan(device, quick, attention):
        # one variant, one length: each measurement is a fresh process, and the report's layout is the same
        return suite.SuitePlan(attention=["local"], lengths=[64], contexts=[8], dim=32, depth=1,
                               heads=2, steps=1, warmup=0, new_tokens=2)

    monkeypatch.setattr(suite, "default_plan", tiny_plan)
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(f"# Benchmarks\n\nkept\n\n{suite.DOC_BEGIN}\nold figures\n{suite.DOC_END}\n\nkept too\n")
    out = tmp_path / "docs" / "bench" / "suite"
    assert main(["bench", "suite", "--quick", "--out", str(out), "--doc", str(doc)]) == 0
    report = (out / "suite.md").read_text()
    assert "## Training step" in report and "| local | 64 |" in report and "Failed" not in report
    for name in ("train_throughput.png", "train_memory.png", "decode.png"):
        assert (out / name).stat().st_size > 1000
    published = doc.read_text()
    assert "old figures" not in published and "kept\n" in published and "kept too" in published
    assert "### Training step" in published and "| local | 64 |" in published
    assert "(bench/suite/train_throughput.png)" in published  # pictures linked from the doc's folder


def test_plot_runs(tmp_path, text_file):  # noqa: F811
    runs = [train(tiny(tmp_path, text_file, name, "train.max_steps=4", "train.eval_every=2")).run_dir
            for name in ("a", "b")]
    out = tmp_path / "runs.png"
    assert main(["plot", *map(str, runs), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "nothing")]) == 2


def test_plot_reads_a_run_whose_last_metrics_line_was_cut_short(tmp_path, caplog):
    """A run killed while it wrote a metrics line is plotted from its whole records, with a warning
    about the cut line (it was a JSONDecodeError traceback)."""
    run = tmp_path / "killed"
    run.mkdir()
    records = [{"step": step, "loss": 5.0 - step, "tokens": 128 * step, "elapsed_s": 0.1 * step} for step in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "lo')
    out = tmp_path / "runs.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skipped 1 line(s) that are not metric records" in caplog.text


def test_tensorboard_sink(tmp_path, text_file):  # noqa: F811
    """Each step's loss once, also after a resume from an earlier checkpoint: TensorBoard drops what
    the first run logged past it, as metrics.jsonl does (it showed both runs over those steps)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from attnlab.train.checkpoint import checkpoint_path

    config = tiny(tmp_path, text_file, "tb", "log.tensorboard=true")
    run_dir = train(config).run_dir
    train(config, resume=str(checkpoint_path(run_dir, 5)))
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("loss")] == list(range(1, 11))


def test_wandb_sink_logs_every_record_and_resumes_the_same_run(tmp_path, text_file, monkeypatch):  # noqa: F811
    """wandb is optional; a stand-in module records what the sink asks of it."""
    import sys
    import types

    calls: list[tuple[str, object]] = []

    class FakeRun:
        def log(self, record, step):
            calls.append(("log", (step, dict(record))))

        def finish(self):
            calls.append(("finish", None))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    fake = types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: "abc123"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = tiny(tmp_path, text_file, "wb", "train.max_steps=4", "train.save_every=2", "log.wandb=true")
    train(config, until_step=2)
    train(config, resume=True)
    inits = [kwargs for kind, kwargs in calls if kind == "init"]
    assert len(inits) == 2 and {k["id"] for k in inits} == {"abc123"} and inits[0]["mode"] == "offline"
    assert all(k["resume"] == "allow" for k in inits)
    logged = [step for kind, (step, record) in ((k, v) for k, v in calls if k == "log") if "loss" in record]
    assert logged == [1, 2, 3, 4]
    assert [kind for kind, _ in calls].count("finish") == 2


def test_wandb_holds_one_timeline_across_resumes_and_restarts(tmp_path, text_file, monkeypatch, caplog):  # noqa: F811
    """A run resumed from a checkpoint before the last step its wandb run holds logs only the steps
    after that one, and says so (it logged them again, over steps wandb does not replace);
    a fresh start after an attempt without checkpoints opens a new wandb run (it reused the old one)."""
    import logging
    import shutil
    import sys
    import types

    from attnlab.train.checkpoint import checkpoint_path

    calls: list[tuple[str, object]] = []
    ids = iter(["first", "second"])

    class FakeRun:
        def log(self, record, step):
            calls.append(("log", step))

        def finish(self):
            pass

    def init(**kwargs):
        calls.append(("init", kwargs["id"]))
        return FakeRun()

    fake = types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: next(ids)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = tiny(tmp_path, text_file, "wb", "log.wandb=true")  # saves at 5 and 10
    run_dir = train(config).run_dir
    caplog.set_level(logging.WARNING, logger="attnlab.train.metrics")
    train(tiny(tmp_path, text_file, "wb", "log.wandb=true", "train.max_steps=12"),
          resume=str(checkpoint_path(run_dir, 5)))
    assert calls[calls.index(("init", "first"), 1) + 1:] == [("log", 11), ("log", 12), ("log", 12)]  # 12: loss, val
    assert "steps 6 to 10 keep the earlier process's records" in caplog.text
    shutil.rmtree(run_dir / "checkpoints")  # an attempt that left no checkpoint
    calls.clear()
    train(config)
    assert calls[0] == ("init", "second") and [step for kind, step in calls if kind == "log"][:2] == [0, 1]


def test_wandb_missing_is_a_clear_error(tmp_path, text_file, monkeypatch):  # noqa: F811
    import sys

    from attnlab.errors import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(ConfigError, match="pip install wandb"):
        train(tiny(tmp_path, text_file, "nowb", "log.wandb=true"))
