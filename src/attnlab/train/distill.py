"""Distillation: train a model toward a fixed teacher's next-token distribution.

Used to train speculative-decoding drafts toward their target (`attnlab speculative train
--distill W`, or `train.distill_from=RUN train.distill_weight=W` on any run). How often
speculative decoding accepts a draft token is sum_v min(p, q) = 1 - TV(p, q), where p is the
target's distribution and q the draft's. A draft trained only on the data learns the data's
distribution, which the target approximates differently. A draft trained toward p learns p itself,
as in DistillSpec (Zhou et al., arXiv 2310.08461).

The loss is (1 - w) * cross-entropy on the data + w * D(p_teacher, q_model), both as means over
the (unmasked) predicted positions. D is KL(p || q) in nats (train.distill_loss=kl, the default),
or the total variation distance TV(p, q) = sum_v |p - q| / 2 (tv): one minus the probability that
speculative decoding at temperature 1 accepts a draft token at that position, so minimising it
maximises acceptance on the training text directly (DistillSpec compares both). The teacher is
loaded once from its run, kept in eval mode without gradients, and run on the same batch, so
resuming stays exact. `student_loss` assembles the per-target part of one micro-batch's loss (the
loop uses it in place of the model's cross-entropy, weighs it by the micro-batch's share of the
global target count and adds the model's auxiliary losses, already weighted, whole).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.config import RunConfig, TrainConfig
from attnlab.errors import CheckpointError, ConfigError, GenerationError
from attnlab.model import ModelOutput, Transformer
from attnlab.model.transformer import check_length
from attnlab.train.checkpoint import load_model

log = logging.getLogger(__name__)


def distillation_loss(
    logits: Tensor, teacher_logits: Tensor, loss_mask: Tensor | None = None, kind: str = "kl"
) -> Tensor:
    """Mean over positions of D(softmax(teacher_logits), softmax(logits)): KL(p || q) in nats
    (kind "kl") or TV(p, q) = sum |p - q| / 2 (kind "tv").
    logits, teacher_logits [B, T, V]; loss_mask [B, T] (0 = ignore) or None."""
    log_q = F.log_softmax(logits.float(), dim=-1)
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    if kind == "kl":
        per_position = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # [B, T]
    elif kind == "tv":
        per_position = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(dim=-1)  # [B, T]
    else:
        raise ValueError(f"unknown distillation loss {kind!r}; choose kl or tv (train.distill_loss)")
    if loss_mask is None:
        return per_position.mean()
    mask = loss_mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp(min=1)


def student_loss(
    output: ModelOutput, teacher: Transformer, inputs: Tensor, loss_mask: Tensor | None, config: TrainConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-target part of the loss to minimise on one micro-batch, (1 - w) * lm_loss +
    w * D(teacher, model) (w = config.distill_weight; the loop adds the model's auxiliary losses),
    and its distillation part named for the log.
    output: the model's forward on inputs [B, T] (logits [B, T, V]); loss_mask [B, T] or None."""
    with torch.no_grad():
        teacher_logits = teacher(inputs).logits  # [B, T, V]
    distill = distillation_loss(output.logits, teacher_logits, loss_mask, config.distill_loss)
    weight = config.distill_weight
    return (1 - weight) * output.lm_loss + weight * distill, {"distill": distill}


def load_teacher(config: RunConfig, device: torch.device) -> Transformer | None:
    """The teacher of `config` (train.distill_from), frozen on `device`; None without one."""
    tc = config.train
    if not tc.distill_from:
        return None
    if not 0.0 < tc.distill_weight <= 1.0:
        raise ConfigError(f"train.distill_weight must be in (0, 1], got {tc.distill_weight}")
    if config.model.loss_chunk_size:
        raise ConfigError("distillation needs the model's full logits: set model.loss_chunk_size=0")
    try:
        teacher = load_model(tc.distill_from, device)
    except CheckpointError as error:
        raise ConfigError(f"train.distill_from: {error}") from error
    if teacher.config.num_tokens != config.model.num_tokens:
        raise ConfigError(
            f"the teacher {tc.distill_from} has {teacher.config.num_tokens} tokens, this model "
            f"model.num_tokens={config.model.num_tokens}: they must share a vocabulary"
        )
    try:  # its learned positions must reach the training windows (they would index past their table)
        check_length(teacher, tc.seq_len, f"the teacher {tc.distill_from}'s windows of train.seq_len")
    except GenerationError as error:
        raise ConfigError(f"train.distill_from: {error}") from error
    teacher.requires_grad_(False)
    log.info("distilling from %s (%s, weight %.2f)", tc.distill_from, tc.distill_loss, tc.distill_weight)
    return teacher
