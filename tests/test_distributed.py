"""Two processes over gloo on CPU: DDP, FSDP2 and DeepSpeed ZeRO 1-3 follow the single-process loss
curve with the same global batch (gradient accumulation included), resume exactly, and only
rank 0 writes files.

Starting two processes, torch and DeepSpeed costs more than training these small models, so every
run but the SIGTERM one is made by two launches (the `launched` fixture: one for the runs and the
first halves of the split ones, the next for their resumption in fresh processes), and each test
checks its own runs."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnlab.config import load_config
from attnlab.train.checkpoint import list_checkpoints, load_model
from attnlab.train.loop import train
from attnlab.train.metrics import read_metrics

pytestmark = pytest.mark.slow


def common(root: Path) -> list[str]:
    corpus = root / "corpus.txt"
    if not corpus.exists():
        corpus.write_bytes((Path(__file__).parent.parent / "src" / "attnlab" / "config.py").read_bytes() * 3)
    return [
        f"out_dir={root / 'runs'}", "model.dim=32", "model.depth=2", "model.heads=2", "model.dim_head=16",
        "model.max_seq_len=64", "data.source=file", f"data.path={corpus}", "train.seq_len=32",
        "train.max_steps=6", "train.warmup_steps=2", "train.eval_every=3", "train.eval_batches=1",
        "train.sample_every=0", "train.save_every=3", "train.log_every=1", "train.grad_accum=2",
        "log.progress=false",
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def single(root) -> Path:
    """The reference: one process, batch 4 = 2 ranks x 2."""
    return train(load_config("demo", [*common(root), "name=single", "train.batch_size=4"])).run_dir


@pytest.fixture(scope="module")
def single_ema(root) -> Path:
    """The same with EMA weights (validation then uses them)."""
    config = load_config("demo", [*common(root), "name=single-ema", "train.batch_size=4", "train.ema=true",
                                  "train.ema_decay=0.5"])
    return train(config).run_dir


def curve(run_dir: Path) -> list[tuple[int, str, float]]:
    return [(r["step"], key, r[key]) for r in read_metrics(run_dir) for key in ("loss", "val_loss") if key in r]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    got, want = curve(run_dir), curve(reference)
    assert [(s, k) for s, k, _ in got] == [(s, k) for s, k, _ in want]  # each step logged once, by rank 0
    for (_, _, a), (_, _, b) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-5)
    for weights in ("model", "ema") if (reference / "checkpoints").exists() and _has_ema(reference) else ("model",):
        final = load_model(run_dir, weights=weights).state_dict()
        for key, value in load_model(reference, weights=weights).state_dict().items():
            # atol 5e-5: summing gradients in another order changes them by float rounding, and Adam
            # scales a near-zero gradient's rounding up to a full step (one weight in 4096 moved 1.6e-5)
            torch.testing.assert_close(final[key], value, atol=5e-5, rtol=1e-4)


def _has_ema(run_dir: Path) -> bool:
    from attnlab.train.checkpoint import read_checkpoint

    return read_checkpoint(list_checkpoints(run_dir)[-1]).get("ema") is not None


def deepspeed_config(root: Path, stage: int) -> Path:
    path = root / f"zero{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}, "torch_adam": True}))
    return path


HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
EMA = ["train.ema=true", "train.ema_decay=0.5"]


def train_command(root: Path, name: str, strategy: str | None, *extra: str) -> list[str]:
    """`attnlab train` of the demo at this file's sizes, two samples a rank a micro-batch."""
    return ["train", "-p", "demo", *common(root), f"name={name}", "train.batch_size=2",
            *([f"dist.strategy={strategy}"] if strategy else []), *extra]


def split_runs(root: Path) -> dict[str, list[str]]:
    """Runs stopped at step 3 (`--until-step 3`) and resumed (`--resume`) in a later launch, by name.
    DDP and FSDP with EMA weights (laid out, sharded, like the model and saved gathered); ZeRO-0
    (whole weights on every rank: checkpointed without zero_to_fp32); ZeRO-3 through its own
    checkpoint, with EMA weights of the partitioned model."""
    runs = {"ddp-split": train_command(root, "ddp-split", "ddp", *EMA),
            "fsdp-split": train_command(root, "fsdp-split", "fsdp", *EMA)}
    if HAS_DEEPSPEED:
        for stage, extra in ((0, []), (3, EMA)):
            runs[f"zero{stage}"] = train_command(root, f"zero{stage}", "deepspeed",
                                                 f"dist.deepspeed_config={deepspeed_config(root, stage)}", *extra)
    return runs


