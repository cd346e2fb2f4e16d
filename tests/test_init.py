"""The initial weights `model.init` names (Transformer.initialise)."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.config import ModelConfig, config_from_dict
from attnlab.model import Transformer

NSA = {"kind": "nsa", "nsa": {"sliding_window_size": 16, "compress_block_size": 8, "compress_stride": 4,
                              "selection_block_size": 8, "num_selected": 2}}


def build(**values) -> Transformer:
    torch.manual_seed(0)
    return Transformer(config_from_dict({"dim": 256, "depth": 4, "max_seq_len": 64, **values}, ModelConfig))


def linear_layers(model: Transformer):
    return [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def test_torch_init_keeps_the_modules_own_scales():
    model = build(init="torch")
    assert model.token_embedding.embed.weight.std().item() == pytest.approx(1.0, rel=0.05)
    for name, linear in linear_layers(model):  # Kaiming-uniform: std 1 / sqrt(3 fan_in)
        assert linear.weight.std().item() == pytest.approx(1 / math.sqrt(3 * linear.in_features), rel=0.1), name


def test_a_tied_embedding_starts_as_the_output_layer():
    model = build(init="torch", tie_embeddings=True)
    assert model.head.weight is model.token_embedding.embed.weight
    assert model.head.weight.std().item() == pytest.approx(1 / math.sqrt(3 * 256), rel=0.1)


def test_gpt2_init_scales_the_residual_projections():
    model = build(init="gpt2")
    assert model.token_embedding.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for name, linear in linear_layers(model):
        residual = name.endswith(("to_out", "down"))
        expected = 0.02 / math.sqrt(2 * 4) if residual else 0.02
        assert linear.weight.std().item() == pytest.approx(expected, rel=0.1), name
        assert linear.bias is None or not linear.bias.any(), name


@pytest.mark.parametrize("init", ["torch", "gpt2"])
def test_nsa_gates_start_on_the_sliding_branch_under_either_init(init):
    model = build(init=init, kv_heads=2, attention=NSA)
    for block in model.blocks:
        bias = block.attention.config.gate_init_bias  # the default, 4 (tests/test_nsa.py)
        expected = torch.tensor([-bias, -bias, bias]).repeat(4)
        assert torch.equal(block.attention.to_gates.bias, expected)
