"""Compiled decoding (Transformer.compile_decoding): for every attention type, the compiled decode
steps give the eager logits over a prefill, one-token steps, multi-token chunks and rollbacks
(level and per row); after warm-up, hundreds of decode steps compile nothing new (the static
caches give every step the same shapes); speculative decoding and generate() run on it.

The per-variant tests compile with the aot_eager back-end (dynamo's tracing, where graph breaks
and recompiles happen, without inductor's code generation); one goes through inductor."""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab.generate.distribution import probabilities, token_at
from attnlab.generate.sampling import SamplingConfig, generate, sample_from, stream
from attnlab.generate.speculative import speculative_generate
from attnlab.model import Transformer
from attnlab.model.transformer import FrozenWeights
from variants import variant_config

pytestmark = pytest.mark.slow
NAMES = ["full", "local", "routing", "sinkhorn", "nsa", "full-cpu-decode", "local-cpu-decode"]


def twins(name: str, backend: str = "aot_eager", **overrides) -> tuple[Transformer, Transformer]:
    """The same model twice, in eval mode: eager, and with compiled decoding."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = variant_config(name, **{"max_seq_len": 512, **overrides})
    eager, compiled = Transformer(config).eval(), Transformer(config).eval()
    compiled.load_state_dict(eager.state_dict())
    assert compiled.compile_decoding(backend=backend)
    return eager, compiled


def decode(model: Transformer, tokens: torch.Tensor, cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Prefill, one-token steps, a 5-token chunk, a rollback of all rows, steps, a per-row rollback,
    a chunk and steps again -> every step's logits, concatenated [B, *, V]."""
    cache = model.new_cache(tokens.shape[0], 300, dtype=cache_dtype)
    logits = [model(tokens[:, :20], cache=cache).logits]
    for position in range(20, 26):
        logits.append(model(tokens[:, position : position + 1], cache=cache).logits)
    logits.append(model(tokens[:, 26:31], cache=cache).logits)
    cache.truncate(24)
    for position in range(24, 27):
        logits.append(model(tokens[:, position : position + 1], cache=cache).logits)
    cache.truncate_rows(torch.tensor([25, 22]))
    logits.append(model(tokens[:, 30:35], cache=cache).logits)
    logits.append(model(tokens[:, 35:36], cache=cache).logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_decoding_equals_eager_and_never_recompiles(name):
    eager, compiled = twins(name)
    tokens = torch.randint(0, 61, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(decode(compiled, tokens), decode(eager, tokens), atol=1e-5, rtol=1e-5)
        cache = compiled.new_cache(2, 300)  # a new cache of the same size: the graphs already made serve it
        compiled(tokens[:, :10], cache=cache)
        compiled(tokens[:, 10:11], cache=cache)
        graphs = counters["stats"]["unique_graphs"]
        for position in range(11, 267):  # 256 decode steps
            compiled(tokens[:, position : position + 1], cache=cache)
    assert counters["stats"]["unique_graphs"] == graphs, "a decode step compiled again"


@pytest.mark.parametrize("name, backend", [("sinkhorn", "aot_eager"), ("nsa", "aot_eager"),
                                           ("full-cpu-decode", "inductor")])
def test_compiled_decoding_over_a_bfloat16_cache_equals_eager(name, backend):
    """A float32 model over a cache storing bfloat16 keys and values (`--cache-dtype bfloat16`):
    the compiled steps give the eager logits over the same cache dtype, as closely as over a float32
    cache (the rounding happens when a key is stored, alike in both). Through inductor, the cpu
    back-end's operator reads the bfloat16 storage beside float32 queries."""
    eager, compiled = twins(name, backend=backend, **({"depth": 1} if backend == "inductor" else {}))
    tokens = torch.randint(0, 61, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        compiled_logits, eager_logits = (decode(model, tokens, torch.bfloat16) for model in (compiled, eager))
    assert compiled_logits.dtype == torch.float32
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5)
    assert compiled._compiled_step is not None, "the compiled step failed and decoding fell back to eager"


@pytest.mark.parametrize("name, backend", [*((name, "aot_eager") for name in NAMES), ("sinkhorn", "inductor"),
                                           ("nsa", "inductor"), ("full-cpu-decode", "inductor")])
def test_compiled_decoding_of_one_row(name, backend):
    """At batch 1 (a size-1 dimension, whose stride any value leaves a tensor contiguous): a
    prefill, verification-sized chunks of 6 and one-token steps, around a rollback, give the eager
    logits, and the compiled step serves them all (none fell back to eager). Sinkhorn's and NSA's
    steps branch (torch.cond), whose two sides must agree in layout: also through inductor, as is
    the cpu back-end's C++ operator (called from inductor's C++ wrapper)."""
    eager, compiled = twins(name, backend=backend, **({"depth": 1} if backend == "inductor" else {}))
    tokens = torch.randint(0, 61, (1, 60), generator=torch.Generator().manual_seed(4))

    def steps(model: Transformer) -> torch.Tensor:
        cache = model.new_cache(1, 64)
        logits = [model(tokens[:, :30], cache=cache).logits]
        for start in (30, 36, 42):  # chunks that complete NSA's compressed blocks, and ones that do not
            logits.append(model(tokens[:, start : start + 6], cache=cache).logits)
            logits.append(model(tokens[:, start + 6 : start + 7], cache=cache).logits)
            cache.truncate(start + 6)
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        torch.testing.assert_close(steps(compiled), steps(eager), atol=1e-5, rtol=1e-5)
    assert compiled._compiled_step is not None, "the compiled step failed and decoding fell back to eager"


@pytest.mark.parametrize("name", ["sinkhorn", "nsa"])
def test_cuda_graph_step_keeps_compiled_equal_to_eager(name, monkeypatch):
    """What a compiled step does on CUDA, exercised on the CPU: the choices torch.cond makes
    elsewhere computed branch-free (sinkhorn's bucket choice, NSA's compression: a CUDA graph holds
    no branch), each cache's tensors marked as fixed addresses, a step mark before each call, the
    logits copied out of the graph's memory. Still the eager logits, over a cache and then a second
    one at other addresses (the marks are unguarded, so the graphs made for the first serve it)."""
    from attnlab.attention import nsa, sinkhorn

    for module in (nsa, sinkhorn):
        monkeypatch.setattr(module, "branch_free", lambda tensor: True)
    eager, compiled = twins(name)
    compiled._cuda_graphs = True
    tokens = torch.randint(0, 61, (2, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(decode(compiled, tokens), decode(eager, tokens), atol=1e-5, rtol=1e-5)
        cache = compiled.new_cache(2, 300)
        compiled(tokens[:, :10], cache=cache)
        compiled(tokens[:, 10:11], cache=cache)
    storage = [cache.lengths, *(tensor for layer in cache.layers for tensor in vars(layer).values()
                                if isinstance(tensor, torch.Tensor))]
    assert cache.pinned and all(getattr(tensor, "_dynamo_static_input_type", None) for tensor in storage)


@pytest.mark.parametrize("name, dtype", [("routing", torch.float32), ("nsa", torch.float32), ("full", torch.bfloat16)])
def test_compiled_decoding_through_inductor(name, dtype):
    """Routing's decode step (top-k over the cluster storage) and NSA's (a torch.cond around the
    compression) in inductor's generated code with the CPU's defaults (the C++ wrapper, the packed
    linear kernels): one-token steps, a level and a per-row rollback (one graph). And a model cast
    to bfloat16 (`--dtype bfloat16`: the packed products with bfloat16 weights, the caches in
    bfloat16), to bfloat16's precision."""
    eager, compiled = twins(name, backend="inductor", depth=1)
    eager.to(dtype)
    compiled.to(dtype)
    tokens = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(2))

    def steps(model: Transformer) -> torch.Tensor:
        cache = model.new_cache(2, 64)
        logits = [model(tokens[:, :20], cache=cache).logits]
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(20, 30)]
        cache.truncate(25)
        cache.truncate_rows(torch.tensor([25, 21]))
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(30, 36)]
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        compiled_logits, eager_logits = steps(compiled), steps(eager)
    assert compiled_logits.dtype == dtype
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(compiled_logits.float(), eager_logits.float(), **tolerance)
    assert compiled._compiled_step is not None, "the compiled step failed and decoding fell back to eager"


def test_each_model_keeps_its_graphs_apart():
    """Dynamo looks through every graph under a code object at each call: each model's step has a
    code object of its own, so a model's one-token step is the only graph its calls look through,
    however many other models compiled theirs."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    models = [twins(name)[1] for name in ("full", "local")]  # twins resets dynamo: made before any step
    models.append(twins("local")[1])
    torch._dynamo.reset()
    tokens = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for model in models:
            cache = model.new_cache(1, 32)
            model(tokens[:, :8], cache=cache)
            for position in range(8, 12):
                model(tokens[:, position : position + 1], cache=cache)
    codes = [model._compiled_step._torchdynamo_orig_callable.__func__.__code__ for model in models]
    assert len(set(map(id, codes))) == len(models)
    assert [len(_debug_get_cache_entry_list(code)) for code in codes] == [1] * len(models)


def test_decode_compile_options():
    """The C++ wrapper and the packed linear kernels: by default for inductor on the CPU without a
    mode; asked for where they cannot be, one error."""
    from attnlab.model.transformer import PACKED_LINEAR_OPTIONS, decode_compile_options

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode_compile_options(cpu, None, "inductor", None) == {"cpp_wrapper": True, **PACKED_LINEAR_OPTIONS}
    assert decode_compile_options(cpu, None, "inductor", False, "library") is None
    assert decode_compile_options(cpu, None, "inductor", False) == PACKED_LINEAR_OPTIONS
    assert decode_compile_options(cuda, "reduce-overhead", "inductor", None) is None
    assert decode_compile_options(cpu, None, "aot_eager", None) is None
    with pytest.raises(ValueError, match="cpp_wrapper is an option of the inductor back-end without a mode"):
        decode_compile_options(cuda, "reduce-overhead", "inductor", True)
    with pytest.raises(ValueError, match="packed linear kernels are inductor's for the CPU, without a mode"):
        decode_compile_options(cuda, None, "inductor", None, "packed")
    with pytest.raises(ValueError, match="linear kernels are one of library, packed; got 'blas'"):
        decode_compile_options(cpu, None, "inductor", None, "blas")


def test_packed_linear_kernels_follow_the_weights():
    """The packed step (the CPU default: the weights frozen into it as constants, packed for
    inductor's GEMM template) gives the eager logits over one-token steps and a verification-sized
    chunk; after the weights change in place, it compiles again and follows them. That the weights
    are constants of the step: with the check skipped, it keeps the old ones."""
    eager, compiled = twins("full", backend="inductor", depth=1)
    assert compiled._frozen_weights is not None
    counters.clear()
    tokens = torch.randint(0, 61, (1, 24), generator=torch.Generator().manual_seed(5))

    def steps(model: Transformer) -> torch.Tensor:
        cache = model.new_cache(1, 32)
        logits = [model(tokens[:, :10], cache=cache).logits]
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(10, 14)]
        logits.append(model(tokens[:, 14:20], cache=cache).logits)
        return torch.cat(logits, dim=1)

    def change_weights() -> None:
        for model in (eager, compiled):
            next(model.blocks[0].feed_forward.parameters()).mul_(1.5)

    with torch.no_grad():
        torch.testing.assert_close(steps(compiled), steps(eager), atol=1e-5, rtol=1e-5)
        assert counters["inductor"]["cpp_templated_kernel_counter"] > 0  # the template made the products,
        assert counters["inductor"]["select_algorithm_autotune"] == 0  # with no timing against ATen's calls
        change_weights()
        torch.testing.assert_close(steps(compiled), steps(eager), atol=1e-5, rtol=1e-5)
        change_weights()
        compiled._frozen_weights = FrozenWeights(compiled)  # skip the check: the step keeps what it froze
        assert not torch.allclose(steps(compiled)[:, 10:], steps(eager)[:, 10:], atol=1e-3)
    assert compiled._compiled_step is not None


def test_six_row_block_makes_a_verification_product_in_one_pass():
    """While a packed step compiles, the template's AVX2 float32 micro-kernels include the six-row
    register block (SIX_ROW_BLOCK): a 6-row product with a frozen weight is made by it and equals
    torch's; afterwards inductor's registry holds exactly what it held before."""
    import torch._inductor.select_algorithm  # noqa: F401 - before cpp_micro_gemm: inductor's own import order
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.cpu_vec_isa import VecAVX2, pick_vec_isa
    from torch._inductor.utils import run_and_get_code

    from attnlab.model.transformer import PACKED_LINEAR_OPTIONS, packed_step_compiling

    if not isinstance(pick_vec_isa(), VecAVX2):
        pytest.skip("the six-row block is an AVX2 micro-kernel; this CPU's vector ISA is another")
    before = list(cpp_micro_gemm.micro_gemm_configs[cpp_micro_gemm.CppMicroGemmFP32Vec])
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer, rows = torch.nn.Linear(64, 48).eval(), torch.randn(6, 64)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, options=PACKED_LINEAR_OPTIONS)
    with torch.no_grad(), packed_step_compiling(), inductor_config.patch(fx_graph_cache=False):
        output, code = run_and_get_code(compiled, rows)
        torch.testing.assert_close(output, layer(rows), atol=1e-5, rtol=1e-5)
    assert re.search(r"_kernel<\s*6,\s*16\b", "\n".join(code)), "the product was not made by the six-row block"
    after = cpp_micro_gemm.micro_gemm_configs[cpp_micro_gemm.CppMicroGemmFP32Vec]
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before))


def test_six_row_block_skipped_where_inductor_keeps_its_kernels_otherwise(monkeypatch, caplog):
    """An inductor without the micro-kernel registry the six-row block extends: the context
    offers nothing, says so in the log, and the packed step compiles as it would without it."""
    import torch._inductor.select_algorithm  # noqa: F401 - before cpp_micro_gemm: inductor's own import order
    from torch._inductor.codegen import cpp_micro_gemm

    from attnlab.model.transformer import six_row_micro_kernels

    monkeypatch.setattr(cpp_micro_gemm, "micro_gemm_configs", {})
    with caplog.at_level("INFO", logger="attnlab.model.transformer"), six_row_micro_kernels():
        assert cpp_micro_gemm.micro_gemm_configs == {}
    assert "compiling without the six-row block" in caplog.text


def test_a_changed_model_is_checked_in_full():
    """After two alike calls the compiled step's code runs without dynamo's guards; quantising the model
    in place, or a cache longer than the rotary tables (which regrows them), changes what the step
    depends on, and the steps after it still give the eager logits."""
    from attnlab.model.quantize import quantize_weights

    eager, compiled = twins("full", max_seq_len=64)
    tokens = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(3))

    def steps(model: Transformer, max_len: int) -> torch.Tensor:
        cache = model.new_cache(2, max_len)
        logits = [model(tokens[:, :10], cache=cache).logits]
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(10, 16)]
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        torch.testing.assert_close(steps(compiled, 32), steps(eager, 32), atol=1e-5, rtol=1e-5)
        assert max(compiled._decode_calls.values()) >= 2 and compiled._direct_calls  # the later steps: direct
        assert quantize_weights(compiled) == quantize_weights(eager) > 0
        torch.testing.assert_close(steps(compiled, 32), steps(eager, 32), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(steps(compiled, 200), steps(eager, 200), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("direct_calls", [True, False, "unavailable"])
def test_direct_calls_run_the_code_dynamo_made_for_each_chunk_length(direct_calls, monkeypatch):
    """Steps of one token and chunks of three, in turn: after two calls of each (counted again after
    a compile: making a graph registers modules, STRUCTURE_CHANGES), each length runs
    the code dynamo made for it directly (its own graph: the entry whose guards pass, among the
    two under the step's code object), without the compiled function's frame evaluation (here it
    raises if called), and every step gives the eager logits. direct_calls=False, or a torch that
    keeps its compiled code where attnlab does not look for it: every call goes through dynamo."""
    eager, compiled = twins("nsa")
    if direct_calls == "unavailable":
        monkeypatch.delattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list")
    compiled.compile_decoding(backend="aot_eager", direct_calls=bool(direct_calls))
    tokens = torch.randint(0, 61, (2, 80), generator=torch.Generator().manual_seed(5))

    def steps(model: Transformer, cache, start: int, rounds: int) -> list[torch.Tensor]:
        logits = []
        for position in range(start, start + 4 * rounds, 4):
            logits.append(model(tokens[:, position : position + 1], cache=cache).logits)
            logits.append(model(tokens[:, position + 1 : position + 4], cache=cache).logits)
        return logits

    def refuse(*arguments):
        raise AssertionError("dynamo's frame evaluation ran")

    with torch.no_grad():
        caches = compiled.new_cache(2, 80), eager.new_cache(2, 80)
        expected = [eager(tokens[:, :10], cache=caches[1]).logits, *steps(eager, caches[1], 10, 12)]
        got = [compiled(tokens[:, :10], cache=caches[0]).logits, *steps(compiled, caches[0], 10, 3)]
        assert len(compiled._direct_calls) == (2 if direct_calls is True else 0)
        if direct_calls is True:
            compiled._compiled_step = refuse
        got += steps(compiled, caches[0], 22, 9)
    torch.testing.assert_close(torch.cat(got, dim=1), torch.cat(expected, dim=1), atol=1e-5, rtol=1e-5)


def test_int8_decoding_compiled_by_inductor_gives_the_eager_logits():
    """An int8 model (a speculative draft) compiled with the CPU defaults: inductor multiplies by its
    frozen int8 weights in a template of its own, with bfloat16 activations as the eager kernel
    has, so the two agree to bfloat16's precision, not to the bit (a draft only proposes: its
    precision moves the acceptance, never the output's distribution)."""
    from attnlab.model.quantize import Int8Linear, quantize_weights

    eager, compiled = twins("full", backend="inductor", max_seq_len=64)
    assert quantize_weights(eager) == quantize_weights(compiled) > 0
    assert all(module.use_kernel for module in compiled.modules() if isinstance(module, Int8Linear))
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(8))

    def steps(model: Transformer) -> torch.Tensor:
        cache = model.new_cache(2, 32)
        logits = [model(tokens[:, :10], cache=cache).logits]
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(10, 16)]
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        torch.testing.assert_close(steps(compiled), steps(eager), atol=2e-2, rtol=2e-2)
    assert compiled._compiled_step is not None and max(compiled._decode_calls.values()) >= 2  # it ran compiled


def test_packed_step_compiles_again_when_its_weights_change(monkeypatch):
    """The bookkeeping of frozen weights, with the compiled step stood in for by the eager one (so
    nothing compiles): steps on unchanged weights compile nothing again; an in-place write to a
    weight, and quantising (other tensors than the frozen ones), each compile it once again."""
    from attnlab.model.quantize import quantize_weights

    torch.manual_seed(0)
    model = Transformer(variant_config("full", max_seq_len=64)).eval()
    compiles = []

    def compile_decoding(**arguments) -> bool:
        compiles.append(arguments)
        Transformer.compile_decoding(model, **arguments)  # lazy: makes the wrapper, compiles nothing
        model._compiled_step = model.run
        return True

    monkeypatch.setattr(model, "compile_decoding", compile_decoding)
    model.compile_decoding(linear="packed")
    tokens = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(6))

    def steps() -> None:
        cache = model.new_cache(1, 32)
        model(tokens[:, :8], cache=cache)
        for position in range(8, 12):
            model(tokens[:, position : position + 1], cache=cache)

    with torch.no_grad():
        steps()
        assert len(compiles) == 1
        next(model.parameters()).mul_(2.0)
        steps()
        assert len(compiles) == 2
        steps()
        assert len(compiles) == 2
        assert quantize_weights(model) > 0
        steps()
        assert len(compiles) == 3 and compiles[-1]["linear"] == "packed"


