"""Benchmarks and whole-split evaluation (attnlab.evaluate): lm-evaluation-harness runs an exported
sparse model on local YAML tasks (multiple choice and loglikelihood) and gives the accuracies and
perplexity attnlab's own log-probabilities give; unknown task names are one line; `attnlab eval --full`
counts every validation target once."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab import Transformer
from attnlab.cli.main import main
from attnlab.config import DataConfig, RunConfig, config_to_dict
from attnlab.data.corpus import load_corpus, with_data_path
from attnlab.evaluate import evaluate, full_split
from attnlab.train.checkpoint import checkpoint_path, load_model, save_checkpoint
from variants import variant_config

CHOICES = [  # context, choices, answer
    ("The cat sat on the", ["mat", "moon", "xyzzy"], 0),
    ("One, two, three,", ["four", "banana", "qqq"], 0),
    ("def add(a, b): return", ["a + b", "zzz", "!!"], 0),
    ("Hello,", ["world", "%%%", "###"], 0),
]
CONTINUATIONS = [("The quick brown fox jumps over the", " lazy dog"), ("abc", "def"), ("1 2 3", " 4 5")]
CHOICE_TASK = """task: attnlab_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
CONTINUATION_TASK = """task: attnlab_continuation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
  - metric: acc
"""


def nsa_run(run_dir: Path) -> Path:
    """A byte-level NSA model (token id = byte value: the exported tokenizer encodes text as UTF-8)
    with weights large enough that its choices differ, saved as a run."""
    torch.manual_seed(0)
    model = Transformer(variant_config("nsa", num_tokens=256)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.uniform_(0.5, 1.5) if name.endswith("norm.weight") else parameter.normal_(0.0, 0.1)
    config = RunConfig(name=run_dir.name, out_dir=str(run_dir.parent), model=model.config, data=DataConfig())
    save_checkpoint(checkpoint_path(run_dir, 5), {"config": config_to_dict(config), "model": model.state_dict(),
                                                  "step": 5})
    return run_dir


def write_tasks(folder: Path) -> Path:
    folder.mkdir()
    choices = folder / "choice.jsonl"
    choices.write_text("".join(json.dumps({"context": c, "choices": o, "answer": a}) + "\n" for c, o, a in CHOICES))
    continuations = folder / "continuation.jsonl"
    continuations.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in CONTINUATIONS))
    cache = folder / "datasets-cache"
    (folder / "choice.yaml").write_text(CHOICE_TASK.format(data=choices, cache=cache))
    (folder / "continuation.yaml").write_text(CONTINUATION_TASK.format(data=continuations, cache=cache))
    return folder


def log_likelihood(model: Transformer, context: str, continuation: str) -> tuple[float, bool]:
    """attnlab's own sum of log p(continuation bytes | context bytes), and whether each is the argmax."""
    context_ids, continuation_ids = list(context.encode()), list(continuation.encode())
    tokens = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(tokens[:, :-1]).logits.float(), dim=-1)[0]  # [T - 1, V]
    positions = range(len(context_ids) - 1, tokens.shape[1] - 1)
    chosen = [log_probs[position, tokens[0, position + 1]] for position in positions]
    greedy = all(log_probs[position].argmax() == tokens[0, position + 1] for position in positions)
    return float(sum(chosen)), greedy


