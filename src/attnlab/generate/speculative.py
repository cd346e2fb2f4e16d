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
  3. by the token rule (`verification="token"`, accept_reject), draft token x_j is accepted with
     probability min(1, p(x_j) / q(x_j)), left to right (Leviathan et al., Algorithm 1); at the
     first rejection a token is drawn from normalise(max(0, p - q)) instead and the step ends; when
     all are accepted, a bonus token is drawn from p at position L + gamma. By the block rule (the
     default, block_accept_reject: Sun et al., "Block Verification Accelerates Speculative
     Decoding", arXiv 2403.10444), the draft's prefixes are tested as wholes and the longest that
     passes is kept, then the next token is drawn from a residual of the same kind: the same forwards,
     at least as many tokens kept in expectation.
Every committed token is then distributed as the target's conditional given the tokens before it
(Leviathan et al., Appendix A.1; Sun et al. for the block rule), whatever happens to the
randomness after it. The same filters (temperature, top-k, top-p, min-p) shape p and q, so the
output follows the filtered target. Temperature 0 makes p and q one-hot: by either rule a draft
token is kept iff it and those before it are the target's argmax, and the output equals greedy
decoding of the target.

Batches (a departure from both papers, which describe one sequence). Rows accept different
numbers of tokens. Two schemes keep every row exact; speculative_generate picks per-row rollback
(every built-in cache counts its tokens per row; at batch 1 the schemes are one algorithm), the
shared window on request.

Per-row rollback (ModelCache.truncate_rows): after each step, row b's
target cache is cut to its committed length L_b minus one and its draft cache to L_b minus two
(DRAFT_LAG), so every row drafts gamma tokens from its own length at the next step. The next forwards
write each row's tokens at that row's own positions (per-row rotary offsets), and a per-row mask
hides whatever lies past a row's length (its rejected draft tokens, until overwritten). Each row
is then exactly the single-sequence algorithm. A row that has stopped stays frozen: it still
takes part in the batched forwards, but commits nothing more.

Shared window: a cache is truncated to one length for all rows. So:
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
ahead it is), which costs a batch about a quarter of its tokens per step at batch 4 (the
per-row scheme's reason to be). The exactness tests (tests/test_speculative.py) enumerate the
target distribution and run a chi-square test of both schemes at batch 1, 4 and in large batches.

Legend: B batch, T prompt tokens, W verification window (gamma + 1), V vocabulary, N new tokens,
S the room for a row's tokens (T + N + 2W, or the longer cache's capacity where that is more).
Positions are absolute indices into the sequence; slot s of a step is position start + s, where
`start` is the first position not yet committed by every row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from attnlab.errors import ConfigError
from attnlab.generate.distribution import SamplingConfig, draw_chain, probabilities, token_at
from attnlab.generate.sampling import check_new_tokens, check_prompt
from attnlab.model.modes import eval_mode
from attnlab.model.transformer import (
    ModelCache,
    ModelOutput,
    Transformer,
    capacity_for,
    check_length,
    model_config,
    new_model_cache,
)

log = logging.getLogger(__name__)
# The draft's cache is kept DRAFT_LAG tokens behind each row's committed length, so a step's draft
# feeds the same number of tokens every time: the last committed one and the one before it (which a
# step that accepted every proposal drafted but never fed). One shape makes one compiled graph: two
# would each hold a copy of the packed weights, and alternating between the copies cost a step more
# than the extra token does.
DRAFT_LAG = 2


class CachedLanguageModel(Protocol):
    """What speculative decoding needs of a draft or a target (Transformer, EarlyExitDraft). A
    draft may also have `draw` (Transformer.draw: its proposals in one compiled call; without
    one, it is called once per token), `drafting_blocks` (the Transformer blocks it draws
    through, which a target's draw_then_decode runs in the same graph as its verification) and
    `decoding_capacity` (the capacity of the cache it decodes `length` tokens a row through:
    Transformer.decoding_capacity; without one, length)."""

    def __call__(self, tokens: Tensor, cache: ModelCache | None = None) -> ModelOutput: ...

    def new_cache(self, batch_size: int, max_len: int | None = None, device=None, dtype=None) -> ModelCache: ...


