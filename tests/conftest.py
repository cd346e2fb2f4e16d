import os
import subprocess
import sys
from pathlib import Path

import pytest

# Inductor compiles in a pool of one process per core unless told otherwise: under pytest -n, every
# worker's pool would contend for the same cores (and each pool's processes import torch). Each
# worker gets its share of the cores; read when torch is first imported, so set before it.
# Subprocesses the tests start (scripts, launches) inherit it. Without workers, inductor's default.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, cores // workers)))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
# Hugging Face libraries (transformers, datasets, lm-eval) read these when imported: tests never reach
# the network (every model, tokenizer and task is a local folder the test writes)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
# Without CUDA the Triton kernels are checked on the CPU under Triton's interpreter, which triton
# reads when it is first imported (its language library is built interpreted or compiled then):
# set here, before any test imports it (tests/test_nsa_triton.py, tests/test_nsa_kernels.py)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Prepared corpora go to one temporary cache per test session, never to the home directory;
    the C++ kernels built into it are shared by the session's workers (pytest -n)."""
    cache = os.environ.get("ATTNLAB_TEST_CACHE")
    if cache is None:
        base = tmp_path_factory.getbasetemp()
        cache = str(base / "attnlab-cache")
        os.environ["ATTNLAB_TEST_CACHE"] = cache
        _share_kernels(base, Path(cache))
    monkeypatch.setenv("ATTNLAB_CACHE", cache)


SHARED_KERNELS = "attnlab-kernels"  # the session's kernels folder, in its temporary folder


def _share_kernels(base: Path, cache: Path) -> None:
    """Under pytest-xdist each worker's temporary folder lies in the session's: its cache's kernels
    folder links to one there, so a kernel is built once for the session (kernels/cpu.py locks each
    build), not once per worker (half a minute each for the decode and sampling operators)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _link_kernels(cache, base.parent / SHARED_KERNELS)


def _link_kernels(cache: Path, shared: Path) -> None:
    """cache's kernels folder: a link to `shared` (both made as needed)."""
    shared.mkdir(exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(shared, target_is_directory=True)


PREBUILDER = pytest.StashKey[subprocess.Popen]()
PREBUILD = """
from attnlab.attention.kernels import cpu, decode_cpu
from attnlab.generate import sampling_cpu
from attnlab.model import int8_linear_cpu
for module in (decode_cpu, int8_linear_cpu, sampling_cpu, cpu):  # the longest build first
    module.available()
"""


def pytest_sessionstart(session):
    """For the whole suite under pytest -n (`make test`), the controller starts building attnlab's
    C++ kernels and operators at once, in a process of its own, into the kernels folder its workers
    share (_share_kernels): while the workers collect, not when a test first needs one. A worker
    that needs one still building waits on its lock (kernels/cpu.py) while the builder has the
    core; built lazily, one worker's build left the other waiting with its core idle (half a minute
    for the decode operator). A run of chosen files builds only what its tests need."""
    config = session.config
    if (os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None)
            or config.args_source != pytest.Config.ArgsSource.TESTPATHS
            or "ATTNLAB_TEST_CACHE" in os.environ or os.environ.get("ATTNLAB_CPU_KERNELS") == "0"):
        return
    base = config._tmp_path_factory.getbasetemp()
    cache = base / "attnlab-prebuild"
    _link_kernels(cache, base / SHARED_KERNELS)
    config.stash[PREBUILDER] = subprocess.Popen(
        [sys.executable, "-c", PREBUILD], env={**os.environ, "ATTNLAB_CACHE": str(cache)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session):
    builder = session.config.stash.get(PREBUILDER, None)
    if builder is not None and builder.poll() is None:  # a run stopped before the builds ended
        builder.kill()
        builder.wait()


@pytest.fixture(params=["cpu", "torch"])
def cpu_path(request, monkeypatch):
    """Run a test on both CPU paths of an attention variant: the `cpu` back-end's compiled kernels
    (attention/kernels/) and the reference (`torch`). For whole models, the environment switch
    makes `auto` take the one asked for."""
    from attnlab.attention.kernels.cpu import available

    if request.param == "cpu" and not available():
        pytest.skip("the CPU kernels could not be built here")
    monkeypatch.setenv("ATTNLAB_CPU_KERNELS", "1" if request.param == "cpu" else "0")
    return request.param
