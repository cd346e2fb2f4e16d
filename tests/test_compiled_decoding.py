"""Compiled decoding (Transformer.compile_decoding): for every attention type, the compiled decode
steps give the eager logits over a prefill, one-token steps, multi-token chunks and rollbacks
(level and per row); after warm-up, hundreds of decode steps compile nothing new (the static
caches give every step the same shapes). Sampling and speculative decoding through compiled
graphs: tests/test_compiled_sampling.py.

The per-variant tests compile with the aot_eager back-end (dynamo's tracing, where graph breaks
and recompiles happen, without inductor's code generation); one goes through inductor."""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.model import Transformer
from attnlab.model.decode_compile import FrozenWeights
from variants import variant_config

pytestmark = pytest.mark.slow
NAMES = ["full", "local", "routing", "sinkhorn", "nsa", "full-cpu-decode", "local-cpu-decode"]
LISTED = ["routing-cpu-decode", "sinkhorn-cpu-decode", "nsa-cpu-decode"]  # the cpu back-end's listed blocks


def twins(name: str, backend: str = "aot_eager", prefill_chunk: int | None = None, **overrides
          ) -> tuple[Transformer, Transformer]:
    """The same model twice, in eval mode: eager, and with compiled decoding. One block unless
    `depth` says more: a compile's time grows with the blocks it traces, and what a block's step
    does is the same in each (the contract tests, tests/test_attention_contract.py, cover depth)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = variant_config(name, **{"max_seq_len": 512, "depth": 1, **overrides})
    eager, compiled = Transformer(config).eval(), Transformer(config).eval()
    compiled.load_state_dict(eager.state_dict())
    assert compiled.compile_decoding(backend=backend, prefill_chunk=prefill_chunk)
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


@pytest.mark.parametrize("name", NAMES)
def test_compiled_prefill_in_chunks_equals_eager(name):
    """compile_decoding(prefill_chunk=8): prompts of 21 tokens (8 + 8 + 5 padded to 8 and rolled
    back), 8 and 3 give the eager prefill's logits of every token, and the steps after them the
    eager steps' (so the rollback of the padding was exact); a prompt whose padded chunk would pass
    the cache's room finishes eagerly. The graph of 8 tokens serves every prompt length: after the
    first prompt, none compiles anything new."""
    eager, compiled = twins(name, prefill_chunk=8)
    tokens = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(3))

    def prefill_then_steps(model: Transformer, length: int, room: int) -> torch.Tensor:
        cache = model.new_cache(2, room)
        logits = [model(tokens[:, :length], cache=cache).logits]
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(length, length + 2)]
        return torch.cat(logits, dim=1)  # [B, length + 2, V]

    # 19 in a room of 21: 8 + 8, then 3 eagerly (for one variant: a cache of another room is another
    # layout, with graphs of its own to compile)
    cases = [(21, 32), (8, 32), (3, 32)] + [(19, 21)] * (name == "routing")
    with torch.no_grad():
        graphs = None
        for length, room in cases:
            torch.testing.assert_close(prefill_then_steps(compiled, length, room),
                                       prefill_then_steps(eager, length, room), atol=1e-5, rtol=1e-5)
            if graphs is None:
                graphs = counters["stats"]["unique_graphs"]
            elif room == 32:
                assert counters["stats"]["unique_graphs"] == graphs, "a prompt of another length compiled a graph"
    chunks = [call[0] for _, call in compiled._decode_calls]  # the shapes of the compiled step's tokens
    assert torch.Size([2, 8]) in chunks, "the prefill never ran by the compiled step"
    with pytest.raises(ValueError, match="prefill_chunk must be a positive number of tokens"):
        compiled.compile_decoding(backend="aot_eager", prefill_chunk=0)


@pytest.mark.parametrize("name, backend", [("sinkhorn", "aot_eager"), ("nsa", "aot_eager"),
                                           ("full-cpu-decode", "inductor")])
def test_compiled_decoding_over_a_bfloat16_cache_equals_eager(name, backend):
    """A float32 model over a cache storing bfloat16 keys and values (`--cache-dtype bfloat16`):
    the compiled steps give the eager logits over the same cache dtype, as closely as over a float32
    cache (the rounding happens when a key is stored, alike in both). Through inductor, the cpu
    back-end's operator reads the bfloat16 storage beside float32 queries."""
    eager, compiled = twins(name, backend=backend)
    tokens = torch.randint(0, 61, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        compiled_logits, eager_logits = (decode(model, tokens, torch.bfloat16) for model in (compiled, eager))
    assert compiled_logits.dtype == torch.float32
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5)
    assert compiled._compiled_step is not None, "the compiled step failed and decoding fell back to eager"


