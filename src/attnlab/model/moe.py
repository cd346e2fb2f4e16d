"""Mixture-of-experts feed-forward: a softmax top-k router over SwiGLU experts, plus shared experts.

Sources: Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
Layer" (arXiv 1701.06538) for top-k gating; Fedus et al., "Switch Transformers" (arXiv 2101.03961,
eq. 4-6) for the load-balance loss; Zoph et al., "ST-MoE" (arXiv 2202.08906, eq. 5) for the router
z-loss; Dai et al., "DeepSeekMoE" (arXiv 2401.06066) for shared experts. MiniMind's `MOEFeedForward`
combines exactly these (softmax scores, top-k renormalised, `aux_loss_alpha`, shared experts), and
its defaults are ours: 4 routed experts, top-2, 1 shared expert, balance weight 0.1.

No capacity factor: every token is processed by exactly `top_k` routed experts (and every shared
expert), so no token is ever dropped. Tokens are grouped by expert with a sort, each expert runs on
its own rows, and the results are scattered back weighted by the router probabilities.

Reports, after each forward:
    aux_losses["moe_balance"]  balance_loss_weight * n_experts * sum_e f_e * P_e  (1 * weight at best)
    aux_losses["moe_z"]        z_loss_weight * mean(logsumexp(router logits)^2)   (only if weight > 0)
    stats["moe_load/<e>"]      share of the routed assignments that went to expert e (sums to 1)

Legend: B batch, T tokens, N = B * T tokens flattened, dim model width, E experts, k top_k.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.config import ModelConfig
from attnlab.errors import ConfigError
from attnlab.model.layers import SwiGLU
from attnlab.registry import FEED_FORWARD


def route(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax router: (probabilities [N, E], top-k weights [N, k], top-k expert indices [N, k]).
    The top-k weights are renormalised to sum to 1 only when k > 1 (MiniMind), so top-1 keeps its
    probability and the router still gets a gradient through it (Switch)."""
    probabilities = logits.float().softmax(dim=-1)  # [N, E], in float32 even under autocast
    weights, experts = probabilities.topk(top_k, dim=-1)  # [N, k], [N, k]
    if normalize and top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probabilities, weights, experts


def balance_loss(probabilities: Tensor, assignment_counts: Tensor) -> Tensor:
    """Switch Transformer load-balance loss (arXiv 2101.03961, eq. 4): n_experts * sum_e f_e * P_e,
    with f_e the share of the assignments sent to expert e (from `assignment_counts` [E]) and P_e
    the mean router probability of expert e. Equal to 1 when the router is uniform (P_e = 1/E for
    any f) and when both are balanced; MiniMind's non-sequence `aux_loss` is the same quantity."""
    n_experts = assignment_counts.shape[0]
    assignments = assignment_counts.float() / assignment_counts.sum().clamp(min=1)  # [E], f_e, sums to 1
    mean_probability = probabilities.mean(dim=0)  # [E], P_e
    return n_experts * (assignments * mean_probability).sum()


def global_counts(counts: Tensor) -> Tensor:
    """Assignment counts summed over the data-parallel ranks (no gradient flows through f_e).

    Deliberate departure from MiniMind, which balances each rank's micro-batch alone: with f_e
    taken over all ranks, the ranks' gradients of n * sum_e f_e * P_e(local) average to exactly
    the gradient of the single-process loss on the whole batch, so DDP, FSDP and DeepSpeed follow
    the single-process run (tests/test_distributed.py)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        counts = counts.clone()
        torch.distributed.all_reduce(counts)
    return counts


def z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss (arXiv 2202.08906, eq. 5): mean over tokens of logsumexp(logits)^2."""
    return logits.float().logsumexp(dim=-1).square().mean()


@FEED_FORWARD.register("moe")
class MoEFeedForward(nn.Module):
    """sum_{e in top-k(x)} w_e(x) * expert_e(x) + sum_s shared_s(x); experts are SwiGLU MLPs of the
    dense model's width (as in MiniMind, so compute per token grows with k + n_shared)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        if not 1 <= moe.top_k <= moe.n_experts:
            raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.n_experts={moe.n_experts}")
        if moe.n_shared_experts < 0:
            raise ConfigError(f"model.moe.n_shared_experts={moe.n_shared_experts} must be >= 0")
        if config.ff_chunks != 1:  # each chunk would overwrite the previous chunk's aux losses
            raise ConfigError("feed_forward=moe does not support model.ff_chunks > 1")
        self.n_experts, self.top_k, self.normalize = moe.n_experts, moe.top_k, moe.normalize_top_k
        self.balance_weight, self.z_weight = moe.balance_loss_weight, moe.z_loss_weight
        self.router = nn.Linear(config.dim, moe.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(config) for _ in range(moe.n_experts))
        self.shared_experts = nn.ModuleList(SwiGLU(config) for _ in range(moe.n_shared_experts))
        self.aux_losses: dict[str, Tensor] = {}  # collected by Transformer.collect_aux_losses
        self.stats: dict[str, Tensor] = {}  # detached, for logging only

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, dim]
        logits = self.router(flat)  # [N, E]
        probabilities, weights, experts = route(logits, self.top_k, self.normalize)  # [N, E], [N, k], [N, k]

        # group the N * k (token, expert) assignments by expert; every assignment is computed
        order = experts.flatten().argsort(stable=True)  # [N * k]
        token_of = order // self.top_k  # [N * k] row of `flat` for each sorted assignment
        assignment_counts = torch.bincount(experts.flatten(), minlength=self.n_experts)  # [E]
        counts = assignment_counts.tolist()
        output = torch.zeros_like(flat)  # [N, dim]
        start = 0
        for expert, count in zip(self.experts, counts):
            # an expert with no rows still runs (on zero rows): its parameters then get zero
            # gradients rather than none, which DDP needs to finish every step's reduction
            rows = token_of[start : start + count]  # [count]
            weight = weights.flatten()[order[start : start + count]]  # [count]
            contribution = expert(flat[rows]) * weight[:, None].to(flat.dtype)  # [count, dim]
            output.index_add_(0, rows, contribution.to(output.dtype))
            start += count
        for shared in self.shared_experts:
            output = output + shared(flat)

        if self.training:
            assignment_counts = global_counts(assignment_counts)
        self.aux_losses = {"moe_balance": self.balance_weight * balance_loss(probabilities, assignment_counts)}
        if self.z_weight > 0:
            self.aux_losses["moe_z"] = self.z_weight * z_loss(logits)
        load = torch.tensor(counts, dtype=torch.float32) / max(1, sum(counts))  # [E]
        self.stats = {f"moe_load/{index}": share for index, share in enumerate(load)}
        return output.reshape(shape)  # [B, T, dim]
