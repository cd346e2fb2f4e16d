"""The `cpu` back-end's compiled kernels: listed_cpu.cpp (routing and sinkhorn attention,
listed_cpu.py) and nsa_cpu.cpp (native sparse attention's three branches, nsa_cpu.py), built
together into one shared library and called through ctypes inside torch custom ops (so autograd,
torch.compile and FlopCounterMode see ordinary operators).

The library is compiled on first use with the system's C++ compiler (`c++`, or $CXX) into a cache
directory keyed by the sources, the compiler and this CPU ($ATTNLAB_CACHE, else ~/.cache/attnlab);
a few seconds. Without a compiler, or with ATTNLAB_CPU_KERNELS=0, `available()` is False (a failed
build is logged once) and `auto` back-ends run the variants' reference paths.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from attnlab.compiler import assume_constant_result

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = (HERE / "listed_cpu.cpp", HERE / "nsa_cpu.cpp")
HEADERS = (HERE / "cpu_vec.h", HERE / "nsa_select.h")
ABI_VERSION = 2
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def _cpu_signature() -> str:
    """What the compiled code depends on besides its source: the CPU's instruction sets."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_openmp_dir() -> Path | None:
    """torch's own OpenMP runtime, if it ships one: the kernel links to it, so that one runtime
    (and one thread pool) serves both."""
    lib = Path(torch.__file__).parent / "lib"
    return lib if (lib / "libgomp.so.1").exists() else None


def compile_library(name: str, sources: tuple[Path, ...], flags: list[str], link: tuple[str, ...] = ()) -> Path:
    """The shared library `name` built from sources (and HEADERS) with the system's C++ compiler and
    `flags`, linked to `link` (libraries, after the sources), in the cache directory under a key of
    everything the build depends on; built once per key, by one process at a time (the ranks of a
    job started together, or test workers, wait for the first one's build instead of each making
    its own: build_lock)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *flags]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.insert(2, "-mprefer-vector-width=512")  # full-width AVX-512 where the CPU has it
    openmp = _torch_openmp_dir()
    if openmp is not None:
        flags += [f"-L{openmp}", f"-Wl,-rpath,{openmp}"]
    texts = [path.read_text() for path in (*sources, *HEADERS)]
    key = hashlib.sha256(
        "\n".join([*texts, compiler, version, " ".join([*flags, *link]), _cpu_signature(), sys.platform]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("ATTNLAB_CACHE") or Path.home() / ".cache" / "attnlab") / "kernels"
    target = cache / f"{name}-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with build_lock(target.with_suffix(".lock")):
        if target.exists():  # another process built it while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *flags, *map(str, sources), *link, "-o", str(built)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"compiling {name} failed:\n{result.stderr[-2000:]}")
            os.replace(built, target)  # atomic: a process that loads it never sees half a file
    return target


@contextlib.contextmanager
def build_lock(path: Path):
    """An exclusive lock (flock) on the file `path` while a library is built; where the file system
    has no flock, none (concurrent builds then each write the same file, atomically)."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as error:
            log.debug("no build lock on %s (%s): building unlocked", path, error)
        yield  # closing the file releases the lock


def _build() -> ctypes.CDLL:
    library = ctypes.CDLL(str(compile_library("attnlab_cpu", SOURCES, ["-std=c++17"])))
    if library.attnlab_cpu_kernels_abi_version() != ABI_VERSION:
        raise RuntimeError(f"the CPU kernels are not ABI version {ABI_VERSION}")
    for name in ("listed_attention_forward", "listed_attention_backward", "nsa_block_attention_forward",
                 "nsa_block_attention_backward"):
        getattr(library, name).restype = None
    return library


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call; None if disabled or it cannot be built (logged
    once, with the reason)."""
    global _library, _failure
    if os.environ.get("ATTNLAB_CPU_KERNELS", "1") == "0":
        return None
    if _library is not None or _failure is not None:
        return _library
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _build()
            except Exception as error:  # noqa: BLE001 - any failure means: use the torch path
                _failure = str(error)
                log.warning("CPU attention kernel unavailable, using the torch path: %s", error)
    return _library


@assume_constant_result
def available() -> bool:
    """Whether the kernels can run here (built on first call). A constant for torch.compile: the
    answer does not change within a process."""
    return library() is not None


class OperatorLibrary:
    """C++ that registers torch operators (built against torch's headers, so that a compiled step
    calls them from inductor's C++ wrapper: decode_cpu.cpp, generate/sampling_cpu.cpp), built and
    loaded into torch's dispatcher on first use, its fake implementations registered after; once
    per process. Without a compiler, or with ATTNLAB_CPU_KERNELS=0, it is not loaded (a failed
    build is logged once, saying what serves instead)."""

    def __init__(self, name: str, source: Path, register_fakes, instead: str) -> None:
        self.name, self.source, self.register_fakes, self.instead = name, source, register_fakes, instead
        self.state: dict[str, str | bool] = {}  # "loaded": True, or "failure": why not
        self.lock = threading.Lock()

    def loaded(self) -> bool:
        if os.environ.get("ATTNLAB_CPU_KERNELS", "1") == "0":
            return False
        if not self.state:
            with self.lock:
                if not self.state:
                    try:
                        self._build_and_load()
                        self.register_fakes()
                        self.state["loaded"] = True
                    except Exception as error:  # noqa: BLE001 - any failure means: the torch path serves
                        self.state["failure"] = str(error)
                        log.warning("%s unavailable, %s: %s", self.name, self.instead, error)
        return "loaded" in self.state

    def availability(self):
        """The `available()` of the operator's module: whether it can run here (built and loaded on
        first call). A constant for torch.compile: the answer does not change within a process."""

        @assume_constant_result
        def available() -> bool:
            return self.loaded()

        return available

    def _build_and_load(self) -> None:
        from torch.utils.cpp_extension import include_paths

        torch_lib = Path(torch.__file__).parent / "lib"
        flags = ["-std=c++20", *(f"-I{path}" for path in include_paths()),
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
        link = (f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}")
        torch.ops.load_library(str(compile_library(self.name, (self.source,), flags, link)))


def pointer(x: Tensor | None) -> ctypes.c_void_p:
    """The data pointer of x (None: a null pointer), for the kernels' ctypes calls."""
    return ctypes.c_void_p(0 if x is None or x.numel() == 0 else x.data_ptr())


def require(*tensors: Tensor) -> None:
    """A one-line error unless the kernels serve these tensors (float32 on the CPU, library built)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) or not available():
        raise RuntimeError("the cpu attention back-end needs float32 CPU tensors and the compiled kernels")
