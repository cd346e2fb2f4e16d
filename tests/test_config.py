"""Config resolution and the errors a user sees for bad input."""

from __future__ import annotations

import dataclasses
import re
import types
import typing

import pytest
import torch

from attnlab.config import (
    PRESET_DIR,
    RunConfig,
    check_preset_name,
    config_from_dict,
    config_to_dict,
    known_presets,
    load_config,
)
from attnlab.errors import AttnlabError, ConfigError
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


# What the model's constructor refuses (a registry's name, a variant's or MoE's own rules) is refused
# when the config is loaded: a run refused only once it builds its model had already prepared its data
# and written its run directory.
@pytest.mark.parametrize("overrides, message", [
    (["model.attention.kind=fulll"], "unknown attention 'fulll'. Did you mean 'full'"),
    (["model.feed_forward=gleu"], "unknown feed-forward 'gleu'. Did you mean 'gelu'"),
    (["model.norm=batchnorm"], "unknown norm 'batchnorm'"),
    (["model.feed_forward=moe", "model.moe.top_k=8"], "model.moe.top_k=8 must be between 1 and model.moe.n_experts=4"),
    (["model.feed_forward=moe", "model.ff_chunks=2"], "model.ff_chunks"),
    (["model.attention.kind=nsa", "model.attention.nsa.compress_stride=5"],
     r"model.attention.nsa.compress_stride=5 must divide model.attention.nsa.compress_block_size=16"),
    (["model.attention.kind=nsa", "model.attention.dropout=0.1"], "nsa: attention dropout is not supported"),
    (["model.attention.kind=local", "model.attention.local.backend=flex", "model.attention.dropout=0.1"],
     "backend=flex has no attention dropout"),
])
def test_what_the_model_refuses_is_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("demo", overrides)


@pytest.mark.parametrize("name", known_presets())
def test_every_preset_builds(name):
    config = load_config(name)
    with torch.device("meta"):
        model = Transformer(config.model)
    assert model.num_parameters() > 0


# --------------------------------------------------------------------------------------------
# Every value is checked when the config is loaded (issue 27, items 9 and 10): a bad one is a
# ConfigError naming its key, never a traceback later.


def leaf_fields(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, annotation with its constraints) of every field that holds a value, nested configs opened."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found = []
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            found += leaf_fields(hints[field.name], f"{prefix}{field.name}.")
        else:
            found.append((f"{prefix}{field.name}", hints[field.name]))
    return found


def base_types(annotation: object) -> set[type]:
    """int, float, str, ... an annotation accepts, through Optional, unions, tuples and Annotated."""
    if typing.get_origin(annotation) is typing.Annotated:
        return base_types(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(base_types(option) for option in typing.get_args(annotation)))
    if typing.get_origin(annotation) is tuple:
        return {tuple}
    return {annotation} if isinstance(annotation, type) else {typing.get_origin(annotation) or annotation}


def lowest(annotation: object) -> float:
    """The smallest value a numeric annotation's constraint allows."""
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[1].low
    return min(lowest(option) for option in typing.get_args(annotation) if option is not type(None)
               and typing.get_origin(option) is not tuple)


NUMERIC = [(key, annotation) for key, annotation in leaf_fields() if base_types(annotation) & {int, float}]
INTEGER = [(key, annotation) for key, annotation in NUMERIC if int in base_types(annotation)]
SIZES = [(key, annotation) for key, annotation in INTEGER if lowest(annotation) >= 1]
CHOICES = [key for key, annotation in leaf_fields() if typing.Literal in base_types(annotation)]


def test_every_numeric_field_has_a_constraint():
    assert len(NUMERIC) > 60
    for key, annotation in NUMERIC:
        assert "Annotated" in str(annotation), f"{key}: {annotation} has no Range"


def refusals(key: str, values: list[str]) -> list[str]:
    """The values of `values` that load_config does NOT refuse with a ConfigError naming `key`."""
    accepted = []
    for value in values:
        try:
            load_config("demo", [f"{key}={value}"])
            accepted.append(value)
        except ConfigError as error:
            assert key in str(error), (value, str(error))
    return accepted


@pytest.mark.parametrize("key", [key for key, _ in NUMERIC])
def test_numeric_field_refuses(key):
    # negative, not a number, infinite, the wrong type: no numeric field of attnlab's takes any of these
    assert refusals(key, ["-1", "-0.5", ".nan", ".inf", "-.inf", "abc", "{a: 1}", "true", "''"]) == []


