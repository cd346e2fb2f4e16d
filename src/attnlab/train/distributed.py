"""How a training step is distributed: one small strategy class per engine.

This is the only class hierarchy in training, because the engines differ in who owns backward,
the optimiser step and the checkpoint (DeepSpeed owns all three).

    single     one process (CPU or one GPU)
    ddp        torch DistributedDataParallel, started by torchrun
    fsdp       torch FSDP2 (`fully_shard` per block, then the root), started by torchrun
    deepspeed  DeepSpeed ZeRO 0-3, started by the `deepspeed` launcher or torchrun, its JSON config
               given by dist.deepspeed_config (or --deepspeed_config)

A strategy keeps what it wraps: after `wrap(model, build_optimizer, copies)` it holds the model,
the module forward is called on (the model itself, its DDP wrapper or the DeepSpeed engine), the
optimiser and the copies of the model (the EMA weights), and its backward, step and checkpoint
methods work on those.

Under every strategy, rank r trains on slice r of the same global batch (the sampler is
counter-based), so a run on N processes with batch_size b follows the loss curve of one process
with batch_size N*b (tests/test_distributed.py). Only rank 0 logs, samples and writes files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - before any process group exists (see below)
import torch.distributed as dist
from torch import nn

from attnlab.config import RunConfig
from attnlab.errors import AttnlabError
from attnlab.registry import Registry
from attnlab.train.checksum import file_sha256, folder_files, write_manifest
from attnlab.train.finite import named_tensors

log = logging.getLogger(__name__)

STRATEGY: Registry = Registry("distribution strategy")


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    """The number of processes a launcher (torchrun, deepspeed) started; 1 without one."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def strategy_for_launcher(config: RunConfig) -> RunConfig:
    """`config`, with DDP where a launcher started several processes and dist.strategy is single:
    each process training alone would write the same run directory N times over."""
    if config.dist.strategy != "single" or launched_world_size() == 1:
        return config
    if os.environ.get("RANK") == "0":
        log.info("%d processes started by a launcher and no dist.strategy: training with DDP (dist.strategy=ddp; "
                 "fsdp and deepspeed are the others)", launched_world_size())
    return dataclasses.replace(config, dist=dataclasses.replace(config.dist, strategy="ddp"))


def require_launcher(strategy: str) -> None:
    """A one-line error where `strategy` is asked of a process no launcher started: without the
    launcher's environment torch has no group to join, and DeepSpeed looks for MPI instead."""
    if not launched_by_torchrun():
        raise AttnlabError(
            f"dist.strategy={strategy} needs a launcher: `torchrun --nproc_per_node N -m attnlab.cli.main train ... "
            f"dist.strategy={strategy}` or `deepspeed --num_gpus N -m attnlab.cli.main train ...`; "
            "without dist.strategy the run trains in this one process"
        )


def init_process_group(device: torch.device) -> None:
    """Join the process group the launcher described in the environment (gloo on CPU, NCCL on CUDA).

    Dynamo is imported with this module, before any group: imported after one exists (by the
    optimiser's constructor, which every run builds), it keeps the world group alive after
    destroy_process_group (torch 2.13), to be torn down during the interpreter's shutdown, where a
    process once aborted (tests/distributed_runs.py checks that no group's threads outlive a run)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))


def destroy_process_groups() -> None:
    """Destroy every process group, and DeepSpeed's own references to them where DeepSpeed made some."""
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()  # also clears the groups deepspeed.utils.groups keeps
    else:
        dist.destroy_process_group()


def engine_checkpoint_folder(run_dir: Path, engine_folder: str, step: int) -> Path:
    """RUN/<engine>/step-NNNNNNN: where an engine that shards its state keeps that step's checkpoint."""
    return Path(run_dir) / engine_folder / f"step-{step:07d}"


def local_device(name: str) -> torch.device:
    """cuda:LOCAL_RANK under a launcher on a GPU machine, else the configured device."""
    if name in ("auto", "cuda") and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if name == "auto":
        return torch.device("cpu")
    return torch.device(name)


