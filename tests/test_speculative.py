"""Speculative decoding: greedy equals the target's greedy decoding, sampled continuations follow
the target's exact distribution at batch 1, 4 and in large batches (chi-square against the
enumerated distribution), deliberately broken variants fail that test, and an identical draft is
always accepted."""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

import attnlab.generate.speculative as speculative
from attnlab.attention.full import FullCache
from attnlab.generate.sampling import SamplingConfig, generate, probabilities
from attnlab.generate.speculative import (
    EarlyExitDraft,
    accept_reject,
    block_accept_reject,
    block_acceptance,
    speculative_generate,
)
from attnlab.model import ModelCache, Transformer
from attnlab.model.quantize import quantize_weights
from variants import variant_config

GREEDY = SamplingConfig(temperature=0)


def model(name: str = "full", seed: int = 0, logit_scale: float = 1.0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    built = Transformer(variant_config(name, **overrides)).eval()
    with torch.no_grad():
        built.head.weight.mul_(logit_scale)  # sharper, more varied distributions than at init
    return built


# --------------------------------------------------------------------------------------------
# Greedy: token for token the target's own greedy decoding


PAIRS = {
    "full-full": (dict(name="full", depth=3), dict(name="full", seed=1, depth=1)),
    "local-local": (dict(name="local", depth=3), dict(name="local", seed=1, depth=1)),
    # different sizes and attention types sharing a vocabulary
    "full-local": (dict(name="full", depth=3, dim=48, heads=6), dict(name="local", seed=1, depth=1)),
    "local-learned": (dict(name="local", depth=2), dict(name="full-learned-positions", seed=1, depth=1)),
    # both caches roll back per row at batch > 1, the target with learned positions
    "learned-full": (dict(name="full-learned-positions", depth=2), dict(name="full", seed=1, depth=1)),
    "routing-full": (dict(name="routing", depth=2), dict(name="full", seed=1, depth=1)),
    "sinkhorn-local": (dict(name="sinkhorn", depth=2), dict(name="local", seed=1, depth=1)),
    "nsa-full": (dict(name="nsa", depth=2), dict(name="full", seed=1, depth=1)),
    "full-nsa": (dict(name="full", depth=2), dict(name="nsa-shared", seed=1, depth=1)),
}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_greedy_speculative_equals_greedy_target(pair, batch):
    target_options, draft_options = PAIRS[pair]
    target, draft = model(logit_scale=8, **target_options), model(logit_scale=8, **draft_options)
    prompt = torch.randint(0, 61, (batch, 9), generator=torch.Generator().manual_seed(batch))
    expected = generate(target, prompt, 32, GREEDY)
    for gamma, per_row in itertools.product((1, 5), [None, True, False]):  # auto, and both schemes
        result = speculative_generate(target, draft, prompt, 32, gamma=gamma, sampling=GREEDY, per_row=per_row)
        assert torch.equal(result.tokens, expected), (pair, batch, gamma, per_row)
        assert result.lengths.tolist() == [32] * batch


def test_both_caches_store_keys_and_values_in_the_dtype_asked_for(monkeypatch):
    """cache_dtype: the target's and the draft's caches hold bfloat16 keys and values beside float32
    weights, and speculative decoding over them runs each row to its full length."""
    target, draft = model(logit_scale=8), model("local", seed=1, logit_scale=8)
    caches = []
    for module in (target, draft):
        make = module.new_cache
        monkeypatch.setattr(module, "new_cache", lambda *args, make=make, **kwargs: caches.append(
            make(*args, **kwargs)) or caches[-1])
    prompt = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    result = speculative_generate(target, draft, prompt, 24, gamma=4, sampling=GREEDY, cache_dtype=torch.bfloat16)
    assert [cache.layers[0].keys.dtype for cache in caches] == [torch.bfloat16, torch.bfloat16]
    assert result.lengths.tolist() == [24, 24] and torch.equal(result.tokens[:, :9], prompt)


@pytest.mark.parametrize("batch", [1, 4])
def test_self_speculative_greedy_equals_target(batch):
    target = model(depth=3, logit_scale=8)
    prompt = torch.randint(0, 61, (batch, 5), generator=torch.Generator().manual_seed(7))
    result = speculative_generate(target, EarlyExitDraft(target, 1), prompt, 40, gamma=4, sampling=GREEDY)
    assert torch.equal(result.tokens, generate(target, prompt, 40, GREEDY))


def test_early_exit_draft_is_the_truncated_target():
    target = model(depth=3)
    tokens = torch.randint(0, 61, (2, 12))
    full_depth = EarlyExitDraft(target, 3)
    torch.testing.assert_close(full_depth(tokens).logits, target(tokens).logits)
    shallow = EarlyExitDraft(target, 1)
    cache = shallow.new_cache(2, 16)
    chunked = torch.cat([shallow(tokens[:, :5], cache=cache).logits, shallow(tokens[:, 5:], cache=cache).logits], 1)
    torch.testing.assert_close(chunked, shallow(tokens).logits, atol=1e-5, rtol=1e-5)
    assert len(cache.layers) == 1


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)])
@pytest.mark.parametrize("batch", [1, 3])
def test_identical_draft_accepts_every_token(sampling, batch):
    target = model(logit_scale=4)
    prompt = torch.randint(0, 61, (batch, 6))
    generator = torch.Generator().manual_seed(0)
    for draft in (target, EarlyExitDraft(target, len(target.blocks))):
        result = speculative_generate(target, draft, prompt, 30, gamma=5, sampling=sampling, generator=generator)
        assert result.n_accepted == result.n_drafted > 0
        assert result.n_steps == 5  # 6 tokens per step: 5 accepted and a bonus


@pytest.mark.parametrize("prompt_length", [1, 2])
def test_prompts_shorter_than_the_drafts_lag(prompt_length):
    """A prompt of DRAFT_LAG tokens or fewer (the draft's first step then feeds all of it, the
    target's first verification is its prefill): greedy equals the target's, by both schemes."""
    target, draft = model(depth=2, logit_scale=8), model(seed=1, depth=1, logit_scale=8)
    for batch in (1, 3):
        prompt = torch.randint(0, 61, (batch, prompt_length), generator=torch.Generator().manual_seed(batch))
        expected = generate(target, prompt, 20, GREEDY)
        for per_row in (None, False):
            result = speculative_generate(target, draft, prompt, 20, gamma=3, sampling=GREEDY, per_row=per_row)
            assert torch.equal(result.tokens, expected), (batch, per_row)


