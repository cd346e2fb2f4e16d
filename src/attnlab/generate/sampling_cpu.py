"""A CPU operator for token_at (generate/distribution.py): the token at which a row's cumulative
distribution passes a uniform, in one C++ call (sampling_cpu.cpp says how, and why it gives torch's
tokens bit for bit).

Built on first use like the attention kernels (attention/kernels/cpu.py: cached by source, compiler
and CPU) and registered with torch's dispatcher as attnlab::token_at_cpu, so a compiled decode step
calls it from inductor's C++ wrapper. Without a compiler, or with ATTNLAB_CPU_KERNELS=0,
`available()` is False and token_at keeps torch's cumsum and searchsorted.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "sampling_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, str | bool] = {}  # "loaded": True, or "failure": why not


def _build_and_load() -> None:
    from torch.utils.cpp_extension import include_paths

    from attnlab.attention.kernels.cpu import compile_library

    torch_lib = Path(torch.__file__).parent / "lib"
    flags = ["-std=c++20", *(f"-I{path}" for path in include_paths()),
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    link = (f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}")
    torch.ops.load_library(str(compile_library("attnlab_sampling", (SOURCE,), flags, link)))
    torch.library.register_fake("attnlab::token_at_cpu")(
        lambda probs, uniform: probs.new_empty(probs.shape[:-1], dtype=torch.long))


def _load() -> bool:
    if os.environ.get("ATTNLAB_CPU_KERNELS", "1") == "0":
        return False
    if not _state:
        with _lock:
            if not _state:
                try:
                    _build_and_load()
                    _state["loaded"] = True
                except Exception as error:  # noqa: BLE001 - any failure means: torch's cumsum and search
                    _state["failure"] = str(error)
                    log.warning("CPU sampling operator unavailable, sampling with torch's operators: %s", error)
    return "loaded" in _state


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the operator can run here (built and loaded on first call). A constant for
    torch.compile: the answer does not change within a process."""
    return _load()


def serves(probs: Tensor, uniform: Tensor) -> bool:
    """Whether the operator takes these: float32 probabilities and uniforms on the CPU."""
    return (probs.device.type == "cpu" and probs.dtype == torch.float32 and uniform.dtype == torch.float32
            and available())


def token_at(probs: Tensor, uniform: Tensor) -> Tensor:
    """probs [..., V], uniform [...] -> [...] int64: distribution.token_at's token (the caller has
    checked `serves`)."""
    return torch.ops.attnlab.token_at_cpu(probs, uniform)
