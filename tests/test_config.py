"""Config resolution and the errors a user sees for bad input."""

from __future__ import annotations

import pytest
import torch

from attnlab.config import config_from_dict, config_to_dict, known_presets, load_config
from attnlab.errors import ConfigError
from attnlab.model import Transformer


def test_precedence_defaults_preset_file_overrides(tmp_path):
    file = tmp_path / "exp.yaml"
    file.write_text("preset: demo\ntrain:\n  lr: 0.01\n  max_steps: 7\n")
    config = load_config(str(file), ["train.max_steps=9", "model.attention.kind=local"])
    assert config.train.lr == 0.01  # file over preset
    assert config.train.max_steps == 9  # override over file
    assert config.model.dim == load_config("demo").model.dim  # preset over defaults
    assert config.train.beta1 == 0.9  # default
    assert config.model.attention.kind == "local"


def test_round_trip():
    config = load_config("demo", ["model.kv_heads=2"])
    assert config_from_dict(config_to_dict(config)) == config


@pytest.mark.parametrize(
    "args, message",
    [
        (("nope", []), "unknown preset 'nope'.*Known presets: .*demo"),
        (("dmeo", []), "Did you mean 'demo'"),
        (("demo", ["train.lerning_rate=1"]), "unknown config key 'train.lerning_rate'"),
        (("demo", ["trian.lr=1"]), "unknown config key 'trian'; did you mean 'train'"),
        (("demo", ["model.dim=abc"]), "model.dim: expected an integer, got 'abc'"),
        (("demo", ["train.precision=fp8"]), "train.precision: 'fp8' is not one of"),
        (("demo", ["train.ema=maybe"]), "train.ema: expected true or false"),
        (("demo", ["train.lr"]), "must look like key.path=value"),
        (("missing.yaml", []), "config file missing.yaml does not exist"),
    ],
)
def test_clear_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(*args)


def test_unknown_attention_kind_is_named():
    config = load_config("demo", ["model.attention.kind=fulll"])
    with pytest.raises(ConfigError, match="unknown attention 'fulll'. Did you mean 'full'"):
        Transformer(config.model)


@pytest.mark.parametrize("name", known_presets())
def test_every_preset_builds(name):
    config = load_config(name)
    with torch.device("meta"):
        model = Transformer(config.model)
    assert model.num_parameters() > 0