@pytest.mark.parametrize("name, backend", [*((name, "aot_eager") for name in NAMES + LISTED), ("sinkhorn", "inductor"),
                                           ("nsa-cpu-decode", "inductor")])
def test_compiled_decoding_of_one_row(name, backend):
    """At batch 1 (a size-1 dimension, whose stride any value leaves a tensor contiguous): a
    prefill, verification-sized chunks of 6 and one-token steps, around a rollback, give the eager
    logits, and the compiled step serves them all (none fell back to eager). Sinkhorn's and NSA's
    steps branch (torch.cond), whose two sides must agree in layout: also through inductor, as are
    the cpu back-end's C++ operators (called from inductor's C++ wrapper; NSA's, all three of its
    branches, the compressed one returning two tensors). NSA's reference path compiles through
    aot_eager here and under CUDA graphs in tests/test_gpu.py."""
    eager, compiled = twins(name, backend=backend)
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


@pytest.mark.parametrize("name, dtype", [("routing", torch.float32), ("full", torch.bfloat16)])
def test_compiled_decoding_through_inductor(name, dtype):
    """Routing's decode step (top-k over the cluster storage) in inductor's generated code with the
    CPU's defaults (the C++ wrapper, the packed linear kernels): one-token steps, a level and a
    per-row rollback (one graph). And a model cast to bfloat16 (`--dtype bfloat16`: the packed
    products with bfloat16 weights, the caches in bfloat16), to bfloat16's precision. NSA's step
    through inductor: test_compiled_decoding_of_one_row (the cpu back-end's operators, its torch.cond
    around the compression) and tests/test_gpu.py (the reference path under CUDA graphs)."""
    eager, compiled = twins(name, backend="inductor")
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


def test_a_compiled_decodings_cache_is_a_power_of_two_long_within_the_model():
    """decode_capacity: the next power of two, at least 64, but no more than max_seq_len where the
    length fits in it (past it, the power of two); an eager model's cache is the length asked, and
    so is that of a model without the rule (capacity_for)."""
    from attnlab.model.transformer import capacity_for, decode_capacity

    lengths = (1, 64, 65, 129, 600, 1024, 1025, 3000)
    assert [decode_capacity(length, 1024) for length in lengths] == [64, 64, 128, 256, 1024, 1024, 2048, 4096]
    assert decode_capacity(700, 768) == 768 and decode_capacity(40, 48) == 48
    eager, compiled = twins("full")  # max_seq_len 512
    assert eager.decoding_capacity(100) == 100 and eager.decoding_capacity(3) == 3
    assert compiled.decoding_capacity(100) == 128 and compiled.decoding_capacity(300) == 512
    assert capacity_for(compiled, 100) == 128 and capacity_for(eager, 100) == 100
    assert capacity_for(torch.nn.Linear(2, 2), 37) == 37