@pytest.mark.parametrize("key", [key for key, _ in INTEGER])
def test_integer_field_refuses(key):
    # beyond 32 bits, beyond any float, not whole, a list with a negative value
    assert refusals(key, ["4294967296", "1" + "0" * 400, "1.5", "[1, 2, 3, -4]"]) == []


@pytest.mark.parametrize("key", [key for key, _ in SIZES])
def test_size_field_refuses_zero(key):
    with pytest.raises(ConfigError, match=re.escape(key) + ".* must be >= "):
        load_config("demo", [f"{key}=0"])


@pytest.mark.parametrize("key", CHOICES)
def test_choice_field_refuses_unknown(key):
    with pytest.raises(ConfigError, match=re.escape(key) + ": 'nosuch' is not one of"):
        load_config("demo", [f"{key}=nosuch"])


@pytest.mark.parametrize("override, message", [
    ("model.dim=0", "model.dim must be >= 1"),
    ("model.depth=0", "model.depth must be >= 1"),
    ("data.val_fraction=1.5", r"data.val_fraction must be in \(0, 1\), got 1.5"),
    ("data.val_fraction=0", r"data.val_fraction must be in \(0, 1\)"),
    ("model.dropout=1", r"model.dropout must be in \[0, 1\)"),
    ("train.min_lr_ratio=2", r"train.min_lr_ratio must be in \[0, 1\]"),
    ("train.lr=0", "train.lr must be > 0"),
    ("train.seed=-3", "train.seed must be in"),
    ("model.num_tokens=100000000000000000000000", "model.num_tokens must be >= 1 .at most 2147483647."),
    ("model.attention.nsa.num_selected=1", "model.attention.nsa.num_selected must be >= 2"),
    ("name=../x", "name must be a plain name"),
    ("name=a/b", "name must be a plain name"),
    ("name=..", "name must be a plain name"),
    ("name=", "name must be a plain name"),
    ("train.device=gpu0", "train.device: 'gpu0' is not a device"),
    ("model.heads=4", None),  # valid
    ("model.kv_heads=3", "model.heads=4 must be a multiple of model.kv_heads=3"),
    ("model.dim_head=15", "model.dim_head=15 must be even for rotary positions"),
    ("model.=3", "a key is missing"),
    ("=3", "a key is missing"),
    ("model=3", "model: expected a mapping"),
    ("model.dim={a: 1}", "model.dim: expected an integer"),
    ("model.nosuch=1", "unknown config key 'model.nosuch'"),
    ("model.attention.local.windw_size=3", "did you mean 'model.attention.local.window_size'"),
    ("model.attention.sinkhorn.n_local_heads=9", None),  # not read unless attention.kind=sinkhorn
    pytest.param("train.lr=" + "[" * 1200, r"train.lr: expected a finite number, got '\[\[.*characters\)$", id="deep"),
])
def test_value_errors_name_the_key(override, message):
    if message is None:
        load_config("demo", [override])
        return
    with pytest.raises(ConfigError, match=message):
        load_config("demo", [override])


def test_consistency_checks_read_the_chosen_variant():
    with pytest.raises(ConfigError, match="n_local_heads has 2 values; model.depth=4 needs one per layer"):
        load_config("demo", ["model.attention.kind=routing", "model.attention.routing.n_local_heads=[1, 1]"])
    with pytest.raises(ConfigError, match="n_local_heads=9 must be at most model.heads=4"):
        load_config("demo", ["model.attention.kind=sinkhorn", "model.attention.sinkhorn.n_local_heads=9"])
    with pytest.raises(ConfigError, match="train.seq_len=512 exceeds model.max_seq_len=256"):
        load_config("demo", ["model.position=learned", "train.seq_len=512"])
    with pytest.raises(ConfigError, match="prime_length \\+ train.sample_length = 300 exceeds"):
        load_config("demo", ["model.position=learned", "train.prime_length=100", "train.sample_length=200"])


def test_yaml_dates_and_numbers_are_names():
    assert load_config("demo", ["name=2024-06-01"]).name == "2024-06-01"
    assert load_config("demo", ["name=7"]).name == "7"