@pytest.fixture(scope="module")
def launched(root, token_data) -> Launch:
    """Every two-process run of this file but the SIGTERM one, in two launches (launch_runs): the
    first halves of the split runs and every other run, then the split runs resumed in fresh
    processes. Each run's exit status by name, and (`stopped_at`) the checkpoints of each split run
    before it resumed."""
    split = split_runs(root)
    runs = {name: [*arguments, "--until-step", "3"] for name, arguments in split.items()}
    runs.update(aux_runs(root) | example_runs(root) | half_precision_runs(root) | token_runs(root, token_data))
    if HAS_DEEPSPEED:
        # the arguments the `deepspeed` launcher and the seeds pass
        runs["zero1"] = train_command(root, "zero1", None, "--deepspeed_config", str(deepspeed_config(root, 1)),
                                      "--local_rank=0")
        disagree = root / "disagree.json"
        disagree.write_text(json.dumps({"gradient_accumulation_steps": 7}))
        runs["disagree"] = train_command(root, "disagree", "deepspeed", f"dist.deepspeed_config={disagree}")
    statuses = launch_runs(root, runs)
    statuses.stopped_at = {name: [path.name for path in list_checkpoints(root / "runs" / name)] for name in split}
    resumed = {f"{name} resumed": [*arguments, "--resume"] for name, arguments in split.items()}
    resumptions = launch_runs(root, resumed)
    statuses.update(resumptions)
    statuses.output += resumptions.output
    return statuses


def assert_trained(launched: Launch, *names: str) -> None:
    failed = {name: launched[name] for name in names if launched[name] != 0}
    assert not failed, f"runs that failed (exit status): {failed}; the output ends:\n{launched.output[-3000:]}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_matches_single_and_resumes(root, single_ema, launched, strategy):
    """With EMA weights too: they are laid out (sharded) like the model and saved gathered."""
    name = f"{strategy}-split"
    assert_trained(launched, name, f"{name} resumed")
    assert launched.stopped_at[name] == ["step-0000003.pt"]
    assert_same_run(root / "runs" / name, single_ema)
    if strategy == "fsdp":  # resumed from its own sharded checkpoint, one shard file per rank
        shards = sorted(p.name for p in (root / "runs" / name / "fsdp" / "step-0000006").iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.sha256"]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_deepspeed_zero_matches_single(root, single, single_ema, launched, stage):
    """Stage 0 and 3 stopped and resumed, stage 1 started as the `deepspeed` launcher does. Stage 2 is
    trained by test_auxiliary_losses_match_single and test_masked_loss_matches_single_with_token_data."""
    pytest.importorskip("deepspeed")
    name = f"zero{stage}"
    if stage != 1:
        assert_trained(launched, name, f"{name} resumed")
        assert launched.stopped_at[name] == ["step-0000003.pt"]
    assert_trained(launched, name)
    assert (root / "runs" / name / "deepspeed" / "step-0000006").is_dir()
    assert_same_run(root / "runs" / name, single_ema if stage == 3 else single)


# routed attention (centroid statistics accumulated over micro-batches, all-reduced once a step)
# and a mixture-of-experts feed-forward (load balance over the whole batch) in one model
AUX_MODEL = [
    "model.attention.kind=routing", "model.attention.routing.window_size=8", "model.attention.routing.n_clusters=3",
    "model.attention.routing.n_local_heads=1", "model.attention.routing.commitment_weight=0.1",
    "model.attention.routing.ema_decay=0.5", "model.feed_forward=moe", "model.moe.n_experts=3",
    "model.moe.top_k=1", "model.moe.balance_loss_weight=0.5",
]


@pytest.fixture(scope="module")
def single_aux(root) -> Path:
    return train(load_config("demo", [*common(root), *AUX_MODEL, "name=single-aux", "train.batch_size=4"])).run_dir


def aux_runs(root: Path) -> dict[str, list[str]]:
    zero2 = [f"dist.deepspeed_config={deepspeed_config(root, 2)}"]
    return {f"{strategy}-aux": train_command(root, f"{strategy}-aux", strategy, *AUX_MODEL,
                                             *(zero2 if strategy == "deepspeed" else []))
            for strategy in ["ddp", "fsdp"] + (["deepspeed"] if HAS_DEEPSPEED else [])}


def test_auxiliary_losses_match_single(root, single_aux, launched):
    """Commitment and balance losses, routing centroids and MoE experts follow the single process
    under DDP, FSDP and DeepSpeed ZeRO-2."""
    names = list(aux_runs(root))
    assert_trained(launched, *names)
    for name in names:
        run_dir = root / "runs" / name
        assert_same_run(run_dir, single_aux)
        logged = [r for r in read_metrics(run_dir) if "commitment" in r]
        assert logged and all(r["moe_balance"] > 0 for r in logged)
        for key, value in load_model(single_aux).state_dict().items():
            if key.endswith("centroids"):  # buffers, not compared by assert_same_run's parameters alone
                torch.testing.assert_close(load_model(run_dir).state_dict()[key], value, atol=1e-5, rtol=1e-4)


class Launch(dict):
    """Each run's exit status by name (a dict), and the launch's output (`output`: stdout and stderr)."""

    output: str = ""
    stopped_at: dict[str, list[str]]


def launch_runs(root: Path, runs: dict[str, list[str]]) -> Launch:
    """Run `runs` (the arguments of an `attnlab` command each, by name) on two processes, one after
    another, in one launch (tests/distributed_runs.py)."""
    listing = root / f"runs-{free_port()}.json"
    listing.write_text(json.dumps(list(runs.values())))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(Path(__file__).parent / "distributed_runs.py"), str(listing),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    launch = Launch(zip(runs, json.loads(listing.with_name(listing.name + ".status").read_text()), strict=True))
    launch.output = result.stdout + result.stderr
    return launch


EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "deepspeed").glob("*.json"))
SHORT = ["train.max_steps=2", "train.grad_accum=1", "train.eval_every=0", "train.save_every=2"]