def test_decode_compile_options():
    """The C++ wrapper, attnlab's products over packed weights (inductor's where the operator is not
    built) and serial elementwise loops: by default for inductor on the CPU without a mode; asked
    for where they cannot be, one error."""
    from attnlab.model import linear_cpu
    from attnlab.model.decode_compile import (
        PACKED_LINEAR_OPTIONS,
        SERIAL_ELEMENTWISE,
        decode_compile_options,
        packed_linear_options,
    )

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    packed = packed_linear_options()
    assert packed.items() >= PACKED_LINEAR_OPTIONS.items()
    operator = {**packed, "post_grad_custom_post_pass": linear_cpu.PACKED_PRODUCTS}
    default = operator if linear_cpu.available() else packed
    assert decode_compile_options(cpu, None, "inductor", None) == {"cpp_wrapper": True, **default, **SERIAL_ELEMENTWISE}
    assert decode_compile_options(cpu, None, "inductor", False, "library", "parallel") is None
    assert decode_compile_options(cpu, None, "inductor", False, "library") == SERIAL_ELEMENTWISE
    assert decode_compile_options(cpu, None, "inductor", False, None, "parallel") == default
    assert decode_compile_options(cpu, None, "inductor", False, "packed", "parallel") == packed
    assert decode_compile_options(cuda, "reduce-overhead", "inductor", None) is None
    assert decode_compile_options(cpu, None, "aot_eager", None) is None
    with pytest.raises(ValueError, match="cpp_wrapper is an option of the inductor back-end without a mode"):
        decode_compile_options(cuda, "reduce-overhead", "inductor", True)
    with pytest.raises(ValueError, match="packed linear kernels are for inductor on the CPU, without a mode"):
        decode_compile_options(cuda, None, "inductor", None, "packed")
    with pytest.raises(ValueError, match="cpu linear kernels are for inductor on the CPU, without a mode"):
        decode_compile_options(cuda, None, "inductor", None, "cpu")
    with pytest.raises(ValueError, match="linear kernels are one of library, packed, cpu; got 'blas'"):
        decode_compile_options(cpu, None, "inductor", None, "blas")
    with pytest.raises(ValueError, match="serial elementwise loops are inductor's for the CPU, without a mode"):
        decode_compile_options(cuda, "reduce-overhead", "inductor", None, None, "serial")
    with pytest.raises(ValueError, match="elementwise loops are one of serial, parallel; got 'omp'"):
        decode_compile_options(cpu, None, "inductor", None, None, "omp")


def test_compile_decoding_takes_the_elementwise_rule_into_its_step():
    """compile_decoding's elementwise argument reaches the options its steps compile with (and the
    arguments it compiles again with): serial by default on the CPU, inductor's rule when asked."""
    from attnlab.model.decode_compile import SERIAL_ELEMENTWISE

    model = Transformer(variant_config("full", max_seq_len=16)).eval()
    for elementwise, serial in ((None, True), ("serial", True), ("parallel", False)):
        assert model.compile_decoding(elementwise=elementwise)
        options = dict(model._compile_settings[3])
        assert (options.items() >= SERIAL_ELEMENTWISE.items()) is serial
        assert model._compile_arguments["elementwise"] == elementwise

def test_decoding_linear_names_the_products_of_the_compiled_step():
    """Transformer.decoding_linear is compile_decoding's `linear` as it resolved (None: attnlab's
    operator where it is built, else inductor's template, on the CPU; the library's through another
    back-end), and None for a model decoding eagerly; benchmark reports name it for float layers."""
    from attnlab.model import linear_cpu
    from attnlab.model.quantize import decoding_products

    model = Transformer(variant_config("full", max_seq_len=16)).eval()
    assert model.decoding_linear is None and decoding_products(model, compiled=True) == "F.linear"
    default = "cpu" if linear_cpu.available() else "packed"
    for arguments, linear in (({}, default), ({"linear": "library"}, "library"), ({"linear": "packed"}, "packed"),
                              ({"backend": "aot_eager"}, "library")):
        assert model.compile_decoding(**arguments)
        assert model.decoding_linear == linear
        assert decoding_products(model, compiled=True) == f"linear {linear}"
        assert decoding_products(model) == "F.linear"  # its eager forward's