@pytest.mark.parametrize("end_token", [None, 39])  # 39: the 19th new token without one
def test_both_schemes_draw_the_same_tokens_at_batch_1(end_token):
    """At batch 1 the per-row scheme (its commit in commit_rows, the default) and the shared window
    are one algorithm: the same uniforms give the same tokens, steps and counts, sampled at
    temperature 1, with an end token or without."""
    target, draft = model(depth=2), model(seed=1, depth=1)  # near-uniform: most drafts kept, some not
    prompt = torch.randint(0, 61, (1, 7), generator=torch.Generator().manual_seed(5))
    runs = [speculative_generate(target, draft, prompt, 40, gamma=4, end_token=end_token, per_row=per_row,
                                 generator=torch.Generator().manual_seed(11)) for per_row in (None, False)]
    assert runs[0].per_row and not runs[1].per_row
    assert torch.equal(runs[0].tokens, runs[1].tokens) and torch.equal(runs[0].lengths, runs[1].lengths)
    counts = [(run.n_steps, run.n_drafted, run.n_accepted, run.n_row_steps) for run in runs]
    assert counts[0] == counts[1] and 0 < runs[0].n_accepted < runs[0].n_drafted
    assert runs[0].lengths.item() == (40 if end_token is None else 19)


def test_commit_rows_is_pure_and_commits_running_rows_only():
    """commit_rows (a per-row step's commit, compiled inside the step) changes none of its inputs;
    a stopped row keeps its length and counts for nothing; a running row's kept drafts and next
    token land after its committed tokens."""
    width, vocabulary = 4, 5
    lengths = torch.tensor([3, 6])
    sequence = torch.arange(2 * 16).reshape(2, 16) % vocabulary
    done = torch.tensor([False, True])
    counts = torch.tensor([10, 30, 20])
    drafted = torch.tensor([[1, 2, 3], [4, 0, 1]])
    draft_probs = torch.full((2, width - 1, vocabulary), 1 / vocabulary)
    logits = torch.zeros(2, width, vocabulary)  # the target agrees with the draft: every draft kept
    inputs = [tensor.clone() for tensor in (sequence, lengths, done, counts)]
    no_known = torch.zeros(2, width - 1, dtype=torch.bool)
    outputs = speculative.commit_rows(logits, draft_probs, drafted, speculative.block_verification, SamplingConfig(),
                                      no_known, torch.full((2, width), 0.5), sequence, lengths, done, counts,
                                      torch.tensor(12), torch.tensor(3), None)
    assert all(torch.equal(before, after) for before, after in zip(inputs, (sequence, lengths, done, counts)))
    new_sequence, new_lengths, new_done, new_counts, host, catch_up, target_rows, draft_rows = outputs
    assert new_lengths.tolist() == [7, 6] and new_done.tolist() == [False, False]  # the goal is 12
    assert torch.equal(new_sequence[0, 3:6], drafted[0]) and torch.equal(new_sequence[0, :3], sequence[0, :3])
    assert new_counts.tolist() == [11, 33, 23] and host.tolist() == [0, 7, 6]
    assert torch.equal(catch_up, torch.stack((new_sequence[0, 5:7], new_sequence[1, 4:6])))
    assert target_rows.tolist() == [6, 5] and draft_rows.tolist() == [5, 4]


@pytest.mark.parametrize("per_row", [True, False])
def test_end_token_stops_each_row(per_row):
    """Rows stop at their own end token; a stopped row's output stays cut while others decode on
    (frozen per-row, decoding on in the shared window)."""
    target, draft = model(depth=2, logit_scale=8), model(seed=1, depth=1, logit_scale=8)
    prompt = torch.randint(0, 61, (4, 6), generator=torch.Generator().manual_seed(3))
    expected = generate(target, prompt, 30, GREEDY)[:, 6:]
    end = int(expected[0, 4])  # row 0 stops at its fifth new token
    result = speculative_generate(target, draft, prompt, 30, gamma=3, sampling=GREEDY, end_token=end,
                                  per_row=per_row)
    assert result.per_row == per_row
    for row in range(4):
        hits = (expected[row] == end).nonzero().flatten().tolist()
        length = hits[0] + 1 if hits else 30
        assert result.lengths[row] == length
        assert torch.equal(result.tokens[row, 6 : 6 + length], expected[row, :length])
        assert (result.tokens[row, 6 + length :] == end).all()


# --------------------------------------------------------------------------------------------
# Exactness of the sampled distribution


VOCABULARY, HORIZON, GAMMA = 4, 3, 2
PROMPT = torch.tensor([[1, 2, 0, 3]])


def tiny(name: str, seed: int, depth: int, **overrides) -> Transformer:
    return model(name, seed=seed, logit_scale=4, num_tokens=VOCABULARY, dim=16, heads=2, dim_head=8, kv_heads=1,
                 depth=depth, **overrides)


def exact_distribution(target: Transformer, sampling: SamplingConfig) -> tuple[Tensor, Tensor]:
    """Every continuation of PROMPT [V^H, H] and its probability under the target [V^H]: the
    product of the target's (filtered) conditionals."""
    continuations = torch.tensor(list(itertools.product(range(VOCABULARY), repeat=HORIZON)))
    sequences = torch.cat((PROMPT.expand(len(continuations), -1), continuations), dim=1)
    with torch.no_grad():
        logits = target(sequences[:, :-1]).logits[:, PROMPT.shape[1] - 1 :]  # [V^H, H, V]
    conditionals = probabilities(logits, sampling).double()
    return continuations, conditionals.gather(-1, continuations[..., None]).squeeze(-1).prod(dim=1)


