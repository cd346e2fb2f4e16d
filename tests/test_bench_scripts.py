"""The benchmark scripts of bench/ that need no trained run start and print what they promise, at
toy sizes (their figures are in docs/benchmarks.md; this only keeps them runnable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_script(name: str, *arguments: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(BENCH / name), *arguments], capture_output=True, text=True,
                            env=env, timeout=300, check=True)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_decode_products_ab_script():
    rows = run_script("decode_products_ab.py", "--attention", "full", "local", "--context", "16", "--new-tokens",
                      "2", "--rounds", "1", "--dim", "32", "--depth", "1", "--heads", "2")
    assert [row["attention"] for row in rows] == ["full", "local"]
    assert all(row["linear_ms_per_token"] > 0 and row["columns_ms_per_token"] > 0 for row in rows)
    assert all(0 < row["linear_weight_mb"] < 1 for row in rows)  # columns taken at this size too
