"""attnlab's float32 products with packed weights on the CPU (linear_cpu.cpp says how), and the
graph pass that puts them in a compiled decode step (Transformer.compile_decoding's linear="cpu").

A step compiled with frozen weights (inductor's freezing) holds each weight as a constant of its
graph. `PackedProducts`, run on the graph after inductor's own passes, replaces every float32 product
of activations with such a constant (torch's MKL linear with its prepacked weight, or a matrix
product of the constant) by attnlab::linear_cpu over the weight packed once by
attnlab::linear_pack_cpu, itself a constant of the graph. Products it does not take (other dtypes,
weights that are not constants) keep inductor's kernels.

Built on first use like the attention kernels (attention/kernels/cpu.py: cached by source, compiler
and CPU) and registered with torch's dispatcher, so a compiled step calls the product from inductor's
C++ wrapper. Without a compiler, or with ATTNLAB_CPU_KERNELS=0, `available()` is False and
compile_decoding takes inductor's template ("packed") by default.

Legend: N rows of activations, K input width, O outputs, P panels.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor, fx
from torch._inductor.custom_graph_pass import CustomGraphPass  # inductor's: imported where steps compile

from attnlab.attention.kernels.cpu import OperatorLibrary

SOURCE = Path(__file__).parent / "linear_cpu.cpp"


def _register_fake() -> None:
    """The product's shape for torch.compile, once it is loaded (its schema is the library's)."""
    torch.library.register_fake("attnlab::linear_cpu")(
        lambda x, packed, bias, outputs: x.new_empty((x.shape[0], outputs)))


_library = OperatorLibrary("attnlab_linear", SOURCE, _register_fake, "using inductor's products")

available = _library.availability()


def pack(weight: Tensor) -> Tensor:
    """weight [O, K] float32 -> its packed form [P, K, PANEL] for `linear` (PANEL: the build's, 64
    outputs with AVX-512, 16 otherwise)."""
    _require()
    return torch.ops.attnlab.linear_pack_cpu(weight.detach())


def linear(x: Tensor, packed: Tensor, bias: Tensor | None, outputs: int) -> Tensor:
    """x [N, K] float32, packed [P, K, PANEL] (`pack`'s), bias [O] or None -> x @ weight^T + bias
    [N, O] float32."""
    _require()
    return torch.ops.attnlab.linear_cpu(x, packed, bias, outputs)


def _require() -> None:
    if not available():
        raise RuntimeError("the cpu float32 product is not built here (no C++ compiler, or ATTNLAB_CPU_KERNELS=0): "
                           "compile with linear='packed' or 'library'")


# the fewest rows of a product the pass takes: a one-row product multiplies a vector by the weight, at
# the pace of memory, where inductor's template makes it in a kernel called directly, its bias,
# activation and residual fused in; from two rows the operator's register blocks reuse each weight
# vector loaded across the rows
MIN_ROWS = 2


class PackedProducts(CustomGraphPass):
    """Inductor's post-grad pass for linear="cpu": each float32 product of activations [N, K] with a
    constant weight becomes attnlab::linear_cpu over the weight packed once (one packed constant per
    weight, however many products use it: a draw's forwards share theirs). The products it takes:
    - torch.ops.mkl._mkl_linear(x, mkl_packed, weight [O, K], bias, N): inductor's freezing makes
      every linear with a frozen weight one of these where torch has MKL;
    - aten.mm(x, weight^T [K, O]) and aten.addmm(bias [O], x, weight^T), the weight a constant;
    each of at least MIN_ROWS rows. A product it does not take keeps inductor's kernel."""

    def __call__(self, graph: fx.Graph) -> None:
        module = graph.owning_module
        packed_names: dict[tuple[str, bool], str] = {}  # (weight's attribute, transposed) -> packed's
        for node in list(graph.nodes):
            product = matched_product(module, node)
            if product is None:
                continue
            x, weight_name, transposed, bias = product
            key = (weight_name, transposed)
            if key not in packed_names:
                weight = getattr(module, weight_name)
                packed_names[key] = f"_attnlab_packed_{len(packed_names)}_{weight_name}"
                module.register_buffer(packed_names[key], pack(weight.t() if transposed else weight))
            outputs = node.meta["val"].shape[-1]
            with graph.inserting_before(node):
                packed = graph.get_attr(packed_names[key])
                replacement = graph.call_function(torch.ops.attnlab.linear_cpu.default, (x, packed, bias, outputs))
            replacement.meta.update(node.meta)
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
        if packed_names:
            graph.eliminate_dead_code()  # the products' former weights, such as MKL's packed copies

    def uuid(self) -> str:
        """Inductor's cache key for the pass: this file's and the kernel's source."""
        texts = (Path(__file__).read_bytes(), SOURCE.read_bytes())
        return hashlib.blake2b(b"".join(texts), digest_size=16).hexdigest()


PACKED_PRODUCTS = PackedProducts()  # one instance: equal compile settings compare equal


def matched_product(module: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, str, bool, fx.Node | None] | None:
    """(activations, the weight's attribute, whether it is stored [K, O], bias) of a product the
    operator can take at `node` (PackedProducts says which), else None."""
    if node.op != "call_function":
        return None
    mkl_linear = getattr(getattr(torch.ops, "mkl", None), "_mkl_linear", None)
    if mkl_linear is not None and node.target in (mkl_linear, mkl_linear.default):  # freezing puts the packet
        x, weight, bias, transposed = node.args[0], node.args[2], node.args[3], False
    elif node.target == torch.ops.aten.mm.default:
        (x, weight), bias, transposed = node.args, None, True
    elif node.target == torch.ops.aten.addmm.default and not node.kwargs:
        (bias, x, weight), transposed = node.args, True
    else:
        return None
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return None
    weight_value, activations = tensor_of(module, weight), tensor_of(module, x)
    if not (is_float32_cpu(weight_value) and weight_value.dim() == 2 and is_float32_cpu(activations)
            and activations.dim() == 2 and activations.shape[0] >= MIN_ROWS
            and (bias is None or is_bias(tensor_of(module, bias), tensor_of(module, node)))):
        return None
    return x, weight.target, transposed, bias


def tensor_of(module: fx.GraphModule, node) -> Tensor | None:
    """A constant's value, or the fake tensor inductor recorded for a node's output (None where
    there is neither)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        return getattr(module, node.target, None)
    return node.meta.get("val")


def is_float32_cpu(value) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.float32 and value.device.type == "cpu"


def is_bias(bias: Tensor | None, output: Tensor | None) -> bool:
    """Whether bias is one float32 value per output of the product `output` [N, O]."""
    return (is_float32_cpu(bias) and bias.dim() == 1 and output is not None
            and bias.shape[0] == output.shape[-1])

