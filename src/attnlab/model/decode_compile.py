"""How Transformer.compile_decoding compiles a decode step, apart from the model itself.

- Inductor's options for the step (decode_compile_options): the C++ wrapper, the step's products
  (LINEAR_KERNELS: the library's calls, inductor's packed GEMM template, attnlab's operator), serial
  elementwise loops, and what `None` resolves to on each device (takes_cpu_defaults,
  resolved_linear).
- While a packed step compiles (packed_step_compiling): only the template's choices for a product,
  the six-row AVX2 micro-kernel offered, equal constants held once.
- Calling the step: dynamo's code called directly (dynamo_code_function), a code object per model
  (own_code), what a graph depends on of its arguments (call_key), and whether the weights a packed
  step froze have changed since (FrozenWeights, STRUCTURE_CHANGES).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import operator
import types
from dataclasses import is_dataclass

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

TENSOR_VERSION = operator.attrgetter("_version")
STRUCTURE_CHANGES = [0]  # modules, parameters and buffers registered in this process (any module's)


def _count_structure_change(*args) -> None:
    STRUCTURE_CHANGES[0] += 1


for _register in (nn.modules.module.register_module_module_registration_hook,
                  nn.modules.module.register_module_parameter_registration_hook,
                  nn.modules.module.register_module_buffer_registration_hook):
    _register(_count_structure_change)


def own_code(function: types.FunctionType) -> types.FunctionType:
    """A copy of function with a code object of its own. Dynamo keeps compiled graphs per code object
    and, at every call, looks through all of that object's graphs: compiling each model's step
    through the one code object of Transformer.run made every model's step pay for every other
    compiled model in the process (1.36 -> 1.59 ms a step beside 8 more: bench/compiled_neighbours.py)."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


def dynamo_code_function(compiled, arguments: tuple):
    """The code dynamo made of a compiled method for a call with these arguments, as a method to
    call directly, without dynamo's frame evaluation (its guards, its stance, its frame callback):
    that code gathers the graph's inputs from the arguments and the model and calls the compiled
    graph, as dynamo runs it. The one entry of dynamo's cache for the method whose guards all pass
    for these arguments (checked here, once); None where not exactly one passes, or where this
    torch keeps its compiled code otherwise."""
    original = getattr(compiled, "_torchdynamo_orig_callable", None)
    function = getattr(original, "__func__", None)
    if not isinstance(function, types.FunctionType):
        return None
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        bound = inspect.signature(function).bind(original.__self__, *arguments)
        bound.apply_defaults()  # the frame's locals: its defaults too
        frame_locals = bound.arguments
        passing = [entry.code for entry in _debug_get_cache_entry_list(function.__code__)
                   if entry.guard_manager.check(frame_locals)]
    except (ImportError, AttributeError, TypeError, RuntimeError) as error:
        log.debug("dynamo's compiled code cannot be called directly on this torch: %s", error)
        return None
    if len(passing) != 1:
        return None
    # the globals as they are now: dynamo installed the compiled graph and what its code imports there
    code_function = types.FunctionType(passing[0], dict(function.__globals__), function.__name__,
                                       function.__defaults__, function.__closure__)
    return types.MethodType(code_function, original.__self__)


