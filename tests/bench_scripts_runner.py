"""Run by tests/test_bench_scripts.py: bench/ scripts one after another in this one process (one start
of Python, torch and attnlab for all of them, where each script's own process spends seconds on
imports). argv: a JSON file holding a list of command lines, each [script path, argument, ...].
Each script runs as `python script ...` would run it (as __main__, its folder first on sys.path),
its stdout and stderr written to the listing's name with `.<index>.out` and `.<index>.err` added;
the exit statuses go, in order, to the listing's name with `.status` added. Between scripts,
dynamo's compiled code and the compilers' settings are reset to what they were, so a script
starts as in a fresh process as far as torch.compile goes."""

from __future__ import annotations

import contextlib
import json
import logging
import runpy
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config as inductor_config


def run(command: list[str], out: Path, err: Path) -> int:
    script, *arguments = command
    saved_argv, saved_path = sys.argv, list(sys.path)
    saved_configs = torch._dynamo.config.save_config(), inductor_config.save_config()
    threads = torch.get_num_threads()
    with open(out, "w") as stdout, open(err, "w") as stderr:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            sys.argv, sys.path[:0] = [script, *arguments], [str(Path(script).parent)]
            try:
                runpy.run_path(script, run_name="__main__")
                status = 0
            except SystemExit as stop:
                status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, int | None):
                    print(stop.code, file=sys.stderr)
            except Exception:  # noqa: BLE001 - reported as the script's own process would
                traceback.print_exc()
                status = 1
            finally:
                sys.argv, sys.path[:] = saved_argv, saved_path
                logging.root.handlers.clear()  # a script's logging.basicConfig wrote to its own files
                torch._dynamo.reset()
                with warnings.catch_warnings():  # restoring a deprecated setting warns that it is
                    warnings.simplefilter("ignore", FutureWarning)
                    torch._dynamo.config.load_config(saved_configs[0])
                    inductor_config.load_config(saved_configs[1])
                torch.set_num_threads(threads)
    return status


if __name__ == "__main__":
    listing = Path(sys.argv[1])
    statuses = [run(command, listing.with_name(f"{listing.name}.{index}.out"),
                    listing.with_name(f"{listing.name}.{index}.err"))
                for index, command in enumerate(json.loads(listing.read_text()))]
    listing.with_name(listing.name + ".status").write_text(json.dumps(statuses))