def test_packed_linear_kernels_follow_the_weights():
    """The packed step (the CPU default: the weights frozen into it as constants, packed for
    inductor's GEMM template) gives the eager logits over one-token steps; after the weights change
    in place, it compiles again and follows them. That the weights are constants of the step: with
    the check skipped, it keeps the old ones. (Packed steps of verification-sized chunks:
    test_compiled_decoding_of_one_row's inductor cases.)"""
    eager, compiled = twins("full", backend="inductor")
    assert compiled._frozen_weights is not None
    counters.clear()
    tokens = torch.randint(0, 61, (1, 24), generator=torch.Generator().manual_seed(5))

    def steps(model: Transformer) -> torch.Tensor:
        cache = model.new_cache(1, 32)
        logits = [model(tokens[:, :10], cache=cache).logits]
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(10, 16)]
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


@pytest.mark.parametrize("rows", [1, 6])
def test_packed_step_makes_queries_keys_and_values_in_one_product(rows):
    """A packed step concatenates the frozen weights of the products of one input: a layer's
    queries, keys and values come from one template kernel (one pass over the rows, where three
    made them before), and equal the eager projections."""
    from attnlab.model.decode_compile import CONCATENATED_PRODUCTS, packed_linear_options, packed_step_compiling

    if CONCATENATED_PRODUCTS not in packed_linear_options():
        pytest.skip("this torch's inductor does not concatenate products")
    eager, _ = twins("full")
    heads = eager.blocks[0].attention.heads
    x = torch.randn(1, rows, heads.spec.dim, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(heads.project, fullgraph=True, dynamic=False, options=packed_linear_options())
    counters.clear()
    with torch.no_grad(), packed_step_compiling():
        for made, expected in zip(compiled(x), heads.project(x), strict=True):
            torch.testing.assert_close(made, expected, atol=1e-5, rtol=1e-5)
    assert counters["inductor"]["cpp_templated_kernel_counter"] == 1


def test_six_row_block_makes_a_verification_product_in_one_pass():
    """While a packed step compiles, the template's AVX2 float32 micro-kernels include the six-row
    register block (SIX_ROW_BLOCK): a 6-row product with a frozen weight is made by it and equals
    torch's; afterwards inductor's registry holds exactly what it held before."""
    import torch._inductor.select_algorithm  # noqa: F401 - before cpp_micro_gemm: inductor's own import order
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.cpu_vec_isa import VecAVX2, pick_vec_isa
    from torch._inductor.utils import run_and_get_code

    from attnlab.model.decode_compile import PACKED_LINEAR_OPTIONS, packed_step_compiling

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

    from attnlab.model.decode_compile import six_row_micro_kernels

    monkeypatch.setattr(cpp_micro_gemm, "micro_gemm_configs", {})
    with caplog.at_level("INFO", logger="attnlab.model.decode_compile"), six_row_micro_kernels():
        assert cpp_micro_gemm.micro_gemm_configs == {}
    assert "compiling without the six-row block" in caplog.text


def test_a_changed_model_is_checked_in_full():
    """After two alike calls the compiled step's code runs without dynamo's guards; quantising the model
    in place, or a cache longer than the rotary tables (which regrows them), changes what the step
    depends on, and the steps after it still give the eager logits (both with torch's int8 kernel)."""
    from attnlab.model.quantize import choose_products, quantize_weights

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
        for model in (eager, compiled):  # one kernel on both sides (eager's default reads float32 rows)
            choose_products(model, "torch")
        torch.testing.assert_close(steps(compiled, 32), steps(eager, 32), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(steps(compiled, 200), steps(eager, 200), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("direct_calls", [True, False, "unavailable"])
def test_direct_calls_run_the_code_dynamo_made_for_each_chunk_length(direct_calls, monkeypatch, caplog):
    """Steps of one token and chunks of three, in turn: after two calls of each (counted again after
    a compile: making a graph registers modules, STRUCTURE_CHANGES), each length runs
    the code dynamo made for it directly (its own graph: the entry whose guards pass, among the
    two under the step's code object), without the compiled function's frame evaluation (here it
    raises if called), and every step gives the eager logits. direct_calls=False, or a torch that
    keeps its compiled code where attnlab does not look for it: every call goes through dynamo (the
    latter said once for each chunk length in the log).
    NSA's step (its branches under torch.cond) for the direct calls; full attention's, quicker to
    trace, for the other two (what they check is the same for every attention type)."""
    eager, compiled = twins("nsa" if direct_calls is True else "full")
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

    caplog.set_level("INFO", logger="attnlab")
    with torch.no_grad():
        caches = compiled.new_cache(2, 80), eager.new_cache(2, 80)
        expected = [eager(tokens[:, :10], cache=caches[1]).logits, *steps(eager, caches[1], 10, 12)]
        got = [compiled(tokens[:, :10], cache=caches[0]).logits, *steps(compiled, caches[0], 10, 3)]
        assert len(compiled._direct_calls) == (2 if direct_calls is True else 0)
        if direct_calls is True:
            compiled._compiled_step = refuse
        got += steps(compiled, caches[0], 22, 9)
    torch.testing.assert_close(torch.cat(got, dim=1), torch.cat(expected, dim=1), atol=1e-5, rtol=1e-5)
    assert caplog.text.count("cannot run dynamo's code directly") == (2 if direct_calls == "unavailable" else 0)


@pytest.mark.parametrize("backend, product, tolerance", [("inductor", "torch", 2e-2), ("aot_eager", "cpu", 1e-5)])
def test_int8_decoding_compiled_gives_the_eager_logits(backend, product, tolerance, monkeypatch):
    """An int8 model (a speculative draft), compiled. With the CPU defaults (inductor, packed) a
    step's few rows take torch's int8 kernel (Int8Linear.product_for), which inductor makes in a
    template of its own with bfloat16 activations, where the eager step takes attnlab's operator
    with float32 ones: the two agree to bfloat16's precision, not to the bit (a draft only
    proposes: its precision moves the acceptance, never the output's distribution). A step that
    reads its weights (here aot_eager, which never packs; linear="library" alike) takes the
    operator, as eager decoding does: the eager logits to float32's precision (torch's kernel
    would differ past 1e-5)."""
    from attnlab.model import int8_linear_cpu
    from attnlab.model.quantize import decoding_products, quantize_weights

    built = int8_linear_cpu.available()
    if product == "cpu" and not built:
        pytest.skip("attnlab's int8 operator is not built here")
    eager, compiled = twins("full", backend=backend, max_seq_len=64)
    assert quantize_weights(eager) == quantize_weights(compiled) > 0
    assert (compiled._frozen_weights is not None) == (backend == "inductor")  # packed
    assert decoding_products(compiled, compiled=True) == f"int8 {product}"
    assert decoding_products(eager) == ("int8 cpu" if built else "int8 torch")
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(8))
    traced, operator = [], int8_linear_cpu.int8_linear
    monkeypatch.setattr(int8_linear_cpu, "int8_linear", lambda *arguments: traced.append(
        torch.compiler.is_compiling()) or operator(*arguments))  # which kernel the traced step took

    def steps(model: Transformer) -> torch.Tensor:
        cache = model.new_cache(2, 32)
        logits = [model(tokens[:, :10], cache=cache).logits]
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(10, 16)]
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        torch.testing.assert_close(steps(compiled), steps(eager), atol=tolerance, rtol=tolerance)
    assert compiled._compiled_step is not None and max(compiled._decode_calls.values()) >= 2  # it ran compiled
    # a packed step's later calls run dynamo's code directly: the kernel's choice, made while the step
    # compiled, is a constant of its graph, not a guard that fails once the compile is over (not
    # asked of aot_eager's here: `traced`, appended to inside its graph, is guarded on its length)
    assert bool(compiled._direct_calls) or backend != "inductor"
    assert any(traced) == (product == "cpu")


def counting_compiles(monkeypatch, model: Transformer, entry: str, stand_in) -> list[dict]:
    """model.compile_decoding stood in for by one that records its arguments (in the list returned),
    makes the compiled wrappers (lazily: nothing compiles) and sets the compiled `entry` to the
    eager `stand_in`."""
    compiles = []

    def compile_decoding(**arguments) -> bool:
        compiles.append(arguments)
        Transformer.compile_decoding(model, **arguments)
        setattr(model, entry, stand_in)
        return True

    monkeypatch.setattr(model, "compile_decoding", compile_decoding)
    return compiles


def assert_compiles_again_after_each_change(compiles: list[dict], steps, changed: Transformer) -> None:
    """steps() compiles once; again after an in-place write to one of `changed`'s weights, not
    when nothing changed; and again after quantising `changed`."""
    from attnlab.model.quantize import quantize_weights

    with torch.no_grad():
        steps()
        assert len(compiles) == 1
        next(changed.parameters()).mul_(2.0)
        steps()
        assert len(compiles) == 2
        steps()
        assert len(compiles) == 2
        assert quantize_weights(changed) > 0
        steps()
        assert len(compiles) == 3


def test_packed_step_compiles_again_when_its_weights_change(monkeypatch):
    """The bookkeeping of frozen weights, with the compiled step stood in for by the eager one (so
    nothing compiles): steps on unchanged weights compile nothing again; an in-place write to a
    weight, and quantising (other tensors than the frozen ones), each compile it once again."""
    torch.manual_seed(0)
    model = Transformer(variant_config("full", max_seq_len=64)).eval()
    compiles = counting_compiles(monkeypatch, model, "_compiled_step", model.run)
    model.compile_decoding(linear="packed")
    tokens = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(6))

    def steps() -> None:
        cache = model.new_cache(1, 32)
        model(tokens[:, :8], cache=cache)
        for position in range(8, 12):
            model(tokens[:, position : position + 1], cache=cache)

    assert_compiles_again_after_each_change(compiles, steps, model)
    assert compiles[-1]["linear"] == "packed"


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


