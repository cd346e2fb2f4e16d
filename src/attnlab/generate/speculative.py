"""Speculative decoding: a small draft model proposes tokens, the target verifies them in one
cached forward, and the output is distributed exactly as sampling from the target alone.

Papers: Leviathan, Kalman and Matias, "Fast Inference from Transformers via Speculative Decoding"
(arXiv 2211.17192); Chen et al., "Accelerating Large Language Model Decoding with Speculative
Sampling" (arXiv 2302.01318). The self-speculative draft (the target's first k layers and its head)
follows the early-exit drafts of Zhang et al., "Draft & Verify" (arXiv 2309.08168) and Elhoushi
et al., "LayerSkip" (arXiv 2404.16710).

One step, for one row whose committed tokens end at position L - 1:
  1. the draft samples x_L .. x_{L+gamma-1}, each from its distribution q given the tokens before;
  2. the target scores all gamma + 1 positions L .. L + gamma in one cached forward (p);
  3. draft token x_j is accepted with probability min(1, p(x_j) / q(x_j)), left to right
     (Leviathan et al., Algorithm 1); at the first rejection a token is drawn from
     normalise(max(0, p - q)) instead and the step ends; when all are accepted, a bonus token is
     drawn from p at position L + gamma.
Every committed token is then distributed as the target's conditional given the tokens before it
(Leviathan et al., Appendix A.1), whatever happens to the randomness after it. The same filters
(temperature, top-k, top-p, min-p) shape p and q, so the output follows the filtered target.
Temperature 0 makes p and q one-hot: a draft token is accepted iff it is the target's argmax, and
the output equals greedy decoding of the target.

Batches (a departure from both papers, which describe one sequence). Rows accept different
numbers of tokens, but a cache can only be truncated to one length for all rows. So:
  - every row keeps all of its committed tokens (accepted drafts and the corrected/bonus token);
  - both caches are truncated to the shortest committed prefix, so no row's cache holds a token
    that row did not commit (never a rejected draft token, never another row's token);
  - at the next step the verification window starts at that common length. A row that is ahead
    has `known` tokens at the start of its window: they are fed like draft tokens but always
    accepted (they are already committed), and the row drafts only the remaining positions.
    Draft and target see each row's own committed tokens at every position, in order.
For each row this is the papers' step with a number of draft tokens (gamma minus the tokens it
is ahead) fixed before the step's randomness is drawn, so each committed token is still the
target's conditional: the output is exact at any batch size, and no accepted token is thrown
away. A row is never more than gamma tokens ahead of the slowest one (it drafts less the further
ahead it is). The exactness tests (tests/test_speculative.py) enumerate the target distribution
and run a chi-square test at batch 1, 4 and in large batches.

Legend: B batch, T prompt tokens, W verification window (gamma + 1), V vocabulary, N new tokens.
Positions are absolute indices into the sequence; slot s of a step is position start + s, where
`start` is the first position not yet committed by every row.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from attnlab.config import RunConfig
from attnlab.errors import ConfigError
from attnlab.generate.sampling import SamplingConfig, probabilities, sample_from
from attnlab.model.transformer import ModelCache, ModelOutput, Transformer

if TYPE_CHECKING:
    from attnlab.train.loop import TrainResult

log = logging.getLogger(__name__)


class CachedLanguageModel(Protocol):
    """What speculative decoding needs of a draft or a target (Transformer, EarlyExitDraft)."""

    def __call__(self, tokens: Tensor, cache: ModelCache | None = None) -> ModelOutput: ...

    def new_cache(self, batch_size: int, max_len: int | None = None, device=None, dtype=None) -> ModelCache: ...


# --------------------------------------------------------------------------------------------
# The accept/reject rule (pure)


def accept_reject(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    known: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Verify one window of draft tokens per row; return (n_accepted [B], next_token [B]).

    target_probs [B, W, V]: p at slots 0..W-1 (slot W-1 is the bonus position).
    draft_probs [B, W-1, V]: q at slots 0..W-2, from which the draft tokens were sampled.
    draft_tokens [B, W-1]: the tokens at slots 0..W-2.
    known [B, W-1] bool: slots whose token is already committed (always accepted; a row's known
        slots come first).
    n_accepted counts the leading accepted slots (known ones included); next_token is the token
    at slot n_accepted: drawn from normalise(max(0, p - q)) after a rejection, or from p at the
    bonus slot when every slot was accepted (q is zero there, so both are the same formula).
    """
    batch, width, n_tokens = target_probs.shape
    p_token = target_probs[:, :-1].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, W-1]
    q_token = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, W-1]
    uniform = torch.rand(p_token.shape, generator=generator, device=p_token.device)  # [B, W-1]
    # accept with probability min(1, p/q) (Leviathan et al., Algorithm 1); u q < p avoids 0 / 0
    accepted = known | (uniform * q_token < p_token)  # [B, W-1]
    n_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B] leading accepted slots

    index = n_accepted[:, None, None].expand(batch, 1, n_tokens)  # [B, 1, V]
    p_next = target_probs.gather(1, index).squeeze(1)  # [B, V]
    # q at the next slot; zero at the bonus slot (no draft there), so the residual is p itself
    q_next = draft_probs.gather(1, index.clamp(max=width - 2)).squeeze(1)  # [B, V]
    q_next = q_next * (n_accepted < width - 1)[:, None]
    residual = (p_next - q_next).clamp_min(0)  # max(0, p - q) (Leviathan et al., eq. 2 / Chen et al.)
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    # a rejection implies p > q somewhere, so mass > 0 up to rounding; fall back to p if not
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    return n_accepted, sample_from(residual, generator)


