"""attnlab's float32 product over a packed weight (model/linear_cpu.py): equal to F.linear at every
row count and width, one-line errors for a weight it cannot take, and the graph pass that gives it
a compiled decode step's products (the multi-row ones with a constant float32 weight)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch.profiler import profile

from attnlab.model import Transformer, linear_cpu
from variants import variant_config

pytestmark = pytest.mark.skipif(not linear_cpu.available(), reason="attnlab's float32 operator is not built here")


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 24])
@pytest.mark.parametrize("outputs, width", [(64, 32), (100, 37), (1, 5), (130, 1)])
def test_the_product_equals_f_linear(rows, outputs, width):
    """Rows in blocks of six and the rest, outputs past a whole panel (zero-padded), any width, with
    and without a bias, activations whose rows lie apart (a column slice)."""
    generator = torch.Generator().manual_seed(rows * 1000 + outputs + width)
    weight, bias = torch.randn(outputs, width, generator=generator), torch.randn(outputs, generator=generator)
    wide = torch.randn(rows, width + 3, generator=generator)
    x = wide[:, 2 : 2 + width]  # rows width + 3 apart
    packed = linear_cpu.pack(weight)
    for b in (None, bias):
        torch.testing.assert_close(linear_cpu.linear(x, packed, b, outputs), F.linear(x, weight, b),
                                   rtol=1e-5, atol=1e-5)


def test_a_weight_the_product_cannot_take_is_a_one_line_error():
    packed = linear_cpu.pack(torch.randn(10, 8))
    with pytest.raises(RuntimeError, match="a weight packed by linear_pack_cpu"):
        linear_cpu.linear(torch.randn(2, 9), packed, None, 10)  # another width
    with pytest.raises(RuntimeError, match="a weight packed by linear_pack_cpu"):
        linear_cpu.linear(torch.randn(2, 8), packed, None, 200)  # more outputs than it packs
    with pytest.raises(RuntimeError, match="a float32 bias of one value per output"):
        linear_cpu.linear(torch.randn(2, 8), packed, torch.randn(3), 10)
    with pytest.raises(RuntimeError, match="a float32 weight"):
        linear_cpu.pack(torch.randn(10, 8, dtype=torch.float64))


class Constants(torch.nn.Module):
    """The constants of a frozen graph: a weight stored [K, O] (as a product's transposed operand),
    a bias, and a float64 weight the operator does not take."""

    def __init__(self, width: int, outputs: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.register_buffer("weight", torch.randn(width, outputs, generator=generator))
        self.register_buffer("bias", torch.randn(outputs, generator=generator))
        self.register_buffer("weight64", torch.randn(width, outputs, generator=generator, dtype=torch.float64))


def product_graph(rows: int, width: int = 8, outputs: int = 70) -> tuple[fx.GraphModule, list[str]]:
    """A graph as inductor's freezing leaves it: mm and addmm of activations with the constant
    weight (twice: one packed copy serves both), and an mm of a float64 constant."""
    module, graph = Constants(width, outputs), fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(rows, width)
    x64 = graph.placeholder("x64")
    x64.meta["val"] = torch.empty(rows, width, dtype=torch.float64)
    weight, bias, weight64 = (graph.get_attr(name) for name in ("weight", "bias", "weight64"))
    outputs_of = []
    for target, args, dtype in ((torch.ops.aten.mm.default, (x, weight), torch.float32),
                                (torch.ops.aten.addmm.default, (bias, x, weight), torch.float32),
                                (torch.ops.aten.mm.default, (x64, weight64), torch.float64)):
        node = graph.call_function(target, args)
        node.meta["val"] = torch.empty(rows, outputs, dtype=dtype)
        outputs_of.append(node)
    graph.output(tuple(outputs_of))
    return fx.GraphModule(module, graph), [str(node.target) for node in graph.nodes if node.op == "call_function"]


def test_the_pass_takes_the_multi_row_float32_products_of_constant_weights():
    """Both float32 products become the operator over one packed copy of their weight, and the graph
    gives the products it gave; the float64 one keeps its kernel."""
    rows = linear_cpu.MIN_ROWS
    module, _ = product_graph(rows)
    x, x64 = torch.randn(rows, 8), torch.randn(rows, 8, dtype=torch.float64)
    expected = module(x, x64)
    linear_cpu.PACKED_PRODUCTS(module.graph)
    module.recompile()
    targets = [node.target for node in module.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.attnlab.linear_cpu.default] * 2 + [torch.ops.aten.mm.default]
    assert len([name for name, _ in module.named_buffers() if name.startswith("_attnlab_packed")]) == 1
    for got, want in zip(module(x, x64), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_pass_leaves_one_row_products_to_inductor():
    module, before = product_graph(rows=1)
    linear_cpu.PACKED_PRODUCTS(module.graph)
    assert [str(node.target) for node in module.graph.nodes if node.op == "call_function"] == before


def test_a_compiled_verification_multiplies_through_the_operator():
    """compile_decoding's CPU default: a chunk of six tokens after a prefill calls attnlab's
    product (the one-token steps keep inductor's) and gives the eager logits."""
    torch.manual_seed(0)
    config = variant_config("full", max_seq_len=32, depth=1)
    model, reference = Transformer(config).eval(), Transformer(config).eval()
    reference.load_state_dict(model.state_dict())
    assert model.compile_decoding()
    tokens = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache, eager_cache = model.new_cache(1, 32), reference.new_cache(1, 32)
        model(tokens[:, :8], cache=cache)
        reference(tokens[:, :8], cache=eager_cache)
        with profile() as profiled:
            logits = model(tokens[:, 8:14], cache=cache).logits
        expected = reference(tokens[:, 8:14], cache=eager_cache).logits
    assert any(event.name == "attnlab::linear_cpu" for event in profiled.events())
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
