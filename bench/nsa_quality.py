"""NSA's learning quality against local attention and the reference library, one recipe for all.

Every model trains on the built-in byte corpus with the same batches and is validated on the same
64 fixed windows (bits per byte): dim 256, depth 4, 4 heads of 64 sharing 2 key/value heads, seq
512, batch 8, AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices) at lr 1e-3 with 30 linear
warm-up steps and a cosine to 1e-4, gradient clip 0.5, fp32, one model seed. NSA: window 64,
compressed blocks of 16 with stride 8, selection blocks of 16, 4 selected.

    # attnlab models: local attention, NSA with its defaults, NSA with options set (an ablation row)
    python bench/nsa_quality.py --model local --steps 300
    python bench/nsa_quality.py --model nsa --steps 300
    python bench/nsa_quality.py --model nsa --set compressor=mean --steps 100
    # the reference library (native-sparse-attention-pytorch 0.2.3) in its own virtual environment:
    # this script runs itself there, reading the same corpus files; attnlab never imports it
    python bench/nsa_quality.py --model reference --python /path/to/venv/bin/python --steps 300

Prints one JSON line per validation (step, bpb) and a final line with the parameter counts; the
figures are deterministic given the seed (load changes only the seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RECIPE = dict(dim=256, depth=4, heads=4, dim_head=64, kv_heads=2, seq_len=512, batch_size=8, lr=1e-3,
              min_lr=1e-4, warmup_steps=30, grad_clip=0.5, weight_decay=0.1, n_val_windows=64)
NSA = dict(sliding_window_size=64, compress_block_size=16, compress_stride=8, selection_block_size=16, num_selected=4)


def parse_settings(items: list[str]) -> dict:
    """["KEY=VALUE", ...] -> {KEY: parsed VALUE}."""
    return {key: parse_value(value) for key, value in (item.split("=", 1) for item in items)}


def parse_value(text: str):
    """'8' -> 8, '0.5' -> 0.5, 'true' -> True, else the string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


# ---- data: the built-in corpus's files, read by both interpreters


def corpus_folder() -> Path:
    from attnlab.data.byte_corpus import prepare_builtin

    return prepare_builtin()


def read_split(folder: Path, split: str) -> torch.Tensor:
    return torch.frombuffer(bytearray((folder / f"{split}.bin").read_bytes()), dtype=torch.uint8).long()


def train_batch(data: torch.Tensor, step: int, seed: int) -> torch.Tensor:
    """[batch, seq + 1] random windows, the same for every model (a generator of their own)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - RECIPE["seq_len"] - 1, (RECIPE["batch_size"],), generator=generator)
    return torch.stack([data[start : start + RECIPE["seq_len"] + 1] for start in starts.tolist()])


def validation_windows(data: torch.Tensor) -> torch.Tensor:
    """[64, seq + 1] windows evenly spaced over the validation split."""
    starts = torch.linspace(0, len(data) - RECIPE["seq_len"] - 1, RECIPE["n_val_windows"]).long()
    return torch.stack([data[start : start + RECIPE["seq_len"] + 1] for start in starts.tolist()])


# ---- models: each a function tokens [B, T] -> logits [B, T, 256]


INITS = ("torch", "gpt2")  # model.init's values
ABLATIONS = ("embedding-1", "linear-torch", "torch-reset", "zero-gates", "zero-branch-values")  # initialise's


def attnlab_model(kind: str, options: dict, init: str, model_options: dict) -> tuple[torch.nn.Module, callable]:
    from attnlab.config import ModelConfig, config_from_dict
    from attnlab.model import Transformer

    attention = {"kind": kind, "local": {"window_size": NSA["sliding_window_size"]}, "nsa": {**NSA, **options}}
    values = {key: RECIPE[key] for key in ("dim", "depth", "heads", "dim_head", "kv_heads")}
    values["init"] = init if init in INITS else "torch" if init.startswith("zero-") else "gpt2"
    values.update(model_options)  # e.g. norm=rmsnorm
    model = Transformer(config_from_dict({**values, "max_seq_len": RECIPE["seq_len"], "attention": attention},
                                         ModelConfig))
    return model, lambda tokens: model(tokens).logits


def initialise(model: torch.nn.Module, scheme: str) -> None:
    """The ablations of initial scales, each on top of the "gpt2" initialisation (attnlab's earlier
    default, which attnlab_model builds for them): "embedding-1" draws the token embedding from
    N(0, 1) (torch's nn.Embedding default); "linear-torch" resets the linear layers to torch's
    default (Kaiming-uniform); "torch-reset" resets both, as the reference library's modules are
    left, then the attention layers' own parameters (NSA's gates) again; "zero-gates", on top of
    "torch", sets NSA's gate weights to zero (every position starts with the gates' biases alone,
    as the reference library starts); "zero-branch-values", on top of "torch", sets the values of
    NSA's compressed and selected branches to zero (the compressor's output layer, the selected
    branch's value projection), so each layer starts as its sliding branch alone under its gate.
    "torch" and "gpt2" are the model's `init` option itself: nothing to do here."""
    if scheme in INITS:
        return
    if scheme == "zero-gates":
        for name, parameter in model.named_parameters():
            if name.endswith("to_gates.weight"):
                torch.nn.init.zeros_(parameter)
        return
    if scheme == "zero-branch-values":
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "compress_values"):
                    module.compress_values.w2.zero_()
                    module.compress_values.b2.zero_()
                    width = module.spec.n_kv_heads * module.spec.dim_head
                    module.branch_kv.weight[width : 2 * width].zero_()  # rows: k_slc, v_slc, k_win, v_win
        return
    if scheme == "embedding-1":
        torch.nn.init.normal_(model.token_embedding.embed.weight, std=1.0)
        return
    kinds = (torch.nn.Linear,) if scheme == "linear-torch" else (torch.nn.Linear, torch.nn.Embedding)
    for module in model.modules():
        if isinstance(module, kinds):
            module.reset_parameters()
    for module in model.modules():
        if hasattr(module, "init_own_parameters"):
            module.init_own_parameters()


