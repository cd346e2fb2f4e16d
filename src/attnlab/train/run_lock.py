"""One run per run directory: `RUN/.lock`, locked (flock) by the process that owns the run, for the
run's life.

A second `attnlab train` or `--resume` on a directory in use stops at once with a one-line error
naming the owner (pid, host, start, command). The kernel releases the lock when its process ends,
however it ends (kill -9, a lost node on a network file system that supports locks), so a lock left
behind is stale by construction: the next run takes it over and says whose it was. The owner removes
the file when it finishes. On a file system without flock the run goes on unlocked, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from attnlab.errors import AttnlabError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class RunDirectoryInUse(AttnlabError):
    """Another live process owns the run directory."""


def not_writable(run_dir: Path, error: OSError) -> AttnlabError:
    return AttnlabError(f"cannot write to the run directory {run_dir}: {error.strerror or error}")


def _open_lock_file(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


class RunLock:
    """`with RunLock(run_dir):` owns the run directory (created if need be) or raises RunDirectoryInUse.
    A directory it created is removed again when the run leaves it empty (a run refused at start-up,
    e.g. for its data or its train.init_from): never one that existed before."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None
        self.created: list[Path] = []  # the folders mkdir made, the run directory first

    def __enter__(self) -> RunLock:
        try:
            self.created = missing_folders(self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.fd = self._lock()
            if self.fd is not None:
                self._take_over()
        except OSError as error:
            self._close()
            remove_if_empty(self.created)
            raise not_writable(self.run_dir, error) from error
        return self

    def _lock(self) -> int | None:
        """The locked file descriptor of RUN/.lock (None where the file system has no locks)."""
        while True:
            fd = _open_lock_file(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read(fd)
                os.close(fd)
                raise RunDirectoryInUse(f"{self.run_dir} is in use by {describe(owner)}; wait for it to finish "
                                        f"or stop it, or choose another run name with name=...") from None
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    log.warning("cannot lock %s (%s): two runs on it would not be stopped", self.run_dir,
                                error.strerror)
                    return None
                raise
            try:
                same_file = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:  # else the previous owner removed it between our open and our lock: again
                return fd
            os.close(fd)

    def _take_over(self) -> None:
        previous = _read(self.fd)
        if previous:
            log.warning("taking over the lock of %s: that process is gone", describe(previous))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)[:500]}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(self.fd)

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # still locked: a waiting process sees a removed file and retries
        self._close()
        remove_if_empty(self.created)

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_if_empty(folders: list[Path]) -> None:
    """Remove `folders`, deepest first, while they are empty: rmdir removes no folder that holds
    anything, so one that another process wrote into meanwhile is kept."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def describe(owner: dict) -> str:
    if not owner or owner.get("unreadable"):
        return "another process (its lock file is unreadable)"
    return (f"pid {owner.get('pid')} on {owner.get('host')} (started {owner.get('started')}: "
            f"{owner.get('command', '?')})")
