"""Compiled sampling: the draws inside compiled graphs (generate's forward and draw in one call,
Transformer.draw's n draft tokens in one call, draw_then_decode's drafts and verification in one
call) give what a forward per token and its draw give; speculative decoding with both models
compiled stays exact (the chi-square and greedy tests of tests/test_speculative.py, on compiled
models). The compiled-decoding tests of the steps themselves are tests/test_compiled_decoding.py."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab.generate.distribution import probabilities, token_at
from attnlab.generate.sampling import SamplingConfig, generate, sample_from, stream
from attnlab.generate.speculative import speculative_generate
from attnlab.model import Transformer
from test_compiled_decoding import assert_compiles_again_after_each_change, counting_compiles, twins
from variants import variant_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("batch, n_samples", [(1, 600), (4, 1200)])
def test_compiled_speculative_sampling_follows_the_target(batch, n_samples):
    """Chi-square: speculative decoding with both models compiled samples the target's distribution
    (per-row rollback, auto's at each batch size: each step's commit inside the compiled step)."""
    from test_speculative import chi_square_p_value, exact_distribution, sampled_counts, tiny

    torch._dynamo.reset()
    target, draft = tiny("full", seed=0, depth=2), tiny("local", seed=1, depth=1)
    _, expected = exact_distribution(target, SamplingConfig())
    assert target.compile_decoding(backend="aot_eager") and draft.compile_decoding(backend="aot_eager")
    counts = sampled_counts(target, draft, batch, n_samples, SamplingConfig(), seed=batch, per_row=None)
    assert chi_square_p_value(counts, expected) > 0.01


def test_speculative_and_generate_on_compiled_models():
    """Greedy speculative decoding with both models compiled equals the target's greedy decoding,
    per-row and shared rollback, at batch 4 (the sampled distribution is the eager one's: the steps
    are). Compiled speculative decoding at batch 1: test_compiled_speculative_sampling_follows_the_target."""
    target, compiled_target = twins("nsa")
    draft, compiled_draft = twins("local")
    prompt = torch.randint(0, 61, (4, 9), generator=torch.Generator().manual_seed(4))
    greedy = SamplingConfig(temperature=0.0)
    expected = generate(target, prompt, 24, greedy)
    assert torch.equal(generate(compiled_target, prompt, 24, greedy), expected)
    for per_row in (True, False):
        result = speculative_generate(compiled_target, compiled_draft, prompt, 24, gamma=4, sampling=greedy,
                                      per_row=per_row)
        assert torch.equal(result.tokens, expected), per_row


def test_compiled_generate_draws_the_tokens_sample_from_draws():
    """A compiled model's generate() draws each token inside its step (draw_last, at a uniform
    drawn before the call): seeded, its tokens and the logits it yields are those of a forward
    then sample_from, token by token."""
    eager, compiled = twins("full", depth=2)
    prompt = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(6))
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    generator = torch.Generator().manual_seed(3)
    tokens, logits = [], []
    with torch.no_grad():
        cache = eager.new_cache(2, 7 + 16)
        next_input = prompt
        for _ in range(16):
            logits.append(eager(next_input, cache=cache).logits[:, -1])  # [B, V]
            tokens.append(sample_from(probabilities(logits[-1], sampling), generator))  # [B]
            next_input = tokens[-1][:, None]
    streamed = list(stream(compiled, prompt, 16, sampling, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(torch.stack([token for token, _ in streamed], dim=1), torch.stack(tokens, dim=1))
    torch.testing.assert_close(torch.stack([step for _, step in streamed]), torch.stack(logits), atol=1e-5,
                               rtol=1e-5)
    assert compiled._compiled_decode_then is not None


def test_generations_of_other_lengths_reuse_the_compiled_step():
    """generate() after compile_decoding() makes its cache a power of two long (decode_capacity):
    generations whose prompt and new tokens round alike compile nothing after the first, and each
    draws what the eager model draws from the same seed."""
    eager, compiled = twins("full", depth=2)
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    graphs = None
    for prompt_length, n_new in ((7, 16), (9, 20), (30, 33)):  # 23, 29 and 63 tokens: caches of 64
        prompt = torch.randint(0, 61, (2, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
        drawn = [generate(model, prompt, n_new, sampling, generator=torch.Generator().manual_seed(n_new))
                 for model in (eager, compiled)]
        assert torch.equal(drawn[1], drawn[0])
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a generation of another length compiled a step"
    assert compiled._compiled_decode_then is not None


def test_speculative_calls_of_other_lengths_reuse_the_compiled_step():
    """speculative_generate with both models compiled makes their caches a power of two long: a
    call whose prompt and new tokens round alike compiles nothing after the first (per-row
    rollback, batch 2), and greedy decoding gives the target's greedy tokens."""
    target, compiled_target = twins("full", depth=2)
    _, compiled_draft = twins("local")
    greedy = SamplingConfig(temperature=0.0)
    graphs = None
    for prompt_length, n_new in ((9, 20), (12, 24)):  # with two windows of 5: 39 and 46 tokens, caches of 64
        prompt = torch.randint(0, 61, (2, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
        result = speculative_generate(compiled_target, compiled_draft, prompt, n_new, gamma=4, sampling=greedy)
        assert torch.equal(result.tokens, generate(target, prompt, n_new, greedy))
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a call of another length compiled a step"
    assert compiled_target._compiled_draw_then_decode is not None


def drawn_one_by_one(model: Transformer, cache, tokens, uniforms, sampling, forced_tokens, forced):
    """Transformer.draw's reference: a forward per token, the draws written out."""
    distributions, drawn = [], []
    logits = model(tokens, cache=cache).logits[:, -1]
    for slot in range(uniforms.shape[1]):
        probs = probabilities(logits, sampling)
        token = torch.where(forced[:, slot], forced_tokens[:, slot], token_at(probs, uniforms[:, slot]))
        distributions.append(probs)
        drawn.append(token)
        if slot < uniforms.shape[1] - 1:
            logits = model(token[:, None], cache=cache).logits[:, -1]
    return torch.stack(distributions, dim=1), torch.stack(drawn, dim=1)


def assert_draws_as_one_by_one(eager, compiled, n_calls: int, seed: int) -> torch.Tensor:
    """compiled.draw against drawn_one_by_one(eager, ...) for n_calls calls after a 12-token prompt
    (2 rows; catch-up chunks of 1 and 2 tokens, forced slots, top-k sampling): the same
    distributions, tokens and cache lengths, and nothing compiled after the fourth call. Returns
    the prompt."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 61, (2, 12), generator=generator)
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    caches = [model.new_cache(2, 200) for model in (eager, compiled)]
    for model, cache in zip((eager, compiled), caches):
        model(prompt, cache=cache)
    graphs = None
    for call in range(n_calls):
        uniforms = torch.rand(2, 3, generator=generator)
        forced = torch.rand(2, 3, generator=generator) < 0.3
        forced_tokens = torch.randint(0, 61, (2, 3), generator=generator)
        chunk = torch.randint(0, 61, (2, 1 + call % 2), generator=generator)  # catch-up chunks of 1 and 2
        expected = drawn_one_by_one(eager, caches[0], chunk, uniforms, sampling, forced_tokens, forced)
        probs, tokens = compiled.draw(chunk, caches[1], uniforms, sampling, forced_tokens, forced)
        torch.testing.assert_close(probs, expected[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(tokens, expected[1])
        assert caches[1].length == caches[0].length and torch.equal(caches[1].lengths, caches[0].lengths)
        if call == 3:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    return prompt


@pytest.mark.parametrize("name", ["full", "nsa"])
def test_compiled_draw_equals_a_forward_per_token(name):
    """Transformer.draw (n tokens drawn in one compiled call, the draws inside the graph) gives the
    distributions and tokens of a forward per token, forced slots included, leaves the cache as
    long as they would, and compiles nothing after its first calls."""
    eager, compiled = twins(name)
    assert_draws_as_one_by_one(eager, compiled, n_calls=12, seed=3)
    assert compiled._compiled_draw is not None


def test_a_packed_draw_keeps_one_copy_of_each_packed_weight(monkeypatch):
    """A draw of n tokens runs the forward n times in one graph; compiled with the packed kernels
    (inductor on the CPU) it holds one packed copy of each weight, not one per forward: no two
    constants of a graph as compiled have equal contents (constants_shared_by_contents found the
    twins), and it draws the eager model's distributions and tokens. Inductor's own naming of
    constants is back in place afterwards."""
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering

    import attnlab.model.decode_compile as decode_compile

    compiled_constants = []  # each graph's constants, as compiled
    compile_to_module = GraphLowering.compile_to_module
    monkeypatch.setattr(GraphLowering, "compile_to_module", lambda graph: compiled_constants.append(
        dict(graph.constants)) or compile_to_module(graph))
    naming = GraphLowering.allocate_non_dup_const_name
    twins_found = []
    constant_twin = decode_compile.constant_twin
    monkeypatch.setattr(decode_compile, "constant_twin",
                        lambda *arguments: twins_found.append(constant_twin(*arguments)) or twins_found[-1])
    eager, compiled = twins("full", backend="inductor")
    assert compiled._frozen_weights is not None  # the packed kernels
    generator = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 61, (2, 12), generator=generator)
    chunk = torch.randint(0, 61, (2, 1), generator=generator)
    uniforms, forced = torch.rand(2, 2, generator=generator), torch.zeros(2, 2, dtype=torch.bool)  # 2 forwards
    no_tokens, sampling = torch.zeros(2, 2, dtype=torch.long), SamplingConfig(temperature=0.9)
    caches = [model.new_cache(2, 32) for model in (eager, compiled)]
    for model, cache in zip((eager, compiled), caches):
        model(prompt, cache=cache)
    expected = drawn_one_by_one(eager, caches[0], chunk, uniforms, sampling, no_tokens, forced)
    with inductor_config.patch(fx_graph_cache=False):  # lowered here, not read from a cache
        probs, tokens = compiled.draw(chunk, caches[1], uniforms, sampling, no_tokens, forced)
    torch.testing.assert_close(probs, expected[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(tokens, expected[1])
    assert any(name is not None for name in twins_found)
    assert compiled_constants
    for constants in compiled_constants:
        contents = [data for data in constants.values() if data.layout == torch.strided]
        for index, first in enumerate(contents):
            assert not any(first.shape == second.shape and first.dtype == second.dtype and torch.equal(first, second)
                           for second in contents[index + 1 :])
    assert GraphLowering.allocate_non_dup_const_name is naming


def test_early_exit_draft_draws_through_the_compiled_graph(monkeypatch):
    """An early-exit draft (the target's first layers) of a compiled target proposes in one call of
    the target's compiled draw (n_layers in its graph): the distributions and tokens of the eager
    early exit, forced slots included, nothing compiled after its first calls; and seeded
    speculative decoding with it, a step one call of the target's draw_then_decode, draws the eager
    pair's tokens, both batch schemes."""
    from attnlab.generate.speculative import EarlyExitDraft

    eager, compiled = twins("full", depth=3)
    drafts = [EarlyExitDraft(model, 2) for model in (eager, compiled)]
    calls = []
    run_compiled = Transformer._run_compiled
    monkeypatch.setattr(Transformer, "_run_compiled", lambda self, name, *rest: calls.append(name) or
                        run_compiled(self, name, *rest))
    prompt = assert_draws_as_one_by_one(*drafts, n_calls=8, seed=5)
    assert calls == ["_compiled_draw"] * 8
    for per_row in (True, False):
        runs = [speculative_generate(model, draft, prompt, 16, gamma=3, per_row=per_row,
                                     generator=torch.Generator().manual_seed(9))
                for model, draft in zip((eager, compiled), drafts)]
        assert torch.equal(runs[0].tokens, runs[1].tokens) and runs[0].n_accepted == runs[1].n_accepted, per_row
    assert set(calls[8:]) == {"_compiled_draw_then_decode"}  # a step: the draws and the verification in one call


@pytest.mark.parametrize("cuda_graph_bookkeeping", [False, True])
def test_compiled_speculative_sampling_equals_eager(cuda_graph_bookkeeping):
    """At temperature 1 with one generator seed, speculative decoding on compiled models draws the
    tokens the eager models draw (the same uniforms, in the same order), both batch schemes; also
    with what a CUDA step adds, exercised on the CPU (fixed cache addresses, step marks, the
    outputs of draw and decode_then copied out of the graph's memory)."""
    target, compiled_target = twins("full", depth=2)
    draft, compiled_draft = twins("local")
    compiled_target._cuda_graphs = compiled_draft._cuda_graphs = cuda_graph_bookkeeping
    prompt = torch.randint(0, 61, (3, 9), generator=torch.Generator().manual_seed(5))
    for per_row in (True, False):
        runs = [speculative_generate(pair[0], pair[1], prompt, 20, gamma=3, per_row=per_row,
                                     generator=torch.Generator().manual_seed(7))
                for pair in ((target, draft), (compiled_target, compiled_draft))]
        assert torch.equal(runs[0].tokens, runs[1].tokens), per_row
        assert runs[0].n_accepted == runs[1].n_accepted


def test_compiled_decode_then_equals_the_forward_then_the_function():
    """Transformer.decode_then (a forward and a function of its logits in one compiled graph: the
    speculative verification) gives the eager forward's result, advances the cache as a forward
    does, and compiles nothing after its first calls."""
    from attnlab.generate.speculative import block_verification

    eager, compiled = twins("full")
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 61, (2, 10), generator=generator)
    caches = [model.new_cache(2, 200) for model in (eager, compiled)]
    for model, cache in zip((eager, compiled), caches):
        model(prompt, cache=cache)
    graphs = None
    for step in range(8):
        window = torch.randint(0, 61, (2, 4), generator=generator)
        draft_probs = torch.softmax(torch.randn(2, 3, 61, generator=generator), dim=-1)
        known = torch.zeros(2, 3, dtype=torch.bool)
        arguments = (draft_probs, window[:, 1:], SamplingConfig(), known, torch.rand(2, 4, generator=generator))
        expected = block_verification(eager(window, cache=caches[0]).logits, *arguments)
        result = compiled.decode_then(block_verification, window, caches[1], *arguments)
        assert all(torch.equal(got, wanted) for got, wanted in zip(result, expected))
        assert torch.equal(caches[1].lengths, caches[0].lengths) and caches[1].length == caches[0].length
        for cache in caches:  # roll back as speculative decoding does
            cache.truncate_rows(cache.lengths - 1 - step % 3)
        if step == 2:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs and compiled._compiled_decode_then is not None


def test_draw_then_decode_is_one_compiled_call_of_the_draws_and_the_forward(monkeypatch):
    """Transformer.draw_then_decode with both models compiled (a draft's proposals, the target's
    forward over them and the verification: speculative decoding's step in one graph) gives the
    proposals, acceptances and tokens of the draft's eager draws, then the eager forward and the
    verification; leaves both caches as long as they would; catch-up chunks of 1 and 2 tokens,
    forced slots; one compiled call a step, and nothing compiled after its first calls."""
    from attnlab.generate.speculative import block_verification

    eager_target, target = twins("full")
    eager_draft, draft = twins("local")
    torch.manual_seed(1)
    for model in (eager_draft, draft):  # a draft unlike the target, so that some proposals are rejected
        model.head.weight.data.copy_(torch.randn(model.head.weight.shape, generator=torch.Generator().manual_seed(2)))
    calls = []
    run_compiled = Transformer._run_compiled
    monkeypatch.setattr(Transformer, "_run_compiled", lambda self, name, *rest: calls.append(name) or
                        run_compiled(self, name, *rest))
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 61, (2, 12), generator=generator)
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    caches = [(model.new_cache(2, 200), other.new_cache(2, 200))
              for model, other in ((eager_draft, eager_target), (draft, target))]
    for (draft_cache, target_cache), (model, other) in zip(caches, ((eager_draft, eager_target), (draft, target))):
        model(prompt, cache=draft_cache)
        other(prompt, cache=target_cache)
    graphs = None
    for call in range(8):
        uniforms, verify_uniforms = torch.rand(2, 3, generator=generator), torch.rand(2, 4, generator=generator)
        forced = torch.rand(2, 3, generator=generator) < 0.3
        forced_tokens = torch.randint(0, 61, (2, 3), generator=generator)
        chunk = torch.randint(0, 61, (2, 1 + call % 2), generator=generator)  # catch-up chunks of 1 and 2
        draft_cache, target_cache = caches[0]
        probs, expected_drafted = eager_draft.draw(chunk, draft_cache, uniforms, sampling, forced_tokens, forced)
        window = torch.cat((chunk[:, -1:], expected_drafted), dim=1)
        expected = block_verification(eager_target(window, cache=target_cache).logits, probs, expected_drafted,
                                      sampling, forced, verify_uniforms)
        drafted, *result = target.draw_then_decode(draft, chunk, *caches[1], uniforms, sampling, forced_tokens, forced,
                                                   block_verification, sampling, forced, verify_uniforms)
        assert torch.equal(drafted, expected_drafted)
        assert all(torch.equal(got, wanted) for got, wanted in zip(result, expected))
        for eager_cache, compiled_cache in zip(caches[0], caches[1]):
            assert compiled_cache.length == eager_cache.length
            assert torch.equal(compiled_cache.lengths, eager_cache.lengths)
        for cache_pair in caches:  # roll back as speculative decoding does
            for cache in cache_pair:
                cache.truncate_rows(cache.lengths - 1 - call % 2)
        if call == 3:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    assert calls == ["_compiled_draw_then_decode"] * 8


def test_models_compiled_alike_once_their_settings_resolve_fuse_their_step():
    """A draft compiled with the CPU's default linear kernels named ("cpu" where attnlab's operator is
    built, else "packed") beside a target left at the default makes speculative decoding's step one
    call; a draft with the library's products, two. Nothing compiles: the check reads the settings
    each compile_decoding resolved."""
    from attnlab.model import linear_cpu
    target, draft = (Transformer(variant_config("full", depth=1)).eval() for _ in range(2))
    tokens = torch.randint(0, 61, (1, 8))
    caches = [model.new_cache(1, 32) for model in (draft, target)]
    with torch.no_grad():
        for model, cache in zip((draft, target), caches):
            model(tokens, cache=cache)  # a prefill, eager
    default = "cpu" if linear_cpu.available() else "packed"
    assert target.compile_decoding() and draft.compile_decoding(linear=default)
    assert target._draws_then_decodes_compiled(draft, *caches)
    assert draft.compile_decoding(linear="library")
    assert not target._draws_then_decodes_compiled(draft, *caches)


def test_draw_then_decode_compiles_again_when_the_drafts_weights_change(monkeypatch):
    """The packed graphs of draw_then_decode hold the draft's weights too, with the compiled call
    stood in for by the eager one (so nothing compiles): calls on unchanged weights compile nothing
    again; an in-place write to a draft weight, and quantising the draft, each compile it once again."""
    from attnlab.generate.speculative import block_verification

    torch.manual_seed(0)
    target = Transformer(variant_config("full", max_seq_len=64)).eval()
    draft = Transformer(variant_config("local", max_seq_len=64, depth=1)).eval()
    compiles = counting_compiles(monkeypatch, target, "_compiled_draw_then_decode", target._draw_then_run)
    target.compile_decoding(linear="packed")
    draft.compile_decoding(linear="packed")
    tokens = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(6))
    no_tokens, no_known = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.bool)

    def steps() -> None:
        draft_cache, cache = draft.new_cache(1, 48), target.new_cache(1, 48)
        draft(tokens[:, :8], cache=draft_cache)
        target(tokens[:, :8], cache=cache)
        for position in range(8, 11):
            target.draw_then_decode(draft, tokens[:, position : position + 1], draft_cache, cache, torch.rand(1, 3),
                                    SamplingConfig(), no_tokens, no_known, block_verification, SamplingConfig(),
                                    no_known, torch.rand(1, 4))
            for each in (draft_cache, cache):
                each.truncate(each.length - 3)

    assert_compiles_again_after_each_change(compiles, steps, draft)