@STRATEGY.register("single")
class SingleProcess:
    """The plain loop: backward, unscale, clip, step. The base of the other strategies."""

    owns_accumulation = False  # True when the engine divides the loss and decides when to step

    def __init__(self, config: RunConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.rank, self.world_size = 0, 1
        self.model: nn.Module | None = None  # the plain model: its parameters, buffers and state dict
        self.forward: nn.Module | None = None  # what forward is called on (DDP wrapper, DeepSpeed engine)
        self.optimizer: torch.optim.Optimizer | None = None
        self.copies: dict[str, nn.Module] = {}  # copies of the model (the EMA weights), checkpointed with it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module, build_optimizer, copies: dict[str, nn.Module] | None = None) -> None:
        """Lay out `model` for this engine and keep it, the module to call forward on, the optimiser
        `build_optimizer(model)` makes for it, and `copies` of the model (made before wrapping)
        laid out like it."""
        self.model = model
        self.forward, self.optimizer = self.wrap_model(model, build_optimizer)
        self.copies = {name: self.prepare_copy(copy) for name, copy in (copies or {}).items()}

    def wrap_model(self, model: nn.Module, build_optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The module to call forward on, and the optimiser `build_optimizer(model)` makes for it."""
        return model, build_optimizer(model)

    def prepare_copy(self, module: nn.Module) -> nn.Module:
        """Lay out a copy of the model (the EMA weights) the way `wrap` laid out the model."""
        return module

    def compile(self) -> None:
        """torch.compile the forward module; an engine's own methods are still reached through it."""
        self.forward = torch.compile(self.forward)

    def micro_step_context(self, is_last: bool):
        """Context for one micro-batch's forward and backward (DDP skips the all-reduce until the last)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler) -> None:
        scaler.scale(loss / self.config.train.grad_accum).backward()

    def step(self, scaler: torch.amp.GradScaler) -> float:
        """Clip and step; return the gradient norm before clipping. Non-finite gradients are never
        applied: without loss scaling the step is left out here (train/finite.py decides what the
        run does then); with it (fp16) the GradScaler skips the step and lowers its scale."""
        clip = self.config.train.grad_clip
        scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else math.inf)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a sharded DTensor
        if math.isfinite(norm) or scaler.is_enabled():
            scaler.step(self.optimizer)
            scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def mean(self, value: float) -> float:
        """The mean of a number over ranks (for logging)."""
        return value

    def total(self, value: float) -> float:
        """The sum of a number over ranks."""
        return value

    def largest(self, value: float) -> float:
        """The largest of a number over ranks."""
        return value

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (every rank gets the same answer)."""
        return self.largest(float(flag)) > 0

    def raise_together(self, error: AttnlabError | None) -> None:
        """Every rank calls this with its own error or None; if any rank has one, every rank raises
        (its own, or the first one's message), so none is left waiting in a collective."""
        messages = self.gather_objects(None if error is None else str(error))
        if error is not None:
            raise error
        first = next((message for message in messages if message is not None), None)
        if first is not None:
            raise AttnlabError(first)

    def gather_objects(self, value: Any) -> list[Any]:
        return [value]

    def barrier(self) -> None:
        pass

    # ---- checkpoints. `checkpoint_states` is called on every rank and returns, on rank 0, the full
    # (unsharded) states that go into the single-file checkpoint (train/checkpoint.py): "model",
    # "optimizer" and one entry per copy (the EMA weights). Engines that shard their state also
    # write their own checkpoint under RUN/<engine_folder>/step-N/ and resume from it.

    engine_folder: str | None = None  # sub-folder of the run directory for the engine's own checkpoints

    def checkpoint_states(self, run_dir: Path, step: int) -> dict[str, Any] | None:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                **{name: copy.state_dict() for name, copy in self.copies.items()}}

    def seal(self, folder: Path) -> None:
        """After every rank wrote its part of an engine checkpoint: the ranks hash its files between
        them and rank 0 writes their checksums beside them (train/checksum.py)."""
        files = folder_files(folder)
        mine = {str(path.relative_to(folder)): file_sha256(path) for path in files[self.rank :: self.world_size]}
        digests = {name: digest for part in self.gather_objects(mine) for name, digest in part.items()}
        if self.is_main:
            write_manifest(folder, digests)

    def restore(self, state: dict[str, Any], run_dir: Path, step: int) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, copy in self.copies.items():
            copy.load_state_dict(state[name])

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor this rank will checkpoint, as it holds it (its shards under FSDP), by name:
        checked for non-finite values before anything is written."""
        yield from named_tensors(self.model.state_dict(), "model")
        yield from named_tensors(self.optimizer.state_dict()["state"], "optimizer")
        for name, copy in self.copies.items():
            yield from named_tensors(copy.state_dict(), name)

    def full_parameters(self):
        """Context in which `self.model.parameters()` hold their full values (ZeRO-3 gathers them)."""
        return contextlib.nullcontext()

    def release(self) -> None:
        """Let go of the model, the module forward was called on, the optimiser and the copies."""
        self.model = self.forward = self.optimizer = None
        self.copies = {}

    def close(self) -> None:
        """The run has ended (its caller holds nothing of it any more)."""
        self.release()


class _ProcessGroupStrategy(SingleProcess):
    def __init__(self, config: RunConfig, device: torch.device) -> None:
        super().__init__(config, device)
        require_launcher(config.dist.strategy)
        init_process_group(device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def mean(self, value: float) -> float:
        return self.total(value) / self.world_size

    def total(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.item()

    def largest(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    def gather_objects(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            # Whatever holds the process group (DDP's Reducer, DeepSpeed's engine, its optimiser and
            # its parameters' group handles) is freed while every rank is still here, so that the
            # group's worker threads are joined by destroy_process_group on every rank: not by a
            # deallocation after the other ranks have exited (a process once hung there), nor during
            # the interpreter's shutdown (a process once aborted there, "terminate called without an
            # active exception").
            self.release()
            gc.collect()
            dist.barrier()
            destroy_process_groups()


@STRATEGY.register("ddp")
class DDP(_ProcessGroupStrategy):
    def wrap_model(self, model, build_optimizer):
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # broadcast_buffers=False: the buffers that must agree across ranks (routing centroids) are
        # all-reduced by their owner once a step, and per-rank statistics must never be overwritten
        wrapped = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)
        return wrapped, build_optimizer(model)

    def micro_step_context(self, is_last):
        return contextlib.nullcontext() if is_last else self.forward.no_sync()


@STRATEGY.register("fsdp")
class FSDP(_ProcessGroupStrategy):
    """FSDP2: each block's parameters sharded over ranks, then the root's."""

    def wrap_model(self, model, build_optimizer):
        return self.prepare_copy(model), build_optimizer(model)  # over the sharded parameters

    def prepare_copy(self, module):
        from torch.distributed.fsdp import fully_shard

        for block in module.blocks:
            fully_shard(block)
        fully_shard(module)
        return module

    def release(self):
        super().release()
        forget_device_meshes()

    # Checkpoints through torch.distributed.checkpoint: every rank writes its own shards under
    # RUN/fsdp/step-N/ (nothing gathered over the network); rank 0 then rebuilds the full fp32 model
    # and EMA weights from those files for the single-file checkpoint (train/sharded.py). The
    # optimiser state lives only in the sharded checkpoint.

    engine_folder = "fsdp"

    def _sharded_states(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {"model": get_model_state_dict(self.model),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
                **{name: get_model_state_dict(copy) for name, copy in self.copies.items()}}

    def checkpoint_states(self, run_dir, step):
        from attnlab.train.sharded import load_full_tensors, save_sharded

        folder = engine_checkpoint_folder(run_dir, self.engine_folder, step)
        save_sharded(self._sharded_states(), folder)
        dist.barrier()
        self.seal(folder)
        if not self.is_main:
            return None
        full = load_full_tensors(folder, ["model", *self.copies])
        return {"optimizer": {}, **full}

    def restore(self, state, run_dir, step):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from attnlab.train.sharded import load_sharded

        sharded = self._sharded_states()
        load_sharded(sharded, engine_checkpoint_folder(run_dir, self.engine_folder, step))
        set_model_state_dict(self.model, sharded["model"])
        set_optimizer_state_dict(self.model, self.optimizer, sharded["optimizer"])
        for name, copy in self.copies.items():
            set_model_state_dict(copy, sharded[name])


def forget_device_meshes() -> None:
    """Empty the caches in which DTensor keeps specs of sharded tensors (torch 2.13), and through them
    the device mesh and its process group, after the tensors are gone: sharding propagation, the
    redistribution plans (FSDP's gradient norm) and the mesh topology. Left full, they would keep
    the process group from being freed by destroy_process_group (tests/distributed_runs.py checks)."""
    try:
        from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop, debug
    except ImportError:  # private to torch: a version without them keeps other caches
        return

    def cache_clear(function):
        return getattr(function, "cache_clear", None)

    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),
                  cache_clear(getattr(_sharding_prop.ShardingPropagator, "_propagate_tensor_meta_cached", None)),
                  cache_clear(getattr(_redistribute, "_gen_transform_infos", None)),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  cache_clear(getattr(_collective_utils.MeshTopoInfo, "build_from_mesh", None))):
        if clear is not None:
            clear()


def forget_zero3_modules(model: nn.Module) -> None:
    """Drop the references DeepSpeed 0.19's ZeRO-3 keeps to a model after its engine is destroyed:
    the model on a module-level stack of modules in forward, and every submodule in a cache of the
    parameters to release after each. Left there, the model, and its parameters' handles on the
    process groups, would outlive the run (tests/distributed_runs.py checks that none does)."""
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    if stack:
        stack[:] = [module for module in stack if module is not model]
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    method = getattr(getattr(coordinator, "PartitionedParameterCoordinator", None),
                     "_PartitionedParameterCoordinator__params_to_release", None)
    for cell in getattr(method, "__closure__", None) or ():  # the cache, under an NVTX wrapper
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def fp32_copies(optimizer) -> dict[int, torch.Tensor]:
    """id(parameter) -> the fp32 copy that DeepSpeed's mixed-precision optimiser without ZeRO steps
    for it: FP16_UnfusedOptimizer keeps a tensor a parameter, FP16_Optimizer a flat one a group."""
    from torch._utils import _unflatten_dense_tensors

    groups = getattr(optimizer, "fp16_groups", None) or []
    if hasattr(optimizer, "fp32_groups"):
        pairs = zip(groups, optimizer.fp32_groups)
    elif hasattr(optimizer, "fp32_groups_flat"):
        flats = optimizer.fp32_groups_flat
        pairs = ((group, _unflatten_dense_tensors(flat, group)) for group, flat in zip(groups, flats))
    else:
        return {}
    return {id(parameter): copy for group, copy_group in pairs for parameter, copy in zip(group, copy_group)}


def resolve_deepspeed_config(config: RunConfig) -> dict[str, Any]:
    """The DeepSpeed config of dist.deepspeed_config with the run's train.batch_size (per process),
    grad_accum and grad_clip written in, so each is applied once; a one-line error where the file
    is no JSON object or sets one of them, or a precision, that differs from the run's (the engine
    trains in the file's precision: a train.precision it lacks would be silently ignored)."""
    path = config.dist.deepspeed_config
    if not path:
        raise AttnlabError("dist.strategy=deepspeed needs dist.deepspeed_config=ds.json (or --deepspeed_config)")
    if not Path(path).is_file():
        raise AttnlabError(f"DeepSpeed config {path} does not exist")
    try:
        ds = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AttnlabError(f"DeepSpeed config {path} is not valid JSON ({error})") from error
    if not isinstance(ds, dict):
        raise AttnlabError(f"DeepSpeed config {path} holds a {type(ds).__name__}, not a JSON object")
    train = config.train
    wanted = {
        "train_micro_batch_size_per_gpu": train.batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": train.grad_clip,
    }
    for key, value in wanted.items():
        if key in ds and ds[key] != value:
            raise AttnlabError(f"{path}: {key}={ds[key]} disagrees with the run config ({value})")
        ds[key] = value
    for name in ("bf16", "fp16"):
        if not isinstance(ds.get(name, {}), dict):  # `"bf16": true` was an AttributeError traceback on every rank
            raise AttnlabError(f'{path}: "{name}" must be an object such as {{"enabled": true}}, not {ds[name]!r}')
    precision = next((name for name in ("bf16", "fp16") if ds.get(name, {}).get("enabled")), "fp32")
    if train.precision not in ("auto", precision):
        raise AttnlabError(f"{path}: trains in {precision} (its bf16 and fp16 sections) but train.precision="
                           f"{train.precision}; enable {train.precision} there, or set train.precision=auto")
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
    ds.setdefault("zero_allow_untested_optimizer", True)  # attnlab passes a plain torch AdamW
    offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload not in (None, "none") and "zero_force_ds_cpu_optimizer" not in ds:
        # DeepSpeed refuses a client optimizer with offload unless told otherwise; the torch AdamW
        # then steps the offloaded fp32 weights on the CPU (DeepSpeedCPUAdam would need a build)
        ds["zero_force_ds_cpu_optimizer"] = False
        log.info("%s: optimizer offload to %s with attnlab's torch AdamW (zero_force_ds_cpu_optimizer=false)",
                 path, offload)
    return ds


@STRATEGY.register("deepspeed")
class DeepSpeed(_ProcessGroupStrategy):
    """DeepSpeed owns backward, the step, gradient accumulation, clipping and loss scaling.

    The run's train.batch_size, grad_accum and grad_clip are written into the DeepSpeed config
    (they must agree with it when it sets them), so they are applied exactly once.
    """

    owns_accumulation = True

    def __init__(self, config: RunConfig, device: torch.device) -> None:
        import importlib

        require_launcher("deepspeed")
        try:
            import deepspeed
        except ImportError as error:  # an optional dependency
            raise AttnlabError(f"dist.strategy=deepspeed needs DeepSpeed ({error}): pip install deepspeed") from error
        ds_config = resolve_deepspeed_config(config)  # checked before any process group is made
        if device.type == "cpu":
            # DeepSpeed's CPU back-end compiles a shared-memory C++ extension on first use (minutes,
            # and a compiler); plain gloo collectives need nothing built. (`deepspeed.comm.torch` as
            # an attribute is the torch package itself, hence the lookup by module name.)
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        SingleProcess.__init__(self, config, device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.deepspeed = deepspeed
        self.ds_config = ds_config

    def wrap_model(self, model, build_optimizer):
        engine, engine_optimizer, _, _ = self.deepspeed.initialize(
            model=model, optimizer=build_optimizer(model), config=self.ds_config
        )
        return engine, engine_optimizer

    def backward(self, loss, scaler):
        self.forward.backward(loss)  # the engine scales by 1/grad_accum itself
        self.forward.step()  # called every micro-batch; the engine steps the optimiser at the boundary

    def step(self, scaler):
        norm = self.forward.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    # The engine writes its own checkpoint under RUN/deepspeed/step-N/ and resumes from it; rank 0
    # rebuilds full fp32 weights from it with DeepSpeed's zero_to_fp32 for the single-file
    # checkpoint; under ZeRO stage 0, which zero_to_fp32 does not read, from the whole weights every
    # rank holds (their fp32 copies under bf16 or fp16: stage_0_weights). The EMA copy stays an
    # ordinary full module on every rank (made before deepspeed.initialize), saved and loaded as it
    # is; under ZeRO-3 the live weights are gathered for its update.

    engine_folder = "deepspeed"

    def checkpoint_states(self, run_dir, step):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        folder = engine_checkpoint_folder(run_dir, self.engine_folder, step)
        self.forward.save_checkpoint(str(folder.parent), tag=folder.name)
        dist.barrier()
        self.seal(folder)
        zero = self.forward.zero_optimization()
        whole = None if zero else self.stage_0_weights()  # a collective: on every rank
        if not self.is_main:
            return None
        weights = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name) if zero else whole
        return {"model": weights, "optimizer": {},
                **{name: copy.state_dict() for name, copy in self.copies.items()}}

    def stage_0_weights(self) -> dict[str, torch.Tensor]:
        """The model's state in fp32 under ZeRO stage 0, on every rank: with bf16 or fp16 each
        parameter's fp32 copy, which the engine's optimiser steps (BF16_Optimizer partitions them
        over the ranks: gathered, a collective), else the parameter itself."""
        from deepspeed.utils import safe_get_full_fp32_param

        copies = fp32_copies(self.forward.optimizer)
        parameters = dict(self.model.named_parameters(remove_duplicate=False))  # tied ones under each name
        state = {}
        for name, tensor in self.model.state_dict().items():
            parameter = parameters.get(name)
            full = None if parameter is None else copies.get(id(parameter))
            if parameter is not None and full is None:
                full = safe_get_full_fp32_param(parameter)
            state[name] = (tensor if full is None else full).detach().float().cpu()
        return state

    def restore(self, state, run_dir, step):
        folder = engine_checkpoint_folder(run_dir, self.engine_folder, step)
        path, _ = self.forward.load_checkpoint(str(folder.parent), tag=folder.name)
        if path is None:
            raise AttnlabError(f"no DeepSpeed checkpoint {folder}")
        for name, copy in self.copies.items():
            copy.load_state_dict(state[name])

    def state_tensors(self):
        """The weights as this rank holds them (a ZeRO-3 partition) and the copies; the engine's
        optimiser state is checked in the full checkpoint rank 0 writes (train/checkpoint.py)."""
        yield from named_tensors(dict(self.model.named_parameters()), "model")
        for name, copy in self.copies.items():
            yield from named_tensors(copy.state_dict(), name)

    def release(self):
        if self.forward is not None:
            self.forward.destroy()  # removes the engine's and its optimiser's hooks on the model
            forget_zero3_modules(self.model)
        super().release()

    def full_parameters(self):
        if self.ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
            return self.deepspeed.zero.GatheredParameters(list(self.model.parameters()))
        return contextlib.nullcontext()
