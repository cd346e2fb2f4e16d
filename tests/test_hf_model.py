"""attnlab's own transformers model type (attnlab.hf_model): a run of every attention type (and a
mixture of experts) exports, loads with `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`,
gives attnlab's logits and decodes greedily the tokens attnlab decodes; local attention also exports
natively as Mistral; bad input is refused in one line and nothing is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab import Transformer, load_model
from attnlab.cli.main import main
from attnlab.config import DataConfig, ModelConfig, RunConfig, config_from_dict, config_to_dict
from attnlab.generate.sampling import SamplingConfig, generate, stream
from attnlab.train.checkpoint import checkpoint_path, save_checkpoint
from variants import variant_config

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # the same modules compute both: only the cache's storage differs
EXPORTED_FILES = {"config.json", "model.safetensors", "generation_config.json", "modeling_attnlab.py"}
MOE = {"feed_forward": "moe", "ff_hidden": 48, "moe": {"n_experts": 4, "top_k": 2, "n_shared_experts": 1}}
MODELS = {  # tests/variants.py's small configurations; 45 tokens span several blocks, buckets and windows
    "full": variant_config("full"),
    "local": variant_config("local"),
    "routing": variant_config("routing"),
    "sinkhorn": variant_config("sinkhorn"),
    "nsa": variant_config("nsa"),
    "nsa-moe": variant_config("nsa", **MOE),
}


@pytest.fixture(scope="module", autouse=True)
def modules_cache(tmp_path_factory):
    """transformers copies an exported folder's modeling_attnlab.py into its modules cache
    (trust_remote_code): a temporary one, not the home directory's."""
    import transformers.dynamic_module_utils as dynamic

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf-modules")))
        yield


def random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """Weights large enough that logits are O(10): a wrong position, cache or weight shows at once,
    and greedy decoding never meets a near tie."""
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.uniform_(0.5, 1.5) if name.endswith("norm.weight") else parameter.normal_(0.0, 0.15)
    return model


def write_run(run_dir: Path, model: Transformer) -> Path:
    """A run directory as training leaves it: one checkpoint."""
    config = RunConfig(name=run_dir.name, out_dir=str(run_dir.parent), model=model.config, data=DataConfig())
    save_checkpoint(checkpoint_path(run_dir, 3), {"config": config_to_dict(config), "model": model.state_dict(),
                                                  "step": 3})
    return run_dir


