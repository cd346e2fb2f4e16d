"""Non-finite numbers never reach the weights, nor a checkpoint.

    gradients   the strategy applies an update only when the global gradient norm is finite
                (train/distributed.py; with fp16 the GradScaler's own overflow skip stays as it is).
                A step whose gradients (or loss) were not finite then stops the run, naming the last
                good checkpoint (train.on_nonfinite=stop), or is skipped (skip: the data is used up,
                the weights, optimiser and EMA are untouched; MAX_CONSECUTIVE_SKIPS in a row stop)
    weights     checked after every update (finite gradients can still overflow a weight), so the
                next step and every save start from finite weights; a failure stops the run
    saves       every floating tensor of a checkpoint is checked before anything is written, on
                every rank (train/loop.py), and again by the writer itself (train/checkpoint.py)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import AttnlabError

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_SKIPS = 10  # train.on_nonfinite=skip stops after this many skipped steps in a row


class TrainingError(AttnlabError):
    """Training cannot go on (a non-finite loss, gradient or weight); the last good checkpoint is kept."""


def local(tensor: Tensor) -> Tensor:
    """The part of a tensor this process holds: an FSDP2 DTensor's shard, a ZeRO-3 partition."""
    if hasattr(tensor, "to_local"):
        return tensor.to_local()
    partition = getattr(tensor, "ds_tensor", None)
    return partition if partition is not None else tensor


def named_tensors(state: Any, prefix: str) -> Iterator[tuple[str, Tensor]]:
    """(dotted name, tensor) for every tensor in nested dicts, lists and tuples."""
    if isinstance(state, Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from named_tensors(value, f"{prefix}.{key}")
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from named_tensors(value, f"{prefix}.{index}")


def nonfinite_names(named: Iterable[tuple[str, Tensor]]) -> list[str]:
    """Names of the floating tensors holding a NaN or an infinity (this process's part of each),
    found with one device synchronisation per device."""
    found: list[tuple[str, torch.device]] = []
    flags: dict[torch.device, list[Tensor]] = {}
    for name, tensor in named:
        tensor = local(tensor)
        if tensor.is_floating_point() and tensor.numel():
            found.append((name, tensor.device))
            flags.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
    finite = {device: iter(torch.stack(values).tolist()) for device, values in flags.items()}
    return [name for name, device in found if not next(finite[device])]


def describe(loss: float, grad_norm: float) -> str:
    return f"loss became {loss}" if not math.isfinite(loss) else f"gradient norm became {grad_norm}"


@dataclass
class NonFiniteSteps:
    """What a step whose gradients were not finite does (the strategy has not applied them)."""

    policy: str  # train.on_nonfinite: "stop" or "skip"
    consecutive: int = 0  # skipped steps in a row

    def not_applied(self, step: int, loss: float, grad_norm: float, last_good: str) -> None:
        """Stop (raise), or skip the step with a warning; MAX_CONSECUTIVE_SKIPS in a row stop."""
        what = f"{describe(loss, grad_norm)} at step {step}"
        self.consecutive += 1
        if self.policy == "stop" or self.consecutive >= MAX_CONSECUTIVE_SKIPS:
            repeated = f" ({self.consecutive} steps in a row)" if self.policy == "skip" else ""
            raise TrainingError(
                f"{what}{repeated}; stopped before updating the weights. Last good checkpoint: {last_good}. "
                f"Try a lower train.lr or train.precision=fp32"
            )
        log.warning("%s: update skipped (train.on_nonfinite=skip)", what)

    def applied(self) -> None:
        self.consecutive = 0


def check_weights(named: Iterable[tuple[str, Tensor]], step: int, last_good: Callable[[], str],
                  any_rank: Callable[[bool], bool]) -> None:
    """Raise if a weight or saved buffer is not finite after step `step`, on every rank if on any
    (`any_rank(flag)`: whether any rank's flag is set); `last_good()` names the checkpoint kept."""
    bad = nonfinite_names(named)
    if any_rank(bool(bad)):
        where = f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else " (on another rank)"
        raise TrainingError(
            f"weights became non-finite at step {step}{where} although the gradients were finite: the update "
            f"overflowed. Last good checkpoint: {last_good()}. Try a lower train.lr"
        )
