"""Tokenized pretraining data: jsonl -> token shards (round trip, errors, streaming), the padded and
packed layouts, the exact loss mask, exact resume, the MiniMind presets, the demo pipeline and CLI."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.cli.main import main
from attnlab.config import DataConfig, TrainConfig, load_config
from attnlab.data.corpus import load_corpus
from attnlab.data.pretrain import PaddedDocumentSampler, load_token_corpus
from attnlab.data.sampler import RandomWindowSampler, make_sampler
from attnlab.data.shards import TokenShards, prepare_token_shards, token_dtype
from attnlab.data.tokenizer import Tokenizer, train_tokenizer
from attnlab.errors import DataError
from attnlab.evaluate import evaluate
from attnlab.model import Transformer
from attnlab.train.checkpoint import load_model
from attnlab.train.loop import train
from attnlab.train.metrics import read_metrics

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ünïcödé, 中文字符 and 🙂",
    "x",
    "A longer document " * 12,
    "literal special text <|endoftext|> inside a document",
] * 6 + [f"document number {index}: " + "words " * (index % 7) for index in range(40)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pretrain")


@pytest.fixture(scope="module")
def tokenizer_dir(folder) -> Path:
    return train_tokenizer([write_jsonl(folder / "train.jsonl", TEXTS)], vocab_size=320, out_dir=folder / "tok")


@pytest.fixture(scope="module")
def prepared(folder, tokenizer_dir) -> Path:
    inputs = [write_jsonl(folder / "a.jsonl", TEXTS[:30]), write_jsonl(folder / "b.jsonl", TEXTS[30:])]
    prepare_token_shards(inputs, tokenizer_dir, folder / "data", shard_tokens=200, batch_lines=7, workers=2)
    return folder / "data"


def test_prepare_round_trips_in_several_shards(prepared, tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    shards = TokenShards(prepared)
    meta = shards.meta
    assert len(meta["shards"]) > 3  # streaming: the 200-token limit closed several shards
    assert meta["dtype"] == "uint16" and shards.shards[0].dtype == np.uint16
    assert (meta["n_documents"], meta["skipped_lines"], meta["vocab_size"]) == (len(TEXTS), 0, 320)
    assert meta["n_tokens"] == sum(len(tokenizer.encode(text)) + 1 for text in TEXTS)
    for index, text in enumerate(TEXTS):
        document = shards.document(index)
        assert document[-1] == tokenizer.eos_id
        assert document[:-1].tolist() == tokenizer.encode(text)
        assert tokenizer.decode(document[:-1]) == text


def test_parallel_prepare_equals_single_process(prepared, folder, tokenizer_dir):
    inputs = [folder / "a.jsonl", folder / "b.jsonl"]
    prepare_token_shards(inputs, tokenizer_dir, folder / "single", shard_tokens=200, batch_lines=3, workers=1)
    parallel, single = TokenShards(prepared), TokenShards(folder / "single")
    assert np.array_equal(parallel.offsets, single.offsets)
    everything = np.arange(parallel.n_tokens)
    assert np.array_equal(parallel.gather(everything), single.gather(everything))


def test_a_worker_process_that_dies_is_a_one_line_error():
    """The workers start fresh (spawn); one that dies mid-prepare is an error, never a wait without end."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from attnlab.data.shards import _in_order

    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=os._exit,
                               initargs=(1,))
    try:
        with pytest.raises(DataError, match="a tokenizing worker process ended without finishing its batch"):
            list(_in_order(pool, iter([("unused.jsonl", [], False, "uint16")]), max_in_flight=2))
    finally:
        pool.shutdown()


def test_token_dtype_by_vocabulary():
    assert token_dtype(6400) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_malformed_line_names_file_and_line_or_is_counted(folder, tokenizer_dir):
    bad = folder / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n\n{"text": 3}\n{"text": "also fine"}\nnot json\n\xff\xfe\n{"text": "end"}\n')
    with pytest.raises(DataError, match=re.escape(f"{bad}:3:")):
        prepare_token_shards([bad], tokenizer_dir, folder / "bad-out", workers=1)
    meta = prepare_token_shards([bad], tokenizer_dir, folder / "bad-out", skip_bad=True, workers=2).meta
    assert (meta["skipped_lines"], meta["n_documents"]) == (3, 3)