@pytest.mark.parametrize("batch, n_samples", [(1, 600), (4, 1200)])
def test_compiled_speculative_sampling_follows_the_target(batch, n_samples):
    """Chi-square: speculative decoding with both models compiled samples the target's distribution
    (per-row rollback at batch 4)."""
    from test_speculative import chi_square_p_value, exact_distribution, sampled_counts, tiny

    torch._dynamo.reset()
    target, draft = tiny("full", seed=0, depth=2), tiny("local", seed=1, depth=1)
    _, expected = exact_distribution(target, SamplingConfig())
    assert target.compile_decoding(backend="aot_eager") and draft.compile_decoding(backend="aot_eager")
    counts = sampled_counts(target, draft, batch, n_samples, SamplingConfig(), seed=batch, per_row=batch > 1)
    assert chi_square_p_value(counts, expected) > 0.01


@pytest.mark.parametrize("batch", [1, 4])
def test_speculative_and_generate_on_compiled_models(batch):
    """Greedy speculative decoding with both models compiled equals the target's greedy decoding,
    per-row and shared rollback (the sampled distribution is the eager one's: the steps are)."""
    target, compiled_target = twins("nsa", depth=2)
    draft, compiled_draft = twins("local", depth=1)
    prompt = torch.randint(0, 61, (batch, 9), generator=torch.Generator().manual_seed(batch))
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
        uniforms = torch.rand(2, 4, generator=generator)
        forced = torch.rand(2, 4, generator=generator) < 0.3
        forced_tokens = torch.randint(0, 61, (2, 4), generator=generator)
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
    draft, compiled_draft = twins("local", depth=1)
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
    from attnlab.generate.speculative import verification

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
        expected = verification(eager(window, cache=caches[0]).logits, *arguments)
        result = compiled.decode_then(verification, window, caches[1], *arguments)
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
    from attnlab.generate.speculative import verification

    eager_target, target = twins("full", depth=1)
    eager_draft, draft = twins("local", depth=1)
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
        expected = verification(eager_target(window, cache=target_cache).logits, probs, expected_drafted, sampling,
                                forced, verify_uniforms)
        drafted, *result = target.draw_then_decode(draft, chunk, *caches[1], uniforms, sampling, forced_tokens, forced,
                                                   verification, sampling, forced, verify_uniforms)
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
    """A draft compiled with linear="packed" beside a target left at the CPU's default (packed too)
    makes speculative decoding's step one call; a draft with the library's products, two. Nothing
    compiles: the check reads the settings each compile_decoding resolved."""
    target, draft = (Transformer(variant_config("full", depth=1)).eval() for _ in range(2))
    tokens = torch.randint(0, 61, (1, 8))
    caches = [model.new_cache(1, 32) for model in (draft, target)]
    with torch.no_grad():
        for model, cache in zip((draft, target), caches):
            model(tokens, cache=cache)  # a prefill, eager
    assert target.compile_decoding() and draft.compile_decoding(linear="packed")
    assert target._draws_then_decodes_compiled(draft, *caches)
    assert draft.compile_decoding(linear="library")
    assert not target._draws_then_decodes_compiled(draft, *caches)