def load_exported(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def tokens_of(vocabulary: int, shape: tuple[int, int], seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocabulary, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_attention_type_loads_in_transformers(tmp_path, name):
    model = random_model(MODELS[name])
    run_dir = write_run(tmp_path / "run", model)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf"), "--model-type", "attnlab"]) == 0
    assert EXPORTED_FILES <= {path.name for path in (tmp_path / "hf").iterdir()}
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == "attnlab" and written["auto_map"]["AutoModelForCausalLM"]
    loaded = load_exported(tmp_path / "hf")
    assert type(loaded).__name__ == "AttnlabForCausalLM"

    tokens = tokens_of(model.config.num_tokens, (2, 45))
    with torch.no_grad():
        ours, theirs = model(tokens).logits, loaded(tokens).logits
    assert ours.abs().max() > 1.0  # not a comparison of near-zero numbers
    assert (ours - theirs).abs().max() < TOLERANCE

    # greedy decoding: the same tokens, and at every step the same logits, as attnlab's cached decoding
    prompt, n_new = tokens[:1, :7], 20
    steps = list(stream(model, prompt, n_new, SamplingConfig(temperature=0.0)))
    expected = torch.cat((prompt, torch.stack([token for token, _ in steps], dim=1)), dim=1)
    with torch.no_grad():
        output = loaded.generate(prompt, max_new_tokens=n_new, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert output.sequences.tolist() == expected.tolist()
    for (_, our_step), their_step in zip(steps, output.logits):
        assert (our_step - their_step).abs().max() < TOLERANCE


def test_greedy_generate_equals_attnlab_sample(tmp_path, capsys):
    """`attnlab sample --temperature 0` and transformers' greedy generate() print the same text
    (a byte-level routing model: token id = byte value, the exported tokenizer maps them alike)."""
    model = random_model(variant_config("routing", num_tokens=256), seed=3)
    run_dir = write_run(tmp_path / "run", model)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0  # auto: attnlab's type
    capsys.readouterr()
    assert main(["sample", str(run_dir), "--prompt", "the cat", "--max-new-tokens", "24", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = tokenizer("the cat", return_tensors="pt")["input_ids"]
    assert prompt.tolist() == [list(b"the cat")]
    with torch.no_grad():
        output = load_exported(tmp_path / "hf").generate(prompt, max_new_tokens=24, do_sample=False)
    assert printed == "the cat" + bytes(output[0, 7:].tolist()).decode("utf-8", errors="replace") + "\n"


def test_generation_past_the_cache_size_grows_it(tmp_path):
    """The cache is made for max_seq_len tokens; decoding beyond it moves to a larger one (fed the
    tokens so far) and still picks attnlab's tokens."""
    model = random_model(variant_config("full", max_seq_len=16), seed=1)
    write_run(tmp_path / "run", model)
    main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--model-type", "attnlab"])
    prompt = tokens_of(61, (2, 6))
    with torch.no_grad():
        theirs = load_exported(tmp_path / "hf").generate(prompt, max_new_tokens=30, do_sample=False)
    assert theirs.tolist() == generate(model, prompt, 30, SamplingConfig(temperature=0.0)).tolist()


def test_padding_attnlab_cannot_compute_is_refused(tmp_path):
    """Right padding is harmless in a parallel forward (attention is causal); left padding there, or
    right padding while generating, would be computed wrongly and is refused."""
    model = random_model(variant_config("local"))
    write_run(tmp_path / "run", model)
    main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--model-type", "attnlab"])
    loaded = load_exported(tmp_path / "hf")
    tokens = tokens_of(61, (2, 12))
    right = torch.ones(2, 12, dtype=torch.long)
    right[1, 9:] = 0
    with torch.no_grad():
        assert torch.equal(loaded(tokens, attention_mask=right).logits, model(tokens).logits)
        with pytest.raises(ValueError, match="may only have zeros after its ones"):
            loaded(tokens, attention_mask=right.flip(-1))
        with pytest.raises(ValueError, match="before them \\(left padding\\) when generating"):
            loaded.generate(tokens, attention_mask=right, max_new_tokens=2)


@pytest.mark.parametrize("name", ["routing", "nsa"])
def test_a_left_padded_batch_generates_what_each_row_generates_alone(tmp_path, name):
    """generate() on prompts of different lengths, left-padded with their attention_mask as lm-eval's
    generation tasks batch them (HFLM._model_generate's call): each row's tokens and logits are those
    of the row generated alone, bit for bit (it raised a ValueError)."""
    from attnlab.hf_model import CACHE_FIELD

    model = random_model(MODELS[name])
    write_run(tmp_path / "run", model)
    main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--model-type", "attnlab"])
    loaded = load_exported(tmp_path / "hf")
    prompts = [tokens_of(61, (1, length), seed=length)[0] for length in (9, 4, 13)]
    width, new = 13, 12
    tokens, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    settings = dict(do_sample=False, pad_token_id=0, use_cache=True, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        batched = loaded.generate(input_ids=tokens, attention_mask=mask, max_length=width + new, **settings)
        for row, prompt in enumerate(prompts):
            alone = loaded.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_length=len(prompt) + new, **settings)
            assert batched.sequences[row, width:].tolist() == alone.sequences[0, len(prompt):].tolist()
            assert all(torch.equal(step[row], step_alone[0]) for step, step_alone in zip(batched.logits, alone.logits))
        cache = getattr(loaded(tokens, attention_mask=mask, use_cache=True), CACHE_FIELD)
        with pytest.raises(ValueError, match="padding is the prompt's while decoding"):  # not the prompt's mask
            loaded(tokens[:, :1], attention_mask=torch.ones(3, width + 1, dtype=torch.long), past_key_values=cache)


def test_local_attention_exports_natively_as_mistral(tmp_path):
    """A local-attention model with Llama's layers is Mistral with sliding_window = window_size:
    transformers' own MistralForCausalLM gives its logits and its greedy tokens."""
    config = config_from_dict({"num_tokens": 300, "dim": 64, "depth": 2, "heads": 4, "kv_heads": 2, "dim_head": 16,
                               "max_seq_len": 64, "norm": "rmsnorm", "feed_forward": "swiglu", "rope_theta": 5000.0,
                               "attention": {"kind": "local", "local": {"window_size": 8}}}, ModelConfig)
    model = random_model(config)
    write_run(tmp_path / "run", model)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["model_type"], written["sliding_window"]) == ("mistral", 8)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == "MistralForCausalLM"
    tokens = tokens_of(300, (2, 40))  # five windows long
    with torch.no_grad():
        ours, theirs = model(tokens).logits, loaded(tokens).logits
    assert ours.abs().max() > 1.0 and (ours - theirs).abs().max() < 1e-4
    prompt = tokens[:1, :6]
    with torch.no_grad():
        expected = loaded.generate(prompt, max_new_tokens=24, do_sample=False)
    assert generate(model, prompt, 24, SamplingConfig(temperature=0.0)).tolist() == expected.tolist()


def test_native_export_refuses_what_transformers_lacks(tmp_path, capsys):
    write_run(tmp_path / "run", random_model(variant_config("sinkhorn")))
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--model-type", "native"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "attention.kind=sinkhorn" in error
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("damage", ["truncated", "no-checkpoint", "not-a-checkpoint", "corrupt-tokenizer"])
def test_export_of_missing_or_corrupt_run_files_is_refused(tmp_path, capsys, damage):
    run_dir = write_run(tmp_path / "run", random_model(variant_config("nsa")))
    checkpoint = checkpoint_path(run_dir, 3)
    if damage == "truncated":
        checkpoint.write_bytes(checkpoint.read_bytes()[:2000])
    elif damage == "no-checkpoint":
        checkpoint.unlink()
    elif damage == "not-a-checkpoint":
        torch.save({"weights": torch.zeros(3)}, checkpoint)
    else:  # the run's own tokenizer copy, cut short
        (run_dir / "tokenizer").mkdir()
        (run_dir / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("attnlab export: error:")
    assert not (tmp_path / "hf").exists()


def test_export_into_an_existing_folder_needs_force(tmp_path, capsys):
    write_run(tmp_path / "run", random_model(variant_config("routing")))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not empty" in error and "--force" in error
    assert [path.name for path in (tmp_path / "hf").iterdir()] == ["config.json"]  # nothing overwritten
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--force"]) == 0
    model = load_model(tmp_path / "run")
    tokens = tokens_of(61, (1, 20))
    with torch.no_grad():
        assert (load_exported(tmp_path / "hf")(tokens).logits - model(tokens).logits).abs().max() < TOLERANCE


def test_an_export_that_fails_midway_leaves_no_half_written_weights(tmp_path, capsys, monkeypatch):
    """A full disk while the weights are written: no partial model.safetensors under the name
    transformers loads, no staging file left, and with --force the previous export stays loadable."""
    import safetensors.torch

    write_run(tmp_path / "run", random_model(variant_config("full")))
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    before = {path.name: path.read_bytes() for path in (tmp_path / "hf").iterdir()}

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--force"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in (tmp_path / "hf").iterdir()} == before
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "new")]) == 1
    assert list((tmp_path / "new").iterdir()) == []


@pytest.mark.parametrize("out", ["a-file", "the-run", "another-run"])
def test_export_into_a_file_or_a_run_directory_is_refused(tmp_path, capsys, out):
    """--out that is a file is one line, not an OSError; a run directory is refused even with
    --force: the export would replace the run's model.safetensors (its final weights)."""
    from attnlab.train.portable import write_weights_file

    runs = {name: write_run(tmp_path / name, random_model(variant_config("full")))
            for name in ("the-run", "another-run")}
    weights = {name: write_weights_file(run).read_bytes() for name, run in runs.items()}
    (tmp_path / "a-file").write_text("keep")
    assert main(["export", str(tmp_path / "the-run"), "--out", str(tmp_path / out), "--force"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("attnlab export: error:")
    assert ("is a file" if out == "a-file" else "holds an attnlab run") in error
    assert (tmp_path / "a-file").read_text() == "keep"
    assert {name: (run / "model.safetensors").read_bytes() for name, run in runs.items()} == weights
    assert not (tmp_path / out / "config.json").exists()


def test_import_attnlab_registers_the_type_once_transformers_is_imported(tmp_path):
    """`import attnlab` does not import transformers (seconds that train or sample need not pay),
    and registers the model type as soon as transformers is imported: no trust_remote_code then."""
    write_run(tmp_path / "run", random_model(variant_config("sinkhorn")))
    main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    (tmp_path / "hf" / "modeling_attnlab.py").unlink()  # only the registered classes can load it now
    script = (
        "import sys, attnlab\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'hf')!r})\n"
        "print(type(model).__name__)\n"
    )
    source = str(Path(__file__).parent.parent / "src")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": source})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "AttnlabForCausalLM"
