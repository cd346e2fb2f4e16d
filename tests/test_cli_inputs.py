"""Every bad input to a command is refused in one line (issue 27, items 9, 10 and 11): arguments
argparse refuses, missing or wrong files and folders, values a model cannot serve, non-finite
logits, what the operating system refuses; and `attnlab --help` imports no torch.

Commands run in-process (`main([...])`); one subprocess checks the imports of a fresh interpreter."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.cli.main import build_parser, main, parse_arguments
from attnlab.model import Transformer

TEXT = (Path(__file__).parent.parent / "src" / "attnlab" / "train" / "loop.py").read_bytes() * 2
TINY = ["model.dim=16", "model.depth=2", "model.heads=2", "model.dim_head=8", "model.max_seq_len=32",
        "train.seq_len=16", "train.batch_size=2", "train.max_steps=2", "train.eval_every=0", "train.sample_every=0",
        "log.progress=false"]


def refused(argv: list[str], capsys) -> str:
    """Run a command that must be refused: a non-zero exit, one line on stderr naming the command,
    no traceback. -> that line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse
        code = exit.code
    error = capsys.readouterr().err.strip()
    assert code not in (0, None), (argv, error)
    assert len(error.splitlines()) == 1 and error.startswith("attnlab") and "Traceback" not in error, error
    return error


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    """A byte-level run, and one with learned positions (max_seq_len 32)."""
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "corpus.txt"
    corpus.write_bytes(TEXT)
    data = ["data.source=file", f"data.path={corpus}", f"out_dir={root}"]
    for name, extra in (("bytes", []), ("learned", ["model.position=learned"])):
        assert main(["train", f"name={name}", *TINY, *data, *extra]) == 0
    return {"bytes": str(root / "bytes"), "learned": str(root / "learned"), "corpus": str(corpus), "root": str(root)}


# --------------------------------------------------------------------------------------------
# `attnlab --help` is quick: the parser imports no torch