# --------------------------------------------------------------------------------------------
# The accept/reject rule (pure)


def proposal_probabilities(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(p, q) of each draft token under the target and the draft -> ([B, W-1], [B, W-1]); shapes as
    accept_reject's. q > 0 where a token was drawn from the draft (not where it is known)."""
    p_token = target_probs[:, :-1].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_token = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    return p_token, q_token


def accept_reject(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    known: Tensor,
    uniforms: Tensor,
) -> tuple[Tensor, Tensor]:
    """Verify one window of draft tokens per row; return (n_accepted [B], next_token [B]).

    target_probs [B, W, V]: p at slots 0..W-1 (slot W-1 is the bonus position).
    draft_probs [B, W-1, V]: q at slots 0..W-2, from which the draft tokens were sampled.
    draft_tokens [B, W-1]: the tokens at slots 0..W-2.
    known [B, W-1] bool: slots whose token is already committed (always accepted; a row's known
        slots come first).
    uniforms [B, W] in [0, 1): slot s's acceptance test at column s, the next token's draw at the last.
    n_accepted counts the leading accepted slots (known ones included); next_token is the token
    at slot n_accepted: drawn from normalise(max(0, p - q)) after a rejection, or from p at the
    bonus slot when every slot was accepted (q is zero there, so both are the same formula).
    """
    batch, width, n_tokens = target_probs.shape
    p_token, q_token = proposal_probabilities(target_probs, draft_probs, draft_tokens)  # [B, W-1] each
    # accept with probability min(1, p/q) (Leviathan et al., Algorithm 1); u q < p avoids 0 / 0
    accepted = known | (uniforms[:, :-1] * q_token < p_token)  # [B, W-1]
    n_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B] leading accepted slots

    index = n_accepted[:, None, None].expand(batch, 1, n_tokens)  # [B, 1, V]
    p_next = target_probs.gather(1, index).squeeze(1)  # [B, V]
    # q at the next slot; zero at the bonus slot (no draft there), so the residual is p itself
    q_next = draft_probs.gather(1, index.clamp(max=width - 2)).squeeze(1)  # [B, V]
    q_next = q_next * (n_accepted < width - 1)[:, None]
    residual = (p_next - q_next).clamp_min(0)  # max(0, p - q) (Leviathan et al., eq. 2 / Chen et al.)
    # sampled in proportion (token_at normalises); a rejection implies p > q somewhere, so the
    # mass is > 0 up to rounding; fall back to p if not
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    return n_accepted, token_at(residual, uniforms[:, -1])