def example_runs(root: Path) -> dict[str, list[str]]:
    if not HAS_DEEPSPEED:
        return {}
    return {f"example-{example.stem}": train_command(root, f"example-{example.stem}", "deepspeed", *SHORT,
                                                     f"dist.deepspeed_config={example}") for example in EXAMPLES}


def test_every_deepspeed_example_trains_on_the_cpu(root, launched):
    """examples/deepspeed/*.json (bf16, ZeRO-1, ZeRO-2 with optimizer offload, ZeRO-3) start and
    train two steps on two CPU processes."""
    pytest.importorskip("deepspeed")
    assert_trained(launched, *example_runs(root))
    for example in EXAMPLES:
        run_dir = root / "runs" / f"example-{example.stem}"
        assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2]
        assert [p.name for p in list_checkpoints(run_dir)] == ["step-0000002.pt"]


def fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_fp16_supported()  # not on a CPU without oneDNN's fp16 (AVX2)


def half_precision_runs(root: Path) -> dict[str, list[str]]:
    """ZeRO stage 0 in bf16, and in fp16 where DeepSpeed's CPU accelerator offers it."""
    if not HAS_DEEPSPEED:
        return {}
    runs = {}
    for precision in ["bf16"] + (["fp16"] if fp16_supported() else []):
        config = root / f"zero0-{precision}.json"
        config.write_text(json.dumps({"zero_optimization": {"stage": 0}, precision: {"enabled": True},
                                      "torch_adam": True}))
        runs[f"zero0-{precision}"] = train_command(root, f"zero0-{precision}", "deepspeed", *SHORT,
                                                   f"dist.deepspeed_config={config}")
    return runs


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_deepspeed_stage_0_with_half_precision_checkpoints_the_fp32_weights(root, launched, precision):
    """Under ZeRO stage 0 with bf16 or fp16 the model holds half-precision weights; the single-file
    checkpoint holds the optimiser's fp32 copies, which half precision cannot represent."""
    pytest.importorskip("deepspeed")
    if precision == "fp16" and not fp16_supported():
        pytest.skip("DeepSpeed's CPU accelerator refuses fp16 on this CPU")
    assert_trained(launched, f"zero0-{precision}")
    projection = load_model(root / "runs" / f"zero0-{precision}").state_dict()["blocks.0.attention.heads.to_q.weight"]
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert projection.dtype == torch.float32
    assert not torch.equal(projection, projection.to(half).float())


