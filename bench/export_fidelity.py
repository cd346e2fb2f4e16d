"""Export fidelity and cost at MiniMind's size: the minimind-pretrain (dense) and minimind-moe
models, randomly initialised, exported with `attnlab.hf.export_model`, loaded by transformers and
imported back with `attnlab.hf.import_hf`. Prints one JSON object per model: seconds to export,
load in transformers and import (medians of 3), and the largest logit difference on 2 x 256 tokens
(attnlab vs transformers; attnlab vs the imported copy). Figures: docs/benchmarks.md."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import attnlab
from attnlab.hf import export_model, import_hf


def timed(function, repeats: int = 3):
    """(median seconds, last result)."""
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def main() -> None:
    for preset in ("minimind-pretrain", "minimind-moe"):
        config = attnlab.load_config(preset).model
        torch.manual_seed(0)
        model = attnlab.Transformer(config).eval()
        folder = Path(tempfile.mkdtemp())
        export_seconds, _ = timed(lambda: export_model(model, folder / "hf", overwrite=True))  # noqa: B023
        load_seconds, reference = timed(lambda: AutoModelForCausalLM.from_pretrained(folder / "hf").eval())  # noqa: B023
        import_seconds, _ = timed(lambda: import_hf(folder / "hf", folder / "run", overwrite=True))  # noqa: B023
        imported = attnlab.load_model(folder / "run")
        tokens = torch.randint(0, config.num_tokens, (2, 256), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ours, theirs, back = model(tokens).logits, reference(tokens).logits, imported(tokens).logits
        print(json.dumps({
            "preset": preset, "architecture": type(reference).__name__,
            "parameters_m": round(model.num_parameters() / 1e6, 2),
            "export_s": round(export_seconds, 3), "transformers_load_s": round(load_seconds, 3),
            "import_s": round(import_seconds, 3),
            "max_abs_logit": round(ours.abs().max().item(), 3),
            "max_diff_transformers": (ours - theirs).abs().max().item(),
            "max_diff_imported": (ours - back).abs().max().item(),
        }))
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