def reference_model(options: dict) -> tuple[torch.nn.Module, callable]:
    from native_sparse_attention_pytorch.transformer import Transformer as ReferenceTransformer

    sparse = dict(sliding_window_size=NSA["sliding_window_size"], compress_block_size=NSA["compress_block_size"],
                  compress_block_sliding_stride=NSA["compress_stride"],
                  selection_block_size=NSA["selection_block_size"], num_selected_blocks=NSA["num_selected"])
    model = ReferenceTransformer(num_tokens=256, dim=RECIPE["dim"], depth=RECIPE["depth"], heads=RECIPE["heads"],
                                 dim_head=RECIPE["dim_head"], kv_heads=RECIPE["kv_heads"], use_sparse_attn=True,
                                 sparse_attn_kwargs={**sparse, **options})
    return model, model


# ---- the recipe


def learning_rate(step: int, total: int) -> float:
    """Linear warm-up, then a cosine from lr to min_lr at the last step."""
    if step < RECIPE["warmup_steps"]:
        return RECIPE["lr"] * (step + 1) / RECIPE["warmup_steps"]
    progress = (step - RECIPE["warmup_steps"]) / max(1, total - RECIPE["warmup_steps"])
    return RECIPE["min_lr"] + 0.5 * (RECIPE["lr"] - RECIPE["min_lr"]) * (1 + math.cos(math.pi * progress))


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW, decay on matrices (parameters of two or more dimensions) only."""
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": RECIPE["weight_decay"]}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=RECIPE["lr"], betas=(0.9, 0.95))


def loss_of(logits_of, windows: torch.Tensor) -> torch.Tensor:
    logits = logits_of(windows[:, :-1])  # [B, T, 256]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, logits_of, windows: torch.Tensor) -> float:
    model.eval()
    losses = [loss_of(logits_of, part) for part in windows.split(RECIPE["batch_size"])]
    model.train()
    return float(torch.stack(losses).mean()) / math.log(2)


def train(model: torch.nn.Module, logits_of, folder: Path, steps: int, stop_after: int, eval_every: int,
          seed: int) -> None:
    """The recipe's schedule over `steps`, stopped after `stop_after` of them (a screen: step 100 of
    a 300-step run has the full run's figure at step 100)."""
    train_data, val_windows = read_split(folder, "train"), validation_windows(read_split(folder, "val"))
    optimizer = optimizer_for(model)
    training_seconds = 0.0
    for step in range(min(steps, stop_after)):
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        loss = loss_of(logits_of, train_batch(train_data, step, seed))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        training_seconds += time.perf_counter() - started
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            bpb = bits_per_byte(model, logits_of, val_windows)
            print(json.dumps({"step": step + 1, "train_loss": round(loss.item(), 4), "val_bpb": round(bpb, 4),
                              "train_seconds": round(training_seconds, 1)}), flush=True)


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """All parameters, and those of the compression networks (names with 'compress')."""
    counts = {"parameters": 0, "compressor_parameters": 0}
    for name, parameter in model.named_parameters():
        counts["parameters"] += parameter.numel()
        if "compress" in name and "mem" not in name:
            counts["compressor_parameters"] += parameter.numel()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("local", "nsa", "reference"), required=True)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="NSA options (attnlab: model.attention.nsa keys; reference: SparseAttention arguments)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="attnlab model options (model.* keys, e.g. norm=rmsnorm)")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this many steps of the schedule")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", choices=INITS + ABLATIONS, default="torch",
                        help="attnlab models' initial weights: model.init, or an ablation (initialise's docstring)")
    parser.add_argument("--python", default=None, help="the reference's interpreter (--model reference)")
    parser.add_argument("--corpus", default=None, help="folder of train.bin / val.bin (set for the reference run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.model == "reference" and args.corpus is None:  # run again in the reference's environment
        command = [args.python or sys.executable, __file__, *sys.argv[1:], "--corpus", str(corpus_folder())]
        sys.exit(subprocess.call(command))
    options, model_options = parse_settings(args.set), parse_settings(args.model_set)
    print(json.dumps({"model": args.model, "set": options, "steps": args.steps, "stop_after": args.stop_after,
                      "seed": args.seed, "init": args.init, "model_set": model_options,
                      "torch": torch.__version__}), flush=True)
    torch.manual_seed(args.seed)
    if args.model == "reference":
        model, logits_of = reference_model(options)
    else:
        model, logits_of = attnlab_model(args.model, options, args.init, model_options)
        initialise(model, args.init)
    print(json.dumps(parameter_counts(model)), flush=True)
    folder = Path(args.corpus) if args.corpus else corpus_folder()
    train(model.train(), logits_of, folder, args.steps, args.stop_after or args.steps, args.eval_every,
          args.seed)


if __name__ == "__main__":
    main()