def test_draw_then_decode_compiles_again_when_the_drafts_weights_change(monkeypatch):
    """The packed graphs of draw_then_decode hold the draft's weights too, with the compiled call
    stood in for by the eager one (so nothing compiles): calls on unchanged weights compile nothing
    again; an in-place write to a draft weight, and quantising the draft, each compile it once again."""
    from attnlab.generate.speculative import verification
    from attnlab.model.quantize import quantize_weights

    torch.manual_seed(0)
    target = Transformer(variant_config("full", max_seq_len=64)).eval()
    draft = Transformer(variant_config("local", max_seq_len=64, depth=1)).eval()
    compiles = []

    def compile_decoding(**arguments) -> bool:
        compiles.append(arguments)
        Transformer.compile_decoding(target, **arguments)  # lazy: makes the wrappers, compiles nothing
        target._compiled_draw_then_decode = target._draw_then_run
        return True

    monkeypatch.setattr(target, "compile_decoding", compile_decoding)
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
                                    SamplingConfig(), no_tokens, no_known, verification, SamplingConfig(), no_known,
                                    torch.rand(1, 4))
            for each in (draft_cache, cache):
                each.truncate(each.length - 3)

    with torch.no_grad():
        steps()
        assert len(compiles) == 1
        next(draft.parameters()).mul_(2.0)
        steps()
        assert len(compiles) == 2
        steps()
        assert len(compiles) == 2
        assert quantize_weights(draft) > 0
        steps()
        assert len(compiles) == 3


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


