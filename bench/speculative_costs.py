"""Per-forward costs behind the speculative decoding figures (docs/benchmarks.md): one cached
target token, one 6-token verification forward (gamma 5 + 1) and one cached draft token, at
batch 1 and 4, on the trained pair. The three forwards are timed in turn, round after round, so
that a busy machine slows them alike; medians are printed as one JSON line per batch size.

Also the per-token acceptance probability alpha = E[sum_v min(p, q)] = 1 - E[TV(p, q)]
(Leviathan et al., section 3.1) on validation text and on the target's own temperature-1
continuations of validation primes, and what the first predicts at batch 1: tokens per step
(1 - alpha^(gamma+1)) / (1 - alpha) and speedup = that * t(target token) / (gamma t(draft token)
+ t(verification)) (their eq. 1 and Theorem 3.8 with these measured costs, loop overhead ignored).

Forwards timed in isolation run with warm caches. Inside decoding they do not: a verification
streams the target's weights through the caches between the draft's tokens. So the last lines
("in_loop", one per batch size) time the forwards inside `speculative_generate` and `generate`
themselves, on the validation primes `attnlab speculative --prime-from-val` uses (256 new
tokens, temperature 1): per step, the draft's forwards, the verification and everything else
(sampling, accept/reject, cache roll-back), each in units of one cached target token of the base
decoding, and the measured speedup of the same runs. Every figure is the median of its own
(3 runs after a warm-up), so tokens_per_step / (draft + verify + other) comes near the speedup but
need not equal it.

    python bench/speculative_costs.py TARGET_RUN DRAFT_RUN [--rounds 200] [--context 200] [--draft-quantize int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from speculative_acceptance import next_token_probs  # this folder's script: python bench/...

from attnlab.model.quantize import QUANTIZATIONS, quantize_weights
from attnlab.train.checkpoint import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--draft-quantize", choices=list(QUANTIZATIONS), default="none",
                        help="the draft's linear weights, as `attnlab speculative --draft-quantize`")
    args = parser.parse_args()
    target, draft = load_model(args.target).eval(), load_model(args.draft).eval()
    quantize_weights(draft, args.draft_quantize)
    alpha = acceptance_on_validation(target, draft)
    own = acceptance_on_own_samples(target, draft)
    print(json.dumps({"acceptance_per_token": round(alpha, 4),
                      "tokens_per_step": round((1 - alpha ** (args.gamma + 1)) / (1 - alpha), 3),
                      "acceptance_per_token_on_target_samples": round(own, 4),
                      "tokens_per_step_on_target_samples": round((1 - own ** (args.gamma + 1)) / (1 - own), 3)}))
    cases = {"target_1": (target, 1), f"target_{args.gamma + 1}": (target, args.gamma + 1), "draft_1": (draft, 1)}
    for batch in (1, 4):
        generator = torch.Generator().manual_seed(batch)
        caches, times = {}, {name: [] for name in cases}
        with torch.inference_mode():
            for name, (model, _) in cases.items():
                caches[name] = model.new_cache(batch, args.context + args.gamma + 1)
                model(torch.randint(0, 256, (batch, args.context), generator=generator), cache=caches[name])
            for _ in range(args.rounds):
                for name, (model, width) in cases.items():
                    tokens = torch.randint(0, 256, (batch, width), generator=generator)
                    started = time.perf_counter()
                    model(tokens, cache=caches[name])
                    times[name].append(time.perf_counter() - started)
                    caches[name].truncate(args.context)
        medians = {f"{name}_ms": round(1000 * statistics.median(values), 3) for name, values in times.items()}
        ratios = {
            "verify_over_token": round(medians[f"target_{args.gamma + 1}_ms"] / medians["target_1_ms"], 3),
            "draft_over_target": round(medians["draft_1_ms"] / medians["target_1_ms"], 3),
        }
        tokens_per_step = (1 - alpha ** (args.gamma + 1)) / (1 - alpha)
        step_cost = args.gamma * ratios["draft_over_target"] + ratios["verify_over_token"]
        predicted = {"predicted_speedup_batch_1": round(tokens_per_step / step_cost, 3)} if batch == 1 else {}
        print(json.dumps({"batch_size": batch, "threads": torch.get_num_threads(), **medians, **ratios, **predicted}))
    for batch in (1, 4):
        print(json.dumps({"in_loop": in_loop_costs(target, draft, batch, args.gamma, repeats=3)}))


@torch.inference_mode()
def acceptance_on_own_samples(target, draft, n_rows: int = 8, prime: int = 128, n_new: int = 256) -> float:
    """sum_v min(p, q) at the positions of the target's own temperature-1 continuations of
    validation primes: the text speculative decoding actually verifies."""
    from attnlab.data.corpus import load_corpus
    from attnlab.data.sampler import eval_windows
    from attnlab.generate.sampling import generate

    primes = eval_windows(load_corpus(target.run_config.data).val, prime, n_rows, seed=0)[:, :prime].long()
    tokens = generate(target, primes, n_new, generator=torch.Generator().manual_seed(0))  # [n, T + N]
    p, q = next_token_probs(target, draft, tokens)
    p, q = p[:, prime - 1 :], q[:, prime - 1 :]  # [n, N, V]: the continuation's tokens
    return float(torch.minimum(p, q).sum(dim=-1).mean())


@torch.inference_mode()
def acceptance_on_validation(target, draft, n_windows: int = 16, seq_len: int = 256) -> float:
    """Mean over validation positions of sum_v min(p, q), temperature 1, no filters."""
    from attnlab.data.corpus import load_corpus
    from attnlab.data.sampler import eval_windows

    windows = eval_windows(load_corpus(target.run_config.data).val, seq_len, n_windows).long()
    p, q = next_token_probs(target, draft, windows)  # [n, T - 1, V]
    return float(torch.minimum(p, q).sum(dim=-1).mean())


class ForwardTimer:
    """Wraps a model's forward and keeps the wall time of each call."""

    def __init__(self, model) -> None:
        self.model, self.forward = model, model.forward
        self.seconds: list[float] = []
        model.forward = self

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - started)

    def remove(self) -> None:
        del self.model.forward  # the instance attribute: the class's forward again


