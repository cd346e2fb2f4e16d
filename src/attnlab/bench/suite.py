"""The benchmark suite: every registered attention variant over a range of lengths, each
measurement in a fresh process, written as JSON lines, a markdown report and PNG plots.

    attnlab bench suite --device cpu --quick --out docs/bench

The report is generated, never typed by hand: docs/benchmarks.md links the generated pages.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import attnlab.attention  # noqa: F401  (registers the variants)
from attnlab.bench.runner import decode_table, model_values, run_isolated, train_table
from attnlab.errors import AttnlabError
from attnlab.registry import ATTENTION

log = logging.getLogger(__name__)

# Options a variant is benchmarked with (each variant reads only its own section).
DEFAULT_OPTIONS = [
    "attention.local.window_size=64",
    "attention.routing.window_size=64",
    "attention.sinkhorn.bucket_size=64",
]


@dataclass(kw_only=True)
class SuitePlan:
    attention: list[str]
    lengths: list[int]
    contexts: list[int]
    dim: int = 256
    depth: int = 4
    heads: int = 4
    batch_size: int = 1
    steps: int = 3
    warmup: int = 1
    new_tokens: int = 16
    device: str = "cpu"
    dtype: str = "fp32"
    threads: int = 2
    overrides: list[str] = field(default_factory=lambda: list(DEFAULT_OPTIONS))


def default_plan(device: str, quick: bool, attention: list[str] | None = None) -> SuitePlan:
    names = attention or ATTENTION.names()
    if device == "cpu":
        lengths = [256, 512] if quick else [512, 1024, 2048, 4096, 8192]
        contexts = [64, 256] if quick else [64, 256, 1024, 4096]
        return SuitePlan(attention=names, lengths=lengths, contexts=contexts,
                         dim=128 if quick else 256, depth=2 if quick else 4, heads=2 if quick else 4,
                         steps=2 if quick else 3, new_tokens=8 if quick else 16)
    lengths = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    contexts = [1024, 8192] if quick else [1024, 8192, 16384, 32768, 65536]
    return SuitePlan(attention=names, lengths=lengths, contexts=contexts, dim=768, depth=12, heads=12,
                     batch_size=1, device=device, dtype="bf16", steps=5, warmup=2, new_tokens=32)


def processor_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_suite(plan: SuitePlan, out_dir: Path, command: str, progress: bool = False) -> list[dict[str, Any]]:
    """Every measurement of `plan`, each in a fresh process, into out_dir (suite.jsonl as they come,
    then the report and plots). progress: a bar over the measurements, the log lines above it."""
    variants = {attention: model_values(plan.dim, plan.depth, plan.heads, attention, plan.overrides)
                for attention in plan.attention}  # every one checked before the first is measured
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "suite.jsonl"
    jsonl.write_text("")
    results: list[dict[str, Any]] = []
    n_jobs = len(plan.attention) * (2 * len(plan.lengths) + len(plan.contexts))
    bar = tqdm(total=n_jobs, desc="bench suite", unit=" measurements", disable=not progress)
    with bar, logging_redirect_tqdm():
        for attention, values in variants.items():
            results += _measure_variant(plan, attention, values, jsonl, bar)
    write_report(plan, results, out_dir, command)
    return results


def _measure_variant(plan: SuitePlan, attention: str, values: dict[str, Any], jsonl: Path, bar: tqdm
                     ) -> list[dict[str, Any]]:
    """One variant's (model config `values`) training, layer and decoding measurements, appended to
    `jsonl` one by one."""
    results = []
    jobs: list[tuple[str, dict[str, Any]]] = []
    for length in plan.lengths:
        jobs.append(("train", dict(model_values=values, seq_len=length, batch_size=plan.batch_size,
                                   steps=plan.steps, warmup=plan.warmup, device=plan.device, dtype=plan.dtype)))
        jobs.append(("layer", dict(model_values=values, seq_len=length, batch_size=plan.batch_size,
                                   repeats=plan.steps, warmup=plan.warmup, device=plan.device, dtype=plan.dtype)))
    for context in plan.contexts:
        jobs.append(("decode", dict(model_values=values, context=context, new_tokens=plan.new_tokens,
                                    use_cache=True, device=plan.device, dtype=plan.dtype)))
    for task, arguments in jobs:
        bar.set_postfix_str(f"{task} {attention} {arguments.get('seq_len') or arguments.get('context')}")
        try:
            result = run_isolated(task, arguments, plan.threads)
        except (AttnlabError, subprocess.TimeoutExpired) as error:
            result = {"kind": task, "attention": attention, "error": str(error)[:300],
                      **{k: arguments.get(k) for k in ("seq_len", "context")}}
        results.append(result)
        with open(jsonl, "a") as handle:
            handle.write(json.dumps(result) + "\n")
        log.info("%s", json.dumps(result))
        bar.update()
    return results


def layer_table(results: list[dict[str, Any]]) -> str:
    lines = ["| attention | seq_len | forward (ms) | forward+backward (ms) |", "|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['attention']} | {r['seq_len']} | {r['forward_ms']:.1f} | {r['forward_backward_ms']:.1f} |")
    return "\n".join(lines)


def write_report(plan: SuitePlan, results: list[dict[str, Any]], out_dir: Path, command: str) -> None:
    ok = [r for r in results if "error" not in r]
    by_kind = {kind: [r for r in ok if r["kind"] == kind] for kind in ("train", "layer", "decode")}
    environment = next(iter(ok), {})
    header = [
        "# Benchmark suite",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}, git revision {git_revision()}.",
        f"Machine: {platform.machine()}, {environment.get('gpu') or processor_name()}, "
        f"torch {environment.get('torch')}, {plan.threads} threads, dtype {plan.dtype}, device {plan.device}.",
        f"Model: dim {plan.dim}, depth {plan.depth}, heads {plan.heads}, batch {plan.batch_size}; "
        f"options {', '.join(plan.overrides) or 'defaults'}. Medians of {plan.steps} measured runs after "
        f"{plan.warmup} warm-up, each configuration in a fresh process.",
        "",
        "## Training step (whole model)",
        "",
        train_table(by_kind["train"]),
        "",
        "![training throughput](train_throughput.png) ![peak memory](train_memory.png)",
        "",
        "## One attention layer",
        "",
        layer_table(by_kind["layer"]),
        "",
        "## Decoding with the cache",
        "",
        decode_table(by_kind["decode"]),
        "",
        "![decode latency](decode.png)",
        "",
    ]
    failed = [r for r in results if "error" in r]
    if failed:
        header += ["## Failed configurations", ""] + [f"- {r['kind']} {r['attention']} "
                                                       f"{r.get('seq_len') or r.get('context')}: {r['error']}"
                                                       for r in failed] + [""]
    (out_dir / "suite.md").write_text("\n".join(header))
    from attnlab.bench.plots import plot_suite

    plot_suite(by_kind, out_dir)


DOC_BEGIN, DOC_END = "<!-- bench-suite:begin -->", "<!-- bench-suite:end -->"


def checked_doc(doc: Path) -> str:
    """The text of `doc`, a writable file with a DOC_BEGIN ... DOC_END block; else AttnlabError.
    `bench suite --doc` checks it before measuring, not only once the suite is done."""
    if not doc.is_file():
        raise AttnlabError(f"--doc {doc} is not a file")
    text = doc.read_text()
    if DOC_BEGIN not in text or DOC_END not in text:
        raise AttnlabError(f"{doc} has no '{DOC_BEGIN}' ... '{DOC_END}' block to put the report in")
    if not os.access(doc, os.W_OK):
        raise AttnlabError(f"--doc {doc} is not writable")
    return text


def update_doc(doc: Path, out_dir: Path) -> None:
    """Put the suite report of `out_dir` between the DOC_BEGIN and DOC_END lines of `doc` (headings one
    level down, picture links relative to `doc`), so the published figures are never typed by hand."""
    text = checked_doc(doc)
    link = Path(os.path.relpath(out_dir.resolve(), doc.resolve().parent)).as_posix()
    report = (out_dir / "suite.md").read_text().splitlines()
    body = []
    for line in report[1:]:  # the report's own title is replaced by the doc's section heading
        line = "#" + line if line.startswith("#") else line
        for picture in ("train_throughput.png", "train_memory.png", "decode.png"):
            line = line.replace(f"]({picture})", f"]({link}/{picture})")
        body.append(line)
    body.append(f"Raw measurements: [{link}/suite.jsonl]({link}/suite.jsonl).")
    before, rest = text.split(DOC_BEGIN, 1)
    after = rest.split(DOC_END, 1)[1]
    doc.write_text(before + DOC_BEGIN + "\n" + "\n".join(body).strip() + "\n" + DOC_END + after)