def chi_square_p_value(counts: Tensor, expected_probs: Tensor) -> float:
    """Pearson's goodness of fit; cells expected fewer than 5 times pooled into one. Survival
    function of chi-square(k) at x is the regularised upper incomplete gamma Q(k/2, x/2)."""
    n_samples = counts.sum()
    if (counts[expected_probs == 0] > 0).any():
        return 0.0  # a continuation the target cannot produce
    expected = expected_probs * n_samples
    small = expected < 5
    observed = torch.cat((counts[~small], counts[small].sum()[None]))
    expected = torch.cat((expected[~small], expected[small].sum()[None]))
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(expected) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def sampled_counts(
    target, draft, batch: int, n_samples: int, sampling: SamplingConfig, seed: int, per_row: bool | None = None,
    verification: str = "block",
) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    place = VOCABULARY ** torch.arange(HORIZON - 1, -1, -1)  # continuation -> its index
    counts = torch.zeros(VOCABULARY**HORIZON, dtype=torch.float64)
    for _ in range(n_samples // batch):
        result = speculative_generate(
            target, draft, PROMPT.expand(batch, -1), HORIZON, gamma=GAMMA, sampling=sampling, generator=generator,
            per_row=per_row, verification=verification,
        )
        new = result.tokens[:, PROMPT.shape[1] :]  # [batch, H]
        counts += torch.bincount((new * place).sum(dim=1), minlength=len(counts)).double()
    return counts


@pytest.fixture(scope="module")
def pair() -> tuple[Transformer, Transformer]:
    """A full-attention target and a local draft, decoded with the shared-window scheme (per_row=False)."""
    return tiny("full", seed=0, depth=2), tiny("local", seed=1, depth=1)


# a window of 3 tokens: the band bites within the 7 tokens of a continuation, and per-row
# rollbacks shift the kept keys of each row (LocalCache) at every step
NARROW_LOCAL = {"attention": {"kind": "local", "local": {"window_size": 3}}}


@pytest.fixture(scope="module")
def local_pair() -> tuple[Transformer, Transformer]:
    """Both caches local attention, rolled back per row at batch > 1."""
    return tiny("local", seed=0, depth=2, **NARROW_LOCAL), tiny("local", seed=1, depth=1, **NARROW_LOCAL)


@pytest.fixture(scope="module")
def full_pair() -> tuple[Transformer, Transformer]:
    """Both caches roll back per row (full attention): the per-row scheme at batch > 1."""
    return tiny("full", seed=0, depth=2), tiny("full", seed=1, depth=1)


SAMPLINGS = {"plain": SamplingConfig(), "filtered": SamplingConfig(temperature=0.8, top_k=3, top_p=0.95)}


@pytest.mark.parametrize(
    "batch, n_samples, sampling, verification",
    [(1, 1000, "plain", "block"), (4, 2000, "plain", "block"), (4, 1200, "filtered", "block"),
     (2000, 6000, "plain", "block"), (2000, 6000, "filtered", "block"),
     (1, 1000, "plain", "token"), (4, 2000, "plain", "token"), (2000, 6000, "filtered", "token")],
)
def test_sampled_continuations_follow_the_target(pair, batch, n_samples, sampling, verification):
    target, draft = pair
    _, expected = exact_distribution(target, SAMPLINGS[sampling])
    counts = sampled_counts(target, draft, batch, n_samples, SAMPLINGS[sampling], seed=batch, per_row=False,
                            verification=verification)
    assert chi_square_p_value(counts, expected) > 0.01


@pytest.mark.parametrize(
    "batch, n_samples, sampling", [(4, 2000, "plain"), (4, 1200, "filtered"), (2000, 6000, "plain")]
)
def test_per_row_rollback_follows_the_target(full_pair, batch, n_samples, sampling):
    target, draft = full_pair
    _, expected = exact_distribution(target, SAMPLINGS[sampling])
    counts = sampled_counts(target, draft, batch, n_samples, SAMPLINGS[sampling], seed=batch + 1, per_row=True)
    assert chi_square_p_value(counts, expected) > 0.01


@pytest.fixture(scope="module")
def routing_pair() -> tuple[Transformer, Transformer]:
    """A routing target (one local and one routed head in layer 0, clusters of W + 1 = 5 keys)
    and a local draft, rolled back per row at batch > 1."""
    return tiny("routing", seed=0, depth=2), tiny("local", seed=1, depth=1, **NARROW_LOCAL)


@pytest.fixture(scope="module")
def sinkhorn_pair() -> tuple[Transformer, Transformer]:
    """A sinkhorn target with buckets of 2 tokens (one local head, one sorted head choosing one
    earlier bucket) and a local draft, rolled back per row at batch > 1."""
    narrow = {"attention": {"kind": "sinkhorn", "sinkhorn": {"bucket_size": 2, "n_sortcut": 1, "n_local_heads": 1,
                                                             "sinkhorn_iter": 3}}}
    return tiny("sinkhorn", seed=0, depth=2, **narrow), tiny("local", seed=1, depth=1, **NARROW_LOCAL)


@pytest.fixture(scope="module")
def nsa_pair() -> tuple[Transformer, Transformer]:
    """An NSA target whose branches all act within the 7 tokens of a continuation (blocks of 2
    compressed every token, one free choice of selection block besides the initial and the own
    one, a window of 2) and a full-attention draft, rolled back per row at batch > 1."""
    narrow = {"attention": {"kind": "nsa", "nsa": {
        "compress_block_size": 2, "compress_stride": 1, "selection_block_size": 2, "num_selected": 3,
        "sliding_window_size": 2, "query_chunk_size": 2}}}
    return tiny("nsa", seed=0, depth=2, **narrow), tiny("full", seed=1, depth=1)


@pytest.mark.parametrize("pair_name", ["local", "routing", "sinkhorn", "nsa"])
def test_local_routing_sinkhorn_nsa_per_row_rollback_follow_the_target(pair_name, request):
    """In 2000 rows each step keeps every possible number of draft tokens in some rows, so every
    rollback length of each cache is drawn from (the per-row scheme at batch 4: full attention's
    test_per_row_rollback_follows_the_target; the same code for every attention type)."""
    batch, n_samples = 2000, 6000
    target, draft = request.getfixturevalue(f"{pair_name}_pair")
    _, expected = exact_distribution(target, SAMPLINGS["plain"])
    counts = sampled_counts(target, draft, batch, n_samples, SAMPLINGS["plain"], seed=batch + 2, per_row=True)
    assert chi_square_p_value(counts, expected) > 0.01


def test_quantized_draft_follows_the_target(full_pair):
    """A draft with int8 weights only changes which tokens are proposed: the output is still the
    target's distribution (per-row scheme, 2000 rows)."""
    target, draft = full_pair
    draft = copy.deepcopy(draft)
    assert quantize_weights(draft, "int8") > 0
    _, expected = exact_distribution(target, SAMPLINGS["plain"])
    counts = sampled_counts(target, draft, 2000, 6000, SAMPLINGS["plain"], seed=7, per_row=True)
    assert chi_square_p_value(counts, expected) > 0.01


def test_bfloat16_pair_follows_the_bfloat16_target(full_pair):
    """Both models cast to bfloat16 (`attnlab speculative --dtype bfloat16`), the draft's weights
    int8 as well: the output follows the cast target's distribution (per-row scheme, 2000 rows).
    The acceptance rule works on float32 probabilities whatever the logits' dtype (filter_logits)."""
    target, draft = (copy.deepcopy(model).to(torch.bfloat16) for model in full_pair)
    assert quantize_weights(draft, "int8") > 0
    _, expected = exact_distribution(target, SAMPLINGS["plain"])
    counts = sampled_counts(target, draft, 2000, 6000, SAMPLINGS["plain"], seed=9, per_row=True)
    assert chi_square_p_value(counts, expected) > 0.01


RULES = {"block": block_accept_reject, "token": accept_reject}  # each verification's accept/reject step


@pytest.mark.parametrize("verification", list(RULES))
def test_accept_always_is_detected(pair, monkeypatch, verification):
    """Accepting every draft token samples the draft, not the target: the test must notice."""
    target, draft = pair
    rule = RULES[verification]
    monkeypatch.setattr(
        speculative, rule.__name__,
        lambda p, q, tokens, known, uniforms: rule(p, q, tokens, torch.ones_like(known), uniforms),
    )
    _, expected = exact_distribution(target, SamplingConfig())
    counts = sampled_counts(target, draft, 1, 600, SamplingConfig(), seed=1, verification=verification)
    assert chi_square_p_value(counts, expected) < 1e-6


def test_ragged_batch_bug_is_detected(pair, monkeypatch):
    """A batch scheme that forgets which tokens a row ahead of the others has already committed
    (and verifies them again as if drafted) is exact at batch 1 but biased at batch > 1: the
    large-batch test (test_sampled_continuations_follow_the_target at batch 2000) tells."""
    target, draft = pair
    monkeypatch.setattr(
        speculative, "block_accept_reject",
        lambda p, q, tokens, known, uniforms: block_accept_reject(p, q, tokens, torch.zeros_like(known), uniforms),
    )
    _, expected = exact_distribution(target, SamplingConfig())
    counts = sampled_counts(target, draft, 2000, 6000, SamplingConfig(), seed=2000, per_row=False)
    assert chi_square_p_value(counts, expected) < 1e-6


class RecordingTarget(torch.nn.Module):
    """The target, recording every cached forward: (position of its first token in each row [B],
    tokens, logits)."""

    def __init__(self, target: Transformer, stale_rollback: bool = False) -> None:
        super().__init__()
        self.target, self.stale_rollback = target, stale_rollback
        self.records: list[tuple[Tensor, Tensor, Tensor]] = []

    def forward(self, tokens, cache=None):
        offsets = cache.lengths.clone()  # [B]
        output = self.target(tokens, cache=cache)
        self.records.append((offsets, tokens.clone(), output.logits.clone()))
        return output

    def new_cache(self, batch_size, max_len=None, device=None, dtype=None) -> ModelCache:
        cache = self.target.new_cache(batch_size, (max_len or 0) + 64, device, dtype)
        if self.stale_rollback:  # a broken rollback that keeps one token past the committed prefix
            cache.truncate = lambda length: ModelCache.truncate(cache, min(length + 1, cache.length))
            cache.truncate_rows = lambda lengths, bounds=None: ModelCache.truncate_rows(  # bounds read anew
                cache, torch.minimum(lengths + 1, cache.lengths)
            )
        return cache


def attended_only_committed_tokens(recording: RecordingTarget, tokens: Tensor) -> bool:
    """Every cached forward's logits at a committed position equal the parallel forward of the
    final sequence there: the cache held exactly the row's own committed tokens before it."""
    with torch.no_grad():
        reference = recording.target(tokens).logits  # [B, T + N, V]
    for offsets, fed, logits in recording.records:
        for row, offset in enumerate(offsets.tolist()):
            if offset >= tokens.shape[1]:  # a row that stopped, still fed past its last token
                continue
            # the first token of every forward is committed by its row, at the position the cache
            # says it is (a cache holding a stale token feeds it one position late)
            if fed[row, 0] != tokens[row, offset]:
                return False
            # the fed tokens are committed up to the first one that differs from the final sequence
            final = tokens[row, offset : offset + fed.shape[1]]  # windows may run past the last token
            same = fed[row, : len(final)] == final
            n_committed = int(same.long().cumprod(0).sum())
            if not torch.allclose(
                logits[row, :n_committed], reference[row, offset : offset + n_committed], atol=1e-5, rtol=1e-4
            ):
                return False
    return True


@pytest.mark.parametrize(
    "name, per_row",
    [("full", True), ("full", False), ("local", True), ("local", False), ("routing", True), ("sinkhorn", True),
     ("nsa", True), ("nsa", False)],
)
def test_rows_attend_only_to_their_own_committed_tokens(name, per_row):
    """Ragged acceptance at batch 6: no row's cache ever holds a rejected draft token, whether
    each row's caches roll back to its own length (per_row) or all to the shortest one."""
    target, draft = model(name, depth=2, logit_scale=3), model(name, seed=1, depth=1, logit_scale=3)
    prompt = torch.randint(0, 61, (6, 5), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(0)
    recording = RecordingTarget(target)
    result = speculative_generate(recording, draft, prompt, 40, gamma=4, generator=generator, per_row=per_row)
    assert 0 < result.n_accepted < result.n_drafted  # some accepted, some rejected: ragged rows
    ragged = [offsets for offsets, _, _ in recording.records if len(set(offsets.tolist())) > 1]
    assert bool(ragged) == per_row  # rows at positions of their own only when rolled back per row
    assert attended_only_committed_tokens(recording, result.tokens)
    broken = RecordingTarget(target, stale_rollback=True)
    result = speculative_generate(broken, draft, prompt, 40, gamma=4, generator=generator, per_row=per_row)
    assert not attended_only_committed_tokens(broken, result.tokens)


def test_per_row_mask_bug_is_detected(monkeypatch):
    """Per-row caches whose mask lets every row see keys up to the longest row (the rejected draft
    tokens a shorter row leaves past its length, and its own later window tokens) are caught.
    (The tiny models of the chi-square tests attend too weakly for this bias to show in 6000
    samples; the logits are compared exactly here instead.)"""
    torch_attention = {"attention": {"kind": "full", "full": {"backend": "torch"}}}  # the masked path
    target = model("full", depth=2, logit_scale=3, **torch_attention)
    draft = model("full", seed=1, depth=1, logit_scale=3, **torch_attention)
    prompt = torch.randint(0, 61, (6, 5), generator=torch.Generator().manual_seed(0))
    visible = FullCache.visible

    def visible_level(cache, positions):
        mask = visible(cache, positions)  # [B, 1, T, L]
        return mask.any(dim=0, keepdim=True).expand_as(mask)  # every row sees what any row sees

    monkeypatch.setattr(FullCache, "visible", visible_level)
    recording = RecordingTarget(target)
    result = speculative_generate(recording, draft, prompt, 40, gamma=4, generator=torch.Generator().manual_seed(0))
    assert not attended_only_committed_tokens(recording, result.tokens)


def test_local_per_row_window_bug_is_detected(monkeypatch):
    """A local cache whose window follows the longest row rather than each row's own position (so a
    shorter row reads the rejected draft tokens past its length) is caught."""
    from attnlab.attention import local

    window_positions = local.window_positions
    monkeypatch.setattr(local, "window_positions", lambda positions, window: window_positions(
        positions.max(dim=0, keepdim=True).values.expand_as(positions), window))
    settings = {"attention": {"kind": "local", "local": {"window_size": 6}}}
    target = model("local", depth=2, logit_scale=3, **settings)
    draft = model("local", seed=1, depth=1, logit_scale=3, **settings)
    prompt = torch.randint(0, 61, (6, 3), generator=torch.Generator().manual_seed(0))
    recording = RecordingTarget(target)
    result = speculative_generate(recording, draft, prompt, 30, gamma=4, generator=torch.Generator().manual_seed(0),
                                  per_row=True)
    assert not attended_only_committed_tokens(recording, result.tokens)


def test_nsa_stale_compressed_blocks_are_detected(monkeypatch):
    """An NSA cache that compresses a block only once (when a row first completes it) keeps
    compressed keys made of a row's rejected draft tokens once the row overwrites them: caught."""
    from attnlab.attention.nsa import NSACache

    compress, done = NSACache.compress, set()

    def compress_once(cache, *arguments):
        if id(cache) not in done:  # only the first cached forward of each layer compresses
            done.add(id(cache))
            compress(cache, *arguments)

    monkeypatch.setattr(NSACache, "compress", compress_once)
    target, draft = model("nsa", depth=2, logit_scale=3), model("nsa", seed=1, depth=1, logit_scale=3)
    prompt = torch.randint(0, 61, (6, 5), generator=torch.Generator().manual_seed(0))
    recording = RecordingTarget(target)
    result = speculative_generate(recording, draft, prompt, 40, gamma=4, generator=torch.Generator().manual_seed(0),
                                  per_row=True)
    assert not attended_only_committed_tokens(recording, result.tokens)


def test_accept_reject_single_slot_is_the_target_distribution():
    """The rule alone, on a 5-token vocabulary: the committed token is distributed as p, however
    different q is; a known slot is kept and the next slot is drawn from p."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    n_rows = 200_000
    generator = torch.Generator().manual_seed(0)
    drafted = torch.multinomial(q, n_rows, replacement=True, generator=generator)[:, None]  # [rows, 1]
    target_probs = p.expand(n_rows, 2, -1)
    draft_probs = q.expand(n_rows, 1, -1)
    no_known = torch.zeros(n_rows, 1, dtype=torch.bool)
    accepted, next_token = accept_reject(target_probs, draft_probs, drafted, no_known,
                                         torch.rand(n_rows, 2, generator=generator))
    committed = torch.where(accepted == 1, drafted[:, 0], next_token)
    assert chi_square_p_value(torch.bincount(committed, minlength=5).double(), p.double()) > 0.01
    expected_acceptance = torch.minimum(p, q).sum()  # 1 - total variation distance
    assert abs(accepted.float().mean() - expected_acceptance) < 0.01
    accepted, next_token = accept_reject(target_probs, draft_probs, drafted, ~no_known,
                                         torch.rand(n_rows, 2, generator=generator))
    assert (accepted == 1).all()
    assert chi_square_p_value(torch.bincount(next_token, minlength=5).double(), p.double()) > 0.01


def random_conditionals(n_tokens: int, length: int, seed: int) -> dict[tuple, Tensor]:
    """A language model as a table: every prefix of up to `length` tokens -> its next token's
    distribution [V] (float64), uniforms cubed and normalised (some tokens far likelier than others)."""
    generator = torch.Generator().manual_seed(seed)
    table = {}
    for size in range(length + 1):
        for prefix in itertools.product(range(n_tokens), repeat=size):
            weights = torch.rand(n_tokens, generator=generator, dtype=torch.float64) ** 3
            table[prefix] = weights / weights.sum()
    return table


def block_rule_outcome(target: dict, draft: dict, n_tokens: int, gamma: int, known: int, first_failure: bool = False
                       ) -> tuple[Tensor, float]:
    """The exact distribution of gamma + 1 tokens that block_acceptance's probabilities give when the
    first `known` tokens are committed (the all-zero prefix) and the others drafted from `draft`:
    every draft block enumerated, each number of kept tokens t weighed by h_t times (1 - h_j) for
    every longer prefix j (uniforms are independent), the next token drawn from the weights, the
    rest sampled from `target`. Returns (probability of each sequence [V^(gamma+1)] in
    itertools.product order, expected tokens kept of the drafted ones). first_failure: keep the
    prefix before the first failing test instead (a wrong rule, to show the enumeration can tell)."""
    sequences = list(itertools.product(range(n_tokens), repeat=gamma + 1))
    index = {sequence: number for number, sequence in enumerate(sequences)}
    outcome = torch.zeros(len(sequences), dtype=torch.float64)
    expected_kept = 0.0
    for drafted in itertools.product(range(n_tokens), repeat=gamma - known):
        block = (0,) * known + drafted
        chance = float(torch.prod(torch.tensor([draft[block[:i]][block[i]] for i in range(known, gamma)],
                                               dtype=torch.float64)))
        target_probs = torch.stack([target[block[:i]] for i in range(gamma + 1)])[None]  # [1, W, V]
        draft_probs = torch.stack([draft[block[:i]] for i in range(gamma)])[None]  # [1, W-1, V]
        is_known = (torch.arange(gamma) < known)[None]
        passes, next_weights = block_acceptance(target_probs, draft_probs, torch.tensor([block]), is_known)
        passes = passes[0].tolist()
        for kept in range(gamma + 1):
            if first_failure:
                weight = math.prod(passes[:kept]) * (1 - passes[kept] if kept < gamma else 1)
            else:
                weight = (passes[kept - 1] if kept else 1) * math.prod(1 - h for h in passes[kept:])
            expected_kept += chance * weight * (kept - known)
            nexts = next_weights[0, kept] / next_weights[0, kept].sum()
            for token in range(n_tokens):
                start = block[:kept] + (token,)
                for rest in itertools.product(range(n_tokens), repeat=gamma - kept):
                    sequence = start + rest
                    tail = math.prod(float(target[sequence[:i]][sequence[i]]) for i in range(kept + 1, gamma + 1))
                    outcome[index[sequence]] += chance * weight * float(nexts[token]) * tail
    return outcome, expected_kept


@pytest.mark.parametrize("known", [0, 1])
def test_block_rule_keeps_the_target_distribution(known):
    """Block verification, enumerated (block_rule_outcome, 3 tokens, gamma 3, distributions that
    depend on the whole prefix): the sequences come out as the target's joint distribution given
    the known token, to rounding; it keeps more draft tokens than the token rule (each prefix's
    product of min(1, p/q)); and keeping the prefix before the first failed test instead is wrong."""
    n_tokens, gamma = 3, 3
    target, draft = (random_conditionals(n_tokens, gamma + 1, seed) for seed in (0, 1))
    outcome, expected_kept = block_rule_outcome(target, draft, n_tokens, gamma, known)
    sequences = list(itertools.product(range(n_tokens), repeat=gamma + 1))
    joint = torch.tensor([math.prod(float(target[s[:i]][s[i]]) for i in range(known, gamma + 1))
                          if s[:known] == (0,) * known else 0.0 for s in sequences], dtype=torch.float64)
    assert torch.allclose(outcome, joint, atol=1e-12)
    token_kept = 0.0
    for drafted in itertools.product(range(n_tokens), repeat=gamma - known):
        block = (0,) * known + drafted
        chance = math.prod(float(draft[block[:i]][block[i]]) for i in range(known, gamma))
        ratios = [min(1.0, float(target[block[:i]][block[i]] / draft[block[:i]][block[i]]))
                  for i in range(known, gamma)]
        token_kept += chance * sum(math.prod(ratios[:n]) for n in range(1, len(ratios) + 1))
    assert expected_kept > token_kept + 1e-3  # strictly more here (never fewer: Sun et al.)
    wrong, _ = block_rule_outcome(target, draft, n_tokens, gamma, known, first_failure=True)
    assert (wrong - joint).abs().max() > 1e-3


def test_block_rule_past_float32s_range():
    """A proposal the target cannot make, then one the draft gave 1e-44 (p / q overflows to inf):
    nothing is kept, the next token comes from the residual, nothing is NaN."""
    target_probs = torch.tensor([[[0.0, 0.5, 0.5], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    draft_probs = torch.tensor([[[1.0, 0.0, 0.0], [1e-44, 0.0, 1.0]]])
    drafted, no_known = torch.tensor([[0, 0]]), torch.zeros(1, 2, dtype=torch.bool)
    passes, next_weights = block_acceptance(target_probs, draft_probs, drafted, no_known)
    assert torch.isfinite(passes).all() and torch.isfinite(next_weights).all()
    for uniform in (0.0, 0.5, 0.99):
        kept, token = block_accept_reject(target_probs, draft_probs, drafted, no_known, torch.full((1, 3), uniform))
        assert int(kept) == 0 and int(token) in (1, 2)  # max(0, p - q) after nothing: tokens 1 and 2


def test_bad_settings_are_one_line():
    from attnlab.bench.speculative import SpeculativeBench
    from attnlab.errors import AttnlabError

    with pytest.raises(AttnlabError, match="^--verification typical: choose from block, token$"):
        SpeculativeBench(target="T", draft="D", verification="typical")  # refused before loading anything
    with pytest.raises(AttnlabError, match="^--prefill-chunk prefills by the compiled step: add --compile$"):
        SpeculativeBench(target="T", draft="D", prefill_chunk=64)
    target, draft = model(depth=1), model(seed=1, depth=1)
    prompt = torch.tensor([[1, 2, 3]])
    for settings, message in ((dict(verification="typical"), "verification must be one of block, token, got "
                                                               "'typical'"),
                              (dict(gamma=0), "gamma must be >= 1")):
        with pytest.raises(ValueError) as error:
            speculative_generate(target, draft, prompt, 4, **settings)
        assert str(error.value) == message
    with pytest.raises(ValueError, match="the prompt needs at least one token"):
        speculative_generate(target, draft, prompt[:, :0], 4)


def test_block_rule_draws_what_its_probabilities_say():
    """block_accept_reject's draws against block_acceptance's probabilities, 200,000 rows of one
    window (gamma 2, 4 tokens): the number kept and the next token after none kept, by chi-square;
    greedy one-hot distributions keep exactly the draft's leading agreement with the target."""
    generator = torch.Generator().manual_seed(0)
    n_rows = 200_000
    target_probs = torch.softmax(torch.randn(1, 3, 4, generator=generator) * 2, dim=-1).expand(n_rows, -1, -1)
    draft_probs = torch.softmax(torch.randn(1, 2, 4, generator=generator) * 2, dim=-1).expand(n_rows, -1, -1)
    drafted = torch.tensor([[2, 1]]).expand(n_rows, -1)
    no_known = torch.zeros(n_rows, 2, dtype=torch.bool)
    kept, next_token = block_accept_reject(target_probs, draft_probs, drafted, no_known,
                                           torch.rand(n_rows, 3, generator=generator))
    passes, next_weights = block_acceptance(target_probs[:1].double(), draft_probs[:1].double(), drafted[:1],
                                            no_known[:1])
    h_1, h_2 = passes[0].tolist()
    expected_kept = torch.tensor([(1 - h_1) * (1 - h_2), h_1 * (1 - h_2), h_2], dtype=torch.float64)
    assert chi_square_p_value(torch.bincount(kept, minlength=3).double(), expected_kept) > 0.01
    after_none = next_token[kept == 0]
    assert chi_square_p_value(torch.bincount(after_none, minlength=4).double(),
                              next_weights[0, 0] / next_weights[0, 0].sum()) > 0.01
    one_hot = torch.nn.functional.one_hot
    target_greedy = one_hot(torch.tensor([[2, 3, 0]]), 4).float()  # the target's argmax at each slot
    for drafted, expected in (([2, 1], 1), ([2, 3], 2), ([1, 3], 0)):
        draft_greedy = one_hot(torch.tensor([drafted]), 4).float()  # the draft's argmax: its tokens
        kept, next_token = block_accept_reject(target_greedy, draft_greedy, torch.tensor([drafted]),
                                               no_known[:1], torch.rand(1, 3, generator=generator))
        assert int(kept) == expected and int(next_token) == [2, 3, 0][expected]


# --------------------------------------------------------------------------------------------
# The command: training a pair on the same batches, and decoding


TINY = [
    "model.dim=32", "model.heads=2", "model.dim_head=16", "model.max_seq_len=64", "data.source=file",
    "train.seq_len=32", "train.batch_size=4", "train.max_steps=4", "train.eval_every=0", "train.eval_batches=1",
    "train.save_every=4", "log.progress=false",
]


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory):
    """A 2-layer target and a 1-layer draft trained by `attnlab speculative train`, with the
    batches each of them drew."""
    from attnlab.cli.main import main
    from attnlab.data.sampler import RandomWindowSampler

    root = tmp_path_factory.mktemp("speculative")
    corpus = root / "corpus.txt"
    corpus.write_bytes((Path(speculative.__file__).read_bytes()) * 4)
    seen: list[Tensor] = []
    original = RandomWindowSampler.next_batch

    def recording(self, data):
        batch = original(self, data)
        seen.append(getattr(batch, "tokens", batch).clone())  # a Batch (tokens, loss_mask) or a tensor
        return batch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RandomWindowSampler, "next_batch", recording)
        code = main([
            "speculative", "train", "--target-preset", "spec-small-target", "--draft-preset", "spec-small-draft",
            *TINY, f"data.path={corpus}", f"out_dir={root}", "target.name=target", "draft.name=draft",
            "target.model.depth=2", "draft.train.lr=3e-3",
        ])
        assert code == 0
        target_batches, draft_batches = seen[:4], seen[4:8]
        assert len(seen) == 8
        seen.clear()
        # a draft for the existing target: the target's batches again, whatever the draft preset says
        code = main([
            "speculative", "train", "--target", str(root / "target"), "--draft-preset", "spec-small-draft",
            *TINY, "train.seq_len=16", "train.batch_size=2", "train.seed=5", f"data.path={corpus}",
            f"out_dir={root}", "draft.name=draft2",
        ])
        assert code == 0
        later_batches = seen[:4]
        seen.clear()
        # a longer draft for the existing target: the target's batches, then the ones after them
        code = main([
            "speculative", "train", "--target", str(root / "target"), "--draft-preset", "spec-small-draft",
            "--draft-steps", "6", *TINY, f"data.path={corpus}", f"out_dir={root}", "draft.name=draft3",
        ])
        assert code == 0
        longer_batches = seen[:]
    return root, target_batches, draft_batches, later_batches, longer_batches


