"""attnlab: train, evaluate, sample and benchmark language models with pluggable attention.

    import attnlab
    config = attnlab.load_config("demo", overrides=["train.max_steps=100"])
    model = attnlab.Transformer(config.model)
    model = attnlab.load_model("runs/demo")          # a run directory or a checkpoint file
"""

from attnlab.config import RunConfig, load_config
from attnlab.model import ModelOutput, Transformer
from attnlab.train.checkpoint import load_model

__all__ = ["ModelOutput", "RunConfig", "Transformer", "load_config", "load_model"]
__version__ = "0.1.0"