def test_lm_eval_runs_local_tasks_on_a_sparse_model(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    run_dir = nsa_run(tmp_path / "run")
    tasks = write_tasks(tmp_path / "tasks")
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--tasks", "attnlab_choice,attnlab_continuation", "--include-path",
                 str(tasks), "--batch-size", "2"]) == 0
    printed = capsys.readouterr().out
    assert "attnlab_choice: acc " in printed and "attnlab_continuation: perplexity " in printed
    written = json.loads((run_dir / "lm-eval" / "step-0000005.json").read_text())  # lm-eval's own results
    results = written["results"]

    model = load_model(run_dir)  # lm-eval's figures are attnlab's log-probabilities (a space before choices)
    picked = [max(range(len(options)), key=lambda i: log_likelihood(model, context, " " + options[i])[0])
              for context, options, _ in CHOICES]
    expected_accuracy = np.mean([pick == answer for pick, (_, _, answer) in zip(picked, CHOICES)])
    assert results["attnlab_choice"]["acc,none"] == pytest.approx(expected_accuracy)
    assert 0 < expected_accuracy < 1  # the comparison can fail both ways
    scored = [log_likelihood(model, context, target) for context, target in CONTINUATIONS]
    assert results["attnlab_continuation"]["perplexity,none"] == pytest.approx(
        math.exp(-np.mean([value for value, _ in scored])), rel=1e-4)
    assert results["attnlab_continuation"]["acc,none"] == pytest.approx(np.mean([greedy for _, greedy in scored]))


