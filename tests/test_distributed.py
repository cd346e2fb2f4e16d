"""Two processes over gloo on CPU: DDP, FSDP2 and DeepSpeed ZeRO 1-3 follow the single-process loss
curve with the same global batch (gradient accumulation included), resume exactly, and only
rank 0 writes files."""

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


def launch(root: Path, name: str, strategy: str, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), "-m", "attnlab.cli.main", "train", "-p", "demo",
        *common(root), f"name={name}", "train.batch_size=2", f"dist.strategy={strategy}", *extra,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_matches_single_and_resumes(root, single_ema, strategy):
    """With EMA weights too: they are laid out (sharded) like the model and saved gathered."""
    name = f"{strategy}-split"
    ema = ["train.ema=true", "train.ema_decay=0.5"]
    launch(root, name, strategy, *ema, "--until-step", "3")
    assert [p.name for p in list_checkpoints(root / "runs" / name)] == ["step-0000003.pt"]
    launch(root, name, strategy, *ema, "--resume")
    assert_same_run(root / "runs" / name, single_ema)
    if strategy == "fsdp":  # resumed from its own sharded checkpoint, one shard file per rank
        shards = sorted(p.name for p in (root / "runs" / name / "fsdp" / "step-0000006").iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.sha256"]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_deepspeed_zero_matches_single(root, single, single_ema, stage):
    """Stage 2 is trained by test_auxiliary_losses_match_single and test_masked_loss_matches_single_with_token_data."""
    pytest.importorskip("deepspeed")
    config = deepspeed_config(root, stage)
    name = f"zero{stage}"
    if stage == 0:  # whole weights on every rank: checkpointed without zero_to_fp32, resumed
        launch(root, name, "deepspeed", f"dist.deepspeed_config={config}", "--until-step", "3")
        launch(root, name, "deepspeed", f"dist.deepspeed_config={config}", "--resume")
    elif stage == 3:  # resumes through its own checkpoint, with EMA weights of the partitioned model
        ema = ["train.ema=true", "train.ema_decay=0.5"]
        launch(root, name, "deepspeed", f"dist.deepspeed_config={config}", *ema, "--until-step", "3")
        launch(root, name, "deepspeed", f"dist.deepspeed_config={config}", *ema, "--resume")
    else:  # the arguments the `deepspeed` launcher and the seeds pass
        launch(root, name, "deepspeed", "--deepspeed_config", str(config), "--local_rank=0")
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


def test_auxiliary_losses_match_single(root, single_aux):
    """Commitment and balance losses, routing centroids and MoE experts follow the single process
    under DDP, FSDP and DeepSpeed ZeRO-2 (one launch)."""
    strategies = ["ddp", "fsdp"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") is not None else [])
    zero2 = [f"dist.deepspeed_config={deepspeed_config(root, 2)}"]
    launch_runs(root, [["demo", *common(root), *AUX_MODEL, f"name={strategy}-aux", "train.batch_size=2",
                        f"dist.strategy={strategy}", *(zero2 if strategy == "deepspeed" else [])]
                       for strategy in strategies])
    for strategy in strategies:
        run_dir = root / "runs" / f"{strategy}-aux"
        assert_same_run(run_dir, single_aux)
        logged = [r for r in read_metrics(run_dir) if "commitment" in r]
        assert logged and all(r["moe_balance"] > 0 for r in logged)
        for name, value in load_model(single_aux).state_dict().items():
            if name.endswith("centroids"):  # buffers, not compared by assert_same_run's parameters alone
                torch.testing.assert_close(load_model(run_dir).state_dict()[name], value, atol=1e-5, rtol=1e-4)


def launch_runs(root: Path, runs: list[list[str]]) -> None:
    """Train `runs` ([preset, override, ...] each) on two processes, one after another, in one launch."""
    listing = root / f"runs-{free_port()}.json"
    listing.write_text(json.dumps(runs))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(Path(__file__).parent / "distributed_runs.py"), str(listing),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_every_deepspeed_example_trains_on_the_cpu(root):
    """examples/deepspeed/*.json (bf16, ZeRO-1, ZeRO-2 with optimizer offload, ZeRO-3) start and
    train two steps on two CPU processes."""
    pytest.importorskip("deepspeed")
    examples = sorted((Path(__file__).parent.parent / "examples" / "deepspeed").glob("*.json"))
    launch_runs(root, [["demo", *common(root), f"name=example-{example.stem}", "train.batch_size=2",
                        "train.max_steps=2", "train.grad_accum=1", "train.eval_every=0", "train.save_every=2",
                        "dist.strategy=deepspeed", f"dist.deepspeed_config={example}"] for example in examples])
    for example in examples:
        run_dir = root / "runs" / f"example-{example.stem}"
        assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2]
        assert [p.name for p in list_checkpoints(run_dir)] == ["step-0000002.pt"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_deepspeed_stage_0_with_half_precision_checkpoints_the_fp32_weights(root, precision):
    """Under ZeRO stage 0 with bf16 or fp16 the model holds half-precision weights; the single-file
    checkpoint holds the optimiser's fp32 copies, which half precision cannot represent."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    if precision == "fp16" and not get_accelerator().is_fp16_supported():  # a CPU without oneDNN's fp16 (AVX2)
        pytest.skip("DeepSpeed's CPU accelerator refuses fp16 on this CPU")
    config = root / f"zero0-{precision}.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 0}, precision: {"enabled": True}, "torch_adam": True}))
    launch_runs(root, [["demo", *common(root), f"name=zero0-{precision}", "train.batch_size=2", "train.max_steps=2",
                        "train.grad_accum=1", "train.eval_every=0", "train.save_every=2", "dist.strategy=deepspeed",
                        f"dist.deepspeed_config={config}"]])
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


def test_masked_loss_matches_single_with_token_data(root, token_data):
    """Padded documents (a loss mask) and packed ones: DDP (chosen for a launch without
    dist.strategy), FSDP and DeepSpeed follow one process holding the whole batch, because every
    step's loss is normalised by the global count of counted targets."""
    runs = []
    for layout in ("padded", "packed"):
        preset, *overrides = token_run(root, token_data, f"single-{layout}", layout, "train.batch_size=4")
        train(load_config(preset, overrides))
        runs.append(token_run(root, token_data, f"ddp-{layout}", layout, "train.batch_size=2"))
        runs.append(token_run(root, token_data, f"fsdp-{layout}", layout, "train.batch_size=2", "dist.strategy=fsdp"))
        if importlib.util.find_spec("deepspeed") is not None:
            runs.append(token_run(root, token_data, f"zero2-{layout}", layout, "train.batch_size=2",
                                  "dist.strategy=deepspeed", f"dist.deepspeed_config={deepspeed_config(root, 2)}"))
    launch_runs(root, runs)
    for name in [run[1].removeprefix("name=") for run in runs]:
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


def test_deepspeed_config_must_agree(root):
    pytest.importorskip("deepspeed")
    path = root / "disagree.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 7}))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
        "-m", "attnlab.cli.main", "train", "-p", "demo", *common(root), "name=disagree",
        "dist.strategy=deepspeed", f"dist.deepspeed_config={path}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "gradient_accumulation_steps=7 disagrees with the run config (2)" in result.stderr


def test_strategy_without_launcher_is_explained(root):
    from attnlab.errors import AttnlabError

    with pytest.raises(AttnlabError, match="needs a launcher"):
        train(load_config("demo", [*common(root), "name=nolauncher", "dist.strategy=ddp"]))
