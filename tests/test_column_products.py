"""Column products: the opt-in inference transform whose decoding-sized products on a CPU run as
W x^T (model/column_products.py); the model itself keeps nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.config import load_config
from attnlab.model import Transformer
from attnlab.model.column_products import (
    COLUMN_PRODUCT_MAX_ROWS,
    CONTIGUOUS_ROWS_MAX,
    ColumnLinear,
    column_product,
    decoding_products,
    use_column_products,
    uses_column_product,
)
from attnlab.model.quantize import quantize_weights


def small_config():
    """A demo model with 128 KB of linear weights."""
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


def test_column_product_only_when_decoding_on_cpu():
    weight = nn.Linear(16, 8).weight
    few, many = torch.randn(3, 16), torch.randn(COLUMN_PRODUCT_MAX_ROWS + 1, 16)
    with torch.inference_mode():
        assert uses_column_product(few, weight)
        assert not uses_column_product(many, weight)  # more rows than decoding has
        assert not uses_column_product(few.double(), weight)
    with torch.no_grad():
        assert uses_column_product(few, weight)
    assert not uses_column_product(few, weight)  # autograd on: training keeps F.linear


def test_the_model_is_plain_until_transformed():
    """Every linear layer of a model is an nn.Linear (F.linear products); the transform changes
    their forward only, in place, keeping tied weights tied, and is undone the same way."""
    config = small_config()
    config.tie_embeddings = True
    model = Transformer(config)
    assert not any(isinstance(m, ColumnLinear) for m in model.modules())
    assert decoding_products(model) == "F.linear"
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert use_column_products(model) == n_linear
    assert model.head.weight is model.token_embedding.embed.weight
    assert decoding_products(model) == "columns" and decoding_products(model, "cuda") == "F.linear"
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    assert use_column_products(model, enabled=False) == n_linear
    assert decoding_products(model) == "F.linear"
    quantize_weights(model, "int8")
    assert decoding_products(model) == "int8"


def test_transformed_layer_trains_as_nn_linear():
    torch.manual_seed(0)
    reference = nn.Linear(16, 8)
    layer = nn.Linear(16, 8)
    layer.load_state_dict(reference.state_dict())
    use_column_products(layer)
    assert isinstance(layer, ColumnLinear)
    x = torch.randn(2, 3, 16)
    with torch.inference_mode():
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
    tokens = torch.randint(0, config.num_tokens, (2, 12))
    logits = {}
    for enabled in (False, True):
        use_column_products(model, enabled)
        with torch.inference_mode():
            cache = model.new_cache(2, 12)
            logits[enabled] = torch.cat([model(tokens[:, i : i + 1], cache=cache).logits for i in range(12)], dim=1)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [2, 6, CONTIGUOUS_ROWS_MAX, CONTIGUOUS_ROWS_MAX + 1])
def test_column_product_multiplies_few_rows_contiguous(monkeypatch, bias, rows):
    """Up to CONTIGUOUS_ROWS_MAX rows W x^T must see the rows of x contiguous (x^T column-major):
    with x^T row-major, as the transposed result of another column product gives it (the
    feed-forward's down projection), MKL took up to 4.0x as long; from 12 rows on it was no slower,
    and x is taken as it comes."""
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
