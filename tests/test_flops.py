"""FLOPs per token by attention type, checked against hand counts; MFU only where a peak is known."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab.config import ModelConfig, config_from_dict, known_presets, load_config
from attnlab.flops import active_linear_parameters, flops_per_token, keys_per_query, peak_flops
from attnlab.model import Transformer
from variants import variant_config


def small(**values) -> ModelConfig:
    base = dict(num_tokens=100, dim=32, depth=2, heads=4, dim_head=8, max_seq_len=512, ff_mult=4.0)
    return config_from_dict({**base, **values}, ModelConfig)


def test_dense_count_by_hand():
    config = small()
    # per layer q, k, v, out: 4 * 32 * 32; gelu MLP: 2 * 32 * 128; head: 32 * 100
    linear = 2 * (4 * 32 * 32 + 2 * 32 * 128) + 32 * 100
    assert active_linear_parameters(config) == linear
    seq = 256
    attention = 2 * 4 * 4 * 8 * seq  # layers * 4 * heads * dim_head * T keys (PaLM's convention)
    assert flops_per_token(config, seq, training=False) == 2 * linear + attention
    assert flops_per_token(config, seq) == 3 * (2 * linear + attention)


def test_keys_per_query_by_type():
    assert keys_per_query(small(attention={"kind": "local", "local": {"window_size": 64}}), 1024, 0) == 64
    assert keys_per_query(small(attention={"kind": "local", "local": {"window_size": 64}}), 16, 0) == 16
    routing = small(attention={"kind": "routing", "routing": {"window_size": 64, "n_local_heads": [1, 4]}})
    assert keys_per_query(routing, 1024, 0) == (1 * 64 + 3 * 65) / 4  # 1 local head, 3 routed
    assert keys_per_query(routing, 1024, 1) == 64
    sinkhorn = small(attention={"kind": "sinkhorn", "sinkhorn": {"bucket_size": 64, "n_sortcut": 2,
                                                                  "n_local_heads": 2}})
    assert keys_per_query(sinkhorn, 1024, 0) == (2 * 64 + 2 * 192) / 4
    nsa = small(kv_heads=2, attention={"kind": "nsa", "nsa": {"compress_stride": 8, "num_selected": 4,
                                                                "selection_block_size": 16,
                                                                "sliding_window_size": 64}})
    assert keys_per_query(nsa, 1024, 0) == 1024 / 8 + 64 + 64


def test_moe_counts_active_experts_only():
    dense = small(feed_forward="swiglu")
    moe = small(feed_forward="moe", moe={"n_experts": 4, "top_k": 1, "n_shared_experts": 0})
    # one routed expert of the dense MLP's size per token, plus the router
    assert active_linear_parameters(moe) == pytest.approx(active_linear_parameters(dense) + 2 * 32 * 4)


@pytest.mark.parametrize("name", known_presets())
def test_every_preset_is_counted(name):
    config = load_config(name)
    assert flops_per_token(config.model, config.train.seq_len) > 6 * config.model.dim


def test_peak_only_where_known():
    assert peak_flops(torch.device("cpu"), None) is None
    assert peak_flops(torch.device("cpu"), torch.bfloat16, configured_tflops=2.0) == 2e12


def test_training_logs_model_flops_and_mfu(tmp_path):
    from attnlab.train.loop import train
    from attnlab.train.metrics import read_metrics
    from test_train import TEXT, tiny

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(TEXT)
    config = tiny(tmp_path, corpus, "mfu", "train.max_steps=2", "train.eval_every=0", "train.peak_tflops=0.5")
    records = [r for r in read_metrics(train(config).run_dir) if "tokens_per_s" in r]
    per_step = flops_per_token(config.model, config.train.seq_len) * config.train.batch_size * config.train.seq_len
    for record in records:
        assert record["model_tflops_per_s"] == pytest.approx(per_step * record["tokens_per_s"] / (
            config.train.batch_size * config.train.seq_len) / 1e12)
        assert record["mfu"] == pytest.approx(record["model_tflops_per_s"] / 0.5)


@pytest.mark.parametrize("name", ["full", "local", "routing", "sinkhorn", "nsa"])
def test_flop_counter_runs_on_every_variant(name, cpu_path):
    """torch's FlopCounterMode (what profilers and MFU tools use) runs a forward and backward of
    every attention type on both CPU paths, and counts at least the projections' matmuls."""
    torch.manual_seed(0)
    config = variant_config(name)
    model = Transformer(config).train()
    tokens = torch.randint(0, config.num_tokens, (2, 33))
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
    projections = 2 * 2 * 32 * config.depth * 4 * config.dim * config.heads * config.dim_head // 2  # a lower bound
    assert counter.get_total_flops() > projections