def block_acceptance(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor, known: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """Block verification's probabilities for one window of draft tokens per row (Sun et al., "Block
    Verification Accelerates Speculative Decoding", arXiv 2403.10444, Algorithm 2); shapes as
    accept_reject's. Returns (passes [B, W-1], next_weights [B, W, V]):

    passes[:, i - 1] = h_i, the probability that the draft's first i tokens pass their test; the
        tokens kept are those of the longest prefix that passes (a prefix may pass where a shorter
        one failed), none if none does. Known slots always pass.
    next_weights[:, i]: the unnormalised distribution of the next token when i are kept: after
        fewer than W - 1, max(0, p_i * p(. | X_1..X_i) - q(. | X_1..X_i)); after all of them, p.

    p_i = min(1, p_{i-1} * p(X_i) / q(X_i)), p_0 = 1, is the prefix's target-to-draft odds, capped
    (1 through known slots: a row's known prefix is committed, its drafted suffix a window of its
    own); h_i = r_i / (r_i + 1 - p_i) with r_i the mass of next_weights[:, i], and h_gamma = p_gamma.
    The token rule (accept_reject) tests each token alone, min(1, p / q), and keeps a prefix only if
    every shorter one passed; judging the draft's block as a whole keeps at least as many tokens in
    expectation (the paper shows it optimal among exact rules), and the output is still the
    target's distribution (tests/test_speculative.py enumerates it)."""
    width = target_probs.shape[1]
    p_token, q_token = proposal_probabilities(target_probs, draft_probs, draft_tokens)  # [B, W-1] each
    ratio = torch.where(known, 1.0, p_token / q_token)  # [B, W-1]
    odds = [torch.ones_like(ratio[:, 0])]  # p_0 .. p_gamma, each [B]
    for slot in range(width - 1):  # once 0, always 0 (a ratio past float32's range must not make 0 x inf)
        odds.append(torch.where(odds[-1] > 0, torch.clamp(odds[-1] * ratio[:, slot], max=1.0), 0.0))
    odds = torch.stack(odds, dim=1)  # [B, W]
    residuals = (odds[:, :-1, None] * target_probs[:, :-1] - draft_probs).clamp_min(0)  # [B, W-1, V]
    mass = residuals[:, 1:].sum(dim=-1)  # [B, W-2]: r_1 .. r_{gamma-1}
    denominator = mass + 1 - odds[:, 1:-1]
    # 0 / 0 where p_i = 1 and nothing is left (the models agree after X_1..X_i): that prefix passes
    passes = torch.where(denominator > 0, mass / denominator.clamp_min(torch.finfo(mass.dtype).tiny), 1.0)
    passes = torch.cat((passes, odds[:, -1:]), dim=1)  # [B, W-1]: h_1 .. h_gamma
    next_weights = torch.cat((residuals, target_probs[:, -1:]), dim=1)  # [B, W, V]
    # a residual with no mass left (rounding, or the agreement above): the target's distribution
    next_weights = torch.where(next_weights.sum(dim=-1, keepdim=True) > 0, next_weights, target_probs)
    return passes.masked_fill(known, 1.0), next_weights


def block_accept_reject(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor, known: Tensor,
                        uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """accept_reject's step by block verification (block_acceptance): the same arguments and
    returns. uniforms[:, i - 1] tests the prefix of i tokens, the last column draws the next token."""
    passes, next_weights = block_acceptance(target_probs, draft_probs, draft_tokens, known)
    batch, width, n_tokens = next_weights.shape
    lengths = torch.arange(1, width, device=passes.device)  # [W-1] the prefix each slot's test is of
    n_accepted = ((uniforms[:, :-1] < passes) * lengths).amax(dim=1)  # [B] the longest passing prefix
    index = n_accepted[:, None, None].expand(batch, 1, n_tokens)  # [B, 1, V]
    return n_accepted, token_at(next_weights.gather(1, index).squeeze(1), uniforms[:, -1])


def token_verification(logits: Tensor, draft_probs: Tensor, draft_tokens: Tensor, sampling: SamplingConfig,
                       known: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """The target's logits over a window [B, W, V] -> accept_reject's (n_accepted [B], next_token
    [B]) under `sampling`: what follows the target's forward in one step (Transformer.decode_then
    and draw_then_decode compile them together)."""
    return accept_reject(probabilities(logits, sampling), draft_probs, draft_tokens, known, uniforms)


def block_verification(logits: Tensor, draft_probs: Tensor, draft_tokens: Tensor, sampling: SamplingConfig,
                       known: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """token_verification by block_accept_reject."""
    return block_accept_reject(probabilities(logits, sampling), draft_probs, draft_tokens, known, uniforms)


# the rules speculative_generate verifies a step's draft tokens by (`attnlab speculative --verification`)
VERIFICATIONS = {"block": block_verification, "token": token_verification}


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
        if cache is None:
            return self.target.run(tokens, None, None, None, self.n_layers)
        return self.target._forward_blocks(tokens, cache, self.n_layers)

    def draw(self, tokens: Tensor, cache: ModelCache, uniforms: Tensor, sampling: SamplingConfig,
             forced_tokens: Tensor | None = None, forced: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The draft's proposals (Transformer.draw through its first n_layers blocks): one compiled
        call of the target's after its compile_decoding()."""
        return self.target.draw(tokens, cache, uniforms, sampling, forced_tokens, forced, self.n_layers)

    def drafting_blocks(self) -> tuple[Transformer, int]:
        """The target's first n_layers blocks (Transformer.drafting_blocks)."""
        return self.target, self.n_layers

    def compiled_entries(self) -> list[str]:
        """The target's (Transformer.compiled_entries): the draft decodes through its graphs."""
        return self.target.compiled_entries()

    def decoding_capacity(self, length: int) -> int:
        """The target's (Transformer.decoding_capacity): the draft decodes through its graphs."""
        return self.target.decoding_capacity(length)

    def new_cache(self, batch_size: int, max_len: int | None = None, device=None, dtype=None) -> ModelCache:
        layers = [block.attention for block in self.target.blocks[: self.n_layers]]
        return new_model_cache(self.target, layers, batch_size,
                               self.target.config.max_seq_len if max_len is None else max_len, device, dtype)


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
    n_row_steps: int  # steps summed over the rows that took part (a row stopped early takes none)
    per_row: bool  # the caches rolled back per row (else to the shortest committed prefix)

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / max(self.n_drafted, 1)

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per row and step (out of gamma)."""
        return self.n_accepted / max(self.n_row_steps, 1)


def _propose_and_verify(state: _Decoding, tokens: Tensor, draft_uniforms: Tensor, forced_tokens: Tensor, forced: Tensor,
                        function: Callable, *arguments) -> tuple:
    """One step's forwards: the draft feeds tokens [B, c] (each row's last committed one last) and
    draws W - 1 tokens at draft_uniforms [B, W-1] (draw_chain; forced slots keep forced_tokens'),
    the target scores the last committed token and the drafted ones, and `function` takes it from
    there: function(logits [B, W, V], draft_probs [B, W-1, V], drafted [B, W-1], *arguments), a
    verification (VERIFICATIONS) or a whole step's commit (commit_rows). Returns (drafted, *what
    function returns). One compiled call where the target has draw_then_decode and both models
    decode compiled (Transformer.draw_then_decode); else the draft's own draw where it has one, or
    a forward per token, then the target's decode_then or forward."""
    target, draft, sampling = state.target, state.draft, state.sampling
    if hasattr(target, "draw_then_decode"):
        return target.draw_then_decode(draft, tokens, state.draft_cache, state.target_cache, draft_uniforms, sampling,
                                       forced_tokens, forced, function, *arguments)
    if hasattr(draft, "draw"):
        draft_probs, drafted = draft.draw(tokens, state.draft_cache, draft_uniforms, sampling, forced_tokens, forced)
    else:
        draft_probs, drafted = draw_chain(lambda chunk: draft(chunk, cache=state.draft_cache).logits, tokens,
                                          draft_uniforms, sampling, forced_tokens, forced)
    window = torch.cat((tokens[:, -1:], drafted), dim=1)  # [B, W]
    if hasattr(target, "decode_then"):
        return drafted, *target.decode_then(function, window, state.target_cache, draft_probs, drafted, *arguments)
    return drafted, *function(target(window, cache=state.target_cache).logits, draft_probs, drafted, *arguments)


def rows_done(sequence: Tensor, lengths: Tensor, goal: int | Tensor, prompt_length: int | Tensor,
              end_token: int | Tensor | None) -> Tensor:
    """[B] rows that have reached the goal or committed the end token: sequence [B, S] holds
    row b's committed tokens in its first lengths[b]. goal, prompt_length and end_token (None: no
    end token) are ints, or 0-dim tensors inside a compiled step (constants would make a graph for
    every prompt and goal)."""
    done = lengths >= goal
    if end_token is not None:
        positions = torch.arange(sequence.shape[1], device=sequence.device)
        generated = positions >= prompt_length  # [S]
        committed = positions < lengths[:, None]  # [B, S]
        done = done | ((sequence == end_token) & generated & committed).any(dim=1)
    return done


def commit_rows(logits: Tensor, draft_probs: Tensor, drafted: Tensor, verify: Callable, sampling: SamplingConfig,
                known: Tensor, uniforms: Tensor, sequence: Tensor, lengths: Tensor, done: Tensor, counts: Tensor,
                goal: Tensor, prompt_length: Tensor, end_token: Tensor | None) -> tuple[Tensor, ...]:
    """A per-row step after the target's forward: verify (VERIFICATIONS' rule; its arguments as
    there), then commit each running row's kept tokens and next token, all as tensors in and out,
    so that the compiled step makes the whole of it in its graph and the host reads one small tensor
    a step (about 25 small operations in Python between two steps before; each is a kernel launch on
    a GPU; docs/benchmarks.md "Speculative decoding" has the effect on a CPU). Pure: nothing passed
    in is changed (CUDA graphs replay only steps that write no tensor but their static ones).

    sequence [B, S] holds row b's committed tokens in its first lengths[b]; done [B] the rows
    stopped before this step (they take part in the forwards but commit nothing); counts [3] (rows
    stepped, tokens drafted, tokens accepted), summed over the steps. Returns (sequence, lengths,
    done, counts after the step; host [3]: (every row done, the longest and the shortest length);
    the draft's next input [B, DRAFT_LAG]: each row's last DRAFT_LAG committed tokens; each row's
    new count for the target's cache [B] (all but its last committed token, the next window's
    first) and for the draft's [B] (all but its last DRAFT_LAG))."""
    n_accepted, next_token = verify(logits, draft_probs, drafted, sampling, known, uniforms)  # [B], [B]
    width = uniforms.shape[1]
    slots = torch.arange(width, device=sequence.device)  # [W]
    # drafts past each row's committed length (nothing there is committed), then the next token after
    # the kept ones; a stopped row's land past its length too: never output
    sequence = sequence.scatter(1, lengths[:, None] + slots[: width - 1], drafted)
    sequence = sequence.scatter(1, (lengths + n_accepted)[:, None], next_token[:, None])
    running = ~done
    n_running = running.sum()
    counts = counts + torch.stack((n_running, n_running * (width - 1), (n_accepted * running).sum()))
    lengths = lengths + (n_accepted + 1) * running  # [B]
    done = rows_done(sequence, lengths, goal, prompt_length, end_token)
    host = torch.stack((done.all().long(), lengths.max(), lengths.min()))  # [3]
    catch_up = sequence.gather(1, lengths[:, None] - DRAFT_LAG + slots[:DRAFT_LAG])  # [B, DRAFT_LAG]
    return sequence, lengths, done, counts, host, catch_up, lengths - 1, lengths - DRAFT_LAG


@dataclass
class _Decoding:
    """One speculative_generate call, as both batch schemes see it: the models and their caches,
    the settings, and the state (committed tokens, their lengths and the counters)."""

    target: CachedLanguageModel
    draft: CachedLanguageModel
    target_cache: ModelCache
    draft_cache: ModelCache
    gamma: int
    sampling: SamplingConfig
    verify: Callable  # VERIFICATIONS': the target's logits over a window -> (n_accepted [B], next_token [B])
    generator: torch.Generator | None
    sequence: Tensor  # [B, S] committed tokens of row b: sequence[b, :lengths[b]]
    lengths: Tensor  # [B]
    goal: int  # T + N
    prompt_length: int
    end_token: int | None
    n_steps: int = 0
    n_row_steps: Tensor | int = 0  # steps summed over the rows decoding in them
    n_drafted: Tensor | int = 0  # summed on the device: no sync per step
    n_accepted: Tensor | int = 0

    def done(self) -> Tensor:
        """[B] rows that have reached the goal or committed the end token (rows_done)."""
        return rows_done(self.sequence, self.lengths, self.goal, self.prompt_length, self.end_token)


def _decode_shared_window(state: _Decoding) -> None:
    """Decode until every row stops, both caches cut to the shortest committed prefix after each
    step (the module docstring, "Shared window"). Stopped rows keep decoding; their output
    is cut afterwards."""
    target_cache, draft_cache = state.target_cache, state.draft_cache
    gamma, generator = state.gamma, state.generator
    sequence = state.sequence
    batch, width = sequence.shape[0], gamma + 1
    device = sequence.device
    slots = torch.arange(width - 1, device=device)  # [W-1]
    start = state.prompt_length  # first slot: every row has committed the tokens before it
    n_ahead = 0  # slots the leading row has committed past start (0: rows level)
    finished = bool(state.done().all())
    while not finished:
        # both caches hold (at most) the first start - 1 tokens, committed by every row
        known = start + slots < state.lengths[:, None]  # [B, W-1] slots a row has already committed
        # Draft tokens are written straight into `sequence` past each row's committed length
        # (nothing there is committed), so the window is a view: no copies, no concatenation.
        window = sequence[:, start : start + width - 1]  # [B, W-1] view

        # 1. draft: catch up to start - 1 in one chunk, then one token per slot (known or drafted);
        # 2. target: score the last common token and the W-1 slots in one forward, and
        # 3. accept/reject per row; the accepted slots are then in place, commit the next token
        draft_uniforms = torch.rand(batch, width - 1, generator=generator, device=device)  # [B, W-1]
        uniforms = torch.rand(batch, width, generator=generator, device=device)  # [B, W]
        catch_up = sequence[:, draft_cache.length : start]  # [B, c] (c = DRAFT_LAG, fewer for a shorter prompt)
        drafted, accepted, next_token = _propose_and_verify(state, catch_up, draft_uniforms, window, known,
                                                            state.verify, state.sampling, known, uniforms)
        window.copy_(drafted)
        sequence.scatter_(1, (start + accepted)[:, None], next_token[:, None])
        n_known = known.sum() if n_ahead else 0  # known slots are neither drafted nor counted
        state.n_drafted += batch * (width - 1) - n_known
        state.n_accepted += accepted.sum() - n_known
        state.lengths = start + accepted + 1
        state.n_steps += 1
        state.n_row_steps += batch

        # roll the target's cache back to the shortest committed prefix minus its last token, the
        # draft's to DRAFT_LAG tokens short of that prefix (what the host needs of this step comes
        # back in one read)
        shortest, longest, finished = torch.stack((state.lengths.min(), state.lengths.max(),
                                                   state.done().all())).tolist()
        start, n_ahead = shortest, longest - shortest
        common = start - 1
        target_cache.truncate(common)
        draft_cache.truncate(start - DRAFT_LAG)


def _decode_per_row(state: _Decoding) -> None:
    """Decode until every row stops, each row's caches rolled back to its own committed length
    (the module docstring, "Per-row rollback"). A stopped row is frozen: it still takes part in
    the forwards, but commits nothing more. A step's commit is commit_rows, inside the compiled
    step where the models decode compiled: between two steps, Python draws the uniforms, reads
    one small tensor and sets both caches' row counts."""
    target_cache, draft_cache = state.target_cache, state.draft_cache
    gamma, generator = state.gamma, state.generator
    sequence = state.sequence
    batch, width = sequence.shape[0], gamma + 1
    device = sequence.device
    no_known = torch.zeros(batch, width - 1, dtype=torch.bool, device=device)
    no_tokens = torch.zeros(batch, width - 1, dtype=torch.long, device=device)
    counts = torch.zeros(3, dtype=torch.long, device=device)  # rows stepped, tokens drafted, tokens accepted

    def scalar(value: int) -> Tensor:
        return torch.tensor(value, dtype=torch.long, device=device)

    goal, prompt_length = scalar(state.goal), scalar(state.prompt_length)
    end_token = None if state.end_token is None else scalar(state.end_token)
    lengths, done = state.lengths, state.done()
    # the draft cache holds each row's committed tokens but the last n_catch_up ones (after the first
    # step, DRAFT_LAG: commit_rows gathers them)
    n_catch_up = min(DRAFT_LAG, state.prompt_length)
    catch_up = sequence.gather(1, lengths[:, None] - n_catch_up + torch.arange(n_catch_up, device=device))  # [B, c]
    finished = bool(done.all())
    while not finished:
        # 1. draft: feed each row's catch-up tokens, then one token per slot; 2. target: each row's
        # last committed token and its W-1 drafted ones, at its own positions; 3. verify, commit
        draft_uniforms = torch.rand(batch, width - 1, generator=generator, device=device)  # [B, W-1]
        uniforms = torch.rand(batch, width, generator=generator, device=device)  # [B, W]
        (_, sequence, lengths, done, counts, host, catch_up, target_rows, draft_rows) = _propose_and_verify(
            state, catch_up, draft_uniforms, no_tokens, no_known, commit_rows, state.verify, state.sampling, no_known,
            uniforms, sequence, lengths, done, counts, goal, prompt_length, end_token)
        state.n_steps += 1
        # 4. roll back: the target keeps each row's committed tokens but the last (the next window's
        # first input), the draft all but the last DRAFT_LAG (it has fed a row's first L + gamma - 1
        # tokens, of them the first L + accepted committed: more than the new length less DRAFT_LAG).
        # Every new length is within what both caches hold: no check of truncate_rows' own
        finished, longest, shortest = host.tolist()
        target_cache.truncate_rows(target_rows, (longest - 1, shortest - 1))
        draft_cache.truncate_rows(draft_rows, (longest - DRAFT_LAG, shortest - DRAFT_LAG))
    state.sequence, state.lengths = sequence, lengths
    state.n_row_steps, state.n_drafted, state.n_accepted = counts.tolist()


def check_request(target: CachedLanguageModel, draft: CachedLanguageModel, prompt: Tensor, max_new_tokens: int,
                  gamma: int, verification: str, per_row: bool | None = None) -> None:
    """speculative_generate's arguments, refused in one line (ConfigError, a ValueError; GenerationError
    for what a model cannot decode) before any forward: the prompt and the new tokens as generate's
    (check_prompt, check_new_tokens), for both models; a draft whose vocabulary is not the target's
    (the acceptance rule compares their distributions token by token); a model with learned
    positions that the decoding would run past (check_length). per_row: speculative_generate's
    (None: auto, checked as per-row rollback, which reaches furthest)."""
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ConfigError("gamma must be >= 1")
    if verification not in VERIFICATIONS:
        raise ConfigError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {verification!r}")
    check_new_tokens(max_new_tokens)
    models = (("the target", target), ("the draft", draft))
    for who, model in models:
        check_prompt(model, prompt, who)
    target_config, draft_config = model_config(target), model_config(draft)
    if target_config and draft_config and target_config.num_tokens != draft_config.num_tokens:
        raise ConfigError(f"the draft's vocabulary has {draft_config.num_tokens} tokens, the target's "
                          f"{target_config.num_tokens} (model.num_tokens): a draft must share its target's")
    # Tokens past the goal are fed too, never output: a step drafts and verifies gamma past a row's
    # length, and at batch > 1 a row that has stopped (up to gamma past the goal) still takes part in
    # the forwards of one more window. The target's last position then is goal + gamma - 2 at batch 1,
    # goal + 2 gamma - 1 in a batch (the draft's one less). A shared window (per_row False) starts at
    # the shortest row's length, below the goal while any row decodes: goal + gamma - 2 at any batch.
    batch, prompt_length = prompt.shape
    past_goal = gamma - 1 if batch == 1 or per_row is False else 2 * gamma
    for who, model in models:
        check_length(model, prompt_length + max_new_tokens + past_goal, f"the prompt, the new tokens and the "
                     f"{past_goal} positions {who} decodes past them (gamma {gamma}, batch {batch})")


def speculative_generate(
    target: CachedLanguageModel,
    draft: CachedLanguageModel,
    prompt: Tensor,
    max_new_tokens: int,
    gamma: int = 5,
    sampling: SamplingConfig | None = None,
    end_token: int | None = None,
    generator: torch.Generator | None = None,
    per_row: bool | None = None,
    cache_dtype: torch.dtype | None = None,
    verification: str = "block",
) -> SpeculativeResult:
    """prompt [B, T] (integer ids on the models' device, T >= 1) -> SpeculativeResult: tokens
    [B, T + max_new_tokens] distributed as sampling from `target`, lengths [B] (the new tokens of each
    row) and the step counts; ordinary tensors (the decoding runs in inference mode, its results
    do not). The models decode in eval mode (their own modes restored after). Bad arguments are
    refused before any forward (check_request).

    A row stops after `max_new_tokens` or after emitting `end_token`; the loop runs until every
    row has stopped (the output is cut after a row's end token and padded with it).
    per_row: roll each row's caches back to its own length (when both models' caches can: every
    built-in attention type), else the shared-window scheme; None picks per-row where both caches
    can (at batch 1 the two schemes are one algorithm; per-row commits a step inside the compiled
    step: commit_rows). cache_dtype: both models' caches' (default: each one's weights'; as in
    generate.sampling.stream). verification: the rule a step's draft tokens are kept by, "block"
    or "token" (VERIFICATIONS; the module docstring): the same output distribution.
    """
    with torch.inference_mode():
        result = _speculative_generate(target, draft, prompt, max_new_tokens, gamma, sampling, end_token, generator,
                                       per_row, cache_dtype, verification)
    # ordinary tensors for the caller: an inference tensor refuses an in-place change and autograd
    # (training on the output, say) outside inference mode; [B, T + N] and [B] are small beside decoding
    result.tokens, result.lengths = result.tokens.clone(), result.lengths.clone()
    return result


def _speculative_generate(target: CachedLanguageModel, draft: CachedLanguageModel, prompt: Tensor, max_new_tokens: int,
                          gamma: int, sampling: SamplingConfig | None, end_token: int | None,
                          generator: torch.Generator | None, per_row: bool | None, cache_dtype: torch.dtype | None,
                          verification: str) -> SpeculativeResult:
    """speculative_generate's decoding, under inference mode, after check_request."""
    check_request(target, draft, prompt, max_new_tokens, gamma, verification, per_row)
    sampling = sampling or SamplingConfig()
    batch, prompt_length = prompt.shape
    width = gamma + 1  # W: tokens the target scores per step
    goal = prompt_length + max_new_tokens
    device = prompt.device
    # room for two windows past the goal: a row that stops at most gamma + 1 tokens past it still
    # feeds (and drafts) one window more while others decode
    capacity = goal + 2 * width
    target_cache = target.new_cache(batch, capacity_for(target, capacity), dtype=cache_dtype)
    draft_cache = draft.new_cache(batch, capacity_for(draft, capacity), dtype=cache_dtype)
    # as long as the longer cache, which a compiled decoding rounds up: a step's graph reads the
    # sequence (commit_rows), so generations whose caches round alike share it
    sequence = torch.zeros(batch, max(capacity, target_cache.max_len, draft_cache.max_len), dtype=torch.long,
                           device=device)  # [B, S]
    sequence[:, :prompt_length] = prompt
    state = _Decoding(
        target=target, draft=draft, target_cache=target_cache, draft_cache=draft_cache, gamma=gamma,
        sampling=sampling, verify=VERIFICATIONS[verification], generator=generator, sequence=sequence,
        lengths=torch.full((batch,), prompt_length, dtype=torch.long, device=device),
        goal=goal, prompt_length=prompt_length, end_token=end_token,
    )
    if per_row is None:
        per_row = all(getattr(cache, "per_row_rollback", False) for cache in (target_cache, draft_cache))
    with eval_mode(target, draft):  # each module's own mode restored afterwards (model/modes.py)
        # the target takes the prompt minus its last token (the last one opens the first window),
        # the draft minus its last DRAFT_LAG (its first step feeds them)
        if prompt_length > 1:
            target(prompt[:, :-1], cache=target_cache)
        if prompt_length > DRAFT_LAG:
            draft(prompt[:, :-DRAFT_LAG], cache=draft_cache)
        decode = _decode_per_row if per_row else _decode_shared_window
        decode(state)

    sequence, lengths = state.sequence, state.lengths
    n_steps, n_drafted, n_accepted = state.n_steps, int(state.n_drafted), int(state.n_accepted)
    n_row_steps = int(state.n_row_steps)
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
        tokens=tokens, lengths=produced, n_steps=n_steps, n_drafted=n_drafted, n_accepted=n_accepted, gamma=gamma,
        n_row_steps=n_row_steps, per_row=per_row,
    )