@pytest.fixture(scope="module")
def token_data(root) -> Path:
    """Tokenized documents of very different lengths: padded samples mask from 0 to most targets."""
    from attnlab.data.shards import prepare_token_shards
    from attnlab.data.tokenizer import train_tokenizer
    from test_pretrain_data import TEXTS, write_jsonl

    tokenizer = train_tokenizer([write_jsonl(root / "texts.jsonl", TEXTS)], vocab_size=320, out_dir=root / "tok")
    return prepare_token_shards([root / "texts.jsonl"], tokenizer, root / "tokens", workers=1).out_dir


def token_run(root: Path, token_data: Path, name: str, layout: str, *extra: str) -> list[str]:
    return ["minimind-demo", f"name={name}", f"out_dir={root / 'runs'}", "model.num_tokens=320", "model.dim=32",
            "model.depth=2", "model.heads=2", "model.kv_heads=1", "model.dim_head=16", "model.ff_hidden=64",
            "model.max_seq_len=64", "data.source=tokens", f"data.path={token_data}", f"data.layout={layout}",
            "data.val_fraction=0.1", "train.seq_len=16", "train.max_steps=4", "train.eval_every=2",
            "train.eval_batches=1", "train.sample_every=0", "train.save_every=4", "train.log_every=1",
            "train.grad_accum=2", "train.schedule=cosine", "train.warmup_steps=1", "log.progress=false", *extra]


def token_runs(root: Path, token_data: Path) -> dict[str, list[str]]:
    """Padded and packed token data under DDP (chosen for a launch without dist.strategy), FSDP and
    DeepSpeed ZeRO-2, two samples a rank a micro-batch."""
    runs = {}
    for layout in ("padded", "packed"):
        strategies = {"ddp": [], "fsdp": ["dist.strategy=fsdp"]}
        if HAS_DEEPSPEED:
            strategies["zero2"] = ["dist.strategy=deepspeed", f"dist.deepspeed_config={deepspeed_config(root, 2)}"]
        for strategy, extra in strategies.items():
            name = f"{strategy}-{layout}"
            preset, *overrides = token_run(root, token_data, name, layout, "train.batch_size=2", *extra)
            runs[name] = ["train", "-p", preset, *overrides]
    return runs


def test_masked_loss_matches_single_with_token_data(root, token_data, launched):
    """Padded documents (a loss mask) and packed ones: DDP, FSDP and DeepSpeed follow one process
    holding the whole batch, because every step's loss is normalised by the global count of
    counted targets."""
    names = list(token_runs(root, token_data))
    assert_trained(launched, *names)
    for layout in ("padded", "packed"):
        preset, *overrides = token_run(root, token_data, f"single-{layout}", layout, "train.batch_size=4")
        train(load_config(preset, overrides))
    for name in names:
        assert_same_run(root / "runs" / name, root / "runs" / f"single-{name.split('-')[1]}")
    assert load_config(str(root / "runs" / "ddp-padded" / "config.yaml")).dist.strategy == "ddp"


def test_sigterm_under_torchrun_stops_every_rank_after_the_same_step(root):
    """What Slurm does at a time limit: SIGTERM to the launcher and its workers (torchrun then
    forwards its own). Every rank stops after the same step, rank 0 saves it, and the run can go on."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), "-m", "attnlab.cli.main", "train", "-p", "demo", *common(root),
        "name=preempted", "train.batch_size=2", "dist.strategy=ddp", "train.max_steps=100000",
        "train.save_every=100000", "train.eval_every=0",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = root / "runs" / "preempted" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count("\n") < 3):
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    (checkpoint,) = list_checkpoints(root / "runs" / "preempted")
    step = read_metrics(root / "runs" / "preempted")[-1]["step"]
    assert checkpoint.name == f"step-{step:07d}.pt", output[-3000:]
    assert output.count(f"stopped by SIGTERM at step {step}, saved") == 2, output[-3000:]  # rank 0 and rank 1


def test_deepspeed_config_must_agree(launched):
    pytest.importorskip("deepspeed")
    assert launched["disagree"] == 2
    assert "gradient_accumulation_steps=7 disagrees with the run config (2)" in launched.output


def test_strategy_without_launcher_is_explained(root):
    from attnlab.errors import AttnlabError

    with pytest.raises(AttnlabError, match="needs a launcher"):
        train(load_config("demo", [*common(root), "name=nolauncher", "dist.strategy=ddp"]))
