"""Optimiser parameter groups and learning-rate schedules (pure functions of the step)."""

from __future__ import annotations

import math

import torch
from torch import nn

from attnlab.config import TrainConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices of linear layers only; never norms, biases or embeddings (GPT-2 practice)."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen or not parameter.requires_grad:
                continue
            seen.add(id(parameter))
            is_matrix = isinstance(module, nn.Linear) and name == "weight"
            (decay if is_matrix and parameter.dim() >= 2 else no_decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        parameter_groups(model, config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
    )


def cosine_lr(step: int, lr: float, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up to lr, then cosine decay to min_ratio * lr at `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def minimind_lr(step: int, lr: float, total: int) -> float:
    """MiniMind's schedule: lr/10 + 0.5 * lr * (1 + cos(pi * step / total))."""
    return lr / 10 + 0.5 * lr * (1 + math.cos(math.pi * step / total))


def learning_rate(step: int, config: TrainConfig) -> float:
    """The learning rate of optimiser step `step` (0-based) under the configured schedule."""
    schedules = {
        "cosine": lambda: cosine_lr(step, config.lr, config.max_steps, config.warmup_steps, config.min_lr_ratio),
        "minimind": lambda: minimind_lr(step, config.lr, config.max_steps),
        "constant": lambda: config.lr,
    }
    return schedules[config.schedule]()