# Small valid values of every model field, alone on a tiny model of every attention kind: the model
# builds, trains a step and decodes, or the config is refused in one line; never a traceback.
TINY = ["model.dim=16", "model.depth=2", "model.heads=2", "model.dim_head=8", "model.max_seq_len=32",
        "model.attention.local.window_size=4", "model.attention.routing.window_size=4",
        "model.attention.sinkhorn.bucket_size=4", "model.attention.nsa.sliding_window_size=4",
        "model.attention.nsa.compress_block_size=4", "model.attention.nsa.compress_stride=2",
        "model.attention.nsa.selection_block_size=4", "model.attention.nsa.query_chunk_size=8"]
SHARED_MODEL_KEYS = {"model.dim", "model.depth", "model.heads", "model.dim_head", "model.kv_heads", "model.max_seq_len"}


def model_cases() -> list[tuple[str, str]]:
    cases = []
    for key, _ in NUMERIC:
        parts = key.split(".")
        if parts[0] != "model" or key == "model.num_tokens":  # the vocabulary: test_cli_inputs.py
            continue
        kinds = [parts[2]] if parts[1] == "attention" and len(parts) == 4 else ["full"]
        kinds = ["full", "local", "routing", "sinkhorn", "nsa"] if key in SHARED_MODEL_KEYS else kinds
        cases += [(kind, key) for kind in kinds]
    return cases


@pytest.mark.parametrize("kind, key", model_cases())
def test_small_values_build_or_refuse(kind, key, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CPU_KERNELS", "0")  # the reference paths: no kernel build in this test
    extra = ["model.feed_forward=moe"] if key.startswith("model.moe.") else []
    large = "9" if key == "model.depth" else "33"  # 33: beyond max_seq_len (32) and the 16-token sequence
    for value in ["0", "1", "3", large] + (["0.5"] if float in base_types(dict(NUMERIC)[key]) else []):
        try:
            config = load_config("demo", [*TINY, f"model.attention.kind={kind}", *extra, f"{key}={value}"])
            model = Transformer(config.model)
        except AttnlabError:
            continue
        tokens = torch.randint(0, 256, (2, 17))
        model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
        model.eval()
        cache = model.new_cache(2, 20)
        with torch.no_grad():
            model(tokens[:, :5], cache=cache)
            model(tokens[:, 5:6], cache=cache)


# Presets by name only; a config file by a path to a regular file (config.py, `looks_like_path`)


def test_preset_names_are_never_paths(tmp_path):
    outside = tmp_path / "outside.yaml"
    outside.write_text("train:\n  max_steps: 3\n")
    for name in ["../../outside", "../outside", "/etc/passwd", "demo.yaml", "a\\b", ".hidden", ""]:
        with pytest.raises(ConfigError, match="is not a preset name"):
            check_preset_name(name)
    config = tmp_path / "exp.yaml"
    config.write_text("preset: ../../presets/demo\n")
    with pytest.raises(ConfigError, match="'../../presets/demo' is not a preset name"):
        load_config(config)
    config.write_text("preset: [demo]\n")
    with pytest.raises(ConfigError, match="preset: expected a preset name"):
        load_config(config)


def test_config_file_must_be_a_regular_text_file(tmp_path):
    cases = {"missing.yaml": (None, "does not exist"), "folder": ("dir", "is not a regular file"),
             "binary.yaml": (b"\xff\xfe\x00garbage", "not a text file"),
             "huge.yaml": (b"a: 1\n" * 300_000, "bytes: not a config file"),
             "list.yaml": (b"- 1\n- 2\n", "expected a mapping"), "broken.yaml": (b"a: [1, 2\n", "not valid YAML"),
             "deep.yaml": (b"a: " + b"[" * 5000 + b"\n", "not valid YAML|nested too deeply"),
             "keys.yaml": (b"1: 2\n", "unknown config key '1'")}
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if content == "dir":
            path.mkdir()
        elif content is not None:
            path.write_bytes(content)
        with pytest.raises(ConfigError, match=message):
            load_config(path)
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml") == load_config(None)  # an empty file: the defaults


def test_a_string_is_a_path_only_when_it_looks_like_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").write_text("train:\n  max_steps: 3\n")  # a file named like a preset is not read
    assert load_config("demo") == load_config(PRESET_DIR / "demo.yaml")
    assert load_config("./demo").train.max_steps == 3