def test_pair_trained_on_the_same_batches(trained_pair):
    root, target_batches, draft_batches, later_batches, _ = trained_pair
    for target_batch, draft_batch, later_batch in zip(target_batches, draft_batches, later_batches, strict=True):
        assert torch.equal(target_batch, draft_batch) and torch.equal(target_batch, later_batch)
    assert len({tuple(batch.flatten().tolist()) for batch in target_batches}) == 4  # not one batch repeated
    from attnlab.train.checkpoint import load_model

    assert len(load_model(root / "target").blocks) == 2 and len(load_model(root / "draft").blocks) == 1
    assert len(load_model(root / "draft2").blocks) == 1


def test_a_draft_can_train_longer_than_its_target(trained_pair):
    """--draft-steps: the target's batches in order, then the ones the same stream gives next."""
    from attnlab.train.checkpoint import load_model

    root, target_batches, _, _, longer_batches = trained_pair
    assert len(longer_batches) == 6
    for target_batch, draft_batch in zip(target_batches, longer_batches[:4], strict=True):
        assert torch.equal(target_batch, draft_batch)
    assert all(not torch.equal(extra, seen) for extra in longer_batches[4:] for seen in target_batches)
    assert load_model(root / "draft3").run_config.train.max_steps == 6


def test_draft_steps_need_an_existing_target(tmp_path, capsys):
    from attnlab.cli.main import main

    code = main(["speculative", "train", "--target-preset", "spec-small-target", "--draft-preset",
                 "spec-small-draft", "--draft-steps", "6", f"out_dir={tmp_path}"])
    assert code == 2 and "needs an existing target (--target RUN)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything trained


