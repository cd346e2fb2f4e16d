"""The benchmark scripts of bench/ that need no trained run start and print what they promise, at
toy sizes (their figures are in docs/benchmarks.md; this only keeps them runnable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_script(name: str, *arguments: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(BENCH / name), *arguments], capture_output=True, text=True,
                            env=env, timeout=300, check=True)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("pool", ["0.25", "8"])
def test_linear_products_script(pool):
    rows = run_script("linear_products.py", "--rows", "1", "3", "--pool-mb", pool, "--rounds", "1", "--dim", "32")
    assert [(row["weight"], row["rows"]) for row in rows] == [
        ([32, 32], 1), ([32, 32], 3), ([128, 32], 1), ([128, 32], 3), ([32, 128], 1), ([32, 128], 3)
    ]
    assert all(row["linear_us"] > 0 and row["columns_us"] > 0 for row in rows)
    assert all("row_major_columns_us" not in row for row in rows)


def test_linear_products_script_times_row_major_columns_when_asked():
    rows = run_script("linear_products.py", "--rows", "4", "--pool-mb", "0.25", "--rounds", "1", "--dim", "32",
                      "--row-major-columns")
    assert len(rows) == 3 and all(row["row_major_columns_us"] > 0 for row in rows)


def test_decode_products_ab_script():
    rows = run_script("decode_products_ab.py", "--attention", "full", "local", "--context", "16", "--new-tokens",
                      "2", "--rounds", "1", "--dim", "32", "--depth", "1", "--heads", "2")
    assert [row["attention"] for row in rows] == ["full", "local"]
    assert all(row["linear_ms_per_token"] > 0 and row["columns_ms_per_token"] > 0 for row in rows)
    assert all(0 < row["linear_weight_mb"] < 1 for row in rows)  # columns taken at this size too