def untraceable_argmax(logits: torch.Tensor) -> torch.Tensor:
    import time

    time.perf_counter()  # dynamo cannot put this call in a graph
    return logits.argmax(dim=-1)


def test_an_untraceable_function_leaves_the_other_compiled_entries(caplog):
    """decode_then with a function dynamo cannot trace gives the eager result after one warning;
    the compiled decode step stays compiled."""
    eager, compiled = twins("full")
    assert compiled.compiled_entries() == ["step", "draw", "decode_then", "draw_then_decode"]
    prompt = torch.randint(0, 61, (1, 8), generator=torch.Generator().manual_seed(6))
    caches = [model.new_cache(1, 100) for model in (eager, compiled)]
    for model, cache in zip((eager, compiled), caches):
        model(prompt, cache=cache)
    window = prompt[:, :3]
    expected = eager(window, cache=caches[0]).logits.argmax(dim=-1)
    with caplog.at_level("WARNING", logger="attnlab.model.transformer"):
        assert torch.equal(compiled.decode_then(untraceable_argmax, window, caches[1]), expected)
    assert "decode_then" in caplog.text and compiled.compiled_entries() == ["step", "draw", "draw_then_decode"]
    torch.testing.assert_close(compiled(window[:, :1], cache=caches[1]).logits,
                               eager(window[:, :1], cache=caches[0]).logits, atol=1e-5, rtol=1e-5)
