"""Fault injection at toy size: what a cluster does to `attnlab train`, and what is left afterwards.

Every case runs the real command (`python -m attnlab.cli.main train`) on a tiny model and a byte
corpus, and checks the run directory it leaves:

    kill -9      killed at a random moment (during checkpoint writes too), resumed until done: the
                 final weights equal an uninterrupted run's bit for bit, each step is logged once,
                 no temporary file is left
    SIGTERM      sent at a random moment: exit status 75, the checkpoint is the last completed step
                 (steps lost: 0), and the resumed run ends bit-identical
    bit flip     one exponent bit of the latest checkpoint flipped: `attnlab eval` refuses it in one
                 line, `--resume` goes on from the newest intact checkpoint and says so
    NaN          train.lr=1e4 without clipping: the gradient norm overflows at step 2; the run stops
                 before the update, and no saved tensor is non-finite
    concurrent   two runs started at once on one run directory: one trains, the other is refused
    full disk    out_dir on a small tmpfs (needs root to mount): one line naming the checkpoint and
                 "no space left on device", the previous checkpoint intact

    python bench/fault_injection.py [--trials 8] [--seed 0] [--out /tmp/attnlab-faults]

Prints one line per case and a JSON summary. Figures: docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from attnlab.train.checkpoint import list_checkpoints, load_model, read_checkpoint
from attnlab.train.metrics import read_metrics

STEPS = 40
ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "src" / "attnlab" / "model" / "transformer.py"


def arguments(out_dir: Path, name: str, *extra: str) -> list[str]:
    return [
        "-p", "demo", f"name={name}", f"out_dir={out_dir}", "model.dim=32", "model.depth=2", "model.heads=2",
        "model.dim_head=16", "model.max_seq_len=64", "data.source=file", f"data.path={CORPUS}", "train.seq_len=32",
        "train.batch_size=4", f"train.max_steps={STEPS}", "train.warmup_steps=4", "train.eval_every=10",
        "train.eval_batches=1", "train.sample_every=0", "train.save_every=3", "train.keep_last=2",
        "train.log_every=1", "log.progress=false", *extra,
    ]


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "attnlab.cli.main", *args]


def start(out_dir: Path, name: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(command("train", *arguments(out_dir, name, *extra)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def finish(out_dir: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command("train", *arguments(out_dir, name, *extra)), capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def saved_step(run_dir: Path) -> int:
    checkpoints = list_checkpoints(run_dir)
    return read_checkpoint(checkpoints[-1])["step"] if checkpoints else 0


def last_step(run_dir: Path) -> int:
    """The step of the last training record in metrics.jsonl (0 before any)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:  # being written
            continue
        if "loss" in record:
            return record["step"]
    return 0


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None and last_step(run_dir) < step:
        time.sleep(0.02)


def same_weights(a: Path, b: Path) -> bool:
    first, second = load_model(a).state_dict(), load_model(b).state_dict()
    return all(torch.equal(value, second[key]) for key, value in first.items())


def steps_once(run_dir: Path) -> bool:
    steps = [record["step"] for record in read_metrics(run_dir) if "loss" in record]
    return steps == list(range(1, STEPS + 1))


def leftovers(run_dir: Path) -> list[str]:
    return [path.name for path in run_dir.rglob(".*tmp-*")]


def kill_9(out_dir: Path, reference: Path, trials: int, rng: random.Random) -> dict:
    identical, once, clean, kills, taken_over, half_written = 0, 0, 0, 0, 0, 0
    for trial in range(trials):
        name = f"kill9-{trial}"
        killed_at = 0
        for attempt in range(2):  # killed twice at random steps (the second past the first), then finished
            process = start(out_dir, name, *(["--resume"] if attempt else []))
            wait_for_step(out_dir / name, rng.randint(killed_at + 1, max(killed_at + 1, STEPS - 12 + 10 * attempt)),
                          process)
            time.sleep(rng.uniform(0.0, 0.03))  # anywhere in a step (~20 ms), its checkpoint write included
            if process.poll() is None:
                process.kill()
                kills += 1
            output = process.communicate(timeout=600)[0]
            taken_over += "taking over the lock" in output
            half_written += output.count("left by a write that was killed")
            killed_at = last_step(out_dir / name)
        result = finish(out_dir, name, "--resume")
        assert result.returncode == 0, result.stderr[-2000:]
        taken_over += "taking over the lock" in result.stderr
        half_written += result.stderr.count("left by a write that was killed")
        identical += same_weights(out_dir / name, reference)
        once += steps_once(out_dir / name)
        clean += not leftovers(out_dir / name)
    print(f"kill -9: {kills} kills in {trials} runs; final weights bit-identical {identical}/{trials}, "
          f"each step logged once {once}/{trials}, no temporary file left {clean}/{trials}, "
          f"stale locks taken over {taken_over}/{kills}, half-written checkpoints removed {half_written}")
    return {"runs": trials, "kills": kills, "bit_identical": identical, "steps_once": once, "clean": clean,
            "stale_locks_taken_over": taken_over, "half_written_removed": half_written}


