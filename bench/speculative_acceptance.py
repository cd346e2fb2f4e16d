"""Where a draft disagrees with its target: the per-token acceptance sum_v min(p, q) of
speculative decoding (temperature 1, no filters), split two ways.

- By position, on validation windows as long as the decoding (prime + new tokens), in bands of
  `--band` tokens, with each model's bits per byte there: past the windows a model was trained
  on, its predictions are extrapolated, and they and the pair's agreement fall.
- By whether the next token repeats the context, i.e. the n-gram it ends (the last n - 1 tokens
  and itself) already occurred earlier in the same text. Copying such a repeat takes attention
  that finds the earlier occurrence (an "induction head", two layers or more). This split is made
  on validation text and on the target's own temperature-1 continuations of validation primes,
  the text speculative decoding verifies, with the mean probability each model gives the actual
  next token.

Then the tokens a step commits by each verification rule (speculative.py's VERIFICATIONS) at each
`--gammas`: at `--positions` places of the target's own continuations, the draft draws a block of
the longest gamma (each gamma's block is its first tokens), the target scores it, and each rule's
expected number of kept tokens is taken over the step's uniforms exactly (token: the sum over
prefixes of the product of min(1, p / q); block: sum over t of t h_t prod_{j > t} (1 - h_j), with
block_acceptance's h), so only the draft's draws are sampled.

One JSON line per measurement.

    python bench/speculative_acceptance.py TARGET_RUN DRAFT_RUN [--ngram 4] [--band 128]
        [--gammas 4 5 6 8] [--positions 16]
"""

from __future__ import annotations

import argparse
import json

import torch

from attnlab.data.corpus import load_corpus
from attnlab.data.sampler import eval_windows
from attnlab.generate.sampling import generate
from attnlab.generate.speculative import block_acceptance, proposal_probabilities
from attnlab.train.checkpoint import load_model


def repeats(row: list[int], ngram: int) -> list[bool]:
    """For each position i >= 1: whether the n-gram ending at token i occurred earlier in the row
    (ending before i)."""
    seen: set[tuple[int, ...]] = set()
    flags = [False]
    for i in range(1, len(row)):
        gram = tuple(row[max(0, i - ngram + 1) : i + 1])
        flags.append(len(gram) == ngram and gram in seen)
        if len(gram) == ngram:
            seen.add(gram)
    return flags


