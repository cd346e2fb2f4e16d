"""train.compile=true: the compiled model trains to the same losses as eager (CPU, tiny size)."""

from __future__ import annotations

import pytest

from attnlab.train.loop import train
from attnlab.train.metrics import read_metrics
from test_train import text_file, tiny  # noqa: F401  (the fixture is shared)

pytestmark = pytest.mark.slow


def test_compiled_matches_eager(tmp_path, text_file):  # noqa: F811
    def losses(name: str, *extra: str) -> list[float]:
        config = tiny(tmp_path, text_file, name, "train.max_steps=3", "train.eval_every=0", *extra)
        return [r["loss"] for r in read_metrics(train(config).run_dir) if "loss" in r]

    eager, compiled = losses("eager"), losses("compiled", "train.compile=true")
    assert compiled == pytest.approx(eager, abs=1e-4)