# the "packed" linear kernels: the weights frozen into the step as constants (so inductor can pack
# them once), every product with a frozen weight made by inductor's C++ GEMM template (micro-kernels
# over the packed weight: one pass over it for all of a step's rows), the other products by ATen's
# calls. max-autotune offers both where the template applies; while a packed step compiles,
# template_choices_only keeps the template's (timing each choice would cost a C++ compile per
# product shape, and the choice would follow the load of the machine at that moment)
PACKED_LINEAR_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
# and, where inductor has the pass, products of one input with frozen weights (a layer's queries,
# keys and values; a gated feed-forward's gate and up) made as one product with the weights
# concatenated: one kernel and one pass over the rows instead of three
CONCATENATED_PRODUCTS = "cpp.enable_concat_linear"
LINEAR_KERNELS = ("library", "packed", "cpu")
# A decode step's elementwise kernels and reductions (norms, activations, rotary positions, cache
# writes, the draw) touch rows x width numbers: a few thousand in a small model's verification.
# Inductor runs a loop on every thread once each thread gets cpp.min_chunk_size (512) of them, and
# opening that OpenMP region costs more than such work. "serial" (the default for inductor on the
# CPU) keeps every such loop on one thread; the products (the GEMM template) and attention's
# operators still use all. Elementwise work grows as rows x width, the products' as rows x width^2,
# so the serial share stays small for larger models. docs/benchmarks.md "Compiled decoding" has the
# effect; "parallel" is inductor's own rule.
SERIAL_ELEMENTWISE = {"cpp.min_chunk_size": 2**31 - 1}
ELEMENTWISE_THREADS = ("serial", "parallel")
COMPILING_PACKED_STEP = [False]  # set while a packed decode step may compile (Transformer._tracing_settings)


def template_choices_only(choices: list) -> list:
    """Inductor's choices for one product: only its C++ templates' where there are any, while a
    packed decode step compiles; all of them otherwise."""
    from torch._inductor.select_algorithm import ExternKernelCaller

    if not COMPILING_PACKED_STEP[0]:
        return choices
    templates = [choice for choice in choices if not isinstance(choice, ExternKernelCaller)]  # the rest: ATen's
    return templates or choices


# The template's float32 micro-kernels for AVX2 hold 4 rows (4 x 24, 4 x 16 columns) or 8 rows of 8
# in registers, so a speculative verification of gamma + 1 = 6 rows passes over each packed weight
# twice (4 rows, then 2). A block of 6 rows by 16 columns (12 accumulators, 2 weight vectors and a
# broadcast: 15 of AVX2's 16 vector registers, the register block of BLIS's Haswell kernel) takes
# the 6 rows in one pass; offered while a packed step compiles, the template's own ranking picks it
# where the rows divide by 6 (and, being larger, over 4 x 16 for one row). AVX-512's blocks hold 8
# or 16 rows already.
SIX_ROW_BLOCK = (6, 16, 1)  # (rows, columns, reduction step) in registers


@contextlib.contextmanager
def six_row_micro_kernels():
    """The AVX2 float32 micro-kernel of SIX_ROW_BLOCK among the template's choices, for the time
    of the context (the registry is inductor's, shared by everything compiled meanwhile). A torch
    whose inductor keeps its micro-kernels otherwise compiles without it (logged)."""
    try:
        import torch._inductor.select_algorithm  # noqa: F401 - imports the code generators in their order
        from torch._inductor.codegen import cpp_micro_gemm
        from torch._inductor.cpu_vec_isa import VecAVX2

        configs = cpp_micro_gemm.micro_gemm_configs[cpp_micro_gemm.CppMicroGemmFP32Vec]
        added = cpp_micro_gemm.generate_gemm_config(VecAVX2, [SIX_ROW_BLOCK], input_dtype=torch.float)
    except (ImportError, AttributeError, KeyError, TypeError) as error:
        log.info("inductor's micro-kernel registry is not as expected; compiling without the six-row block: %s",
                 error)
        yield
        return
    configs.extend(added)
    try:
        yield
    finally:
        configs[:] = [config for config in configs if not any(config is extra for extra in added)]