def sigterm(out_dir: Path, reference: Path, trials: int, rng: random.Random) -> dict:
    statuses, lost, identical = [], [], 0
    for trial in range(trials):
        name = f"sigterm-{trial}"
        process = start(out_dir, name)
        wait_for_step(out_dir / name, rng.randint(2, STEPS - 5), process)
        time.sleep(rng.uniform(0.0, 0.03))
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=600)
        statuses.append(process.returncode)
        lost.append(last_step(out_dir / name) - saved_step(out_dir / name))
        result = finish(out_dir, name, "--resume")
        assert result.returncode == 0, result.stderr[-2000:]
        identical += same_weights(out_dir / name, reference)
    print(f"SIGTERM: {trials} runs; exit statuses {sorted(set(statuses))}, steps lost {lost}, "
          f"final weights bit-identical {identical}/{trials}")
    return {"runs": trials, "exit_statuses": sorted(set(statuses)), "steps_lost": lost, "bit_identical": identical}


def flip_bit(path: Path, rng: random.Random) -> None:
    """An exponent bit of a random float32 in the checkpoint's largest tensor."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda item: item.file_size)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length
    data[start + rng.randrange(info.file_size // 4) * 4 + 3] ^= 0x40
    path.write_bytes(bytes(data))


def bit_flip(out_dir: Path, reference: Path, rng: random.Random) -> dict:
    run_dir = out_dir / "bitflip"
    shutil.copytree(reference, run_dir)
    latest = list_checkpoints(run_dir)[-1]
    flip_bit(latest, rng)
    evaluated = subprocess.run(command("eval", str(latest), "--windows", "8"), capture_output=True, text=True)
    resumed = finish(out_dir, "bitflip", "--resume", f"train.max_steps={STEPS + 3}")
    fell_back = "the newest intact checkpoint" in resumed.stderr
    print(f"bit flip: eval exit {evaluated.returncode} ({last_line(evaluated.stderr or evaluated.stdout)}); "
          f"--resume exit {resumed.returncode}, fell back to the newest intact checkpoint: {fell_back}")
    return {"eval_exit": evaluated.returncode, "eval_error_lines": evaluated.stderr.strip().count("\n") + 1,
            "resume_exit": resumed.returncode, "fell_back": fell_back}


def not_finite(out_dir: Path) -> dict:
    result = finish(out_dir, "nan", "train.lr=1e4", "train.grad_clip=0", "train.warmup_steps=0",
                    "train.save_every=1", "train.keep_last=100")
    bad = sum(1 for path in list_checkpoints(out_dir / "nan") for part in ("model", "optimizer")
              for _, value in flat(read_checkpoint(path)[part]) if value.is_floating_point()
              and not torch.isfinite(value).all())
    print(f"NaN: exit {result.returncode} ({last_line(result.stderr)}); "
          f"{len(list_checkpoints(out_dir / 'nan'))} checkpoints, non-finite tensors in them: {bad}")
    return {"exit": result.returncode, "checkpoints": len(list_checkpoints(out_dir / "nan")), "nonfinite": bad}


def flat(state, prefix=""):
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from flat(value, f"{prefix}.{key}")


def concurrent(out_dir: Path) -> dict:
    first, second = start(out_dir, "concurrent"), start(out_dir, "concurrent")
    outputs = [process.communicate(timeout=600)[0] for process in (first, second)]
    statuses = sorted(process.returncode for process in (first, second))
    refused = sum("is in use by pid" in output for output in outputs)
    print(f"concurrent start: exit statuses {statuses}, refused with the owner named: {refused}, "
          f"each step logged once: {steps_once(out_dir / 'concurrent')}")
    return {"exit_statuses": statuses, "refused": refused, "steps_once": steps_once(out_dir / "concurrent")}


def full_disk(out_dir: Path) -> dict:
    mount = Path(tempfile.mkdtemp(dir=out_dir))
    size = 3 * 400_000  # the metrics, configs and about two checkpoints of this model (~390 kB each)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        print("full disk: skipped (mounting a tmpfs needs root)")
        return {"skipped": True}
    try:
        result = finish(mount, "full", "train.keep_last=100")
        kept = list_checkpoints(mount / "full")
        intact = all(read_checkpoint(path)["step"] > 0 for path in kept)
        one_line = last_line(result.stderr)
        print(f"full disk: exit {result.returncode}, last line: {one_line!r}; {len(kept)} checkpoints kept, "
              f"all intact: {intact}; temporary files left: {leftovers(mount / 'full')}")
        return {"exit": result.returncode, "message": one_line, "kept": len(kept), "intact": intact,
                "leftovers": leftovers(mount / "full")}
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8, help="runs per kill -9 and SIGTERM case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="work folder (default: a new temporary one)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="attnlab-faults-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    reference = finish(out_dir, "reference")
    assert reference.returncode == 0, reference.stderr[-2000:]
    reference_dir = out_dir / "reference"
    cases = {
        "kill_9": lambda: kill_9(out_dir, reference_dir, args.trials, rng),
        "sigterm": lambda: sigterm(out_dir, reference_dir, args.trials, rng),
        "bit_flip": lambda: bit_flip(out_dir, reference_dir, rng),
        "nan": lambda: not_finite(out_dir),
        "concurrent": lambda: concurrent(out_dir),
        "full_disk": lambda: full_disk(out_dir),
    }
    summary = {}
    for name, case in cases.items():
        try:
            summary[name] = case()
        except Exception as error:  # a version without these guarantees: record how it failed, go on
            summary[name] = {"failed": f"{type(error).__name__}: {last_line(str(error))}"}
            print(f"{name}: failed ({summary[name]['failed']})")
    summary["seconds"] = round(time.time() - started)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