@torch.inference_mode()
def next_token_probs(target, draft, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [n, L] -> (p, q) [n, L - 1, V]: the target's and the draft's temperature-1
    distributions of tokens 1 .. L-1. Their acceptance is sum_v min(p, q)."""
    inputs = tokens[:, :-1]
    return torch.softmax(target(inputs).logits.float(), dim=-1), torch.softmax(draft(inputs).logits.float(), dim=-1)


def split(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, first: int, ngram: int) -> dict:
    """p, q of tokens [n, L] (next_token_probs); positions first .. L-2 predict tokens first + 1 .. L-1."""
    p, q, nexts = p[:, first:], q[:, first:], tokens[:, first + 1 :]
    accept = torch.minimum(p, q).sum(dim=-1)  # [n, L - 1 - first]
    p_next = p.gather(-1, nexts[..., None]).squeeze(-1)
    q_next = q.gather(-1, nexts[..., None]).squeeze(-1)
    copy = torch.tensor([repeats(row, ngram)[first + 1 :] for row in tokens.tolist()])  # by next token
    result = {"positions": int(copy.numel()), "copy_fraction": round(float(copy.float().mean()), 4),
              "acceptance_all": round(float(accept.mean()), 4)}
    for name, mask in (("copy", copy), ("other", ~copy)):
        if mask.any():
            result[f"acceptance_{name}"] = round(float(accept[mask].mean()), 4)
            result[f"target_p_next_{name}"] = round(float(p_next[mask].mean()), 4)
            result[f"draft_p_next_{name}"] = round(float(q_next[mask].mean()), 4)
    return result


def by_position(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, band: int) -> list[dict]:
    """p, q of tokens [n, L] (next_token_probs): acceptance and each model's bits per byte in bands
    of positions."""
    nexts = tokens[:, 1:]
    accept = torch.minimum(p, q).sum(dim=-1)
    bits_p = -torch.log2(p.gather(-1, nexts[..., None]).squeeze(-1))
    bits_q = -torch.log2(q.gather(-1, nexts[..., None]).squeeze(-1))
    rows = []
    width = nexts.shape[1]
    for start in range(0, width, band):
        part = slice(start, start + band)
        rows.append({"positions": f"{start}-{min(start + band, width) - 1}",
                     "acceptance": round(float(accept[:, part].mean()), 4),
                     "target_bits": round(float(bits_p[:, part].mean()), 4),
                     "draft_bits": round(float(bits_q[:, part].mean()), 4)})
    return rows


def expected_kept(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafted: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft tokens each rule keeps of one block per row in expectation over the step's
    uniforms -> (token rule [B], block rule [B]). target_probs [B, G + 1, V], draft_probs [B, G, V],
    drafted [B, G] as block_acceptance takes them."""
    p_token, q_token = proposal_probabilities(target_probs, draft_probs, drafted)  # [B, G] each
    token_rule = torch.clamp(p_token / q_token, max=1.0).cumprod(dim=1).sum(dim=1)  # sum_i P(first i all pass)
    passes, _ = block_acceptance(target_probs, draft_probs, drafted, torch.zeros_like(drafted, dtype=torch.bool))
    # P(exactly t kept) = h_t prod_{j > t} (1 - h_j): the longest passing prefix is t long
    longer_fail = torch.cat(((1 - passes).flip(1).cumprod(dim=1).flip(1)[:, 1:], torch.ones_like(passes[:, :1])), 1)
    lengths = torch.arange(1, passes.shape[1] + 1, dtype=passes.dtype)
    return token_rule, (passes * longer_fail * lengths).sum(dim=1)


@torch.inference_mode()
def tokens_per_step(target, draft, own: torch.Tensor, first: int, gammas: list[int], n_positions: int) -> list[dict]:
    """Expected tokens a step commits (1 + kept) by each rule at each gamma, averaged over rows and
    n_positions places from `first` on in the target's own text own [B, L] (the module docstring)."""
    longest = max(gammas)
    generator = torch.Generator().manual_seed(0)
    places = torch.linspace(first, own.shape[1] - 1, n_positions).long().tolist()
    kept = {(gamma, rule): [] for gamma in gammas for rule in ("token", "block")}
    for place in places:
        block, draft_probs = own[:, :place], []
        for _ in range(longest):  # the draft's block, drawn token by token from its distribution
            q = torch.softmax(draft(block).logits[:, -1].float(), dim=-1)  # [B, V]
            block = torch.cat((block, torch.multinomial(q, 1, generator=generator)), dim=1)
            draft_probs.append(q)
        target_probs = torch.softmax(target(block).logits[:, place - 1 :].float(), dim=-1)  # [B, G + 1, V]
        draft_probs = torch.stack(draft_probs, dim=1)  # [B, G, V]
        for gamma in gammas:
            token_rule, block_rule = expected_kept(target_probs[:, : gamma + 1], draft_probs[:, :gamma],
                                                   block[:, place : place + gamma])
            kept[gamma, "token"].append(token_rule)
            kept[gamma, "block"].append(block_rule)
    means = {key: round(1 + float(torch.cat(values).mean()), 4) for key, values in kept.items()}
    return [{"split": "tokens per step", "text": "target samples (temperature 1)", "gamma": gamma,
             "places": len(places), "rows": own.shape[0], "token_rule": means[gamma, "token"],
             "block_rule": means[gamma, "block"]} for gamma in gammas]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--ngram", type=int, default=4)
    parser.add_argument("--band", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prime", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--gammas", type=int, nargs="+", default=[4, 5, 6, 8])
    parser.add_argument("--positions", type=int, default=16, help="places of each row a block is drawn at")
    args = parser.parse_args()
    target, draft = load_model(args.target).eval(), load_model(args.draft).eval()
    trained = {"target_train_seq_len": target.run_config.train.seq_len,
               "draft_train_seq_len": draft.run_config.train.seq_len}
    val = load_corpus(target.run_config.data).val
    length = args.prime + args.new_tokens
    windows = eval_windows(val, length, args.rows, seed=0).long()
    p, q = next_token_probs(target, draft, windows)  # once for both splits of the validation text
    print(json.dumps({"split": "position", "text": "validation", **trained,
                      "bands": by_position(p, q, windows, args.band)}))
    print(json.dumps({"split": "repeat", "text": "validation", "ngram": args.ngram,
                      **split(p, q, windows, args.prime - 1, args.ngram)}))
    primes = windows[:, : args.prime]
    with torch.inference_mode():
        own = generate(target, primes, args.new_tokens, generator=torch.Generator().manual_seed(0))
    p, q = next_token_probs(target, draft, own)
    print(json.dumps({"split": "repeat", "text": "target samples (temperature 1)", "ngram": args.ngram,
                      **split(p, q, own, args.prime - 1, args.ngram)}))
    for line in tokens_per_step(target, draft, own, args.prime, args.gammas, args.positions):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
