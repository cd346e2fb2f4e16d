"""Model FLOPs per token, per attention type, and model FLOPs utilisation (MFU).

Counted, for one token of a training step (forward + backward = 3 x forward):

    forward = 2 * N_active                              every nn.Linear weight (the output head
                                                         included; MoE experts scaled by top_k / n_experts)
            + 4 * sum over layers of H * D * K_layer     scores q.k and the weighted sum of values

K_layer is the number of keys a query is scored against (each attention class's `keys_per_query`), for a
sequence of T:

    full      T                          PaLM's convention (arXiv 2204.02311, appendix B): causal
                                         kernels skip half, but MFU is quoted against this count
    local     min(w, T)
    routing   local heads min(w, T), routed heads w + 1 slots (itself and the last w of its cluster)
    sinkhorn  local heads bucket, sorted heads bucket * (1 + n_sortcut) (own bucket + sorted ones)
    nsa       T / stride compressed keys + num_selected * selection_block + sliding window

Element-wise work (norms, softmax, rotary, the NSA compression network's raw weights) is not
counted, as in the usual MFU accounting. Heads of a layer are averaged, so mixed layers count right.

Legend: N parameters, H query heads, D head width, T sequence length, w window.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.config import ModelConfig
from attnlab.registry import ATTENTION

# dense bf16 tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name()
GPU_BF16_PEAK = {
    "H200": 989.4e12,
    "H100 PCIe": 756.0e12,
    "H100": 989.4e12,
    "A100": 312.0e12,
    "L40S": 362.1e12,
    "A10G": 70.0e12,
    "4090": 165.2e12,
}


def keys_per_query(config: ModelConfig, seq_len: int, layer_index: int) -> float:
    """Mean number of keys one query head of layer `layer_index` scores: each attention class's
    own `keys_per_query` (see the module docstring)."""
    import attnlab.attention  # noqa: F401  (registers the variants)

    kind = config.attention.kind
    attention_class = ATTENTION.get(kind)
    if not hasattr(attention_class, "keys_per_query"):
        raise ValueError(f"no FLOP count for attention kind {kind!r}")
    variant_config = getattr(config.attention, kind, None)
    return attention_class.keys_per_query(variant_config, seq_len, config.heads, layer_index)


def active_linear_parameters(config: ModelConfig) -> float:
    """nn.Linear weights a token goes through (MoE experts scaled by top_k / n_experts)."""
    from attnlab.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    total = 0.0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            share = config.moe.top_k / config.moe.n_experts if ".experts." in f".{name}." else 1.0
            total += module.weight.numel() * share
    return total


def flops_per_token(config: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs for one token of a length-`seq_len` sequence; x3 for a training step."""
    attention = sum(
        4 * config.heads * config.dim_head * keys_per_query(config, seq_len, layer) for layer in range(config.depth)
    )
    forward = 2 * active_linear_parameters(config) + attention
    return 3 * forward if training else forward


def peak_flops(device: torch.device, dtype: torch.dtype | None, configured_tflops: float = 0.0) -> float | None:
    """The hardware peak MFU is measured against: `configured_tflops` if > 0, else the dense bf16 peak
    of a known GPU when training in bf16/fp16, else None (no MFU is reported)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_BF16_PEAK.items():
        if key in name:
            return peak
    return None
