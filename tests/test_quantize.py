"""Weight-only int8 quantization (model/quantize.py): each layer's output is the dequantized
weight's product (attnlab's CPU operator, torch's kernel and the float path agree), a quantized
model stays close to the float one and is still a consistent cached model, and a quantized draft
leaves speculative decoding exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.generate.speculative import speculative_generate
from attnlab.model import Transformer, int8_linear_cpu
from attnlab.model.quantize import FAST_PATH_MAX_ROWS, PRODUCTS, Int8Linear, choose_products, quantize_weights
from variants import variant_config

KERNEL = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="no int8 CPU kernel")
OPERATOR = pytest.mark.skipif(not int8_linear_cpu.available(), reason="attnlab's int8 operator is not built here")


def linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight[3] = 0  # a row of zeros: its scale stays finite, its outputs zero
    return layer


@pytest.mark.parametrize("bias", [True, False])
def test_int8_weights_are_the_rounded_float_weights(bias):
    layer = linear(64, 40, bias)
    quantized = Int8Linear.from_linear(layer)
    assert quantized.weight.dtype == torch.int8 and quantized.weight.abs().max() == 127
    # rounding to the nearest of 255 levels per row: at most half a level off
    error = (quantized.dequantized() - layer.weight).abs()
    assert (error <= quantized.scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(2, 5, 64)
    exact = nn.functional.linear(x, quantized.dequantized(), layer.bias)
    torch.testing.assert_close(quantized(x, product="dequantized"), exact, rtol=1e-5, atol=1e-5)
    assert quantized(x).shape == (2, 5, 40) and torch.isfinite(quantized(x)).all()
    assert (quantized(x, product="dequantized")[..., 3] == (layer.bias[3] if bias else 0)).all()


@KERNEL
@pytest.mark.parametrize("rows", [1, 4])
def test_cpu_kernel_matches_the_float_path(rows):
    layer = linear(256, 48, bias=True)
    quantized = Int8Linear.from_linear(layer)
    assert quantized.torch_kernel_handles
    x = torch.randn(rows, 1, 256)
    reference = quantized(x, product="dequantized")
    # bfloat16 activations and scales: about 3 significant digits
    torch.testing.assert_close(quantized(x, product="torch"), reference, rtol=2e-2, atol=2e-2 * reference.abs().max())


def test_torch_kernel_is_avoided_for_widths_it_miscomputes(monkeypatch):
    monkeypatch.setattr(int8_linear_cpu, "available", lambda: False)  # no compiler, or ATTNLAB_CPU_KERNELS=0
    for width in (24, 8):  # a width it gets wrong, one it crashes on
        quantized = Int8Linear.from_linear(linear(width, 8, bias=False))
        assert not quantized.torch_kernel_handles and quantized.product_for(torch.randn(1, width)) == "dequantized"
    assert Int8Linear.from_linear(linear(32, 8, bias=False)).product_for(torch.randn(1, 32)) == ("torch" if hasattr(
        torch.ops.aten, "_weight_int8pack_mm") else "dequantized")


@OPERATOR
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("width, outputs", [(256, 48), (70, 37), (8, 5), (1024, 256)])
def test_cpu_operator_is_the_dequantized_product(rows, width, outputs):
    """attnlab's operator: every block of rows (4, then 3, 2 or 1) by outputs (8 to 2 a block, then
    one at a time), reduction widths with a tail past the last whole vector (70) and shorter than
    one (8 with AVX-512), against the product in float64."""
    quantized = Int8Linear.from_linear(linear(width, outputs, bias=True, seed=rows))
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width))
    exact = (x.double() @ quantized.dequantized(torch.float64).T + quantized.bias.double()).float()
    got = quantized(x, product="cpu")
    assert got.dtype == torch.float32 and got.shape == (rows, outputs)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5 * exact.abs().max())
    strided = torch.zeros(rows, width + 5)
    strided[:, 2 : 2 + width] = x  # rows further apart than their width: read in place
    assert torch.equal(quantized(strided[:, 2 : 2 + width], product="cpu"), got)


@OPERATOR
def test_default_product_is_the_operator_for_a_few_float32_rows(monkeypatch):
    quantized = Int8Linear.from_linear(linear(64, 16, bias=False))
    assert quantized.product_for(torch.randn(FAST_PATH_MAX_ROWS, 64)) == "cpu"
    assert quantized.product_for(torch.randn(FAST_PATH_MAX_ROWS + 1, 64)) == "dequantized"  # a prefill: a GEMM
    expected_bfloat16 = "torch" if hasattr(torch.ops.aten, "_weight_int8pack_mm") else "dequantized"
    assert quantized.product_for(torch.randn(1, 64, dtype=torch.bfloat16)) == expected_bfloat16
    assert quantized.product_for(torch.randn(1, 64), compiled=True, packed=True) == expected_bfloat16  # its template
    assert quantized.product_for(torch.randn(1, 64), compiled=True, packed=False) == "cpu"  # a step reading weights
    assert quantized.product_for(torch.randn(1, 64), compiled=True) == "cpu"  # no packed step compiling now
    model = nn.Sequential(quantized, nn.ReLU(), Int8Linear.from_linear(linear(16, 8, bias=False)))
    x = torch.randn(3, 64)
    expected = model(x)

    def refuse(*arguments):
        raise AssertionError("the operator was called")

    monkeypatch.setattr(int8_linear_cpu, "int8_linear", refuse)
    choose_products(model, "dequantized")  # every call of every layer, whatever its default
    assert [module.product for module in model if isinstance(module, Int8Linear)] == ["dequantized"] * 2
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    choose_products(model, None)
    with pytest.raises(AssertionError, match="operator was called"):
        model(x)


def test_unknown_product_is_refused():
    quantized = Int8Linear.from_linear(linear(16, 8, bias=False))
    with pytest.raises(ValueError, match="int8 product is one of cpu, torch, dequantized; got 'fast'"):
        quantized(torch.randn(1, 16), product="fast")
    with pytest.raises(ValueError, match="int8 product is one of"):
        choose_products(quantized, "fast")
    assert PRODUCTS == ("cpu", "torch", "dequantized")


def test_quantized_model_is_close_to_the_float_model_and_cache_consistent():
    torch.manual_seed(0)
    model = Transformer(variant_config("full", dim=64, heads=4, dim_head=16, depth=2)).eval()
    tokens = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        float_logits = model(tokens).logits
        n_linears = sum(isinstance(module, nn.Linear) for module in model.modules())
        assert quantize_weights(model, "int8") == n_linears > 0
        assert not any(isinstance(module, nn.Linear) for module in model.modules())
        assert isinstance(model.token_embedding.embed, nn.Embedding)  # embeddings stay float
        logits = model(tokens).logits
        assert (logits - float_logits).abs().max() < 0.05 * float_logits.std()
        # the cached forward (a prompt, then single tokens on the CPU kernel) = the parallel one
        cache = model.new_cache(2, 12)
        steps = [model(tokens[:, :8], cache=cache).logits] + [
            model(tokens[:, i : i + 1], cache=cache).logits for i in range(8, 12)
        ]
        torch.testing.assert_close(torch.cat(steps, dim=1), logits, rtol=2e-2, atol=2e-2 * logits.abs().max())


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        quantize_weights(nn.Linear(4, 4), "int4")
    model = nn.Sequential(nn.Linear(4, 4))
    assert quantize_weights(model, "none") == 0 and isinstance(model[0], nn.Linear)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", ["full", "routing", "sinkhorn", "nsa"])
def test_quantized_draft_keeps_greedy_speculative_equal_to_the_target(batch, name):
    torch.manual_seed(0)
    target = Transformer(variant_config(name, depth=2)).eval()
    draft = Transformer(variant_config(name, depth=1)).eval()
    with torch.no_grad():
        target.head.weight.mul_(8)
        draft.head.weight.mul_(8)
    quantize_weights(draft, "int8")
    prompt = torch.randint(0, 61, (batch, 9), generator=torch.Generator().manual_seed(batch))
    greedy = SamplingConfig(temperature=0)
    expected = generate(target, prompt, 24, greedy)
    result = speculative_generate(target, draft, prompt, 24, gamma=5, sampling=greedy)
    assert torch.equal(result.tokens, expected)


def test_quantized_nsa_layer_keeps_a_float_cache():
    """An NSA layer's cache takes its dtype from a float parameter of the layer, not from a
    projection that quantization made int8."""
    model = Transformer(variant_config("nsa", depth=1)).eval()
    quantize_weights(model, "int8")
    cache = model.blocks[0].attention.new_cache(2, 16)
    assert {tensor.dtype for tensor in cache.tensors.values()} == {torch.float32}
    assert cache.compressed_keys.dtype == torch.float32


def test_decoding_products_names_what_a_model_multiplies_with():
    from attnlab.model.quantize import decoding_products

    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 4)))
    assert decoding_products(model) == "F.linear"
    quantize_weights(model[1], "int8")
    default = model[1][0].product_for(torch.randn(1, 16))
    assert decoding_products(model) == f"F.linear+int8 {default}"
    compiled = model[1][0].product_for(torch.randn(1, 16), compiled=True, packed=False)
    assert decoding_products(model, compiled=True) == f"F.linear+int8 {compiled}"
    model._frozen_weights = object()  # as a model whose compiled step is packed (compile_decoding's default)
    packed = model[1][0].product_for(torch.randn(1, 16), compiled=True, packed=True)
    assert decoding_products(model, compiled=True) == f"F.linear+int8 {packed}"
    assert decoding_products(model) == f"F.linear+int8 {default}"
    model.decoding_linear = "cpu"  # as a Transformer compiled with linear="cpu"
    assert decoding_products(model, compiled=True) == f"int8 {packed}+linear cpu"
    assert decoding_products(model) == f"F.linear+int8 {default}"
    choose_products(model, "dequantized")
    assert decoding_products(model) == "F.linear+int8 dequantized"


@OPERATOR
def test_cpu_operator_compiles_into_a_step_by_its_fake_and_cpp_wrapper():
    """A layer fixed to the operator (choose_products) traced whole by torch.compile and called
    from inductor's C++ wrapper, as a compiled decode step calls it: the eager layer's outputs."""
    quantized = Int8Linear.from_linear(linear(64, 24, bias=True))
    choose_products(quantized, "cpu")
    compiled = torch.compile(quantized, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), quantized(x), rtol=1e-6, atol=1e-6)
