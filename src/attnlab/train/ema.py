"""Exponential moving average of the weights (the seeds' --use_ema): evaluation and sampling
use the averaged copy, training updates the live one."""

from __future__ import annotations

import copy

import torch
from torch import nn


class WeightEMA:
    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.model = copy.deepcopy(model).eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """average <- decay * average + (1 - decay) * current; buffers copied as they are."""
        for module in (self.model, model):
            reshard = getattr(module, "reshard", None)  # FSDP2 roots stay gathered after a forward:
            if callable(reshard):  # put both back in their sharded layout so the shards line up
                reshard()
        for average, current in zip(self.model.parameters(), model.parameters()):
            average.lerp_(current.detach(), 1 - self.decay)
        for average, current in zip(self.model.buffers(), model.buffers()):
            average.copy_(current)