@pytest.mark.parametrize("stop_step", [2, 4])
def test_a_stopped_target_stops_the_pair(tmp_path, monkeypatch, capsys, stop_step):
    """A stop signal while the target trains (a scheduler's SIGTERM), before or during its last
    step, saves the target and ends the command with the requeue status: the draft neither trains
    on nor distils from an unfinished target, nor starts after the command was asked to stop.
    --resume then finishes the target and trains the draft."""
    import os
    import signal

    from attnlab.cli.main import main
    from attnlab.train import loop
    from attnlab.train.checkpoint import list_checkpoints

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(Path(speculative.__file__).read_bytes() * 4)
    real = loop.record_metrics

    def record(run, result, elapsed):  # the signal arrives while the target's step is recorded
        real(run, result, elapsed)
        if run.config.name == "target" and run.step == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loop, "record_metrics", record)
    command = ["speculative", "train", "--target-preset", "spec-small-target", "--draft-preset", "spec-small-draft",
               "--distill", "0.5", *TINY, "train.log_every=1", f"data.path={corpus}", f"out_dir={tmp_path}",
               "target.name=target", "draft.name=draft", "target.model.depth=2"]
    assert main(command) == 75
    printed = capsys.readouterr().out
    assert f"stopped at step {stop_step} by SIGTERM" in printed and "--resume" in printed
    assert [path.name for path in list_checkpoints(tmp_path / "target")] == [f"step-000000{stop_step}.pt"]
    assert not (tmp_path / "draft").exists()
    monkeypatch.undo()
    assert main([*command, "--resume"]) == 0
    assert [path.name for path in list_checkpoints(tmp_path / "draft")] == ["step-0000004.pt"]


