"""Starting weights from another model (`train.init_from`), also one that differs: retrofitting.

A common research recipe continues the pretraining of a trained model with another attention: a
dense model given NSA, local or routing attention. The two models share most tensors by name, since
every attention type keeps its projections as `heads.to_q / to_k / to_v / to_out` (attention/base.py):
the embeddings, norms, feed-forwards and those projections. So every tensor of this run's model that
the source has under the same name and with the same shape is loaded; the others keep this model's
initialisation (NSA's gates, compressors and memory; routing's centroids when their number changes);
the source's tensors this model has no use for are skipped. A short table of the three is logged.
The same rule covers the plain case, an identical model, where everything is loaded.

The source is an attnlab run or checkpoint, and so any Llama through `attnlab import-hf`. Only its
model weights are taken: optimiser, schedule, data order and step count start afresh.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from attnlab.config import ModelConfig
from attnlab.errors import CheckpointError, ConfigError
from attnlab.model.transformer import Transformer
from attnlab.train.checkpoint import load_model

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^blocks\.\d+\.")


@dataclass
class WeightMatch:
    """How a source's tensors meet this model's."""

    loaded: dict[str, Tensor] = field(default_factory=dict)  # this model's name -> the source's tensor
    new: dict[str, str] = field(default_factory=dict)  # this model's tensors the source lacks -> why
    skipped: dict[str, str] = field(default_factory=dict)  # the source's tensors left unused -> why


def model_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """The shape of every tensor in a model of `config` (built on the meta device: no memory, no time)."""
    with torch.device("meta"):
        model = Transformer(config)
    return {name: value.shape for name, value in model.state_dict().items()}


def match_weights(source: dict[str, Tensor], shapes: dict[str, torch.Size]) -> WeightMatch:
    """Source tensors by name and shape against this model's `shapes` (see the module docstring)."""
    match = WeightMatch()
    for name, shape in shapes.items():
        tensor = source.get(name)
        if tensor is None:
            match.new[name] = f"{list(shape)}"
        elif tensor.shape == shape:
            match.loaded[name] = tensor
        else:
            match.new[name] = f"{list(shape)}, {list(tensor.shape)} there"
    for name, tensor in source.items():
        if name not in shapes:
            match.skipped[name] = f"{list(tensor.shape)}"
        elif name in match.new:
            match.skipped[name] = f"{list(tensor.shape)}, {list(shapes[name])} here"
    return match


def table(match: WeightMatch) -> list[str]:
    """One line per kind of tensor (the layers of a name counted together), grouped by status."""
    rows = [("loaded", {name: f"{list(value.shape)}" for name, value in match.loaded.items()}),
            ("new", match.new), ("skipped", match.skipped)]
    kinds: dict[tuple[str, str, str], int] = defaultdict(int)  # (status, name with layers as *, shapes) -> count
    for status, names in rows:
        for name, detail in names.items():
            kinds[(status, _LAYER.sub("blocks.*.", name), detail)] += 1
    width = max((len(name) for _, name, _ in kinds), default=0)
    return [f"  {status:<8}{count:>3} x {name:<{width}}  {detail}" for (status, name, detail), count in kinds.items()]


def initial_weights(source: str | Path, config: ModelConfig) -> dict[str, Tensor]:
    """The tensors of the run or checkpoint `source` that fit a model of `config` (logged as a table);
    ConfigError in one line when none does."""
    try:
        start = load_model(source, weights="model")
    except CheckpointError as error:
        raise ConfigError(f"train.init_from: {error}") from error
    match = match_weights(start.state_dict(), model_shapes(config))
    if not match.loaded:
        raise ConfigError(f"train.init_from={source}: none of its {len(match.skipped)} tensors fits this model "
                          "(no tensor with the same name and shape: is it the same width, heads and vocabulary?)")
    log.info("train.init_from=%s (step %d): %d tensors loaded, %d new, %d skipped\n%s", source,
             start.checkpoint_step, len(match.loaded), len(match.new), len(match.skipped), "\n".join(table(match)))
    return match.loaded
