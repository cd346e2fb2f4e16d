"""Exponential moving average of the weights (the seeds' --use_ema): evaluation and sampling
use the averaged copy, training updates the live one."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import Tensor, nn


class WeightEMA:
    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.model = copy.deepcopy(model).eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """average <- decay * average + (1 - decay) * current; saved buffers (routing centroids)
        copied as they are. Buffers a module does not save are caches it derives and may regrow on
        its own (the rotary table grows when a sample runs past max_seq_len): they are not copied."""
        for module in (self.model, model):
            reshard = getattr(module, "reshard", None)  # FSDP2 roots stay gathered after a forward:
            if callable(reshard):  # put both back in their sharded layout so the shards line up
                reshard()
        for average, current in zip(self.model.parameters(), model.parameters()):
            average.lerp_(current.detach(), 1 - self.decay)
        for average, current in zip(saved_buffers(self.model), saved_buffers(model)):
            average.copy_(current)


def saved_buffers(model: nn.Module) -> Iterator[Tensor]:
    """The buffers that go into the state dict (persistent ones), in module order."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield buffer