def test_lm_eval_generates_until_on_a_byte_level_model_what_greedy_decoding_gives(tmp_path):
    """Generation tasks (lm-eval's generate_until) on a byte-level run, whose tokenizer has no EOS:
    each answer is attnlab's own greedy continuation of its context, cut at the task's stop sequence,
    in one batch (left-padded rows of other lengths)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from attnlab.evaluate import exported_for_lm_eval, lm_eval_model

    run_dir = nsa_run(tmp_path / "run")
    model, tokenizer, _ = exported_for_lm_eval(run_dir, "auto", "cpu")
    contexts = [context for context, _ in CONTINUATIONS]
    generation = {"until": ["m"], "max_gen_toks": 8, "do_sample": False}  # 2 of 3 stop
    requests = [Instance("generate_until", {}, (context, dict(generation)), index)
                for index, context in enumerate(contexts)]
    answers = lm_eval_model(model, tokenizer, 3, "cpu").generate_until(requests)  # one left-padded batch

    reference = load_model(run_dir)
    expected = []
    for context in contexts:
        tokens = torch.tensor([list(context.encode())])
        with torch.no_grad():
            for _ in range(generation["max_gen_toks"]):
                next_token = reference(tokens).logits[:, -1].argmax(dim=-1, keepdim=True)
                tokens = torch.cat([tokens, next_token], dim=1)
        expected.append(tokenizer.decode(tokens[0, len(context.encode()):].tolist()).split("m")[0])
    assert answers == expected


def test_a_failed_write_of_lm_eval_results_leaves_the_old_ones_whole(tmp_path, monkeypatch):
    """Evaluating a step again replaces RUN/lm-eval/step-N.json staged and renamed: a write that fails
    (a full disk, a kill) leaves the earlier results whole and no staging file. lm-eval and the model
    are stand-ins: only the write is under test."""
    from types import SimpleNamespace

    pytest.importorskip("lm_eval")
    from attnlab import evaluate

    results = tmp_path / "run" / "lm-eval"
    results.mkdir(parents=True)
    (results / "step-0000005.json").write_text('{"results": {"earlier": {"acc,none": 0.25}}}\n')
    monkeypatch.setattr(evaluate, "_lm_eval", lambda: SimpleNamespace(
        simple_evaluate=lambda **keywords: {"results": {"task": {"acc,none": 0.5}}}))
    monkeypatch.setattr(evaluate, "task_manager", lambda tasks, include_path: None)
    monkeypatch.setattr(evaluate, "exported_for_lm_eval", lambda run, weights, device: (None, None, 5))
    monkeypatch.setattr(evaluate, "lm_eval_model", lambda model, tokenizer, batch_size, device: None)

    def full_disk(*arguments, **keywords):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        evaluate.lm_eval_run(tmp_path / "run", ["task"])
    assert [path.name for path in results.iterdir()] == ["step-0000005.json"]
    assert json.loads((results / "step-0000005.json").read_text())["results"] == {"earlier": {"acc,none": 0.25}}


def test_metrics_are_printed_with_their_standard_errors_where_there_are_some():
    from attnlab.cli.eval import format_metrics

    metrics = {"acc": 0.75, "acc_stderr": 0.25, "bits_per_byte": 3.5, "bits_per_byte_stderr": "N/A"}
    assert format_metrics(metrics) == "acc 0.7500 ± 0.2500, bits_per_byte 3.5000"


@pytest.mark.slow  # a name not in --include-path is looked for among lm-eval's own tasks: indexing them takes seconds
def test_unknown_task_names_are_one_line(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    run_dir = nsa_run(tmp_path / "run")
    tasks = write_tasks(tmp_path / "tasks")
    assert main(["eval", str(run_dir), "--tasks", "attnlab_choise", "--include-path", str(tasks)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "unknown lm-eval task 'attnlab_choise' (did you mean attnlab_choice" in error
    assert not (run_dir / "lm-eval").exists()


@pytest.mark.parametrize("length", [97, 96, 33])  # a partial last window, whole windows, a single one
def test_full_split_counts_every_target_once(length):
    data = np.random.default_rng(0).integers(0, 256, size=length).astype(np.uint8)
    samples = full_split(data, seq_len=32)
    kept = samples.tokens[:, 1:][samples.loss_mask.bool()]
    assert kept.tolist() == data[1:].tolist()  # each target once, in order
    for row, window in enumerate(samples.tokens):  # inputs are the data before each target
        count = int(samples.loss_mask[row].sum())
        assert window[: count + 1].tolist() == data[row * 32 : row * 32 + count + 1].tolist()


def test_full_split_of_padded_documents_is_every_document_once(tmp_path):
    from attnlab.data.pretrain import load_token_corpus
    from attnlab.data.shards import prepare_token_shards
    from attnlab.data.tokenizer import train_tokenizer

    texts = [f"document {index}: " + "word " * (index % 11) for index in range(40)]
    corpus = tmp_path / "documents.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    train_tokenizer([corpus], vocab_size=290, out_dir=tmp_path / "tokenizer")
    prepare_token_shards([corpus], tmp_path / "tokenizer", tmp_path / "shards", workers=1)
    validation = load_token_corpus(DataConfig(source="tokens", path=str(tmp_path / "shards"), val_fraction=0.25)).val
    samples = full_split(validation, seq_len=8)
    assert samples.tokens.shape[0] == validation.n_documents == 10
    lengths = [len(validation.text_tokens(index)) for index in range(validation.n_documents)]
    assert samples.loss_mask.sum(dim=1).tolist() == [min(length, 7) + 1 for length in lengths]  # text + EOS


def test_full_evaluation_equals_the_mean_over_every_target(tmp_path, capsys):
    model = Transformer(variant_config("local", num_tokens=256)).eval()
    data = np.random.default_rng(1).integers(0, 256, size=150).astype(np.uint8)
    result = evaluate(model, data, seq_len=32, n_windows=0, batch_size=2, full=True)
    windows = [torch.from_numpy(data[start : start + 33].astype(np.int64)) for start in range(0, 149, 32)]
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(window[None, :-1]).logits[0], window[1:], reduction="sum")
                  for window in windows]
    assert result.n_tokens == 149 and result.n_windows == 5
    assert result.loss == pytest.approx(float(sum(losses)) / 149, rel=1e-5)
    # and from the command line, on a text file's validation split
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(np.random.default_rng(2).integers(32, 127, size=4000).astype(np.uint8)))
    config = RunConfig(name="run", out_dir=str(tmp_path), model=model.config, data=DataConfig())
    save_checkpoint(checkpoint_path(tmp_path / "run", 1), {"config": config_to_dict(config),
                                                           "model": model.state_dict(), "step": 1})
    assert main(["eval", str(tmp_path / "run"), "--data", str(text), "--full", "--seq-len", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    validation = load_corpus(with_data_path(DataConfig(), str(text))).val
    assert report["full"] and report["n_tokens"] == len(validation) - 1
