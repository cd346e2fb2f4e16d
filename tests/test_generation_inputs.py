"""Bad arguments to the Python decoding API (generate, speculative_generate, a model's cache): each
refused in one line naming what is wrong, before any forward, never an error deep in torch or a
silent wrong result."""

from __future__ import annotations

import logging

import pytest
import torch

from attnlab.errors import AttnlabError, GenerationError
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.generate.speculative import speculative_generate
from attnlab.model import Transformer
from variants import variant_config

PROMPT = torch.tensor([[1, 2, 3]])
GREEDY = SamplingConfig(temperature=0)


def model(name: str = "full", seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(variant_config(name, **overrides)).eval()


def refused(call, message: str, error: type[Exception] = AttnlabError) -> None:
    """call() raises `error` whose text is one line and starts with `message`."""
    with pytest.raises(error) as raised:
        call()
    text = str(raised.value)
    assert "\n" not in text and text.startswith(message), text


BAD_PROMPTS = [
    (PROMPT[:, :0], "the prompt needs at least one token"),  # was an IndexError in the first draw
    (torch.tensor([1, 2, 3]), "the prompt must be a [batch, tokens] tensor"),  # an IndexError in the checks
    (PROMPT.float(), "the prompt must hold integer token ids"),  # a RuntimeError in the embedding
    (PROMPT.to(torch.uint8), "the prompt must hold integer token ids"),  # bytes as numpy holds them: the same
    (PROMPT.short(), "the prompt must hold integer token ids"),
    (PROMPT.to("meta"), "the prompt is on meta, "),  # another device: an error deep in torch
]


@pytest.mark.parametrize("prompt, message", BAD_PROMPTS)
def test_generate_refuses_a_bad_prompt(prompt, message):
    refused(lambda: generate(model(), prompt, 4), message, ValueError)


@pytest.mark.parametrize("prompt, message", BAD_PROMPTS)
def test_speculative_generate_refuses_a_bad_prompt(prompt, message):
    refused(lambda: speculative_generate(model(), model(seed=1, depth=1), prompt, 4), message, ValueError)


@pytest.mark.parametrize("count", [-1, 2.0])
def test_a_negative_or_fractional_max_new_tokens_is_refused(count):
    """-1 returned the prompt alone, silently (both decoders); 2.0 failed in a cache's allocation."""
    target, draft = model(), model(seed=1, depth=1)
    refused(lambda: generate(target, PROMPT, count), "max_new_tokens must be a whole number >= 0", ValueError)
    refused(lambda: speculative_generate(target, draft, PROMPT, count), "max_new_tokens must be a whole number",
            ValueError)
    assert generate(target, PROMPT, 0).shape == (1, 3)  # zero new tokens: the prompt
    assert generate(target, PROMPT.int(), 2).dtype == torch.long  # int32 ids: the embedding takes them
    assert speculative_generate(target, draft, PROMPT, 0).tokens.shape == (1, 3)


def test_a_fractional_top_k_is_refused():
    """top_k=2.5 was accepted, then failed at the first draw inside torch.topk."""
    refused(lambda: SamplingConfig(top_k=2.5), "top_k must be a whole number >= 1", ValueError)
    assert generate(model(), PROMPT, 2, SamplingConfig(top_k=1000)).shape == (1, 5)  # more than V: no filter


def test_speculative_generate_checks_the_draft_against_the_target():
    """A prompt id past the vocabulary was an IndexError in the embedding; a draft of another
    vocabulary a size mismatch inside the acceptance rule."""
    target, draft = model(), model(seed=1, depth=1)
    refused(lambda: speculative_generate(target, draft, torch.tensor([[1, 99]]), 4),
            "the prompt holds token ids from 1 to 99; the target has 61", GenerationError)
    for n_tokens in (50, 80):
        refused(lambda n=n_tokens: speculative_generate(target, model(seed=1, depth=1, num_tokens=n), PROMPT, 4),
                f"the draft's vocabulary has {n_tokens} tokens, the target's 61", ValueError)


@pytest.mark.parametrize("batch, past_goal", [(1, 2), (4, 6)])
def test_learned_positions_are_checked_before_decoding(batch, past_goal):
    """A draft (or target) with learned positions failed mid-decoding, some runs and not others, with
    an error not naming it, when the tokens decoded past the goal (never output) ran past its
    max_seq_len: gamma - 1 of them at batch 1, 2 gamma in a batch. Refused up front; a goal that
    leaves room decodes."""
    target = model()
    draft = model("full-learned-positions", seed=1, depth=1, max_seq_len=24)
    prompt = PROMPT.expand(batch, -1)
    refused(lambda: speculative_generate(target, draft, prompt, 24 - 3 - past_goal + 1, gamma=3),
            f"the prompt, the new tokens and the {past_goal} positions the draft decodes past them", GenerationError)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        result = speculative_generate(target, draft, prompt, 24 - 3 - past_goal, gamma=3, generator=generator)
        assert result.tokens.shape == (batch, 24 - past_goal)


def test_a_shared_window_is_checked_for_the_positions_it_reaches():
    """per_row=False (one window for the batch, starting at the shortest row) feeds gamma - 1 past
    the goal at any batch, as at batch 1: a goal that left that room was refused as if the rows
    rolled back on their own (2 gamma past it)."""
    target = model()
    draft = model("full-learned-positions", seed=1, depth=1, max_seq_len=24)
    prompt = PROMPT.expand(4, -1)
    refused(lambda: speculative_generate(target, draft, prompt, 24 - 3 - 2 + 1, gamma=3, per_row=False),
            "the prompt, the new tokens and the 2 positions the draft decodes past them", GenerationError)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        result = speculative_generate(target, draft, prompt, 24 - 3 - 2, gamma=3, per_row=False, generator=generator)
        assert result.tokens.shape == (4, 24 - 2) and not result.per_row


def test_speculative_results_are_ordinary_tensors():
    """They were inference tensors: training on them, or changing them in place, raised."""
    target, draft = model(), model(seed=1, depth=1)
    result = speculative_generate(target, draft, PROMPT, 6, sampling=GREEDY)
    assert not result.tokens.is_inference() and not result.lengths.is_inference()
    torch.testing.assert_close(result.tokens, generate(target, PROMPT, 6, GREEDY), rtol=0, atol=0)
    target.train()
    target(result.tokens[:, :-1], targets=result.tokens[:, 1:]).loss.backward()
    result.tokens[0, 0] = 5


def test_the_cache_refuses_what_it_cannot_hold():
    """Past max_len and truncations past a row: refused as before. Rows other than the cache's were
    an IndexError in the layers; max_len 0 made a cache of max_seq_len silently, -1 failed in torch;
    truncate(2.5) was kept as a length of 2.5 on the host beside 2 in the tensor; truncate_rows of
    another number of rows, or of floats, a broadcast error or a silent cast."""
    net = model()
    cache = net.new_cache(1, 8)
    with torch.no_grad():
        net(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)
        refused(lambda: net(torch.tensor([[1, 2, 3, 4]]), cache=cache), "the cache holds 8 tokens a row; 5 fed and 4 "
                "more asked", ValueError)
        refused(lambda: net(torch.tensor([[1], [2]]), cache=cache), "the cache holds 1 rows; a forward of 2 asked",
                ValueError)
    assert cache.length == 5 and cache.lengths.tolist() == [5]  # the refusals changed nothing
    for max_len in (0, -1):
        refused(lambda n=max_len: net.new_cache(1, n), "a cache holds max_len >= 1 tokens a row", ValueError)
    for length in (6, -1, 2.5):
        refused(lambda n=length: cache.truncate(n), "cannot truncate rows of lengths 5..5 to", ValueError)
    for lengths in (torch.tensor([2, 2]), torch.tensor([2.0]), [2]):
        refused(lambda n=lengths: cache.truncate_rows(n), "truncate_rows takes a tensor of 1 integer lengths",
                ValueError)
    refused(lambda: cache.truncate_rows(torch.tensor([6])), "cannot truncate rows", ValueError)
    assert cache.length == 5 and cache.lengths.tolist() == [5]
    cache.truncate(2)
    assert (cache.length, cache.shortest, cache.lengths.tolist()) == (2, 2, [2])


def test_decoding_through_a_cache_with_gradients_on_warns_once(caplog):
    """Each step's keys and values are written into the cache's storage in place, so with gradients
    on the storage's graph kept every step's activations alive, silently (the README's snippet did
    so). A prefill alone and decoding under no_grad say nothing."""
    net = model()
    cache = net.new_cache(1, 16)
    with caplog.at_level(logging.WARNING, logger="attnlab.model.transformer"):
        token = net(PROMPT, cache=cache).logits[:, -1:].argmax(-1)  # a prefill: a graph of its own, no warning
        assert not caplog.records
        for _ in range(3):
            token = net(token, cache=cache).logits[:, -1:].argmax(-1)
        with torch.no_grad():
            quiet = net.new_cache(1, 16)
            net(PROMPT, cache=quiet)
            net(token, cache=quiet)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "wrap decoding in torch.no_grad()" in messages[0], messages