def test_the_parser_imports_no_torch():
    code = ("import sys, attnlab, attnlab.cli.main as m; m.build_parser(); "
            "print(sorted(n for n in sys.modules if n.split('.')[0] in "
            "{'torch', 'numpy', 'tokenizers', 'safetensors', 'transformers', 'matplotlib', 'tqdm'}))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    assert output.strip() == "[]"


def test_lazy_names_still_resolve():
    import attnlab
    from attnlab.cli import export, speculative
    from attnlab.generate.speculative import VERIFICATIONS
    from attnlab.hf import DTYPES
    from attnlab.model import Transformer
    from attnlab.model.quantize import QUANTIZATIONS

    assert attnlab.Transformer is Transformer and callable(attnlab.load_model)
    assert export.DTYPES == tuple(DTYPES) and speculative.QUANTIZATIONS == QUANTIZATIONS  # copies kept in step
    assert speculative.VERIFICATIONS == tuple(VERIFICATIONS)
    with pytest.raises(AttributeError):
        attnlab.no_such_name  # noqa: B018


# --------------------------------------------------------------------------------------------
# Arguments argparse refuses, before anything is loaded: one line, naming the option

ARGUMENTS = [
    ["sample", "RUN", "--max-new-tokens", "-1"], ["sample", "RUN", "--max-new-tokens", "1" + "0" * 30],
    ["sample", "RUN", "--temperature", "-1"], ["sample", "RUN", "--temperature", "nan"],
    ["sample", "RUN", "--temperature", "inf"], ["sample", "RUN", "--top-k", "0"], ["sample", "RUN", "--top-p", "0"],
    ["sample", "RUN", "--top-p", "1.5"], ["sample", "RUN", "--min-p", "-0.1"], ["sample", "RUN", "--min-p", "nan"],
    ["sample", "RUN", "--seed", "-1"], ["sample", "RUN", "--seed", "1" + "0" * 30],
    ["sample", "RUN", "--device", "gpu"], ["sample", "RUN", "--device", "auto"],
    ["sample", "RUN", "--weights", "best"], ["sample", "RUN", "--dtype", "float64"], ["sample"],
    ["eval", "RUN", "--windows", "0"], ["eval", "RUN", "--windows", "-3"], ["eval", "RUN", "--batch-size", "0"],
    ["eval", "RUN", "--seq-len", "0"], ["eval", "RUN", "--seq-len", "x"], ["eval", "RUN", "--seed", "-1"],
    ["eval", "RUN", "--device", "cuda:x"], ["eval"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--gamma", "0"],
    ["speculative", "--target", "RUN", "--early-exit", "0"], ["speculative", "--target", "RUN", "--draft", "RUN",
                                                             "--early-exit", "1"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--max-new-tokens", "0"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--batch-size", "-1"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--repeats", "0"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--prime-length", "0"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--top-p", "2"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--device", "tpu"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--dtype", "int8"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--cache-dtype", "float8"],
    ["sample", "RUN", "--cache-dtype", "int8"], ["sample", "RUN", "--attention-backend", "cuda"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--draft-quantize", "int4"],
    ["speculative", "--target", "RUN", "--draft", "RUN", "--verification", "typical"],
    ["speculative", "train", "--target-preset", "demo", "--draft-preset", "demo", "--distill", "1.5"],
    ["speculative", "train", "--target", "RUN", "--draft-preset", "demo", "--draft-steps", "0"],
    ["data", "prepare", "--input", "x.jsonl", "--tokenizer", "T", "--out", "D", "--workers", "0"],
    ["data", "prepare", "--input", "x.jsonl", "--tokenizer", "T", "--out", "D", "--shard-tokens", "-5"],
    ["data", "prepare", "nosuch"], ["data", "download", "enwik9"],
    ["tokenizer", "train", "--input", "x", "--out", "T", "--vocab-size", "100"],
    ["tokenizer", "train", "--input", "x", "--out", "T", "--vocab-size", "100000000000"],
    ["tokenizer", "decode", "--tokenizer", "T", "-1"], ["tokenizer", "decode", "--tokenizer", "T", "x"],
    ["bench", "train", "--dim", "0"], ["bench", "decode", "--context", "0"], ["bench", "suite", "--threads", "0"],
    ["export", "RUN", "--dtype", "float8"], ["nosuch-command"], ["train", "--until-step"],
    ["plot", "RUN", "--out", "runs.txt"], ["plot", "RUN", "--out", "runs"],
    ["train", "a.b=1", "--until-step", "2", "--bogus"], ["sample", "RUN", "model.dim=8"],
]


@pytest.mark.parametrize("argv", ARGUMENTS, ids=[" ".join(argv)[:60] for argv in ARGUMENTS])
def test_bad_arguments_one_line(argv, capsys):
    # parsed only, never run: were a refusal lost, a benchmark or a 10^11-token vocabulary would not start
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        parse_arguments(build_parser(), argv)  # as main parses them
    error = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and len(error.splitlines()) == 1 and error.startswith("attnlab"), error
    assert error.endswith("-h)"), error


@pytest.mark.parametrize("argv, overrides", [
    (["train", "a.b=1", "--until-step", "2", "c.d=2", "e.f=3"], ["a.b=1", "c.d=2", "e.f=3"]),
    (["train", "a.b=1", "--resume", "c.d=2", "e.f=3"], ["a.b=1", "c.d=2", "e.f=3"]),
    (["data", "info", "a.b=1", "-p", "demo", "c.d=2"], ["a.b=1", "c.d=2"]),
])
def test_overrides_are_taken_on_both_sides_of_an_option(argv, overrides):
    """argparse fills a list of positionals once: `train a.b=1 --until-step 2 c.d=2` refused c.d=2."""
    args = parse_arguments(build_parser(), argv)
    inserted = getattr(args, "resume_override", None)  # `--resume key=value`: train's ResumeAction
    taken = list(args.overrides)
    if inserted is not None:
        taken.insert(*inserted)
    assert taken == overrides


# --------------------------------------------------------------------------------------------
# Presets by name only, config files by path (config.py)


def test_presets_by_name_and_config_files_by_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outside = tmp_path / "elsewhere" / "file.yaml"
    outside.parent.mkdir()
    outside.write_text("train:\n  max_steps: 1\n")
    (tmp_path / "folder.yaml").mkdir()
    (tmp_path / "corpus.txt").write_bytes(TEXT)
    quick = [*TINY, "data.source=file", "data.path=corpus.txt", f"out_dir={tmp_path / 'runs'}"]  # were one accepted
    cases = [
        (["train", "-p", "../elsewhere/file"], "is not a preset name"),
        (["train", "-p", str(outside)], "is not a preset name"),
        (["train", "-p", "demo.yaml"], "is not a preset name"),
        (["train", "-c", "nosuch.yaml"], "config file nosuch.yaml does not exist"),
        (["train", "-c", "nosuch"], "config file nosuch does not exist"),
        (["train", "-c", "folder.yaml"], "is not a regular file"),
        (["train", *quick, "name=../outside"], "name must be a plain name"),
        (["train", *quick, "model.dim=0"], "model.dim must be >= 1"),
        (["train", *quick, "model.depth=0"], "model.depth must be >= 1"),
        (["train", *quick, "data.val_fraction=1.5"], "data.val_fraction must be in (0, 1)"),
        (["data", "info", "-p", "../../x"], "is not a preset name"),
        (["data", "info", "-c", str(tmp_path)], "is not a regular file"),
        (["speculative", "train", "--target-preset", "../../x", "--draft-preset", "demo"], "does not exist"),
    ]
    for argv, message in cases:
        assert message in refused(argv, capsys), argv
    assert not (tmp_path / "outside").exists() and not (tmp_path / "runs").exists()


def test_a_path_that_is_not_text_is_refused_in_one_line(tmp_path, capsys):
    """A file name's bytes that are not UTF-8 reach Python surrogate-escaped; the resolved config is
    saved as YAML, which cannot hold them: refused, naming the override."""
    name = os.fsdecode(os.fsencode(tmp_path) + b"/corpus\xff.txt")
    Path(name).write_bytes(TEXT)
    for command in (["data", "info"], ["train", *TINY]):
        error = refused([*command, "data.source=file", f"data.path={name}"], capsys)
        assert "data.path=" in error and "not utf-8 text" in error, error


def test_a_model_that_cannot_be_built_is_refused_before_the_run_starts(tmp_path, capsys):
    """A name no registry holds, or a part's own rule (MoE's top_k): refused with the config, before
    the data is prepared (enwik8, a BPE vocabulary: minutes) and the run directory is written."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT)
    data = ["data.source=file", f"data.path={corpus}", f"out_dir={tmp_path}", "name=bad"]
    for override, message in (("model.attention.kind=lcoal", "unknown attention 'lcoal'"),
                              ("model.moe.top_k=8", "model.moe.top_k=8 must be between 1 and model.moe.n_experts")):
        line = refused(["train", *TINY, *data, "model.feed_forward=moe", override], capsys)
        assert message in line, line
        assert not (tmp_path / "bad").exists()


# --------------------------------------------------------------------------------------------
# Inputs a run cannot serve: refused when the command runs, one line each


def test_sample_eval_speculative_refuse_in_one_line(runs, tmp_path, capsys):
    folder, empty = tmp_path / "folder", tmp_path / "empty.txt"
    folder.mkdir()
    empty.write_bytes(b"")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(2000))
    cases = [
        (["sample", runs["learned"], "--max-new-tokens", "40"], "learned positions end at model.max_seq_len=32"),
        (["sample", runs["learned"], "--prompt", "x" * 40, "--max-new-tokens", "1"], "make 41 tokens"),
        (["sample", str(folder)], "has no checkpoints"),
        (["sample", str(empty)], "is corrupt or unsafe to load"),
        (["sample", runs["bytes"], "--no-cache", "--compile"], "--compile: not read with --no-cache"),
        (["sample", runs["bytes"], "--no-cache", "--cache-dtype", "bf16"], "--cache-dtype: not read with --no-cache"),
        (["eval", runs["learned"], "--seq-len", "64"], "evaluation windows of seq_len make 64 tokens"),
        (["eval", runs["bytes"], "--seq-len", "100000"], "windows of seq_len + 1"),
        (["eval", runs["bytes"], "--data", str(folder)], f"data file {folder} is a folder, not a file"),
        (["eval", runs["bytes"], "--data", os.devnull], "is not a regular file"),
        (["eval", runs["bytes"], "--data", str(empty)], "is empty"),
        (["eval", runs["bytes"], "--data", str(tmp_path / "nosuch")], "does not exist"),
        (["eval", str(garbage)], "is corrupt or unsafe to load"),
        (["eval", runs["bytes"], "--limit", "10"], "--limit: read with --tasks only"),
        (["eval", runs["bytes"], "--tasks", "arc_easy", "--data", runs["corpus"], "--full"],
         "--data, --full: not read with --tasks"),
        (["speculative", "--target", runs["bytes"], "--early-exit", "3", "--max-new-tokens", "2"],
         "--early-exit 3: the target has 2 layers"),
        (["speculative", "--target", runs["learned"], "--draft", runs["learned"], "--max-new-tokens", "40"],
         "learned positions end"),
        (["speculative", "--target", runs["bytes"]], "give --target RUN and --draft RUN"),
        (["speculative", "--target", runs["bytes"], "--early-exit", "1", "--prime-from-val", "--prime-length",
          "100000"], "--prime-length 100000: the target's validation split has"),
        (["speculative", "--target", runs["bytes"], "--early-exit", "1", "--prompt", "ab", "--prime-length", "9"],
         "--prime-length: read with --prime-from-val only"),  # it was ignored
        (["speculative", "--gamma", "3", "train", "--target-preset", "demo", "--draft-preset", "demo"],
         "--gamma: options of decoding, given before `train`"),  # parsed as decoding's, and ignored
        (["sample", runs["bytes"], "--attention-backend", "flex"],
         "attention.full.backend=flex is not offered; full offers: auto, torch, cpu, triton"),
        (["speculative", "--target", runs["bytes"], "--draft", runs["bytes"], "--attention-backend", "flex"],
         "attention.full.backend=flex is not offered"),
    ]
    if not torch.cuda.is_available():
        cases.append((["sample", runs["bytes"], "--device", "cuda:0"], "CUDA is not available"))
    for argv, message in cases:
        assert message in refused(argv, capsys), (argv, message)


def test_the_vocabulary_of_the_data_must_fit_the_model(tmp_path, capsys, monkeypatch):
    """Token ids past the model's vocabulary (model.num_tokens), in training, evaluation or a prompt:
    named in one line, never an index error from inside the embedding."""
    import attnlab.train.checkpoint as checkpoint
    from attnlab.data.shards import prepare_token_shards
    from attnlab.data.tokenizer import train_tokenizer

    documents = tmp_path / "docs.jsonl"
    documents.write_text("".join(json.dumps({"text": f"document {i} is about {i % 7}; " * 9}) + "\n"
                                 for i in range(40)))
    for vocabulary in (300, 400):
        train_tokenizer([documents], vocabulary, tmp_path / f"tokenizer-{vocabulary}")
        prepare_token_shards([documents], tmp_path / f"tokenizer-{vocabulary}", tmp_path / f"tokens-{vocabulary}",
                             workers=1)
    data = ["data.source=tokens", f"data.path={tmp_path / 'tokens-300'}", f"out_dir={tmp_path}"]
    line = refused(["train", *TINY, *data, "model.num_tokens=256"], capsys)
    assert "vocabulary has 300 tokens but model.num_tokens=256" in line
    assert main(["train", *TINY, *data, "model.num_tokens=300", "name=tokens"]) == 0
    run = str(tmp_path / "tokens")
    line = refused(["eval", run, "--data", str(tmp_path / "tokens-400"), "--windows", "2"], capsys)
    assert re.search(r"its vocabulary has 3\d\d tokens, the model's 300 \(model.num_tokens\)", line), line
    model = checkpoint.load_model(run)
    model.config.num_tokens = 100  # as an imported model whose tokenizer is larger than its embedding
    monkeypatch.setattr(checkpoint, "load_model", lambda *args, **kwargs: model)
    assert "the model has 100 (model.num_tokens)" in refused(["sample", run, "--prompt", "document 3"], capsys)
    small = Transformer(dataclasses.replace(model.config, num_tokens=100))  # an embedding of 100 rows
    small.run_config = model.run_config
    import attnlab.bench.speculative as speculative

    monkeypatch.setattr(speculative, "load_model", lambda *args, **kwargs: small)
    line = refused(["speculative", "--target", run, "--early-exit", "1", "--prompt", "document 3"], capsys)
    assert "the target has 100 (model.num_tokens)" in line  # speculative decoding names which of its models


def test_non_finite_logits_stop_sampling_in_one_line(runs, capsys, monkeypatch):
    """A model whose logits are NaN (damaged or overflowing weights): `sample` says so instead of
    indexing past the vocabulary with the token drawn from them."""
    import attnlab.train.checkpoint as checkpoint
    from attnlab.errors import GenerationError
    from attnlab.generate.sampling import SamplingConfig, stream_text

    model = checkpoint.load_model(runs["bytes"])
    with torch.no_grad():
        model.head.weight[:] = float("nan")
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0), SamplingConfig(top_k=5, top_p=0.9)):
        with pytest.raises(GenerationError, match="non-finite logits .* at new token 1"):
            list(stream_text(model, torch.tensor([[100, 101]]), 4, sampling))
    monkeypatch.setattr(checkpoint, "load_model", lambda *args, **kwargs: model)
    assert "non-finite logits" in refused(["sample", runs["bytes"], "--max-new-tokens", "3"], capsys)
    import attnlab.bench.speculative as speculative

    monkeypatch.setattr(speculative, "load_model", lambda *args, **kwargs: model)
    line = refused(["speculative", "--target", runs["bytes"], "--early-exit", "1", "--max-new-tokens", "2"], capsys)
    assert "the target gave non-finite logits" in line


def test_a_prompt_of_any_bytes_is_sampled(runs, capsys):
    """A command line's bytes that are not UTF-8 arrive as surrogates: encoded as the bytes they were."""
    assert main(["sample", runs["bytes"], "--prompt", "caf\udce9", "--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("caf\ufffd")


def test_a_byte_model_with_more_tokens_than_bytes_is_sampled(runs, capsys, monkeypatch):
    """A byte-level model with model.num_tokens > 256 can draw an id that stands for no byte: shown as
    U+FFFD by `sample` and `speculative` (bytes() refused it, a ValueError traceback)."""
    import attnlab.bench.speculative as speculative
    import attnlab.train.checkpoint as checkpoint

    data = ["data.source=file", f"data.path={runs['corpus']}", f"out_dir={runs['root']}"]
    assert main(["train", *TINY, *data, "model.num_tokens=300", "name=wide"]) == 0
    run = str(Path(runs["root"]) / "wide")
    model = checkpoint.load_model(run)
    with torch.no_grad():  # the final (layer) norm gives ones; the head makes token 299 the most likely
        model.norm.weight.zero_()
        model.norm.bias.fill_(1.0)
        model.head.weight.zero_()
        model.head.weight[299] = 1.0
    monkeypatch.setattr(checkpoint, "load_model", lambda *args, **kwargs: model)
    monkeypatch.setattr(speculative, "load_model", lambda *args, **kwargs: model)
    capsys.readouterr()
    assert main(["sample", run, "--prompt", "ab", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "ab" + "\ufffd" * 3 + "\n"
    assert main(["speculative", "--target", run, "--early-exit", "1", "--prompt", "ab", "--max-new-tokens", "3",
                 "--temperature", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["base"]["text"] == report["speculative"]["text"] == "\ufffd" * 3


def test_a_refused_sample_writes_nothing_to_stdout(runs, capsys):
    """A prompt the model cannot take is refused before the prompt is echoed: the error stood on the
    prompt's line, and output redirected to a file held the prompt of a sample that failed."""
    capsys.readouterr()
    assert main(["sample", runs["learned"], "--prompt", "x" * 40, "--max-new-tokens", "1"]) == 2
    captured = capsys.readouterr()
    assert "make 41 tokens" in captured.err and captured.out == ""


# --------------------------------------------------------------------------------------------
# What the operating system refuses (a path, a permission, memory): one line, -v for the traceback


def test_system_errors_one_line(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = refused(["data", "download", "enwik8", "--dest", str(a_file)], capsys)
    assert "File exists" in line and "-v shows where" in line
    with pytest.raises(FileExistsError):
        main(["-v", "data", "download", "enwik8", "--dest", str(a_file)])

    import attnlab.data.byte_corpus as byte_corpus

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 6400000000064 bytes.\nmore")

    monkeypatch.setattr(byte_corpus, "prepare_builtin", out_of_memory)
    assert "out of memory: " in refused(["data", "prepare", "builtin"], capsys)
    monkeypatch.setattr(byte_corpus, "prepare_builtin", lambda *args: (_ for _ in ()).throw(MemoryError()))
    assert refused(["data", "prepare", "builtin"], capsys).endswith("out of memory (-v shows where)")
    monkeypatch.setattr(byte_corpus, "prepare_builtin", lambda *args: (_ for _ in ()).throw(KeyError("bug")))
    with pytest.raises(KeyError):  # a bug keeps its traceback
        main(["data", "prepare", "builtin"])