def constant_fingerprint(tensor: Tensor) -> tuple | None:
    """What two constants of equal contents share: dtype, shape, strides and a digest of the values;
    None for a tensor whose values cannot be read here (not a strided tensor on the CPU, such as
    oneDNN's packed weights)."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return None
    values = tensor.contiguous().reshape(-1).view(torch.uint8)  # the bytes, in the tensor's order
    digest = hashlib.blake2b(values.numpy().tobytes(), digest_size=16).hexdigest()
    return tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), digest


def constant_twin(constants: dict[str, Tensor], fingerprints: dict[str, tuple | None], data: Tensor) -> str | None:
    """The name of a constant among `constants` whose contents equal data's (fingerprints: a cache
    of theirs, by name, filled as needed); None if there is none."""
    fingerprint = constant_fingerprint(data)
    if fingerprint is None:
        return None
    for name, value in constants.items():
        if value.dtype != data.dtype or value.shape != data.shape:
            continue
        if name not in fingerprints:
            fingerprints[name] = constant_fingerprint(value)
        if fingerprints[name] == fingerprint and torch.equal(value, data):
            return name
    return None


@contextlib.contextmanager
def constants_shared_by_contents():
    """While a packed step compiles, a constant equal to one the graph holds already is that one.
    Inductor packs a frozen weight for each product that reads it, each time as a new tensor, so a
    graph that runs the model's forward several times (a draft's proposal of n tokens, an early
    exit's) held n packed copies of every weight (n times the bytes a token reads through the
    processor's caches; docs/bench/speculative-compiled/README.md has the effect): it now holds
    one. Constants are never written, so equal ones can share storage. A torch whose inductor names
    constants otherwise compiles without it (logged)."""
    try:
        from torch._inductor.graph import GraphLowering

        original = GraphLowering.allocate_non_dup_const_name
    except (ImportError, AttributeError) as error:
        log.info("inductor's constants are not as expected; compiling without sharing equal ones: %s", error)
        yield
        return

    def allocate(graph, name, data):
        fingerprints = graph.__dict__.setdefault("_attnlab_constant_fingerprints", {})
        return constant_twin(graph.constants, fingerprints, data) or original(graph, name, data)

    GraphLowering.allocate_non_dup_const_name = allocate
    try:
        yield
    finally:
        GraphLowering.allocate_non_dup_const_name = original


@contextlib.contextmanager
def packed_step_compiling():
    """Dynamo makes the weights constants only while inductor's freezing is on (compile_decoding's
    option reaches inductor alone); the choices of each product are the template's, its AVX2
    micro-kernels include the six-row block, and a graph keeps one copy of equal constants (one
    packed weight for every forward of a draw)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.select_algorithm import add_preprocessing_fn, get_algorithm_selector_cache

    if template_choices_only not in get_algorithm_selector_cache().preprocessing_fns:
        add_preprocessing_fn(template_choices_only)
    COMPILING_PACKED_STEP[0] = True
    try:
        with inductor_config.patch(freezing=True), six_row_micro_kernels(), constants_shared_by_contents():
            yield
    finally:
        COMPILING_PACKED_STEP[0] = False


def decode_compile_options(device: torch.device, mode: str | None, backend: str, cpp_wrapper: bool | None,
                           linear: str | None = None, elementwise: str | None = None) -> dict | None:
    """Inductor's options for a compiled decode step (Transformer.compile_decoding): the C++ wrapper,
    the packed linear kernels and serial elementwise loops when asked, or by default on the CPU;
    none by default where a `mode` is given (torch.compile takes one or the other) or the back-end
    is not inductor."""
    cpu_default = takes_cpu_defaults(device, mode, backend)
    if cpp_wrapper and (backend != "inductor" or mode is not None):
        raise ValueError(f"cpp_wrapper is an option of the inductor back-end without a mode (got backend={backend!r}, "
                         f"mode={mode!r})")
    if linear not in (None, *LINEAR_KERNELS):
        raise ValueError(f"linear kernels are one of {', '.join(LINEAR_KERNELS)}; got {linear!r}")
    if linear in ("packed", "cpu") and not cpu_default:
        raise ValueError(f"{linear} linear kernels are for inductor on the CPU, without a mode (got device "
                         f"{device.type}, backend={backend!r}, mode={mode!r})")
    if elementwise not in (None, *ELEMENTWISE_THREADS):
        raise ValueError(f"elementwise loops are one of {', '.join(ELEMENTWISE_THREADS)}; got {elementwise!r}")
    if elementwise == "serial" and not cpu_default:
        raise ValueError(f"serial elementwise loops are inductor's for the CPU, without a mode (got device "
                         f"{device.type}, backend={backend!r}, mode={mode!r})")
    options = {}
    if cpp_wrapper or (cpp_wrapper is None and cpu_default):
        options["cpp_wrapper"] = True
    options.update(linear_options(linear, cpu_default))
    if elementwise == "serial" or (elementwise is None and cpu_default):
        options.update(SERIAL_ELEMENTWISE)
    return options or None


