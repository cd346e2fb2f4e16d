"""The commands, run in-process: train -> eval -> sample, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from attnlab.cli.main import main

TEXT = (Path(__file__).parent.parent / "src" / "attnlab" / "train" / "loop.py").read_bytes() * 3


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus.txt"
    corpus.write_bytes(TEXT)
    code = main([
        "train", "-p", "demo", "name=cli", f"out_dir={root / 'runs'}", "model.dim=32", "model.depth=1",
        "model.heads=2", "model.dim_head=16", "model.max_seq_len=64", "data.source=file", f"data.path={corpus}",
        "train.seq_len=32", "train.batch_size=4", "train.max_steps=6", "train.eval_every=3", "train.eval_batches=1",
        "train.sample_every=3", "train.sample_length=8", "train.prime_length=8", "log.progress=false",
    ])
    assert code == 0
    return root / "runs" / "cli"


def test_eval_json_is_deterministic(run_dir, capsys):
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--json", "--windows", "4", "--batch-size", "2"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["eval", str(run_dir), "--json", "--windows", "4", "--batch-size", "4"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["step"] == 6 and first["n_windows"] == 4
    assert first["bits_per_token"] == pytest.approx(second["bits_per_token"], rel=1e-5)
    assert first["perplexity"] > 1


def test_sample_cache_matches_no_cache(run_dir, capsys):
    capsys.readouterr()
    args = ["sample", str(run_dir), "--prompt", "def ", "--max-new-tokens", "20", "--temperature", "0"]
    assert main(args) == 0
    cached = capsys.readouterr().out
    assert main([*args, "--no-cache"]) == 0
    assert capsys.readouterr().out == cached and cached.startswith("def ")


@pytest.mark.parametrize("option, weights, cache_dtype", [("--dtype", "bfloat16", None),
                                                        ("--cache-dtype", "float32", "bfloat16")])
def test_sample_decodes_in_the_dtype_asked_for(run_dir, capsys, monkeypatch, option, weights, cache_dtype):
    """--dtype bfloat16: the command decodes the model cast to bfloat16, weights and cache;
    --cache-dtype bfloat16: float32 weights over a cache of bfloat16 keys and values. Either way its
    text is that model's own greedy decoding (generate(cache_dtype=...))."""
    import torch

    from attnlab.generate.sampling import SamplingConfig, generate
    from attnlab.model import Transformer
    from attnlab.train import checkpoint

    loaded, caches = [], []
    load_model, new_cache = checkpoint.load_model, Transformer.new_cache
    monkeypatch.setattr(checkpoint, "load_model", lambda *args, **kwargs: loaded.append(load_model(*args, **kwargs))
                        or loaded[-1])
    monkeypatch.setattr(Transformer, "new_cache", lambda *args, **kwargs: caches.append(new_cache(*args, **kwargs))
                        or caches[-1])
    capsys.readouterr()
    assert main(["sample", str(run_dir), "--prompt", "def ", "--max-new-tokens", "20", "--temperature", "0",
                 option, "bf16"]) == 0
    [model], [cache] = loaded, caches
    assert {parameter.dtype for parameter in model.parameters()} == {getattr(torch, weights)}
    assert cache.layers[0].keys.dtype == torch.bfloat16
    expected = generate(model, torch.tensor([list(b"def ")]), 20, SamplingConfig(temperature=0),
                        cache_dtype=cache_dtype and getattr(torch, cache_dtype))
    assert capsys.readouterr().out == bytes(expected[0].tolist()).decode("utf-8", "replace") + "\n"


def test_sample_decodes_on_the_attention_backend_asked_for(run_dir, capsys, monkeypatch):
    """--attention-backend torch: every layer's attention on the reference, the same greedy text as
    the run's own back-end (auto)."""
    from attnlab.train import checkpoint

    loaded = []
    load_model = checkpoint.load_model
    monkeypatch.setattr(checkpoint, "load_model", lambda *args, **kwargs: loaded.append(load_model(*args, **kwargs))
                        or loaded[-1])
    args = ["sample", str(run_dir), "--prompt", "def ", "--max-new-tokens", "20", "--temperature", "0"]
    capsys.readouterr()
    assert main(args) == 0
    own = capsys.readouterr().out
    assert main([*args, "--attention-backend", "torch"]) == 0
    assert capsys.readouterr().out == own
    assert [block.attention.config.backend for block in loaded[-1].blocks] == ["torch"]
    assert loaded[-1].config.attention.full.backend == "torch" and loaded[0].config.attention.full.backend == "auto"


