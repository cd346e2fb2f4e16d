"""Linear: nn.Linear whose decoding-sized products on a CPU run as W x^T (model/linear.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.config import load_config
from attnlab.model import Transformer
from attnlab.model.linear import (
    COLUMN_PRODUCT_MAX_ROWS,
    COLUMN_PRODUCT_MIN_MODEL_BYTES,
    CONTIGUOUS_ROWS_MAX,
    Linear,
    column_product,
    column_products,
    decoding_products,
    linear_weight_bytes,
    set_column_layout,
    uses_column_product,
)
from attnlab.model.quantize import quantize_weights


def small_config():
    """A demo model with 128 KB of linear weights: far below COLUMN_PRODUCT_MIN_MODEL_BYTES."""
    return load_config("demo", ["model.dim=32", "model.depth=2", "model.heads=2", "model.dim_head=16"]).model


@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (5, 24), (COLUMN_PRODUCT_MAX_ROWS, 24), (2, 3, 24), (1, 1, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_column_product_equals_linear(shape, bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator)
    weight = torch.randn(40, 24, generator=generator)
    b = torch.randn(40, generator=generator) if bias else None
    y = column_product(x, weight, b)
    assert y.shape == (*shape[:-1], 40)
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_linear_takes_the_column_product_only_when_decoding_on_cpu():
    layer = Linear(16, 8)
    few, many = torch.randn(3, 16), torch.randn(COLUMN_PRODUCT_MAX_ROWS + 1, 16)
    with column_products(True):
        with torch.inference_mode():
            assert uses_column_product(few, layer.weight)
            assert not uses_column_product(many, layer.weight)  # more rows than decoding has
            assert not uses_column_product(few.double(), layer.weight)
        with torch.no_grad():
            assert uses_column_product(few, layer.weight)
        assert not uses_column_product(few, layer.weight)  # autograd on: training keeps F.linear
    with column_products(False), torch.inference_mode():
        assert not uses_column_product(few, layer.weight)


def test_linear_matches_nn_linear_in_both_layouts_and_trains_alike():
    torch.manual_seed(0)
    reference = nn.Linear(16, 8)
    layer = Linear(16, 8)
    layer.load_state_dict(reference.state_dict())  # the same parameters and state-dict keys
    x = torch.randn(2, 3, 16)
    for enabled in (True, False):
        with column_products(enabled), torch.inference_mode():
            torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)
    layer(x).square().sum().backward()
    grad_layer = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = None
    reference(x).square().sum().backward()
    torch.testing.assert_close(grad_layer, (x.grad, reference.weight.grad))


def test_cached_decoding_agrees_across_layouts():
    """A model decoding token by token gives the same logits with either product layout."""
    config = small_config()
    torch.manual_seed(0)
    model = Transformer(config).eval()
    assert set_column_layout(model, min_bytes=0)  # a model this small keeps F.linear by default
    assert all(m.column_layout for m in model.modules() if isinstance(m, Linear))
    tokens = torch.randint(0, config.num_tokens, (2, 12))
    logits = {}
    for enabled in (True, False):
        with column_products(enabled), torch.inference_mode():
            cache = model.new_cache(2, 12)
            logits[enabled] = torch.cat([model(tokens[:, i : i + 1], cache=cache).logits for i in range(12)], dim=1)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-5)


def test_environment_turns_the_column_layout_off():
    code = "import attnlab.model.linear as m; print(m.column_products_enabled())"
    for value, expected in (("0", "False"), ("1", str(torch.backends.mkl.is_available()))):
        env = {**os.environ, "ATTNLAB_COLUMN_PRODUCTS": value}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.strip() == expected


def test_a_model_takes_the_column_layout_by_the_size_of_its_weights():
    """Weights that stay in the caches keep F.linear; a model whose weights stream from memory
    takes the column products (COLUMN_PRODUCT_MIN_MODEL_BYTES)."""
    small = small_config()
    model = Transformer(small)
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    assert linear_weight_bytes(model) == 4 * sum(w.numel() for w in weights.values())
    assert linear_weight_bytes(model) < COLUMN_PRODUCT_MIN_MODEL_BYTES
    assert not model.head.column_layout
    x = torch.randn(1, 32)
    with column_products(True), torch.inference_mode():
        assert uses_column_product(x, model.head.weight)  # the product qualifies, the model does not
        assert torch.equal(model.head(x), F.linear(x, model.head.weight))
        model.head.column_layout = True
        assert torch.equal(model.head(x), column_product(x, model.head.weight))
    large = load_config("demo", ["model.dim=512", "model.depth=3", "model.heads=8", "model.dim_head=64"]).model
    model = Transformer(large)
    assert linear_weight_bytes(model) >= COLUMN_PRODUCT_MIN_MODEL_BYTES
    assert all(m.column_layout for m in model.modules() if isinstance(m, Linear))
    assert not set_column_layout(model, min_bytes=linear_weight_bytes(model) + 1)
    assert not any(m.column_layout for m in model.modules() if isinstance(m, Linear))


def test_decoding_products_names_what_a_model_multiplies_with():
    config = small_config()
    model = Transformer(config)
    with column_products(True):
        assert decoding_products(model) == "F.linear"  # too small for the column products
        set_column_layout(model, min_bytes=0)
        assert decoding_products(model) == "columns"
        assert decoding_products(model, "cuda") == "F.linear"
    with column_products(False):
        assert decoding_products(model) == "F.linear"
    quantize_weights(model, "int8")
    assert decoding_products(model) == "int8"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [2, 6, CONTIGUOUS_ROWS_MAX, CONTIGUOUS_ROWS_MAX + 1])
def test_column_product_multiplies_few_rows_contiguous(monkeypatch, bias, rows):
    """Up to CONTIGUOUS_ROWS_MAX rows W x^T must see the rows of x contiguous (x^T column-major):
    with x^T row-major, as the transposed result of another column product gives it (the
    feed-forward's down projection), MKL took up to 4.0x as long; from 12 rows on it was no slower,
    and x is taken as it comes (docs/benchmarks.md, "The rows of a column product")."""
    seen = []
    mm, addmm = torch.mm, torch.addmm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append(b.stride()) or mm(a, b))
    monkeypatch.setattr(torch, "addmm", lambda c, a, b: seen.append(b.stride()) or addmm(c, a, b))
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=generator)
    b = torch.randn(40, generator=generator) if bias else None
    produced = column_product(torch.randn(1, rows, 16, generator=generator), torch.randn(24, 16, generator=generator))
    assert not produced.is_contiguous()  # a transposed view, as the next layer receives it
    y = column_product(produced, weight, b)
    torch.testing.assert_close(y, F.linear(produced, weight, b), rtol=1e-5, atol=1e-5)
    # both products' x^T [K, N]: stride 1 down its columns (rows of x contiguous) up to the bound
    expected = (1, 24) if rows <= CONTIGUOUS_ROWS_MAX else (rows, 1)
    assert seen == [(1, 16), expected]
