"""Checkpoints: written atomically, read without unpickling arbitrary objects, checked against
their checksum, the last k kept.

A checkpoint is one file `RUN/checkpoints/step-NNNNNNN.pt` holding plain data only (tensors,
numbers, strings, lists, dicts): model and optimiser state, the step, RNG states, the data
sampler's position, the resolved config and a checksum of all that (train/checksum.py). It is
read with `torch.load(weights_only=True)`, whose restricted unpickler refuses any other object, so
a crafted file cannot run code, and a file whose content does not match its checksum is refused.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from attnlab.config import RunConfig, config_from_dict
from attnlab.errors import CheckpointError
from attnlab.model.transformer import Transformer
from attnlab.train.checksum import content_digest
from attnlab.train.finite import named_tensors, nonfinite_names

log = logging.getLogger(__name__)

# 2: attention back-ends (model.attention.<kind>.backend "auto"); version 1 checkpoints are read
# with their "torch" back-ends as "auto" (which is what "torch" then did) and their attention
# weights renamed when loaded (attention/base.py: Attention.migrate_state_dict)
# 3: a "checksum" of the content (train/checksum.py); versions 1 and 2 have none to check
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"step-(\d+)\.pt$")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:07d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run, oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir() if _NAME.search(path.name)]
    return sorted(found, key=lambda path: int(_NAME.search(path.name).group(1)))


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary file in the same folder, flush it to disk, then rename over `path`:
    a crash at any moment leaves either the old file or the new one, never half of one. A state
    holding a non-finite tensor is refused before anything is written."""
    bad = nonfinite_names(named_tensors(state, "checkpoint"))
    if bad:
        raise CheckpointError(f"not writing {path}: non-finite values in {', '.join(name[11:] for name in bad[:3])}")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            content = {"format_version": FORMAT_VERSION, **state}
            torch.save({**content, "checksum": content_digest(content)}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except (OSError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and "inline_container" not in str(error):
            raise  # not torch's file writer: a bug, with its traceback
        raise write_failure(path, error) from error
    finally:
        temporary.unlink(missing_ok=True)


def write_failure(path: Path, error: BaseException) -> CheckpointError:
    """A failed write as one line. torch's zip writer reports a full disk as "unexpected pos A vs B"
    (the file handle's own ENOSPC often follows as the exception's context)."""
    chain = [error]
    while chain[-1].__context__ is not None and len(chain) < 5:
        chain.append(chain[-1].__context__)
    codes = {item.errno for item in chain if isinstance(item, OSError)}
    free = shutil.disk_usage(path.parent).free if path.parent.is_dir() else None
    if codes & {errno.ENOSPC, errno.EDQUOT} or (not codes and free is not None and free < 1 << 20):
        return CheckpointError(f"cannot write checkpoint {path}: no space left on device ({free} bytes free); "
                               f"free some space and resume, the previous checkpoints are intact")
    reason = next((item.strerror for item in chain if isinstance(item, OSError) and item.strerror), None)
    return CheckpointError(f"cannot write checkpoint {path}: {reason or one_line(error)}")


def prune_checkpoints(run_dir: Path, keep_last: int, engine_folder: str | None = None) -> None:
    """Keep the newest `keep_last` checkpoints, and of an engine's own checkpoints (RUN/<engine_folder>/
    step-N/, written by FSDP and DeepSpeed) those of the same steps."""
    for old in list_checkpoints(run_dir)[: -max(1, keep_last)]:
        old.unlink(missing_ok=True)
        if engine_folder is not None:
            shutil.rmtree(Path(run_dir) / engine_folder / old.stem, ignore_errors=True)


def discard_engine_checkpoint(run_dir: Path, engine_folder: str | None, step: int) -> None:
    """Remove an engine's own checkpoint of `step` (RUN/<engine_folder>/step-N/) whose single file
    was not written: without it the step is no checkpoint."""
    if engine_folder is not None:
        shutil.rmtree(Path(run_dir) / engine_folder / checkpoint_path(run_dir, step).stem, ignore_errors=True)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint's plain data; any damage becomes a CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, bad pickle, forbidden global: all mean "unusable"
        raise CheckpointError(f"checkpoint {path} is corrupt or unsafe to load ({one_line(error)})") from error
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise CheckpointError(f"checkpoint {path} is not an attnlab checkpoint")
    if state.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint {path} has format {state.get('format_version')}, expected one of {READABLE_VERSIONS}"
        )
    expected = state.pop("checksum", None)
    if state["format_version"] >= 3 and expected is None:
        raise CheckpointError(f"checkpoint {path} has no checksum: damaged")
    if state["format_version"] >= 3 and expected != content_digest(state):
        raise CheckpointError(f"checkpoint {path} is corrupt: its content does not match its checksum")
    if state["format_version"] == 1:
        state["config"] = upgrade_version_1_config(state["config"])
    state["config"] = drop_retired_options(state["config"])
    return state


def one_line(error: BaseException) -> str:
    """torch's whole explanation (a refused global names the object and the way round) as one line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # the bold of its warnings
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(error).__name__


def upgrade_version_1_config(config: dict[str, Any]) -> dict[str, Any]:
    """Before back-ends were named, routing, sinkhorn and NSA's "torch" meant: the compiled CPU
    kernels where they serve, the torch path elsewhere; "auto" does that now (and on CUDA takes
    the flex or triton kernels of the same semantics). Local attention's "torch" stays."""
    for kind, variant in config.get("model", {}).get("attention", {}).items():
        if kind in ("routing", "sinkhorn", "nsa") and isinstance(variant, dict) and variant.get("backend") == "torch":
            variant["backend"] = "auto"
    return drop_retired_options(config)


def drop_retired_options(config: dict[str, Any]) -> dict[str, Any]:
    """Options a saved config may hold that attnlab no longer has: local attention's max_rollback
    (its static cache keeps every position, so any rollback is exact)."""
    config.get("model", {}).get("attention", {}).get("local", {}).pop("max_rollback", None)
    return config


def resolve_checkpoint(run_or_checkpoint: str | Path) -> Path:
    """A checkpoint file, or the latest checkpoint of a run directory."""
    path = Path(run_or_checkpoint)
    if path.is_file():
        return path
    if path.is_dir():
        checkpoints = list_checkpoints(path)
        if not checkpoints:
            raise CheckpointError(f"run directory {path} has no checkpoints in {path / CHECKPOINT_DIR}")
        return checkpoints[-1]
    raise CheckpointError(f"{path} is neither a run directory nor a checkpoint file")


def describe_corruption(path: Path, error: CheckpointError) -> CheckpointError:
    """Add the newest intact older checkpoint to the message, so the user knows what still works."""
    run_dir = path.parent.parent
    older = [candidate for candidate in list_checkpoints(run_dir) if candidate != path]
    for candidate in reversed(older):
        try:
            read_checkpoint(candidate)
        except CheckpointError:
            continue
        return CheckpointError(f"{error}; the previous checkpoint {candidate} is intact: resume from it")
    return error


def load_model(
    run_or_checkpoint: str | Path, device: str | torch.device = "cpu", weights: str = "auto",
    dtype: torch.dtype | None = None, attention_backend: str | None = None,
) -> Transformer:
    """A trained model in eval mode from a run directory (its latest checkpoint) or a checkpoint.

    weights: "model", "ema" (the moving average, if the run kept one) or "auto" (ema when present).
    dtype: cast the weights (and so the caches decoding makes) to it, e.g. torch.bfloat16 to decode
    in half the bytes; None keeps the checkpoint's float32.
    attention_backend: the back-end of every layer's attention (model.attention.<kind>.backend,
    attention/kernels/__init__.py), e.g. "triton" for full attention's cached calls on CUDA; None
    keeps the run's. One the attention type does not offer is a one-line ConfigError.
    """
    path = resolve_checkpoint(run_or_checkpoint)
    state = read_checkpoint(path)
    config: RunConfig = config_from_dict(state["config"])
    if attention_backend is not None:
        getattr(config.model.attention, config.model.attention.kind).backend = attention_backend
    model = Transformer(config.model)
    use_ema = weights == "ema" or (weights == "auto" and state.get("ema") is not None)
    if use_ema and state.get("ema") is None:
        raise CheckpointError(f"checkpoint {path} has no EMA weights")
    model.load_state_dict(state["ema"] if use_ema else state["model"])
    model.to(device=device, dtype=dtype).eval()
    model.run_config = config  # where the model came from, for eval and sampling defaults
    model.checkpoint_step = int(state.get("step", 0))
    log.debug("loaded %s (step %s, %s weights)", path, model.checkpoint_step, "ema" if use_ema else "model")
    return model