def test_a_stop_during_start_up_is_one_line(tmp_path, monkeypatch, capsys):
    import os
    import signal
    import time

    from attnlab.cli.main import main
    from attnlab.train import loop

    def interrupted(*args):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)

    monkeypatch.setattr(loop, "load_training_corpus", interrupted)
    code = main(["speculative", "train", "--target-preset", "spec-small-target", "--draft-preset", "spec-small-draft",
                 *TINY, f"out_dir={tmp_path}", "target.name=target", "draft.name=draft"])
    assert code == 130
    assert capsys.readouterr().err == "attnlab speculative train: stopped by SIGINT during start-up; nothing to save\n"


@pytest.mark.parametrize("draft_arguments", [["--draft", "draft"], ["--early-exit", "1"]])
def test_speculative_command_reports_both_decodings(trained_pair, draft_arguments, capsys):
    from attnlab.cli.main import main

    root = trained_pair[0]
    if draft_arguments[0] == "--draft":
        draft_arguments = ["--draft", str(root / "draft")]
    capsys.readouterr()
    code = main([
        "speculative", "--target", str(root / "target"), *draft_arguments, "--gamma", "3", "--prompt", "def ",
        "--max-new-tokens", "12", "--batch-size", "2", "--temperature", "0", "--repeats", "3", "--json",
    ])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["base"]["ms_all"]) == len(report["speculative"]["ms_all"]) == 3
    assert report["base"]["text"] == report["speculative"]["text"]  # greedy: token for token
    assert report["speedup"] > 0 and 0 <= report["speculative"]["mean_accepted"] <= 3
    times = zip(report["base"]["ms_all"], report["speculative"]["ms_all"], strict=True)
    paired = [base / speculative for base, speculative in times]
    assert report["speedup_paired_median"] == pytest.approx(sorted(paired)[len(paired) // 2])
    assert report["speculative"]["batch_scheme"] == "per-row"  # full attention: auto rolls back per row
    assert report["products"] == {"target": "F.linear", "draft": "F.linear"}  # models far below 8 MB
    assert report["compiled_entries"] == {"target": [], "draft": []} and report["cudagraph_skips"] is None
    assert report["attention_backend"] == {"target": "auto", "draft": "auto"}  # the runs' own
    code = main([
        "speculative", "--target", str(root / "target"), *draft_arguments, "--gamma", "3", "--prompt", "def ",
        "--max-new-tokens", "12", "--batch-size", "2", "--temperature", "0", "--batch-scheme", "shared", "--json",
        "--verification", "token",
    ])
    assert code == 0
    shared = json.loads(capsys.readouterr().out)
    assert (report["verification"], shared["verification"]) == ("block", "token")
    assert shared["speculative"]["batch_scheme"] == "shared"
    assert shared["speculative"]["text"] == report["base"]["text"]
    code = main([
        "speculative", "--target", str(root / "target"), *draft_arguments, "--prime-from-val", "--prime-length", "8",
        "--max-new-tokens", "8", "--top-k", "5",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "products: target F.linear, draft F.linear" in printed
    assert "gamma 5 (block verification)" in printed


def test_speculative_command_with_an_int8_draft(trained_pair, capsys):
    from attnlab.cli.main import main
    from attnlab.model import int8_linear_cpu

    root = trained_pair[0]
    arguments = ["speculative", "--target", str(root / "target"), "--gamma", "3", "--prompt", "def ",
                 "--max-new-tokens", "12", "--batch-size", "2", "--temperature", "0", "--draft-quantize", "int8"]
    capsys.readouterr()
    assert main([*arguments, "--draft", str(root / "draft"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft_quantize"] == "int8" and report["draft"].endswith("(int8 weights)")
    # a decoded row's products: attnlab's int8 operator where it is built (float32 activations)
    float32_kernel = "cpu" if int8_linear_cpu.available() else "torch"
    assert report["products"] == {"target": "F.linear", "draft": f"int8 {float32_kernel}"}
    assert report["speculative"]["text"] == report["base"]["text"]  # greedy: token for token
    assert main([*arguments, "--early-exit", "1"]) == 2  # its layers are the target's
    assert "--draft-quantize needs a draft of its own" in capsys.readouterr().err
    assert main([*arguments, "--draft", str(root / "draft"), "--dtype", "bfloat16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # both models in bfloat16, the base decoding too
    # bfloat16 activations: torch's int8 kernel
    assert report["dtype"] == "bfloat16" and report["products"] == {"target": "F.linear", "draft": "int8 torch"}
    assert report["cache_dtype"] == "bfloat16"
    assert main([*arguments, "--draft", str(root / "draft"), "--cache-dtype", "bf16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # float32 weights over bfloat16 caches, the base's too
    assert report["dtype"] == "float32" and report["cache_dtype"] == "bfloat16"
    assert main([*arguments, "--draft", str(root / "draft"), "--attention-backend", "torch", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # both models on the reference attention
    assert report["attention_backend"] == {"target": "torch", "draft": "torch"}
    assert report["speculative"]["text"] == report["base"]["text"]


def test_decoding_past_the_training_length_warns(trained_pair, caplog):
    """The pair was trained on windows of 32 tokens: a decoding that reaches further is flagged for
    each model, one that stays within is not."""
    from attnlab.bench.speculative import warn_beyond_training
    from attnlab.train.checkpoint import load_model

    root = trained_pair[0]
    target, draft = load_model(root / "target"), load_model(root / "draft")
    with caplog.at_level("WARNING", logger="attnlab.bench.speculative"):
        assert not warn_beyond_training(target, "target", 32)
        assert warn_beyond_training(target, "target", 33) and warn_beyond_training(draft, "draft", 40)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2 and "trained on windows of 32 tokens" in messages[0] and "reaches 40" in messages[1]


def test_decoding_restores_every_modules_own_mode():
    """Decoding runs in eval mode and gives each module its own mode back afterwards: a
    submodule kept in eval mode under a root in training mode stays so, and a call that raises
    changes nothing."""
    target, draft = model("full", depth=2), model("full", seed=1, depth=1)
    target.train()
    target.blocks[1].eval()  # e.g. a frozen block
    before = {name: module.training for name, module in target.named_modules()}
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(0))
    generate(target, prompt, 4)
    assert {name: module.training for name, module in target.named_modules()} == before
    speculative_generate(target, draft, prompt, 4, gamma=2)
    assert {name: module.training for name, module in target.named_modules()} == before
    assert not draft.training  # it came in eval mode

    def failing(*args, **kwargs):
        raise RuntimeError("a forward that fails")

    draft.forward = failing
    with pytest.raises(RuntimeError, match="a forward that fails"):
        speculative_generate(target, draft, prompt, 4, gamma=2)
    assert {name: module.training for name, module in target.named_modules()} == before


@pytest.mark.parametrize("batch, new_tokens, refused", [(1, 18, False), (2, 14, False), (2, 15, True)])
def test_speculative_bench_checks_positions_as_speculative_generate_does(tmp_path, capsys, batch, new_tokens,
                                                                          refused):
    """`attnlab speculative` checked a learned-position model with a sum of its own (prompt, new
    tokens and gamma): at batch 1 it refused a decoding speculative_generate takes (gamma - 1 past
    the goal: 4 + 18 + 2 = 24 positions), in a batch it measured one speculative_generate then
    refused (2 gamma past the goal). Both now ask check_request, before any measurement."""
    from attnlab.cli.main import main
    from attnlab.config import DataConfig, RunConfig, TrainConfig, config_to_dict
    from attnlab.train.checkpoint import checkpoint_path, save_checkpoint

    def write_run(name: str, config) -> Path:
        torch.manual_seed(0)
        run = RunConfig(name=name, out_dir=str(tmp_path), model=config, data=DataConfig(),
                        train=TrainConfig(seq_len=16, sample_every=0))
        save_checkpoint(checkpoint_path(tmp_path / name, 1), {"config": config_to_dict(run),
                                                             "model": Transformer(config).state_dict(), "step": 1})
        return tmp_path / name

    target = write_run("target", variant_config("full-learned-positions", depth=1, num_tokens=256, max_seq_len=24))
    draft = write_run("draft", variant_config("full", depth=1, num_tokens=256))
    code = main(["speculative", "--target", str(target), "--draft", str(draft), "--gamma", "3", "--prompt", "def ",
                 "--batch-size", str(batch), "--max-new-tokens", str(new_tokens), "--json"])
    output = capsys.readouterr()
    if refused:
        assert code == 2 and "the prompt, the new tokens and the 6 positions the target decodes past them" in output.err
    else:
        assert code == 0, output.err
        assert json.loads(output.out)["max_new_tokens"] == new_tokens