def test_constants_of_equal_contents_are_found_by_their_fingerprints():
    """constant_twin: among a graph's constants, the one whose dtype, shape, strides and values equal
    a new one's (a transposed view too); none for other values, dtypes or strides, or for a tensor
    whose values cannot be read (not strided)."""
    from attnlab.model.decode_compile import constant_fingerprint, constant_twin

    weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    constants = {"ones": torch.ones(8, 4), "weight": weight, "transposed": weight.t()}
    fingerprints = {}
    assert constant_twin(constants, fingerprints, weight.clone()) == "weight"
    assert constant_twin(constants, fingerprints, weight.clone().t()) == "transposed"  # a view, the same strides
    assert constant_twin(constants, fingerprints, weight.t().contiguous()) is None  # equal values, other strides
    assert constant_twin(constants, fingerprints, weight + 1) is None
    assert constant_twin(constants, fingerprints, weight.double()) is None
    assert constant_twin(constants, fingerprints, torch.ones(8, 4)) == "ones"
    assert set(fingerprints) == set(constants)  # each read once, when first a candidate, and kept by name
    assert constant_fingerprint(weight.to_sparse()) is None and constant_twin(constants, {}, weight.to_sparse()) is None


def test_constants_kept_apart_where_inductor_names_them_otherwise(monkeypatch, caplog):
    """An inductor whose graphs lack the method that names constants: the context changes nothing and
    says so in the log."""
    from torch._inductor.graph import GraphLowering

    from attnlab.model.decode_compile import constants_shared_by_contents

    monkeypatch.delattr(GraphLowering, "allocate_non_dup_const_name")
    with caplog.at_level("INFO", logger="attnlab.model.decode_compile"), constants_shared_by_contents():
        assert not hasattr(GraphLowering, "allocate_non_dup_const_name")
    assert "compiling without sharing equal ones" in caplog.text