def test_padded_layout_is_minimind_samples_with_masked_padding(prepared, tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    corpus = load_token_corpus(DataConfig(source="tokens", path=str(prepared), val_fraction=0.1))
    seq_len = 12
    batch = corpus.train.batch(np.array([3, 4]), seq_len)  # "x" (short) and a long document
    assert batch.tokens.shape == (2, seq_len + 1) and batch.loss_mask.shape == (2, seq_len)
    short = [tokenizer.bos_id, *tokenizer.encode("x"), tokenizer.eos_id]
    assert batch.tokens[0].tolist() == short + [tokenizer.pad_id] * (seq_len + 1 - len(short))
    assert batch.loss_mask[0].tolist() == [1] * (len(short) - 1) + [0] * (seq_len + 1 - len(short))
    long = [tokenizer.bos_id, *tokenizer.encode(TEXTS[4])[: seq_len - 1], tokenizer.eos_id]  # truncated, EOS kept
    assert batch.tokens[1].tolist() == long and batch.loss_mask[1].tolist() == [1] * seq_len
    literal = corpus.train.batch(np.array([5]), 40)  # "<|endoftext|>" in the text is still a target
    n_text = len(tokenizer.encode(TEXTS[5])) + 2
    assert literal.loss_mask[0].sum() == n_text - 1 and (literal.tokens[0, :n_text] == tokenizer.pad_id).any()


def test_packed_layout_windows_are_the_stream(prepared):
    corpus = load_token_corpus(DataConfig(source="tokens", path=str(prepared), layout="packed", val_fraction=0.1))
    shards = corpus.train.shards
    stream = np.concatenate([shards.document(index) for index in range(shards.n_documents)])
    sampler = make_sampler(corpus, TrainConfig(seq_len=16, batch_size=8, seed=3))
    assert isinstance(sampler, RandomWindowSampler) and not isinstance(sampler, PaddedDocumentSampler)
    for _ in range(5):  # windows cross shard boundaries: the stream is still contiguous
        starts = sampler.starts(sampler.position)
        batch = sampler.next_batch(corpus.train)
        assert batch.loss_mask is None and batch.tokens.shape == (8, 17)
        for row, start in enumerate(starts):
            assert batch.tokens[row].tolist() == stream[start : start + 17].tolist()
    boundary = corpus.val.start  # validation: the last documents, from a document boundary
    assert boundary == shards.offsets[shards.n_documents - len(TEXTS) // 10] and len(corpus.val) > 0


def test_padded_sampler_covers_each_epoch_and_splits_ranks():
    single = PaddedDocumentSampler(50, 8, batch_size=10, seed=1)
    ranks = [PaddedDocumentSampler(50, 8, batch_size=5, seed=1, rank=rank, world_size=2) for rank in range(2)]
    for index in range(5):  # one epoch: each document exactly once
        together = single.starts(index)
        parts = [sampler.starts(index) for sampler in ranks]
        assert not set(parts[0]) & set(parts[1])
        assert np.array_equal(np.concatenate(parts), together)
    assert sorted(np.concatenate([single.starts(index) for index in range(5)])) == list(range(50))
    assert not np.array_equal(single.starts(0), single.starts(5))  # a new order next epoch


def test_loss_mask_is_exact():
    """Masked targets contribute zero loss and zero gradient; the loss is the mean over the rest."""
    config = load_config("minimind-demo", ["model.dim=32", "model.depth=2", "model.dim_head=8",
                                           "model.num_tokens=64", "model.ff_hidden=64"]).model
    torch.manual_seed(0)
    model = Transformer(config)
    tokens = torch.randint(0, 64, (3, 10))
    targets = torch.randint(0, 64, (3, 10))
    mask = (torch.rand(3, 10) > 0.4).long()
    mask[:, 0] = 1

    def loss_and_gradients(targets):
        model.zero_grad()
        output = model(tokens, targets=targets, loss_mask=mask)
        output.lm_loss.backward()
        return output.lm_loss.detach(), [p.grad.clone() for p in model.parameters()], output.logits.detach()

    loss, gradients, logits = loss_and_gradients(targets)
    changed = torch.where(mask == 0, (targets + 7) % 64, targets)  # other targets where masked only
    assert not torch.equal(changed, targets)
    changed_loss, changed_gradients, _ = loss_and_gradients(changed)
    assert torch.equal(loss, changed_loss)
    assert all(torch.equal(a, b) for a, b in zip(gradients, changed_gradients))
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    reference = (per_token * mask.flatten()).sum() / mask.sum()  # MiniMind's (loss * mask).sum() / mask.sum()
    assert torch.allclose(loss, reference, atol=1e-6)


def tiny_token_run(tmp_path: Path, prepared: Path, name: str, *extra: str):
    return load_config("minimind-demo", [
        f"name={name}", f"out_dir={tmp_path / 'runs'}", "model.num_tokens=320", "model.dim=32", "model.depth=2",
        "model.heads=2", "model.kv_heads=1", "model.dim_head=16", "model.ff_hidden=64", "model.max_seq_len=64",
        "data.source=tokens", f"data.path={prepared}", "data.val_fraction=0.1", "train.seq_len=16",
        "train.batch_size=4", "train.max_steps=6", "train.eval_every=3", "train.eval_batches=1",
        "train.sample_every=3", "train.sample_length=8", "train.prime_length=4", "train.save_every=3",
        "train.log_every=1", "log.progress=false", *extra,
    ])


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_resume_is_exact_with_token_shards(tmp_path, prepared, layout):
    whole = train(tiny_token_run(tmp_path, prepared, "whole", f"data.layout={layout}"))
    train(tiny_token_run(tmp_path, prepared, "split", f"data.layout={layout}"), until_step=3)
    split = train(tiny_token_run(tmp_path, prepared, "split", f"data.layout={layout}"), resume=True)
    assert split.step == 6
    resumed = load_model(split.run_dir).state_dict()
    for key, value in load_model(whole.run_dir).state_dict().items():
        assert torch.equal(value, resumed[key]), key
    losses = [[(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]
              for run in (whole.run_dir, split.run_dir)]
    assert losses[0] == losses[1] and len(losses[0]) == 6


def test_a_resume_in_another_layout_is_refused_before_a_step_where_it_cannot_evaluate(tmp_path, prepared):
    """A padded run resumed packed (other batches, said in a warning) whose one validation document is
    shorter than a window: refused as it starts, not at its first evaluation after steps it would lose."""
    short_val = ["data.val_fraction=0.01", "train.eval_every=4"]  # one validation document, of 11 tokens
    run = tiny_token_run(tmp_path, prepared, "relayout", "data.layout=padded", *short_val)
    train(run, until_step=2)
    with pytest.raises(DataError, match="the validation split has 11 tokens; windows of seq_len"):
        train(tiny_token_run(tmp_path, prepared, "relayout", "data.layout=packed", *short_val), resume=True)
    assert max(record["step"] for record in read_metrics(run.run_dir)) == 2


def test_vocabulary_larger_than_the_model_is_refused(tmp_path, prepared):
    with pytest.raises(Exception, match="model.num_tokens=320"):
        train(tiny_token_run(tmp_path, prepared, "small-vocab", "model.num_tokens=256"))


def test_a_model_vocabulary_larger_than_the_tokenizer_samples_and_trains(tmp_path, prepared, capsys):
    """model.num_tokens past the tokenizer's vocabulary (a preset's 6400 on a tokenizer that came out
    smaller) draws ids that stand for no text: shown as U+FFFD, in training samples, `attnlab sample`
    and `attnlab speculative` alike, not an error that ends training at its first sample."""
    result = train(tiny_token_run(tmp_path, prepared, "large-vocab", "model.num_tokens=6400"))
    assert result.step == 6
    capsys.readouterr()
    assert main(["sample", str(result.run_dir), "--prompt", "héllo", "--max-new-tokens", "16"]) == 0
    assert "\ufffd" in capsys.readouterr().out  # almost all of 6400 near-uniform ids are past the 320
    assert main(["speculative", "--target", str(result.run_dir), "--early-exit", "1", "--prompt", "héllo",
                 "--max-new-tokens", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # the texts decoded as `attnlab sample` decodes them
    assert report["prompt"] == "<|im_start|>héllo"
    assert "\ufffd" in report["base"]["text"] + report["speculative"]["text"]
    tokenizer = Tokenizer(prepared / "tokenizer")
    assert tokenizer.decode_bytes([tokenizer.encode("a")[0], 6399]) == "a\ufffd".encode()
    with pytest.raises(DataError, match="token id -1"):
        tokenizer.decode_bytes([-1])


def test_a_relative_data_path_read_from_another_folder_says_where_it_looked(tmp_path, prepared, monkeypatch, capsys):
    """A run trained with a relative data.path, evaluated from another folder: the error says the path
    is read from the current folder, rather than only to prepare data that exists."""
    monkeypatch.chdir(prepared.parent)
    result = train(tiny_token_run(tmp_path, prepared, "relative", f"data.path={prepared.name}", "train.max_steps=1"))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["eval", str(result.run_dir)]) == 2
    error = capsys.readouterr().err
    assert f"{prepared.name} does not exist (a relative path, read from the current folder {tmp_path})" in error
    assert f"`attnlab data prepare --input FILES --tokenizer DIR --out {prepared.name}`" in error  # a whole command
    assert len(error.strip().splitlines()) == 1


def test_bits_per_byte_counts_decoded_bytes(prepared):
    """bits per byte = summed loss in bits / UTF-8 bytes of the counted targets (special tokens 0 bytes)."""
    corpus = load_token_corpus(DataConfig(source="tokens", path=str(prepared), val_fraction=0.3))
    config = tiny_token_run(Path("/tmp"), prepared, "unused").model
    torch.manual_seed(0)
    model = Transformer(config)
    result = evaluate(model, corpus.val, 16, 6, 4)
    batch = corpus.val.eval_batch(16, 6, 1234)
    targets, mask = batch.tokens[:, 1:], batch.loss_mask
    text_bytes = sum(len(corpus.tokenizer.decode_bytes([t])) for t, m in zip(targets.flatten().tolist(),
                     mask.flatten().tolist()) if m and t > 2)
    assert result.n_tokens == int(mask.sum())
    assert result.bits_per_byte == pytest.approx(result.bits_per_token * result.n_tokens / text_bytes, rel=1e-6)


def test_cli_prepare_and_errors(folder, tokenizer_dir, capsys):
    out = folder / "cli-data"
    assert main(["data", "prepare", "--input", str(folder / "a.jsonl"), "--tokenizer", str(tokenizer_dir),
                 "--out", str(out), "--workers", "1"]) == 0
    assert "30 documents" in capsys.readouterr().out and TokenShards(out).n_documents == 30
    assert main(["data", "prepare", "--input", str(folder / "bad.jsonl"), "--tokenizer", str(tokenizer_dir),
                 "--out", str(out), "--workers", "1"]) == 2
    assert f"{folder / 'bad.jsonl'}:3:" in capsys.readouterr().err
    assert main(["data", "prepare", "--input", str(folder / "bad.jsonl"), "--tokenizer", str(tokenizer_dir),
                 "--out", str(out), "--skip-bad", "--workers", "1"]) == 0
    assert "3 lines skipped" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# Presets


@pytest.mark.parametrize("name", ["minimind-pretrain", "minimind-moe", "minimind-demo"])
def test_minimind_presets_are_minimind_shaped(name):  # their parameter counts: test_presets.py
    config = load_config(name)
    assert (config.model.norm, config.model.position, config.model.tie_embeddings) == ("rmsnorm", "rotary", True)
    assert config.model.n_kv_heads < config.model.heads  # GQA
    assert config.data.source in ("tokens", "builtin-tokens") and config.data.layout == "padded"


def test_minimind_presets_reproduce_the_seed():
    for name in ("minimind-pretrain", "minimind-moe"):
        config = load_config(name)
        model, tc = config.model, config.train
        assert (model.dim, model.depth, model.max_seq_len, model.num_tokens, tc.seq_len) == (512, 8, 512, 6400, 512)
        assert (tc.batch_size, tc.lr, tc.precision, tc.grad_accum, tc.grad_clip) == (32, 5e-4, "bf16", 8, 1.0)
        assert (tc.schedule, tc.warmup_steps, tc.log_every, tc.save_every) == ("minimind", 0, 100, 100)
    moe = load_config("minimind-moe").model
    assert moe.feed_forward == "moe" and load_config("minimind-pretrain").model.feed_forward == "swiglu"
    assert (moe.moe.n_experts, moe.moe.top_k, moe.moe.n_shared_experts, moe.moe.balance_loss_weight) == (4, 2, 1, 0.1)


# --------------------------------------------------------------------------------------------
# The demo pipeline, end to end at a tiny size


def test_runs_started_together_each_train_the_tokenizer_in_a_folder_of_their_own(tmp_path, monkeypatch):
    """Two runs preparing the built-in tokens on one fresh cache: the second starts, and finishes,
    while the first trains its tokenizer. Neither deletes the other's staging folder, and both end
    with the one tokenizer (a shared staging folder ended the first in a FileNotFoundError)."""
    import os

    from attnlab.data import pretrain

    every_source = pretrain.stdlib_sources()
    monkeypatch.setattr(pretrain, "stdlib_sources", lambda: every_source[:20])  # a small corpus: fast
    monkeypatch.setattr(pretrain, "prepare_token_shards", lambda *arguments, **keywords: None)  # not this test's
    config = load_config("minimind-demo", [f"data.cache_dir={tmp_path}", "data.vocab_size=300"]).data
    train_for_real, started = pretrain.train_tokenizer, []

    def train_while_another_run_starts(inputs, vocab_size, out_dir, **keywords):
        train_for_real(inputs, vocab_size, out_dir, **keywords)
        if not started:  # the first run, its tokenizer staged but not yet moved: a second run starts
            started.append(out_dir)
            with monkeypatch.context() as patch:
                patch.setattr(os, "getpid", lambda: 424242)
                pretrain.prepare_builtin_tokens(config)

    monkeypatch.setattr(pretrain, "train_tokenizer", train_while_another_run_starts)
    pretrain.prepare_builtin_tokens(config)
    tokenizer_dir = pretrain.builtin_folder(config) / "tokenizer-v300"
    assert Tokenizer(tokenizer_dir).backend.get_vocab_size() == 300
    assert [path.name for path in tokenizer_dir.parent.iterdir() if "partial" in path.name] == []


def test_minimind_demo_pipeline_end_to_end(tmp_path, capsys, caplog, monkeypatch):
    from attnlab.data import pretrain

    every_source = pretrain.stdlib_sources()
    monkeypatch.setattr(pretrain, "stdlib_sources", lambda: every_source[:200])  # tiny: fewer documents
    tiny = [f"out_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",  # a corpus of 200 files: not shared
            "data.vocab_size=300", "model.num_tokens=300", "model.dim=32",
            "model.depth=1", "model.dim_head=8", "model.ff_hidden=64", "train.max_steps=4", "train.eval_every=2",
            "train.sample_every=4", "train.sample_length=8", "train.save_every=4", "log.progress=false"]
    caplog.set_level(logging.INFO)
    assert main(["train", "-p", "minimind-demo", "name=first", *tiny]) == 0
    records = read_metrics(tmp_path / "runs" / "first")
    assert [r["step"] for r in records if "val_bpb" in r] == [0, 2, 4]
    assert "<|im_start|>" in caplog.text  # the sample was decoded with the tokenizer
    caplog.clear()
    assert main(["data", "info", "-p", "minimind-demo", *tiny]) == 0  # a second run finds every stage done
    for stage in ("built-in jsonl corpus: cached", "tokenizer: cached", "token shards: cached"):
        assert stage in caplog.text, stage
    capsys.readouterr()
    run = str(tmp_path / "runs" / "first")
    assert main(["sample", run, "--prompt", "Return the", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    cached = capsys.readouterr().out
    assert main(["sample", run, "--prompt", "Return the", "--max-new-tokens", "12", "--temperature", "0",
                 "--no-cache"]) == 0
    assert capsys.readouterr().out == cached and cached.startswith("Return the")
    import attnlab.generate.sampling as sampling

    tokenizer = load_corpus(load_config("minimind-demo", tiny).data).tokenizer
    word, rest = tokenizer.encode(" word"), tokenizer.encode(" after")
    steps = [*word, tokenizer.eos_id, *rest]
    with monkeypatch.context() as patch:
        patch.setattr(sampling, "stream", lambda *a, **k: ((torch.tensor([t]), torch.zeros(1, 8)) for t in steps))
        assert main(["sample", run, "--prompt", "Say", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == "Say word\n"  # generation stops at the end token
    for prime in (["--prime-from-val", "--batch-size", "2"], ["--prompt", "Return the"]):  # primes are documents
        assert main(["speculative", "--target", run, "--early-exit", "1", *prime, "--max-new-tokens", "6",
                     "--temperature", "0", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["base"]["text"] == report["speculative"]["text"]  # greedy: the same tokens
    assert main(["eval", run, "--json", "--windows", "4", "--batch-size", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bits_per_byte"] < report["bits_per_token"]  # a token is more than one byte
    corpus = load_corpus(load_config("minimind-demo", tiny).data)
    assert corpus.tokenizer.vocab_size == 300 and corpus.layout == "padded"
