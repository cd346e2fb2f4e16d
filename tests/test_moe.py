"""Mixture-of-experts feed-forward: dense equivalence, balance loss minimum, routing, training."""

from __future__ import annotations

import pytest
import torch

from attnlab.config import ModelConfig, MoEConfig, load_config
from attnlab.errors import ConfigError
from attnlab.model.layers import SwiGLU
from attnlab.model.moe import MoEFeedForward, balance_loss, route
from attnlab.model.transformer import Transformer
from attnlab.train.loop import train
from attnlab.train.metrics import read_metrics


def moe_config(**moe) -> ModelConfig:
    return ModelConfig(
        dim=32, depth=2, heads=2, dim_head=16, max_seq_len=32, feed_forward="moe", norm="rmsnorm", moe=MoEConfig(**moe)
    )


def test_one_expert_top1_equals_dense_swiglu():
    torch.manual_seed(0)
    config = moe_config(n_experts=1, top_k=1, n_shared_experts=0)
    moe, dense = MoEFeedForward(config), SwiGLU(config)
    moe.experts[0].load_state_dict(dense.state_dict())
    x = torch.randn(3, 7, 32)
    torch.testing.assert_close(moe(x), dense(x), rtol=0, atol=1e-6)


def test_shared_expert_is_added_for_every_token():
    torch.manual_seed(0)
    config = moe_config(n_experts=1, top_k=1, n_shared_experts=1)
    moe = MoEFeedForward(config)
    x = torch.randn(2, 5, 32)
    expected = moe.experts[0](x) + moe.shared_experts[0](x)
    torch.testing.assert_close(moe(x), expected, rtol=0, atol=1e-6)


def test_balance_loss_is_one_for_a_uniform_router():
    torch.manual_seed(0)
    config = moe_config(n_experts=4, top_k=2, balance_loss_weight=0.5)
    moe = MoEFeedForward(config)
    torch.nn.init.zeros_(moe.router.weight)  # every token: probabilities 1/4 each
    moe(torch.randn(2, 16, 32))
    # n_experts * sum_e f_e * (1 / n_experts) = sum_e f_e = 1, its minimum over routers with balanced f
    torch.testing.assert_close(moe.aux_losses["moe_balance"], torch.tensor(0.5))


def test_balance_loss_penalises_a_collapsed_router():
    logits = torch.tensor([[4.0, 0.0, 0.0, 0.0]]).repeat(64, 1)  # every token prefers expert 0
    probabilities, _, experts = route(logits, top_k=1, normalize=True)
    collapsed = balance_loss(probabilities, torch.bincount(experts.flatten(), minlength=4))
    assert collapsed > 3.0  # f_0 = 1 and P_0 ~ 0.95: close to the maximum n_experts
    uniform_probabilities, _, uniform_experts = route(torch.zeros(64, 4), top_k=1, normalize=True)
    uniform_counts = torch.bincount(uniform_experts.flatten(), minlength=4)
    assert balance_loss(uniform_probabilities, uniform_counts) == pytest.approx(1.0)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_every_token_gets_exactly_top_k_experts(top_k):
    torch.manual_seed(top_k)
    config = moe_config(n_experts=4, top_k=top_k, n_shared_experts=0)
    moe = MoEFeedForward(config)
    x = torch.randn(2, 9, 32)
    y = moe(x)
    probabilities, weights, experts = route(moe.router(x.reshape(-1, 32)), top_k, normalize=True)
    assert experts.shape == (18, top_k)
    assert all(len(set(row)) == top_k for row in experts.tolist())  # k distinct experts per token
    if top_k > 1:  # renormalised, as MiniMind's norm_topk_prob; top-1 keeps its probability (Switch)
        torch.testing.assert_close(weights.sum(-1), torch.ones(18))
    else:
        torch.testing.assert_close(weights[:, 0], probabilities.max(-1).values)
    # no token dropped: the output is exactly the weighted sum of its k experts, recomputed token by token
    flat = x.reshape(-1, 32)
    expected = torch.stack(
        [sum(weights[n, j] * moe.experts[int(experts[n, j])](flat[n]) for j in range(top_k)) for n in range(18)]
    )
    torch.testing.assert_close(y.reshape(-1, 32), expected, rtol=1e-5, atol=1e-6)
    loads = [moe.stats[f"moe_load/{e}"].item() for e in range(4)]
    assert sum(loads) == pytest.approx(1.0)


def test_z_loss_reported_only_when_weighted():
    x = torch.randn(2, 4, 32)
    without = MoEFeedForward(moe_config())
    without(x)
    assert set(without.aux_losses) == {"moe_balance"}
    with_z = MoEFeedForward(moe_config(z_loss_weight=1e-3))
    with_z(x)
    assert set(with_z.aux_losses) == {"moe_balance", "moe_z"} and with_z.aux_losses["moe_z"] > 0


def test_gradients_finite_and_aux_loss_in_model_loss():
    torch.manual_seed(0)
    model = Transformer(moe_config(z_loss_weight=1e-3))
    tokens = torch.randint(0, 256, (2, 17))
    output = model(tokens[:, :-1], targets=tokens[:, 1:])
    assert set(output.aux_losses) == {"moe_balance", "moe_z"}
    torch.testing.assert_close(output.loss, output.lm_loss + sum(output.aux_losses.values()))
    output.loss.backward()
    router_grads = [block.feed_forward.inner.router.weight.grad for block in model.blocks]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in router_grads)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert set(model.collect_stats()) == {f"moe_load/{e}" for e in range(4)}


def test_invalid_top_k_and_chunks_rejected():
    with pytest.raises(ConfigError, match="top_k"):
        MoEFeedForward(moe_config(n_experts=2, top_k=3))
    config = moe_config()
    config.ff_chunks = 2
    with pytest.raises(ConfigError, match="ff_chunks"):
        MoEFeedForward(config)


def test_model_with_moe_trains(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    config = load_config(
        "demo",
        [
            f"out_dir={tmp_path / 'runs'}",
            "name=moe",
            "model.dim=32",
            "model.depth=2",
            "model.heads=2",
            "model.dim_head=16",
            "model.max_seq_len=32",
            "model.feed_forward=moe",
            "model.norm=rmsnorm",
            "data.source=file",
            f"data.path={text}",
            "train.seq_len=32",
            "train.batch_size=4",
            "train.max_steps=12",
            "train.warmup_steps=2",
            "train.eval_every=12",
            "train.eval_batches=1",
            "train.sample_every=0",
            "train.save_every=12",
            "train.log_every=1",
            "log.progress=false",
        ],
    )
    result = train(config)
    records = [r for r in read_metrics(result.run_dir) if "loss" in r]
    assert len(records) == 12 and "moe_balance" in records[0] and "moe_load/0" in records[0]
    assert records[-1]["lm_loss"] < records[0]["lm_loss"]
