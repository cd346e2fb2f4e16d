"""Evaluation: mean next-token loss, bits per token, bits per byte and perplexity, over a fixed,
seeded set of validation windows (or padded documents), so the same model always gets the same numbers,
or over the whole validation split (`full`: every target once). And benchmarks through
lm-evaluation-harness (`lm_eval_run`): the run exported as a transformers model, evaluated by lm-eval's
own Hugging Face model class on its tasks or local YAML tasks.

Bits per byte of tokenized data: the summed loss in bits over the UTF-8 bytes the counted targets
decode to (special tokens count 0 bytes), so it is comparable with byte-level models.

Legend: N windows (or documents), T seq_len.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from attnlab.attention.routing import routing_stats
from attnlab.data.corpus import load_corpus, with_data_path
from attnlab.data.files import write_atomic
from attnlab.data.sampler import Batch, eval_batch
from attnlab.errors import AttnlabError, ConfigError, DataError
from attnlab.model.modes import eval_mode
from attnlab.model.transformer import Transformer, check_length
from attnlab.train.checkpoint import load_model
from attnlab.train.portable import run_directory


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy in nats per token
    bits_per_token: float  # loss / ln 2; bits per byte (and per character of ASCII) for byte data
    perplexity: float
    n_windows: int
    n_tokens: int  # targets counted (padding excluded)
    bits_per_byte: float | None = None  # equal to bits_per_token for byte data

    def as_dict(self) -> dict:
        return asdict(self)


def full_split(data: Any, seq_len: int) -> Batch:
    """The whole validation split as samples, every target once: each padded document (its first
    T tokens, as training sees it), or a token stream cut into consecutive windows of T + 1 tokens that
    overlap by one (window i predicts tokens i T + 1 .. (i + 1) T), the last one padded and masked."""
    if hasattr(data, "batch") and hasattr(data, "n_documents"):  # padded documents (data/pretrain.py)
        return data.batch(np.arange(data.n_documents), seq_len)
    n_targets = len(data) - 1
    n_windows = -(-n_targets // seq_len)  # ceil
    positions = np.arange(n_windows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # [N, T + 1]
    inside = positions < len(data)
    tokens = torch.zeros(positions.shape, dtype=torch.int64)
    tokens[torch.from_numpy(inside)] = torch.from_numpy(np.asarray(data[positions[inside]], dtype=np.int64))
    return Batch(tokens=tokens, loss_mask=torch.from_numpy(inside[:, 1:]).long())  # [N, T + 1], [N, T]


@torch.no_grad()
def evaluate(
    model: Transformer,
    data: np.ndarray,  # or a validation split with eval_batch / token_bytes (data/pretrain.py)
    seq_len: int,
    n_windows: int,
    batch_size: int,
    seed: int = 1234,
    autocast_dtype: torch.dtype | None = None,
    full: bool = False,
    progress: bool = False,
) -> EvalResult:
    """Loss over `n_windows` windows of seq_len + 1 tokens drawn with `seed` from `data`, or over the
    whole split (`full`, see full_split; n_windows is then ignored). progress: a bar over the windows
    (stderr)."""
    for name, value in (("windows", 1 if full else n_windows), ("seq_len", seq_len), ("batch_size", batch_size)):
        if value < 1:
            raise ConfigError(f"evaluation needs {name} >= 1, got {value}")
    check_length(model, seq_len, "evaluation windows of seq_len")
    with eval_mode(model):  # each module's own mode restored afterwards, also on an error
        device = next(model.parameters()).device
        # tokens [N, seq_len + 1], loss mask or None
        samples = full_split(data, seq_len) if full else eval_batch(data, seq_len, n_windows, seed)
        n_windows = samples.tokens.shape[0]
        token_bytes = getattr(data, "token_bytes", None)  # [V] bytes per id; None: one byte per token
        if token_bytes is not None:
            token_bytes = torch.from_numpy(token_bytes)  # once, not per batch
        total, count, n_bytes = 0.0, 0, 0
        bar = tqdm(total=n_windows, desc="evaluating", unit=" windows", disable=not progress)
        for start in range(0, n_windows, batch_size):
            bar.update(min(batch_size, n_windows - start))
            batch = samples.tokens[start : start + batch_size].to(device)
            mask = None if samples.loss_mask is None else samples.loss_mask[start : start + batch_size].to(device)
            autocast = torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                      enabled=autocast_dtype is not None)
            with autocast:
                output = model(batch[:, :-1], targets=batch[:, 1:], loss_mask=mask)
            counted = torch.ones_like(batch[:, 1:]) if mask is None else mask  # [B, T]
            n = int(counted.sum())
            total += output.lm_loss.item() * n  # lm_loss is the mean over the counted targets
            count += n
            if token_bytes is None:
                n_bytes += n
            else:
                n_bytes += int((token_bytes[batch[:, 1:].cpu()] * counted.cpu()).sum())
        bar.close()
    if count == 0:
        raise DataError("the validation windows hold no target to score (every one is padding)")
    loss = total / count
    return EvalResult(
        loss=loss, bits_per_token=loss / math.log(2), perplexity=math.exp(min(loss, 50.0)),
        n_windows=n_windows, n_tokens=count, bits_per_byte=total / math.log(2) / max(n_bytes, 1),
    )


def evaluate_run(
    run: str | Path,
    n_windows: int = 64,
    seq_len: int | None = None,
    batch_size: int = 8,
    seed: int = 1234,
    data_path: str | None = None,
    weights: str = "auto",
    device: str = "cpu",
    full: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """The record `attnlab eval RUN --json` prints: the run's checkpoint evaluated on its validation
    data (or on `data_path`'s: a byte file, or token shards for a tokenized run) over `n_windows`
    windows of seq_len (default: the run's), or over all of it (`full`), with routing statistics
    when the model routes."""
    model = load_model(run, device=device, weights=weights)
    config = model.run_config
    data_config = config.data if data_path is None else with_data_path(config.data, data_path)
    corpus = load_corpus(data_config)
    if corpus.vocab_size > model.config.num_tokens:  # ids past the embedding: name the mismatch, do not index
        raise DataError(f"{corpus.description}: its vocabulary has {corpus.vocab_size} tokens, the model's "
                        f"{model.config.num_tokens} (model.num_tokens): it was not trained on this kind of data")
    seq_len = seq_len or config.train.seq_len
    result = evaluate(model, corpus.val, seq_len, n_windows, batch_size, seed=seed, full=full, progress=progress)
    report = {"run": str(run), "step": model.checkpoint_step, "data": corpus.description, "seq_len": seq_len,
              "full": full, **result.as_dict()}
    windows = eval_batch(corpus.val, seq_len, min(n_windows, batch_size), seed).tokens
    routing = routing_stats(model, windows[:, :-1].to(device))  # empty unless the model routes
    if routing:
        report["routing"] = routing
    return report


# --------------------------------------------------------------------------------------------
# Benchmarks through lm-evaluation-harness


def _lm_eval():
    try:
        import lm_eval
    except ImportError as error:  # an optional dependency
        raise AttnlabError("benchmarks need lm-evaluation-harness: pip install 'attnlab[eval]'") from error
    return lm_eval


def task_manager(names: list[str], include_path: str | None = None):
    """lm-eval's TaskManager knowing every task in `names` (a task, group or tag name, or a YAML file);
    ConfigError naming the first unknown one. The folder `include_path` is indexed first: lm-eval's
    own thousands of tasks take seconds to index, so only when a name is not found there."""
    from lm_eval.tasks import TaskManager

    def unknown(manager) -> list[str]:
        return [name for name in names if name not in manager.all_tasks and not Path(name).is_file()]

    manager = TaskManager(include_path=include_path, include_defaults=False)
    if unknown(manager):
        manager = TaskManager(include_path=include_path)
    missing = unknown(manager)
    if missing:
        close = difflib.get_close_matches(missing[0], manager.all_tasks, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else " (a task name of lm-eval, or a YAML file)"
        raise ConfigError(f"unknown lm-eval task {missing[0]!r}{hint}")
    return manager


def exported_for_lm_eval(run: str | Path, weights: str, device: str):
    """(model, tokenizer, step): the run as transformers loads it (attnlab's model type, hf_model.py)
    and its tokenizer, read back from a temporary export folder, so that what lm-eval evaluates is
    what `attnlab export` writes."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnlab.hf import TOKENIZER_FILES, export_model, find_tokenizer

    source = load_model(run, weights=weights)
    tokenizer_dir = find_tokenizer(run_directory(run), source.run_config)
    with tempfile.TemporaryDirectory(prefix="attnlab-lm-eval-") as folder:
        export_model(source, folder, tokenizer_dir=tokenizer_dir, model_type="attnlab", overwrite=True)
        if not (Path(folder) / TOKENIZER_FILES[0]).is_file():
            raise DataError(f"{run} has no tokenizer, which lm-eval needs to encode its tasks")
        model = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()  # float32, as exported
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer, source.checkpoint_step


def lm_eval_model(model, tokenizer, batch_size: int, device: str):
    """lm-eval's Hugging Face model (HFLM) over an exported run and its tokenizer. HFLM reads the
    tokenizer's BOS and EOS tokens, which a byte-level tokenizer lacks:
    - an empty context starts with BOS (or EOS): without either, a newline stands in;
    - a generation stops at the task's stop sequences and at EOS, decoded first: without EOS there
      is no such stop (no byte is made one), the task's own stops and length remain."""
    from lm_eval.models.huggingface import HFLM

    class AttnlabHFLM(HFLM):
        def tok_decode(self, tokens, skip_special_tokens: bool = True):
            if tokens is None:  # the EOS of a tokenizer without one (HFLM.generate_until)
                return None
            return super().tok_decode(tokens, skip_special_tokens=skip_special_tokens)

    special = tokenizer.bos_token_id is not None or tokenizer.eos_token_id is not None
    return AttnlabHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                       prefix_token_id=None if special else ord("\n"))


def lm_eval_run(
    run: str | Path,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    weights: str = "auto",
    device: str = "cpu",
) -> dict[str, Any]:
    """`attnlab eval RUN --tasks A,B`: lm-eval's Hugging Face model (HFLM) on the exported run, on
    tasks by name (lm-eval's, or YAML tasks in `include_path`). lm-eval's results are written as JSON
    beside the run (RUN/lm-eval/step-N.json); returned: {"path", "step", "results": {task: {metric: value}}}."""
    lm_eval = _lm_eval()
    from lm_eval.utils import handle_non_serializable

    manager = task_manager(tasks, include_path)  # unknown names fail before the model is loaded
    model, tokenizer, step = exported_for_lm_eval(run, weights, device)
    language_model = lm_eval_model(model, tokenizer, batch_size, device)
    results = lm_eval.simple_evaluate(model=language_model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, log_samples=False)
    path = run_directory(run) / "lm-eval" / f"step-{step:07d}.json"
    # atomic: evaluating the same step again (other tasks) replaces the file, never leaves half of it
    write_atomic(path, (json.dumps(results, indent=2, default=handle_non_serializable) + "\n").encode())
    metrics = {task: {name.split(",")[0]: value for name, value in values.items() if "," in name}  # "acc,none"
               for task, values in results["results"].items()}
    return {"path": str(path), "step": step, "results": metrics}
