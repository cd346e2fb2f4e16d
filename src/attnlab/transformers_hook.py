"""Register attnlab's model type (hf_model.py) with transformers' Auto classes once both are imported.

`import attnlab` then `AutoModelForCausalLM.from_pretrained(folder)` loads an exported attnlab model
without `trust_remote_code`. Importing transformers' model classes takes seconds, which commands that
never touch transformers (train, sample, bench) should not pay: so when transformers is not imported
yet, a finder on `sys.meta_path` waits for its import and registers right after it. Registration is
a convenience: if it fails, a warning is logged and transformers works as before.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

log = logging.getLogger(__name__)


def register_now() -> None:
    try:
        from attnlab.hf_model import register

        register()
    except Exception as error:  # an incompatible transformers: keep it usable, say why attnlab's type is missing
        log.warning("attnlab's model type was not registered with transformers (%s: %s)", type(error).__name__, error)


class RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `transformers` is imported, it lets the other finders find it and
    registers attnlab's model type after the module has run."""

    def find_spec(self, name, path, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not come back here
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            register_now()

        spec.loader.exec_module = exec_module
        return spec


def register_with_transformers() -> None:
    """Register now if transformers is imported, after its import if it is installed, else never."""
    if "transformers" in sys.modules:
        register_now()
    elif importlib.util.find_spec("transformers") is not None:
        if not any(isinstance(finder, RegisterAfterImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, RegisterAfterImport())
