"""attnlab: train, evaluate, sample and benchmark language models with pluggable attention.

    import attnlab
    config = attnlab.load_config("demo", overrides=["train.max_steps=100"])
    model = attnlab.Transformer(config.model)
    model = attnlab.load_model("runs/demo")          # a run directory or a checkpoint file

Importing attnlab registers its model type with transformers' AutoConfig and AutoModelForCausalLM
(when transformers is installed, as soon as it is imported: attnlab/transformers_hook.py), so a folder
from `attnlab export` loads with `AutoModelForCausalLM.from_pretrained(folder)`.
"""

import importlib
from typing import TYPE_CHECKING, Any

from attnlab.config import RunConfig, load_config
from attnlab.transformers_hook import register_with_transformers

if TYPE_CHECKING:
    from attnlab.model import ModelOutput, Transformer
    from attnlab.train.checkpoint import load_model

__all__ = ["ModelOutput", "RunConfig", "Transformer", "load_config", "load_model"]
__version__ = "0.1.0"

register_with_transformers()

# imported on first use (PEP 562): `import attnlab` (and so the CLI's `attnlab --help`) needs no torch
_LAZY = {"ModelOutput": "attnlab.model", "Transformer": "attnlab.model", "load_model": "attnlab.train.checkpoint"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