def takes_cpu_defaults(device: torch.device, mode: str | None, backend: str) -> bool:
    """Whether a step compiled so takes compile_decoding's CPU defaults (inductor on the CPU without
    a mode: the C++ wrapper, packed products, serial elementwise loops)."""
    return device.type == "cpu" and backend == "inductor" and mode is None


def resolved_linear(linear: str | None, cpu_default: bool) -> str:
    """The step's products (one of LINEAR_KERNELS) that compile_decoding's `linear` gives: None is
    "cpu" where attnlab's operator is built, else "packed", for inductor on the CPU without a mode
    (cpu_default); else the library's."""
    if linear is not None:
        return linear
    if not cpu_default:
        return "library"
    from attnlab.model import linear_cpu

    return "cpu" if linear_cpu.available() else "packed"


def linear_options(linear: str | None, cpu_default: bool) -> dict:
    """Inductor's options for the step's products (resolved_linear's). "cpu" freezes and multiplies
    as "packed" does, and PackedProducts (model/linear_cpu.py) then gives attnlab's operator every
    float32 product of two rows or more with a frozen weight."""
    from attnlab.model import linear_cpu  # imports inductor's pass types: only where a step compiles

    linear = resolved_linear(linear, cpu_default)
    if linear == "cpu" and not linear_cpu.available():
        raise ValueError("cpu linear kernels are attnlab's operator, not built here (no C++ compiler, or "
                         "ATTNLAB_CPU_KERNELS=0): choose 'packed' or 'library'")
    if linear == "packed":
        return packed_linear_options()
    if linear == "cpu":
        return {**packed_linear_options(), "post_grad_custom_post_pass": linear_cpu.PACKED_PRODUCTS}
    return {}


def packed_linear_options() -> dict:
    """PACKED_LINEAR_OPTIONS, with the products of one input concatenated where this torch's
    inductor can (CONCATENATED_PRODUCTS)."""
    from torch._inductor import config as inductor_config

    section, name = CONCATENATED_PRODUCTS.split(".")
    if not hasattr(getattr(inductor_config, section, None), name):
        return dict(PACKED_LINEAR_OPTIONS)
    return {**PACKED_LINEAR_OPTIONS, CONCATENATED_PRODUCTS: True}


def call_key(value) -> tuple | object:
    """What a compiled graph depends on of one argument: a tensor's layout, a dataclass's fields
    (settings such as a SamplingConfig), else the value itself."""
    if isinstance(value, Tensor):
        return (value.shape, value.stride(), value.dtype, value.device, value.is_inference())
    if is_dataclass(value):  # its fields, as they are now (vars: astuple's deep copy costs a step ~2%)
        return (type(value), tuple(vars(value).values()))
    return value


class FrozenWeights:
    """A module's weights as packed decode graphs hold them (constants, frozen when the graphs
    compiled): its parameters and buffers, and their versions' sum then. An in-place write (an
    optimiser step, load_state_dict) raises a tensor's version, and versions never fall."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module  # kept alive: a draft's id names its record (Transformer._frozen_draft)
        self.tensors = weight_tensors(module)
        self.state = sum(map(TENSOR_VERSION, self.tensors))
        self.structure = STRUCTURE_CHANGES[0]

    def changed(self) -> bool:
        """Whether a weight was written in place since, or, after any module's structure changed,
        the module holds other tensors (it was quantised)."""
        if self.structure != STRUCTURE_CHANGES[0]:
            if list(map(id, weight_tensors(self.module))) != list(map(id, self.tensors)):
                return True
            self.structure = STRUCTURE_CHANGES[0]
        return sum(map(TENSOR_VERSION, self.tensors)) != self.state


def weight_tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *module.buffers()]
