"""Sampling filters and generation: cache = no cache, seeded, and exact distributions."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.errors import ConfigError
from attnlab.generate import sampling_cpu
from attnlab.generate.distribution import token_at
from attnlab.generate.sampling import SamplingConfig, filter_logits, generate, probabilities, sample_from, stream
from attnlab.model import Transformer
from variants import variant_config

LOGITS = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))


def kept(config: SamplingConfig) -> list[int]:
    return torch.isfinite(filter_logits(LOGITS, config)).nonzero().flatten().tolist()


def test_filters_keep_the_right_tokens():
    assert kept(SamplingConfig()) == [0, 1, 2, 3, 4, 5]
    assert kept(SamplingConfig(top_k=2)) == [0, 1]
    assert kept(SamplingConfig(top_p=0.5)) == [0, 1]  # 0.40 < 0.5, 0.65 >= 0.5
    assert kept(SamplingConfig(top_p=0.35)) == [0]
    assert kept(SamplingConfig(top_p=0.66)) == [0, 1, 2]
    assert kept(SamplingConfig(min_p=0.3)) == [0, 1, 2]  # >= 0.12
    assert kept(SamplingConfig(top_k=3, min_p=0.5)) == [0, 1]


def test_bad_sampling_values_rejected():
    for bad in (dict(temperature=-1), dict(top_k=0), dict(top_p=0), dict(min_p=2)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


@pytest.mark.parametrize("config", [SamplingConfig(), SamplingConfig(temperature=0.7, top_k=4),
                                    SamplingConfig(top_p=0.8), SamplingConfig(min_p=0.2, temperature=1.5)])
def test_sampled_frequencies_match_the_distribution(config):
    """Chi-square goodness of fit of 20000 draws against the filtered, tempered distribution."""
    expected = probabilities(LOGITS, config)
    generator = torch.Generator().manual_seed(0)
    draws = sample_from(expected.expand(20000, -1), generator)
    counts = torch.bincount(draws, minlength=len(LOGITS)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a filtered-out token was sampled"
    want = expected[support].double() * 20000
    chi2 = ((counts[support] - want) ** 2 / want).sum().item()
    dof = int(support.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof) + 10, (chi2, dof)  # far beyond the 0.999 quantile


def test_greedy_is_argmax():
    assert torch.equal(probabilities(LOGITS, SamplingConfig(temperature=0)), torch.eye(6)[0])


def test_a_tiny_temperature_is_greedy_not_nan():
    """logits / a tiny temperature overflowed to -inf (or +inf): a softmax of NaN, from which the draw
    lands past the vocabulary (an IndexError in the embedding). One float32 rounds to 0 is refused."""
    for logits in (LOGITS, LOGITS + 10):
        assert torch.equal(probabilities(logits, SamplingConfig(temperature=1.2e-38)), torch.eye(6)[0])
    with pytest.raises(ConfigError, match="temperature must be 0 .greedy. or at least"):
        SamplingConfig(temperature=1e-46)


@pytest.mark.parametrize("name", ["full", "local"])
def test_cached_and_uncached_generation_agree(name):
    torch.manual_seed(0)
    model = Transformer(variant_config(name)).eval()
    prompt = torch.randint(0, 61, (2, 11))
    cached = list(stream(model, prompt, 30, SamplingConfig(temperature=0)))
    uncached = list(stream(model, prompt, 30, SamplingConfig(temperature=0), use_cache=False))
    for (token_a, logits_a), (token_b, logits_b) in zip(cached, uncached):
        torch.testing.assert_close(logits_a, logits_b, atol=1e-5, rtol=1e-5)
        assert torch.equal(token_a, token_b)


def test_seeded_generation_reproducible():
    torch.manual_seed(0)
    model = Transformer(variant_config("full")).eval()
    prompt = torch.randint(0, 61, (1, 5))
    runs = [generate(model, prompt, 20, SamplingConfig(top_k=10), generator=torch.Generator().manual_seed(3))
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (1, 25)


def test_sampling_never_lands_past_the_last_likely_token(monkeypatch):
    """The largest uniform draw below 1, scaled by a sum that rounds up, must still pick a token of
    positive probability, never a trailing zero-probability one."""
    probs = torch.tensor([[0.1, 0.7, 0.2, 0.0, 0.0], [0.0, 0.0, 1 / 3, 1 / 3, 1 / 3]])
    largest_below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    monkeypatch.setattr(torch, "rand", lambda shape, **options: torch.full(shape, float(largest_below_one)))
    assert sample_from(probs).tolist() == [2, 4]
    monkeypatch.setattr(torch, "rand", lambda shape, **options: torch.zeros(shape))
    assert sample_from(probs).tolist() == [0, 2]  # a draw of 0 skips the zero-probability tokens before


@pytest.mark.skipif(not sampling_cpu.available(), reason="no C++ compiler for the CPU operators")
def test_the_cpu_operator_draws_torchs_tokens(monkeypatch):
    """token_at's CPU operator (sampling_cpu.cpp) picks the tokens torch's cumulative sum and search
    pick, bit for bit: distributions with many zero-probability tokens, the extreme uniforms, leading
    dimensions, vocabularies of 1 to 6400; and its fake gives torch.compile the operator's output."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for n_tokens in (1, 2, 7, 256, 6400):
        for _ in range(20):
            probs = torch.softmax(4 * torch.randn(2, 3, n_tokens, generator=generator), dim=-1)
            probs[torch.rand(probs.shape, generator=generator) < 0.5] = 0  # top-k, top-p and min-p leave zeros
            uniform = torch.rand(2, 3, generator=generator)
            uniform[0, :2] = torch.tensor([0.0, 1 - 2**-24])  # 0 and the largest float32 below 1
            cases.append((probs, uniform))
    tokens = [token_at(probs, uniform) for probs, uniform in cases]
    monkeypatch.setattr(sampling_cpu, "available", lambda: False)  # torch's cumsum and searchsorted
    for (probs, uniform), token in zip(cases, tokens):
        assert token.dtype == torch.long and torch.equal(token, token_at(probs, uniform))
    torch.library.opcheck(torch.ops.attnlab.token_at_cpu, cases[70])


@pytest.mark.parametrize("decoder", ["generate", "speculative"])
def test_a_model_trains_after_decoding_grew_its_rotary_table(decoder):
    """Decoding runs under inference mode; past the rotary table's length it grows the table, which
    must stay an ordinary tensor: a training step after it saves the table for its backward."""
    from attnlab.generate.speculative import speculative_generate

    torch.manual_seed(0)
    model = Transformer(variant_config("full", max_seq_len=16)).eval()
    rotary = model.blocks[0].attention.heads.spec.rotary
    length = rotary.cos.shape[0]
    prompt = torch.randint(0, 61, (1, 5))
    if decoder == "generate":
        tokens = generate(model, prompt, 2 * length)
        assert not tokens.is_inference()
    else:
        speculative_generate(model, model, prompt, 2 * length, gamma=2)
    assert rotary.cos.shape[0] > length and not rotary.cos.is_inference()
    model.train()
    tokens = torch.randint(0, 61, (2, 3 * length))
    model(tokens, targets=tokens).loss.backward()
    assert all(parameter.grad is not None for parameter in model.blocks[0].attention.parameters())


def test_stream_yields_ordinary_tensors():
    """The steps run under inference mode; the caller gets tensors it may change in place."""
    torch.manual_seed(0)
    model = Transformer(variant_config("full")).eval()
    token, logits = next(iter(stream(model, torch.randint(0, 61, (2, 4)), 3)))
    assert not token.is_inference() and not logits.is_inference()
    token += 1
    logits.zero_()
