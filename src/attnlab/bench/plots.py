"""PNG plots with matplotlib (headless): benchmark curves and training runs side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabError
from attnlab.train.metrics import read_metrics


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise AttnlabError("plots need matplotlib: pip install matplotlib") from error
    return plt


def _lines(axis, results: list[dict[str, Any]], x: str, y: str) -> None:
    for name in sorted({r["attention"] for r in results}):
        points = sorted((r[x], r[y]) for r in results if r["attention"] == name and r.get(y) is not None)
        if points:
            axis.plot(*zip(*points), marker="o", label=name)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()


def plot_suite(by_kind: dict[str, list[dict[str, Any]]], out_dir: Path) -> list[Path]:
    """Throughput and memory against length, decode latency against context: one line per variant."""
    plt = _pyplot()
    written = []
    for name, kind, x, y, label in [
        ("train_throughput.png", "train", "seq_len", "tokens_per_s", "training tokens/s"),
        ("train_memory.png", "train", "seq_len", "peak_memory_mb", "peak training memory (MB)"),
        ("decode.png", "decode", "context", "ms_per_token", "decode latency with cache (ms/token)"),
    ]:
        figure, axis = plt.subplots(figsize=(6, 4))
        _lines(axis, by_kind.get(kind, []), x, y)
        axis.set_xlabel(x.replace("_", " "))
        axis.set_ylabel(label)
        figure.tight_layout()
        figure.savefig(out_dir / name, dpi=100)
        plt.close(figure)
        written.append(out_dir / name)
    return written


def plot_runs(runs: list[tuple[str, list[dict[str, Any]]]], out: Path) -> Path:
    """Training loss and validation bits per byte of runs against steps, tokens and wall time."""
    plt = _pyplot()
    figure, axes = plt.subplots(2, 3, figsize=(15, 8), sharey="row")
    for label, records in runs:
        train = [r for r in records if "loss" in r]
        val = [r for r in records if "val_bpb" in r]
        tokens_per_step = train[-1]["tokens"] / train[-1]["step"] if train and train[-1]["step"] else 0
        elapsed = {r["step"]: r.get("elapsed_s") for r in train}
        for column, x in enumerate(["step", "tokens", "elapsed_s"]):
            def position(record, x=x, tokens_per_step=tokens_per_step, elapsed=elapsed):
                if x == "step":
                    return record["step"]
                if x == "tokens":
                    return record["step"] * tokens_per_step
                return elapsed.get(record["step"], record.get("elapsed_s"))

            points = [(position(r), r["loss"]) for r in train if position(r) is not None]
            if points:
                axes[0][column].plot(*zip(*points), label=label)
            points = [(position(r), r["val_bpb"]) for r in val if position(r) is not None]
            if points:
                axes[1][column].plot(*zip(*points), marker="o", label=label)
    for column, x in enumerate(["steps", "tokens", "training time (s)"]):
        axes[1][column].set_xlabel(x)
        for row in range(2):
            axes[row][column].grid(True, alpha=0.3)
            axes[row][column].legend()
    axes[0][0].set_ylabel("training loss (nats/token)")
    axes[1][0].set_ylabel("validation bits per token")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def plot_run_dirs(run_dirs: list[Path], out: Path) -> Path:
    """plot_runs of run directories (their metrics.jsonl), each labelled with its folder's name."""
    runs = []
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise AttnlabError(f"{run_dir} has no metrics.jsonl: is it a run directory?")
        runs.append((run_dir.name, read_metrics(run_dir)))
    return plot_runs(runs, out)
