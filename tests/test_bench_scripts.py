"""The benchmark scripts of bench/ that need no trained run (or only saved runs, made here with
untrained weights) start and print what they promise, at toy sizes (their figures are in
docs/benchmarks.md; this only keeps them runnable). They run one after another in one process
(tests/bench_scripts_runner.py: one start of torch for all) and each test reads what its script
printed; bench/gpu.sh runs as the one command it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab import Transformer
from attnlab.config import DataConfig, RunConfig, config_to_dict
from attnlab.train.checkpoint import checkpoint_path, save_checkpoint
from variants import variant_config

BENCH = Path(__file__).resolve().parent.parent / "bench"


def save_byte_run(run_dir: Path, depth: int, corpus: Path, **overrides) -> Path:
    """A small byte-level full-attention model saved as a run whose data is `corpus` (a file)."""
    model = Transformer(variant_config("full", num_tokens=256, depth=depth, **overrides))
    config = RunConfig(name=run_dir.name, out_dir=str(run_dir.parent), model=model.config,
                       data=DataConfig(source="file", path=str(corpus), cache_dir=str(run_dir.parent / "cache")))
    save_checkpoint(checkpoint_path(run_dir, 1), {"config": config_to_dict(config), "model": model.state_dict(),
                                                  "step": 1})
    return run_dir


def script_commands(folder: Path) -> dict[str, list[str]]:
    """Every script run of this file but the GPU one's, by name: [script, argument, ...], at toy
    sizes. The runs they read are saved here: a 2-layer target and a 1-layer draft over a byte
    corpus (and the same with heads of 16, a width the decode operator takes), a 1-layer model."""
    corpus = folder / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 64)
    target, draft = save_byte_run(folder / "target", 2, corpus), save_byte_run(folder / "draft", 1, corpus)
    target16 = save_byte_run(folder / "target16", 2, corpus, dim_head=16)
    draft16 = save_byte_run(folder / "draft16", 1, corpus, dim_head=16)
    tiny = save_byte_run(folder / "tiny", 1, corpus)
    pair = ("--max-new-tokens", "8", "--prime-length", "4")
    acceptance = ("--prime", "8", "--new-tokens", "16", "--rows", "2", "--band", "8", "--gammas", "2", "3",
                  "--positions", "3")
    commands = {
        "listed_kernel": ["listed_kernel.py", "--seq-len", "128", "--heads", "2", "--dim-head", "16", "--window", "16",
                          "--rounds", "1"],
        "nsa_kernel": ["nsa_kernel.py", "--seq-len", "128", "--heads", "2", "--kv-heads", "1", "--dim-head", "16",
                       "--rounds", "1"],
        "nsa_default_speed": ["nsa_default_speed.py", "--seq-len", "64", "--rounds", "1"],
        "static_cache_reference": ["static_cache_reference.py", "--context", "8", "--rounds", "1", "--repeats", "2",
                                   "--backend", "aot_eager"],
        "small_gemm": ["small_gemm.py", "--rows", "1", "3", "--repeats", "3", "--attainable-size", "64"],
        "linear_kernels": ["linear_kernels.py", "--shapes", "3x70x8", "--rounds", "1"],
        "cached_attention_gpu": ["cached_attention_gpu.py", "--device", "cpu", "--dtype", "fp32", "--contexts", "300",
                                 "--batch-sizes", "2", "--queries", "1", "6", "--heads", "4", "--kv-heads", "2",
                                 "--dim-head", "16", "--calls", "1", "--repeats", "1", "--out", str(folder / "cached")],
        "speculative_profile": ["speculative_profile.py", "--backend", "aot_eager", "--context", "16", "--new-tokens",
                                "12", "--gamma", "2", "--warm-runs", "2"],
        "int8_products": ["int8_products.py", "--rows", "1", "--rounds", "1", "--repeats", "2", "--gamma", "2",
                          "--context", "8", "--linear", "library", "--backend", "aot_eager"],
        "step_kernel_profile": ["step_kernel_profile.py", "--backend", "aot_eager", "--batch-size", "2", "--context",
                                "8", "--capacity", "16", "--calls", "2", "--rows", "3"],
        "inference_mode_decoding": ["inference_mode_decoding.py", "--attention", "full", "--context", "8",
                                    "--new-tokens", "4", "--rounds", "1", "--variants", "eager"],
        "speculative_ab drafts": ["speculative_ab.py", str(target), f"float32={draft}", f"int8={draft}:int8",
                                  f"dequantized={draft}:int8/dequantized", "--rounds", "2", "--gamma", "2", "3",
                                  *pair],
        "speculative_ab bad draft": ["speculative_ab.py", str(target), f"bad={draft}:int8/fast", "--rounds", "1"],
        "speculative_ab eager kernels": ["speculative_ab.py", str(target), f"float32={draft}", "--target-linear",
                                         "default", "packed"],
        "speculative_ab eager prefill": ["speculative_ab.py", str(target), f"float32={draft}", "--prefill-chunk",
                                         "eager", "8"],
        "speculative_ab rules": ["speculative_ab.py", str(target), f"float32={draft}", "--rounds", "1", "--gamma", "2",
                                 "--verification", "block", "token", *pair],
        "speculative_ab schemes": ["speculative_ab.py", str(target), f"float32={draft}", "--rounds", "1", "--gamma",
                                   "2", "--batch-scheme", "per-row", "shared", *pair],
        "acceptance identical": ["speculative_acceptance.py", str(target), str(target), *acceptance],
        "acceptance other": ["speculative_acceptance.py", str(target), str(draft), *acceptance],
        "decode_backend_pair": ["decode_backend_pair.py", str(target16), str(draft16), "--eager", "--rounds", "2",
                                "--gamma", "2", "--max-new-tokens", "8", "--batch-size", "2"],
        "compile_time": ["compile_time.py", str(tiny), "--backend", "aot_eager", "--variants", "library", "--rounds",
                         "1", "--new-tokens", "4"],
    }
    return {name: [str(BENCH / script), *arguments] for name, (script, *arguments) in commands.items()}


class ScriptRuns(dict):
    """Each script run's exit status, stdout and stderr by name (a dict), and the folder they ran
    over (`folder`: the saved runs, the scripts' own outputs)."""

    folder: Path


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> ScriptRuns:
    """Every script of script_commands run one after another in one process
    (tests/bench_scripts_runner.py)."""
    folder = tmp_path_factory.mktemp("bench-scripts")
    commands = script_commands(folder)
    listing = folder / "commands.json"
    listing.write_text(json.dumps(list(commands.values())))
    subprocess.run([sys.executable, str(Path(__file__).parent / "bench_scripts_runner.py"), str(listing)],
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1200, check=True)
    statuses = json.loads(listing.with_name(listing.name + ".status").read_text())
    runs = ScriptRuns((name, (status, *(listing.with_name(f"{listing.name}.{index}.{stream}").read_text()
                                        for stream in ("out", "err"))))
                      for index, (name, status) in enumerate(zip(commands, statuses, strict=True)))
    runs.folder = folder
    return runs


def printed_by(scripts: ScriptRuns, name: str) -> str:
    """What the script run `name` printed; that it exited with status 0 (else its stderr's end)."""
    status, stdout, stderr = scripts[name]
    assert status == 0, f"{name} exited with {status}:\n{stderr[-3000:]}"
    return stdout


def test_kernel_scripts_print_their_tables(scripts):
    listed = printed_by(scripts, "listed_kernel")
    assert "| routing |" in listed and "| sinkhorn |" in listed
    branches = printed_by(scripts, "nsa_kernel")
    assert all(f"| {name} |" in branches for name in ("compressed + selection", "selected", "sliding"))


def test_nsa_default_speed_prints_the_ratio(scripts):
    printed = printed_by(scripts, "nsa_default_speed")
    assert '"what": "layer"' in printed and "current_over_earlier" in printed and "current_over_shared" in printed


def test_static_cache_reference_prints_both_steps(scripts):
    printed = printed_by(scripts, "static_cache_reference")
    assert '"attnlab_ms"' in printed and "static-cache reference" in printed and '"read_ms"' in printed


def test_small_gemm_prints_each_shape_then_the_attainable_rate(scripts):
    printed = printed_by(scripts, "small_gemm")
    *lines, attainable = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [line["weight"] for line in lines] == ["query/key/value", "output", "feed-forward up", "feed-forward down",
                                                  "head"]
    assert all(set(line["microseconds"]) == {"1", "3"} and line["most_over_fewest_rows"] > 0
               and line["gflop_per_s_most_rows"] > 0 for line in lines)
    assert attainable["attainable"] == [64, 64, 64] and attainable["gflop_per_s"] > 0


def test_linear_kernels_times_each_kernel_at_each_shape(scripts):
    printed = printed_by(scripts, "linear_kernels")
    reports = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [report["shape"] for report in reports] == ["3x70x8"]
    assert all(reports[0][kernel]["us"] > 0 and reports[0][kernel]["gflops"] > 0 for kernel in ("cpu", "packed",
                                                                                                "library"))


def test_cached_attention_gpu_dry_run_times_both_back_ends(scripts):
    """On the CPU (the triton kernels under TRITON_INTERPRET=1, which tests/conftest.py sets without
    CUDA) the GPU script runs its cases and writes its table; both back-ends give one result."""
    printed = printed_by(scripts, "cached_attention_gpu")
    rows = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [(row["queries"], row["storage"]) for row in rows] == [(1, 300), (1, 600), (6, 300), (6, 600)]
    assert all(row["max_abs_difference"] < 1e-5 and row["torch_us"] > 0 and row["triton_us"] > 0 for row in rows)
    assert "| 2 | 6 | 300 | 600 |" in (scripts.folder / "cached" / "cached_attention.md").read_text()


def test_speculative_profile_splits_a_step(scripts):
    report = json.loads(printed_by(scripts, "speculative_profile").splitlines()[-1])
    parts = report["ms_per_step"]
    assert parts["forwards"] > 0 and parts["around forwards"] > 0
    assert parts["of them separate calls"] == {"target": 0.0, "draft": 0.0}  # both in one call
    assert report["compiled_calls_per_step"] == 1.0 and report["dynamo_us_per_compiled_call"] > 0


def test_int8_products_prints_each_product_and_the_compiled_proposals(scripts):
    lines = [json.loads(line) for line in printed_by(scripts, "int8_products").splitlines()]
    assert [line["weight"] for line in lines if "weight" in line] == ["query, key, value, output, head",
                                                                      "feed-forward up", "feed-forward down"]
    assert all(set(line["microseconds"]) == {"cpu", "torch", "dequantized"} for line in lines if "weight" in line)
    assert [(line["proposal"], line["linear"]) for line in lines if "proposal" in line] == [
        ("cpu", "library"), ("torch", "library")]
    assert lines[-1]["proposal_ratio"] == "library/torch / library/cpu" and len(lines[-1]["rounds"]) == 1


def test_step_kernel_profile_prints_each_steps_shares(scripts):
    printed = printed_by(scripts, "step_kernel_profile")
    steps = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [step["step"] for step in steps] == ["one token", "verification"]
    assert all(0 < step["attention_share"] < 1 and step["median_ms"] > 0 for step in steps)
    assert all(0 < step["products_share"] < 1 for step in steps)  # ATen's products, under aot_eager
    # the rate counts each row times every weight of spec-small-target's products: 6 layers of queries,
    # keys and values (768 x 256), output (256 x 256), feed-forward (1024 x 256 and back), and the head
    multiply_adds = 6 * (768 * 256 + 256 * 256 + 2 * 1024 * 256) + 256 * 256
    for step, rows in zip(steps, (2 * 1, 2 * 6)):  # batch 2, one token then gamma + 1 = 6
        seconds = step["median_ms"] / 1e3 * step["products_share"]
        assert step["products_gflops"] * 1e9 * seconds == pytest.approx(2 * multiply_adds * rows, rel=1e-6)


def test_inference_mode_decoding_prints_the_ratio(scripts):
    printed = printed_by(scripts, "inference_mode_decoding")
    report = json.loads(printed.splitlines()[0])
    assert report["full eager"]["no_grad_over_inference"] > 0 and "no_grad / inference mode" in printed


def test_speculative_ab_times_each_draft_at_each_gamma(scripts):
    lines = [json.loads(line) for line in printed_by(scripts, "speculative_ab drafts").splitlines()]
    summaries = {line["summary"]: line for line in lines if "summary" in line}
    names = ("float32", "int8", "dequantized")
    assert set(summaries) == {f"{name}@{gamma}" for name in names for gamma in (2, 3)}
    assert all(summary["gamma"] == int(name[-1]) and len(summary["speedups"]) == 2 and summary["speedup"] > 0
               and summary["decoding_speedup"] > 0 for name, summary in summaries.items())
    rounds = [line for line in lines if "round" in line]
    # the prefills, timed alone, come off both sides of decoding_speedup
    for line in rounds:
        base_prefill, speculative_prefill = line["prefill_ms"]
        assert 0 < base_prefill < line["base_ms"] and 0 < speculative_prefill < line["speculative_ms"]
        assert line["decoding_speedup"] == pytest.approx(
            (line["base_ms"] - base_prefill) / (line["speculative_ms"] - speculative_prefill), rel=0.05)  # ms rounded
    assert sorted((line["draft"], line["gamma"]) for line in rounds) == sorted(
        [(draft_name, gamma) for draft_name in names for gamma in (2, 3)] * 2)
    products = {name.split("@")[0]: summary["products"]["draft"] for name, summary in summaries.items()}
    assert products["float32"] == "F.linear" and products["dequantized"] == "int8 dequantized"
    assert products["int8"].startswith("int8 ") and products["int8"] != "int8 dequantized"  # the default kernel
    status, _, error = scripts["speculative_ab bad draft"]
    assert status == 2 and "PRODUCT one of cpu, torch, dequantized), got 'bad=" in error
    status, _, error = scripts["speculative_ab eager kernels"]  # the target's kernels are compiled ones
    assert status == 2 and "--target-linear chooses compiled kernels: it needs --compile" in error
    status, _, error = scripts["speculative_ab eager prefill"]  # a prefill by the compiled step
    assert status == 2 and "--prefill-chunk prefills by the compiled step: it needs --compile" in error


def test_speculative_ab_times_each_verification_rule(scripts):
    printed = printed_by(scripts, "speculative_ab rules")
    summaries = {line["summary"]: line for line in map(json.loads, printed.splitlines()) if "summary" in line}
    assert {name: summary["verification"] for name, summary in summaries.items()} == {
        "float32/block": "block", "float32/token": "token"}


def test_speculative_ab_times_each_batch_scheme(scripts):
    """--batch-scheme with several: a variant each; at batch 1 both draw the same tokens a step."""
    lines = list(map(json.loads, printed_by(scripts, "speculative_ab schemes").splitlines()))
    summaries = {line["summary"]: line for line in lines if "summary" in line}
    assert {name: summary["batch_scheme"] for name, summary in summaries.items()} == {
        "float32+per-row": "per-row", "float32+shared": "shared"}
    rounds = {line["batch_scheme"]: line for line in lines if "round" in line}
    assert rounds["per-row"]["per_row"] and not rounds["shared"]["per_row"]
    assert rounds["per-row"]["tokens_per_step"] == rounds["shared"]["tokens_per_step"]


def test_speculative_acceptance_counts_tokens_per_step_by_each_rule(scripts):
    """A draft identical to its target keeps every token by either rule (gamma + 1 a step); another
    keeps fewer. (The block rule keeps at least as many in expectation over the draft's blocks, not
    in each: tests/test_speculative.py checks that exactly.)"""
    for name, identical in (("acceptance identical", True), ("acceptance other", False)):
        printed = printed_by(scripts, name)
        steps = [line for line in map(json.loads, printed.splitlines()) if line["split"] == "tokens per step"]
        assert [line["gamma"] for line in steps] == [2, 3]
        for line in steps:
            if identical:
                assert line["token_rule"] == line["block_rule"] == line["gamma"] + 1
            else:
                assert 1 <= min(line["token_rule"], line["block_rule"])
                assert max(line["token_rule"], line["block_rule"]) < line["gamma"] + 1


def test_decode_backend_pair_times_both_backends(scripts):
    lines = [json.loads(line) for line in printed_by(scripts, "decode_backend_pair").splitlines()]
    assert sorted((line["backend"], line["round"]) for line in lines[:-1]) == [("auto", 0), ("auto", 1), ("torch", 0),
                                                                                 ("torch", 1)]
    summary = lines[-1]["summary"]
    assert summary["auto"]["speedup"] > 0 and summary["torch"]["speedup"] > 0
    assert summary["operator / torch, base"] > 0 and summary["operator / torch, speculative"] > 0


def run_gpu_script(tmp_path: Path, *parts: str, **settings: str) -> subprocess.CompletedProcess:
    """bench/gpu.sh with its outputs under tmp_path, this interpreter first on PATH (attnlab importable:
    the script installs nothing)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs"), **settings,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(BENCH / "gpu.sh"), *parts], capture_output=True, text=True, env=env,
                          timeout=120)


def timings(tmp_path: Path) -> list[tuple[str, str]]:
    lines = (tmp_path / "out" / "timings.jsonl").read_text().splitlines()
    return [(record["part"], record["status"]) for record in map(json.loads, lines)]


def command_lines() -> list[str]:
    """The command lines of this machine's processes (/proc)."""
    lines = []
    for entry in Path("/proc").iterdir():
        try:
            lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # not a process, or one that just ended
            continue
    return lines


def test_gpu_script_keeps_to_its_budget(tmp_path):
    """The one GPU command runs its parts in order within BUDGET_S: a part that does not fit is
    skipped and one that outlasts the budget is stopped, its whole process group with it; both are
    named in the last line, to run in a next call, and recorded in timings.jsonl."""
    result = run_gpu_script(tmp_path, BUDGET_S="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == ("not done within the budget: bash bench/gpu.sh cached pair speculative "
                                              "tests decode train layer kernels")
    assert timings(tmp_path) == [(part, "skipped") for part in
                                 ("cached", "pair", "speculative", "tests", "decode", "train", "layer", "kernels")]

    (tmp_path / "out" / "timings.jsonl").unlink()
    result = run_gpu_script(tmp_path, "tests", BUDGET_S="2", MIN_PART_S="1")  # pytest alone takes longer
    assert result.returncode == 0, result.stderr
    assert "== tests: cut after" in result.stdout
    assert result.stdout.splitlines()[-1] == "not done within the budget: bash bench/gpu.sh tests"
    assert timings(tmp_path) == [("tests", "cut")]
    assert not any("tests/test_gpu.py" in command for command in command_lines())  # nothing of it outlives it

    result = run_gpu_script(tmp_path, "tests", "benchmarks")
    assert result.returncode == 2 and "unknown part benchmarks" in result.stdout


def test_compile_time_script_runs_fresh_processes(scripts):
    """bench/compile_time.py times one fresh process after another per kind of step (aot_eager here:
    no inductor graphs to cache, so a quick check that it runs and reports each process)."""
    printed = printed_by(scripts, "compile_time")
    rows = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [(row["variant"], row["process"]) for row in rows] == [("library", 1), ("library", 2)]
    assert all(row["first_generate_s"] > 0 and row["ms_per_token"] > 0 for row in rows)
    assert "| library | 2 |" in printed


def test_compiled_decoding_moves_the_order_of_the_steps_each_round(monkeypatch):
    """Each round times every step of every model once, each model's steps in turn, its variants
    starting one further along than the round before: over as many rounds as variants, each
    variant runs first once."""
    monkeypatch.syspath_prepend(str(BENCH))
    from compiled_decoding import rotated

    variants = ("eager", "compiled", "library")
    models = {(kind, context, variant): None for kind in ("full", "nsa") for context in (8, 16) for variant in variants}
    orders = [rotated(models, variants, round_) for round_ in range(len(variants))]
    assert all(sorted(order) == sorted(models) for order in orders)
    assert all(order[:3] == [("full", 8, variant) for variant in order_of_variants]
               for order, order_of_variants in zip(orders, [variants, variants[1:] + variants[:1],
                                                            variants[2:] + variants[:2]], strict=True))


def test_compiled_decoding_spare_positions_enlarge_each_cache(monkeypatch):
    """--spare: the timed decoding's cache holds that many positions beyond the prompt and the new
    tokens (a step whose cost follows the storage, not the position, shows it in the figures)."""
    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    from compiled_decoding import ms_per_token

    torch.manual_seed(0)
    model = Transformer(variant_config("full")).eval()
    sizes = []
    new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda batch, max_len, **options: sizes.append(max_len) or
                        new_cache(batch, max_len, **options))
    prompt = torch.randint(0, 61, (1, 5))
    for spare in (0, 7):
        assert ms_per_token(model, prompt, 3, seed=0, spare=spare) > 0
    assert sizes == [5 + 3, 5 + 3 + 7]