# --------------------------------------------------------------------------------------------
# Self-speculative draft


class EarlyExitDraft(nn.Module):
    """The target's first `n_layers` blocks, then its final norm and head: a draft with no weights
    of its own (self-speculative decoding). It has its own cache over those blocks."""

    def __init__(self, target: Transformer, n_layers: int) -> None:
        super().__init__()
        if not 1 <= n_layers <= len(target.blocks):
            raise ValueError(f"n_layers must be in 1..{len(target.blocks)}, got {n_layers}")
        self.target = target
        self.n_layers = n_layers
        self.training = target.training

    def train(self, mode: bool = True) -> EarlyExitDraft:
        """The target's train/eval mode is the target's own: switching the draft leaves it alone."""
        self.training = mode
        return self

    def forward(self, tokens: Tensor, cache: ModelCache | None = None) -> ModelOutput:
        """tokens [B, T] -> ModelOutput(logits [B, T, V]), as Transformer.forward without a loss."""
        target = self.target
        offset = 0 if cache is None else cache.length
        x = target.token_embedding(tokens)  # [B, T, dim]
        if target.position_embedding is not None:
            positions = torch.arange(offset, offset + tokens.shape[1], device=tokens.device)
            x = x + target.position_embedding(positions)
        for index, block in enumerate(target.blocks[: self.n_layers]):
            x = block(x, None if cache is None else cache.layers[index])
        x = target.norm(x)
        if target.head_project is not None:
            x = target.head_project(x)
        return ModelOutput(logits=target.head(x))  # [B, T, V]

    def new_cache(self, batch_size: int, max_len: int | None = None, device=None, dtype=None) -> ModelCache:
        parameter = next(self.target.parameters())
        max_len = max_len or self.target.config.max_seq_len
        device = device or parameter.device
        dtype = dtype or parameter.dtype
        blocks = self.target.blocks[: self.n_layers]
        return ModelCache([block.attention.new_cache(batch_size, max_len, device, dtype) for block in blocks], max_len)


# --------------------------------------------------------------------------------------------
# Decoding


