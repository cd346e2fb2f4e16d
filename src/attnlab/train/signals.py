"""Stopping on a signal, at the last completed step, with a checkpoint and a status that says why.

    SIGINT (Ctrl-C)            stop after the current step, save, exit 130; a second Ctrl-C aborts at once
    SIGTERM, SIGHUP, SIGUSR1   what Slurm, torchrun and other schedulers send on preemption, a time
                               limit or a closed terminal: stop after the current step, save, exit 75
                               (EX_TEMPFAIL, "try again": a requeue script or Slurm's RequeueExit=75
                               resubmits `attnlab train --resume`). Repeats are ignored: torchrun
                               forwards the SIGTERM it got itself to every worker
    during start-up            nothing new to save: the run stops at once, with the same status and
                               a one-line message (`Stopped`, caught by the command)
    during the last step       the run completes (saved, status 0), but what was to follow it in the
                               same command stops: `speculative train` does not start the draft

Under several processes every rank stops after the same step (the loop agrees on it through one
collective a step), rank 0 writes the checkpoint, and every rank exits with the same status.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a process it interrupted
EXIT_REQUEUE = 75  # EX_TEMPFAIL (sysexits.h): stopped by the system, continue it with --resume


def exit_status(signum: int) -> int:
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_REQUEUE


class Stopped(BaseException):  # noqa: N818 (like KeyboardInterrupt: not an error of the run, not an Exception)
    """A stop signal before the first step: nothing to save."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """While active: during start-up a stop signal raises `Stopped`; once `in_loop`, the first one is
    recorded in `received` (the loop saves and stops after the current step) and repeats are ignored,
    except a second Ctrl-C, which aborts at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.in_loop = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if not self.in_loop:
            raise Stopped(signum)
        if self.received is None:
            self.received = signum
            log.info("%s: stopping after this step and saving a checkpoint%s", signal.Signals(signum).name,
                     " (Ctrl-C again to abort)" if signum == signal.SIGINT else "")
        elif signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            log.info("%s: already stopping", signal.Signals(signum).name)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
