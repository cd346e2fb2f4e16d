"""Eval mode for a block of code, with every module's own mode restored afterwards.

Decoding and evaluation switch a model to eval mode (dropout off, no training-time noise such as
sinkhorn's Gumbel sorting). `model.train(was_training)` afterwards would set every submodule to
the root's mode, so a submodule kept in eval mode on purpose (a frozen part of a model in
training) would come back in training mode; and a block that raises would leave the model in
eval mode. `eval_mode` restores each submodule's own flag, also when the block raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(*models: object) -> Iterator[None]:
    """Every nn.Module among `models` in eval mode within the block (others are ignored)."""
    roots = [model for model in models if isinstance(model, nn.Module)]
    saved = [(module, module.training) for root in roots for module in root.modules()]
    for root in roots:
        if root.training:  # skipped when already in eval mode
            root.eval()
    try:
        yield
    finally:
        for module, training in saved:
            module.training = training