def test_sample_compiles_the_step_inductor_caches(run_dir, capsys, monkeypatch):
    """--compile on a CPU asks for the step with ATen's products (the one inductor's cache keeps for
    the next process; aot_eager here, for speed), and its greedy text is the eager command's."""
    from attnlab.model.transformer import Transformer

    asked = []
    compile_decoding = Transformer.compile_decoding

    def recorded(self, **options):
        asked.append(options)
        return compile_decoding(self, **{**options, "backend": "aot_eager"})

    monkeypatch.setattr(Transformer, "compile_decoding", recorded)
    args = ["sample", str(run_dir), "--prompt", "def ", "--max-new-tokens", "20", "--temperature", "0"]
    capsys.readouterr()
    assert main(args) == 0
    eager = capsys.readouterr().out
    assert main([*args, "--compile"]) == 0
    assert capsys.readouterr().out == eager and asked == [{"linear": "library"}]


def test_seeded_sampling_repeats(run_dir, capsys):
    capsys.readouterr()
    args = ["sample", str(run_dir), "--max-new-tokens", "16", "--top-k", "20", "--seed", "5"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


def test_sample_prints_to_an_ascii_terminal(run_dir, monkeypatch):
    """A stdout that cannot encode the text (an ASCII locale) shows escapes, not UnicodeEncodeError."""
    import io

    terminal = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["sample", str(run_dir), "--prompt", "h\u00e9llo \u2603", "--max-new-tokens", "4"]) == 0
    terminal.flush()
    assert terminal.buffer.getvalue().startswith(b"h\\xe9llo \\u2603")


@pytest.mark.parametrize("argv, message", [
    (["train", "-p", "nosuch"], "unknown preset 'nosuch'"),
    (["train", "train.max_stepz=3"], "unknown config key 'train.max_stepz'; did you mean 'train.max_steps'"),
    (["train", "data.source=file", "data.path=/no/such/file.txt"], "/no/such/file.txt"),
    (["sample", "/no/such/run"], "neither a run directory nor a checkpoint"),
    (["eval", "/no/such/run"], "neither a run directory nor a checkpoint"),
])
def test_bad_input_one_line_error(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1, error


def test_eval_reports_routing_statistics(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT)
    assert main([
        "train", "-p", "routing-small", "name=r", f"out_dir={tmp_path}", "model.dim=32", "model.depth=1",
        "model.heads=2", "model.dim_head=16", "model.max_seq_len=64", "model.reversible=false",
        "model.attention.routing.window_size=8", "model.attention.routing.n_local_heads=1",
        "data.source=file", f"data.path={corpus}", "train.seq_len=32", "train.batch_size=2",
        "train.max_steps=2", "train.eval_every=0", "train.sample_every=0", "log.progress=false",
    ]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "r"), "--json", "--windows", "2", "--batch-size", "2"]) == 0
    routing = json.loads(capsys.readouterr().out)["routing"]
    assert routing["no_routed_key_fraction"] == 0.0 and 0 < routing["largest_cluster_share"] <= 1


def test_deepspeed_launcher_arguments(monkeypatch):
    """`deepspeed -m attnlab.cli.main train ...` runs `... --local_rank=N train ...`."""
    from attnlab.cli.main import take_local_rank

    monkeypatch.setenv("LOCAL_RANK", "0")  # recorded, so the value the test leaves is undone (lm-eval reads it)
    monkeypatch.delenv("LOCAL_RANK")
    assert take_local_rank(["--local_rank=1", "train", "-p", "demo"]) == ["train", "-p", "demo"]
    assert os.environ["LOCAL_RANK"] == "1"
    assert take_local_rank(["train", "--local-rank", "2", "x=1"]) == ["train", "x=1"]