@dataclass
class SpeculativeResult:
    tokens: Tensor  # [B, T + N] prompt and new tokens; after a row stops, padded with the end token
    lengths: Tensor  # [B] new tokens of each row up to and including its end token (<= N)
    n_steps: int  # verification steps (target forwards after the prompt)
    n_drafted: int  # draft tokens proposed, summed over rows
    n_accepted: int  # of them accepted
    gamma: int

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / max(self.n_drafted, 1)

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per row and step (out of gamma)."""
        n_rows = self.tokens.shape[0]
        return self.n_accepted / max(self.n_steps * n_rows, 1)


def _next_probs(model: CachedLanguageModel, tokens: Tensor, cache: ModelCache, sampling: SamplingConfig) -> Tensor:
    """Feed tokens [B, t] through the cache; the sampling distribution after the last one [B, V]."""
    return probabilities(model(tokens, cache=cache).logits[:, -1], sampling)


@torch.inference_mode()
def speculative_generate(
    target: CachedLanguageModel,
    draft: CachedLanguageModel,
    prompt: Tensor,
    max_new_tokens: int,
    gamma: int = 5,
    sampling: SamplingConfig | None = None,
    end_token: int | None = None,
    generator: torch.Generator | None = None,
) -> SpeculativeResult:
    """prompt [B, T] -> T + max_new_tokens tokens per row, distributed as sampling from `target`.

    A row stops after `max_new_tokens` or after emitting `end_token`; the loop runs until every
    row has stopped (stopped rows keep decoding internally; their output is cut and padded).
    """
    if gamma < 1:
        raise ValueError("gamma must be >= 1")
    if prompt.shape[1] < 1:
        raise ValueError("the prompt needs at least one token")
    sampling = sampling or SamplingConfig()
    batch, prompt_length = prompt.shape
    width = gamma + 1  # W: tokens the target scores per step
    goal = prompt_length + max_new_tokens
    device = prompt.device
    # eval mode for the call (dropout off), restored afterwards; skipped when already in eval mode
    was_training = [module for module in (target, draft) if isinstance(module, nn.Module) and module.training]
    for module in was_training:
        module.eval()

    # committed tokens of each row: sequence[i, :lengths[i]]; room for a window past the goal
    sequence = torch.zeros(batch, goal + width, dtype=torch.long, device=device)  # [B, T + N + W]
    sequence[:, :prompt_length] = prompt
    lengths = torch.full((batch,), prompt_length, dtype=torch.long, device=device)  # [B]
    target_cache = target.new_cache(batch, goal + width)
    draft_cache = draft.new_cache(batch, goal + width)
    slots = torch.arange(width - 1, device=device)  # [W-1]
    rows = torch.arange(batch, device=device)
    positions = torch.arange(sequence.shape[1], device=device)  # [T + N + W]
    n_steps = 0
    n_drafted = torch.zeros((), dtype=torch.long, device=device)  # summed on the device: no sync per step
    n_accepted = torch.zeros((), dtype=torch.long, device=device)

    try:
        # the prompt minus its last token; the last one opens the first window
        if prompt_length > 1:
            target(prompt[:, :-1], cache=target_cache)
            draft(prompt[:, :-1], cache=draft_cache)
        start = prompt_length  # first slot: every row has committed the tokens before it
        while True:
            done = lengths >= goal
            if end_token is not None:
                generated = positions >= prompt_length  # [T + N + W]
                committed = positions < lengths[:, None]  # [B, T + N + W]
                done |= ((sequence == end_token) & generated & committed).any(dim=1)
            if bool(done.all()):
                break
            # both caches hold (at most) the first start - 1 tokens, committed by every row
            n_ahead = int(lengths.max()) - start  # slots the leading row has committed (0: rows level)
            known = start + slots < lengths[:, None]  # [B, W-1] slots a row has already committed
            # Draft tokens are written straight into `sequence` past each row's committed length
            # (nothing there is committed), so the window is a view: no copies, no concatenation.
            window = sequence[:, start : start + width - 1]  # [B, W-1] view

            # 1. draft: catch up to start - 1 in one chunk, then one token per slot (known or drafted)
            draft_probs = []
            probs = _next_probs(draft, sequence[:, draft_cache.length : start], draft_cache, sampling)  # [B, V]
            for slot in range(width - 1):
                draft_probs.append(probs)  # q at this slot [B, V]
                proposed = sample_from(probs, generator)  # [B]
                if slot < n_ahead:  # some row has committed this slot already: it keeps its token
                    proposed = torch.where(known[:, slot], window[:, slot], proposed)
                window[:, slot] = proposed
                if slot < width - 2:
                    probs = _next_probs(draft, window[:, slot : slot + 1], draft_cache, sampling)
            draft_probs = torch.stack(draft_probs, dim=1)  # [B, W-1, V]

            # 2. target: score the last common token and the W-1 slots in one forward
            inputs = sequence[:, start - 1 : start + width - 1]  # [B, W] view
            target_probs = probabilities(target(inputs, cache=target_cache).logits, sampling)  # [B, W, V]

            # 3. accept/reject per row; the accepted slots are already in place, commit the next token
            accepted, next_token = accept_reject(target_probs, draft_probs, window, known, generator)
            sequence[rows, start + accepted] = next_token
            n_known = known.sum() if n_ahead else 0  # known slots are neither drafted nor counted
            n_drafted += batch * (width - 1) - n_known
            n_accepted += accepted.sum() - n_known
            lengths = start + accepted + 1
            n_steps += 1

            # roll both caches back to the shortest committed prefix minus its last token
            start = int(lengths.min())
            common = start - 1
            target_cache.truncate(common)
            draft_cache.truncate(min(common, draft_cache.length))
    finally:
        for module in was_training:
            module.train()

    n_drafted, n_accepted = int(n_drafted), int(n_accepted)
    new = sequence[:, prompt_length:goal].clone()  # [B, N]
    produced = (lengths.clamp(max=goal) - prompt_length).clamp(min=0)  # [B]
    if end_token is not None:
        is_end = new == end_token
        first_end = torch.where(is_end.any(dim=1), is_end.float().argmax(dim=1) + 1, produced)
        produced = torch.minimum(produced, first_end)
        new = new.masked_fill(torch.arange(new.shape[1], device=device) >= produced[:, None], end_token)
    tokens = torch.cat((prompt, new), dim=1)  # [B, T + N]
    log.debug(
        "speculative: %d steps, %d/%d draft tokens accepted (gamma %d, batch %d)",
        n_steps, n_accepted, n_drafted, gamma, batch,
    )
    return SpeculativeResult(
        tokens=tokens, lengths=produced, n_steps=n_steps, n_drafted=n_drafted, n_accepted=n_accepted, gamma=gamma
    )


# --------------------------------------------------------------------------------------------
# Training a draft with its target


# What decides the batches a run sees: the data sampler is counter-based (batch i depends only on
# the corpus, seq_len, batch_size and (seed, i)), so a draft with the target's values of these
# sees exactly the target's batches, in the same order, as the seed's joint training loop does.
SHARED_TRAIN_FIELDS = ("seq_len", "batch_size", "grad_accum", "seed", "max_steps")


def draft_config_for(target: RunConfig, draft: RunConfig) -> RunConfig:
    """The draft's config with the target's data and batch settings (SHARED_TRAIN_FIELDS)."""
    shared = {name: getattr(target.train, name) for name in SHARED_TRAIN_FIELDS}
    changed = [
        f"train.{name}: {getattr(draft.train, name)} -> {value}"
        for name, value in shared.items() if getattr(draft.train, name) != value
    ]
    if draft.data != target.data:
        changed.append("data: the target's")
    if changed:
        log.info("draft %s takes the target's batch settings: %s", draft.name, "; ".join(changed))
    if draft.model.num_tokens != target.model.num_tokens:
        raise ConfigError(
            f"draft and target must share a vocabulary: model.num_tokens {draft.model.num_tokens} "
            f"!= {target.model.num_tokens}"
        )
    if draft.run_dir == target.run_dir:
        raise ConfigError(f"draft and target would both write to {draft.run_dir}: give them different names")
    return dataclasses.replace(draft, data=target.data, train=dataclasses.replace(draft.train, **shared))


def train_pair(
    target: RunConfig | None,
    draft: RunConfig,
    target_settings: RunConfig | None = None,
    resume: bool = False,
    command_line: list[str] | None = None,
    distill_weight: float | None = None,
    target_dir: Path | None = None,
    draft_steps: int | None = None,
) -> tuple[TrainResult | None, TrainResult]:
    """Train a target and its draft on the same batches (one after the other, each with its own
    optimiser), or, with target None, only a draft for the existing target whose config is
    `target_settings` and whose run is `target_dir`. Returns (target result or None, draft result).

    distill_weight: the draft also learns the target's distribution, from the target's final
    checkpoint (train.distill_from and train.distill_weight, train/distill.py).
    draft_steps: only for a draft of an existing target: train it for this many steps instead of
    the target's. It still reads the target's batch stream: the target's batches first, in order,
    then the ones that follow them."""
    from attnlab.train.loop import train  # training pulls in data and metrics; decoding does not

    reference = target if target is not None else target_settings
    if reference is None:
        raise ValueError("give a target config to train, or the settings of an existing target")
    draft = draft_config_for(reference, draft)
    if draft_steps is not None:
        if target is not None:
            raise ConfigError("the draft's own step count (--draft-steps) needs an existing target (--target RUN): "
                              "a draft trained together with its target sees exactly the target's batches")
        if draft_steps < 1:
            raise ConfigError(f"the draft's steps must be >= 1, got {draft_steps}")
        log.info("draft %s trains for %d steps (the target took %d)", draft.name, draft_steps, draft.train.max_steps)
        draft = dataclasses.replace(draft, train=dataclasses.replace(draft.train, max_steps=draft_steps))
    if distill_weight is not None:
        teacher = target.run_dir if target is not None else target_dir
        if teacher is None:
            raise ValueError("distilling a draft for an existing target needs its run directory (target_dir)")
        draft = dataclasses.replace(
            draft, train=dataclasses.replace(draft.train, distill_from=str(teacher), distill_weight=distill_weight)
        )
    target_result = None
    if target is not None:
        log.info("training the target %s", target.name)
        target_result = train(target, resume=resume or None, command_line=command_line)
    log.info("training the draft %s on the target's batches", draft.name)
    draft_result = train(draft, resume=resume or None, command_line=command_line)
    return target_result, draft_result
