"""The faster paths of the attention variants, each behind a named back-end.

Each variant file (attention/*.py) holds the paper's math as its reference path; the back-end in
its config (`model.attention.<kind>.backend`) names the faster path that serves the calls it can:

    torch   the variant file's reference path itself: any device, dtype, dropout and call
    cpu     compiled C++ kernels (kernels/cpu.py): float32 on the CPU, no dropout or autocast, whole
            sequences (training, prefill); registered as torch custom ops, so torch.compile traces them.
            Calls through a cache too (a decode step, a speculative verification; kernels/decode_cpu.py),
            float32 or bfloat16: full, local, routing and sinkhorn attention's, NSA's three branches
    flex    FlexAttention with block masks (kernels/flex*.py): whole sequences or long chunks, no
            dropout; compiled on CUDA, forward-only eager reference on the CPU (for checks)
    triton  Triton kernels: CUDA, or the CPU under TRITON_INTERPRET=1. NSA's whole sequences
            (kernels/nsa_compressed_triton.py, nsa_triton.py); full and local attention's calls
            through a cache (kernels/decode_triton.py: only the keys each query sees)
    auto    the fastest back-end that serves the call: cpu where it serves it, else on CUDA for whole
            sequences triton (NSA) or flex (local, routing, sinkhorn), else torch (choose); a call
            through a cache: cpu on the CPU where offered and served, else torch (choose_cached)

A call a back-end does not serve (a cached chunk for `cpu`, a short chunk for `flex`) runs on the
reference path: every back-end has one semantics, tested against the reference
(tests/test_backends.py and the per-kernel tests). The choice reads the call's device, dtype,
autocast state, dropout and length, never the values of its tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.attention.kernels.flex import LENGTH_BUCKET
from attnlab.errors import ConfigError


def check_backend(kind: str, backend: str, offered: tuple[str, ...]) -> None:
    """A one-line error for a back-end this variant has no path for."""
    if backend != "auto" and backend not in offered:
        raise ConfigError(
            f"attention.{kind}.backend={backend} is not offered; {kind} offers: auto, {', '.join(offered)}"
        )


def cpu_refusal(x: Tensor, dropout: float) -> str | None:
    """Why the C++ kernels cannot run here (None: they can): float32 on the CPU, no dropout, no
    autocast, kernels built."""
    from attnlab.attention.kernels.cpu import available

    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        return "runs float32 CPU tensors without autocast"
    if dropout:
        return "has no attention dropout"
    if not available():
        return "needs the compiled CPU kernels (a C++ compiler; ATTNLAB_CPU_KERNELS not 0)"
    return None


def decode_cpu_refusal(q: Tensor, keys: Tensor, dropout: float) -> str | None:
    """Why the decode operator (kernels/decode_cpu.py) cannot run here at all (None: it can):
    float32 or bfloat16 CPU tensors, no autocast, dropout or gradient, the operator built."""
    from attnlab.attention.kernels.decode_cpu import available

    if q.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
        return "runs CPU tensors without autocast"
    if q.dtype not in (torch.float32, torch.bfloat16) or keys.dtype not in (torch.float32, torch.bfloat16):
        return "runs float32 or bfloat16 tensors"
    if dropout:
        return "has no attention dropout"
    if torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad):
        return "has no backward (it decodes)"
    if not available():
        return "needs the compiled CPU kernels (a C++ compiler; ATTNLAB_CPU_KERNELS not 0)"
    return None


def flex_refusal(x: Tensor, dropout: float) -> str | None:
    if dropout:
        return "has no attention dropout"
    # torch's FlexAttention has no backward on the CPU: its forward serves evaluation and decoding there
    if x.device.type == "cpu" and torch.is_grad_enabled() and x.requires_grad:
        return "has no backward on CPU (it trains on CUDA)"
    return None


def triton_refusal(x: Tensor, dropout: float) -> str | None:
    from attnlab.attention.kernels.nsa_triton import interpreting, triton_installed

    if not triton_installed():
        return "needs triton (pip install triton)"
    if x.device.type != "cuda" and not interpreting():
        return "runs on CUDA tensors (or the CPU under TRITON_INTERPRET=1)"
    return None


def serves_call(backend: str, x: Tensor, whole: bool) -> bool:
    """Whether a back-end that can run here takes this call: the cpu kernels take whole sequences;
    flex on CUDA takes chunks of LENGTH_BUCKET queries or more (a shorter one would compile a kernel
    for its shape), on the CPU any chunk of 2 or more (eager reference); triton takes any."""
    if backend == "cpu":
        return whole
    if backend == "flex":
        return x.shape[-2] >= (LENGTH_BUCKET if x.device.type == "cuda" else 2)
    return True


REFUSALS = {"torch": lambda x, dropout: None, "cpu": cpu_refusal, "flex": flex_refusal, "triton": triton_refusal}


def choose(backend: str, offered: tuple[str, ...], x: Tensor, whole: bool, dropout: float = 0.0) -> str:
    """The back-end that runs a call with queries x [..., T, D]. A named back-end runs every call
    it takes (`serves_call`) and leaves the others to the reference (torch); one that cannot run
    on this device, dtype or dropout at all is a one-line error. `auto` takes cpu where it serves,
    then on CUDA for whole sequences triton or flex, as offered, else torch. whole: a whole sequence
    from position 0 (training, prefill), not a chunk through a cache."""
    if backend != "auto":
        refusal = REFUSALS[backend](x, dropout)
        if refusal is not None:
            raise ConfigError(f"attention back-end {backend} {refusal}; choose backend=auto or torch")
        return backend if serves_call(backend, x, whole) else "torch"
    candidates = ["cpu"] + (["triton", "flex"] if x.device.type == "cuda" and whole else [])
    for name in candidates:
        if name in offered and REFUSALS[name](x, dropout) is None and serves_call(name, x, whole):
            return name
    return "torch"


def decode_triton_refusal(q: Tensor, keys: Tensor, dropout: float) -> str | None:
    """Why the triton back-end's cached-call kernels (kernels/decode_triton.py) cannot run here at
    all (None: they can): triton installed, CUDA tensors (or the CPU under TRITON_INTERPRET=1), no
    dropout or gradient."""
    refusal = triton_refusal(q, dropout)
    if refusal is not None:
        return refusal
    if dropout:
        return "has no attention dropout"
    if torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad):
        return "has no backward (it decodes)"
    return None


def _decode_cpu_serves(q: Tensor, keys: Tensor) -> bool:
    from attnlab.attention.kernels.decode_cpu import serves

    return serves(q)


def _decode_triton_serves(q: Tensor, keys: Tensor) -> bool:
    from attnlab.attention.kernels.decode_triton import serves

    return serves(q, keys)


# the back-ends of calls through a cache: why one cannot run here, whether it takes a call
CACHED_BACKENDS = {
    "cpu": (decode_cpu_refusal, _decode_cpu_serves),
    "triton": (decode_triton_refusal, _decode_triton_serves),
}


def choose_cached(backend: str, offered: tuple[str, ...], q: Tensor, keys: Tensor, dropout: float = 0.0) -> str:
    """The back-end of an attention's call through a cache, queries q [B, H, T, D] over its storage
    keys [B, G, L, D]: cpu (kernels/decode_cpu.py) or triton (kernels/decode_triton.py) where the
    variant offers it for cached calls (`offered`), named or auto, and it serves the call, else
    torch. `auto` takes cpu for CPU tensors; triton serves CUDA tensors when named, and `auto` leaves
    CUDA to torch until the kernels have been run and timed on a GPU (tests/test_gpu.py, `bash
    bench/gpu.sh cached`). A named back-end that cannot run here at all is a one-line error, as in
    `choose`; a call it does not take (a head width or query count it has no block for) runs on torch."""
    name = backend if backend != "auto" else "cpu" if q.device.type == "cpu" else None
    if name not in offered or name not in CACHED_BACKENDS:
        return "torch"
    refused, serves = CACHED_BACKENDS[name]
    refusal = refused(q, keys, dropout)
    if refusal is not None:
        if backend != "auto":
            raise ConfigError(f"attention back-end {name} {refusal}; choose backend=auto or torch")
        return "torch"
    return name if serves(q, keys) else "torch"