def test_without_torch_compile_decoding_stays_eager(monkeypatch, caplog):
    """Where torch.compile cannot serve the device, compile_decoding says so in one warning, returns
    False, and every entry decodes eagerly."""
    def unavailable(*args, **kwargs):
        raise RuntimeError("no compiler for this device")

    model = Transformer(variant_config("full", max_seq_len=64)).eval()
    monkeypatch.setattr(torch, "compile", unavailable)
    with caplog.at_level("WARNING", logger="attnlab.model.transformer"):
        assert not model.compile_decoding()
    assert len(caplog.records) == 1 and "unavailable" in caplog.text
    assert model.compiled_entries() == []
    prompt = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(2))
    assert generate(model, prompt, 4, SamplingConfig(temperature=0.0)).shape == (1, 10)


def test_weights_made_under_inference_mode_compile_with_library_products(caplog):
    """An inference tensor counts no versions, so a step whose weights are made under inference
    mode cannot tell when they change: it reads them as inputs (one warning) and still gives the
    eager tokens; asking for the packed products then is a one-line error."""
    torch.manual_seed(0)
    config = variant_config("full", depth=1)
    with torch.inference_mode():
        model = Transformer(config).eval()
    reference = Transformer(config).eval()
    reference.load_state_dict(model.state_dict())
    prompt = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="packed linear kernels need weights made outside torch.inference_mode"):
        model.compile_decoding(linear="packed")
    with caplog.at_level("WARNING", logger="attnlab.model.transformer"):
        assert model.compile_decoding()
    assert "made under torch.inference_mode" in caplog.text
    assert model._frozen_weights is None
    greedy = SamplingConfig(temperature=0)
    assert torch.equal(generate(model, prompt, 8, greedy), generate(reference, prompt, 8, greedy))