def in_loop_costs(target, draft, batch: int, gamma: int, repeats: int, n_new: int = 256, prime: int = 128) -> dict:
    """Medians over `repeats` alternating runs of base and speculative decoding (seeds 0, 1, ..;
    one warm-up run of each first) of where a speculative step's time goes, in cached target
    tokens of the base decoding. Each decoder's first forward feeds the prompt (prefill); it is
    counted apart."""
    from attnlab.data.corpus import load_corpus
    from attnlab.data.sampler import eval_windows
    from attnlab.generate.sampling import generate
    from attnlab.generate.speculative import speculative_generate

    prompt = eval_windows(load_corpus(target.run_config.data).val, prime, batch, seed=0)[:, :prime].long()
    rows = []
    for repeat in range(repeats + 1):
        timer = ForwardTimer(target)
        try:
            started = time.perf_counter()
            with torch.inference_mode():
                generate(target, prompt, n_new, generator=torch.Generator().manual_seed(repeat))
            base = time.perf_counter() - started
        finally:
            timer.remove()
        base_prefill, token = timer.seconds[0], statistics.mean(timer.seconds[1:])
        target_timer, draft_timer = ForwardTimer(target), ForwardTimer(draft)
        try:
            started = time.perf_counter()
            result = speculative_generate(target, draft, prompt, n_new, gamma,
                                          generator=torch.Generator().manual_seed(repeat))
            speculative = time.perf_counter() - started
        finally:
            target_timer.remove()
            draft_timer.remove()
        steps = result.n_steps
        prefill = target_timer.seconds[0] + draft_timer.seconds[0]
        verify, drafted = sum(target_timer.seconds[1:]) / steps, sum(draft_timer.seconds[1:]) / steps
        other = (speculative - prefill) / steps - verify - drafted
        rows.append({
            "base_ms": 1000 * base, "speculative_ms": 1000 * speculative, "speedup": base / speculative,
            "target_token_ms": 1000 * token, "base_prefill_ms": 1000 * base_prefill,
            "speculative_prefill_ms": 1000 * prefill, "tokens_per_step": n_new / steps,
            "draft_forwards_per_step": (len(draft_timer.seconds) - 1) / steps,
            "draft_per_step": drafted / token, "verify_per_step": verify / token, "other_per_step": other / token,
        })
    medians = {key: round(statistics.median(row[key] for row in rows[1:]), 3) for key in rows[0]}
    return {"batch_size": batch, "threads": torch.get_num_threads(), **medians}


if __name__ == "__main__":
    main()
