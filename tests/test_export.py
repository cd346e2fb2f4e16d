"""Hugging Face export and import (attnlab.hf): transformers' LlamaForCausalLM (and, for a mixture
of experts, Qwen2MoeForCausalLM) computes the logits attnlab computes, in both directions; export
then import is bit-identical; architectures and options without an equivalent are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab import Transformer, load_model
from attnlab.cli.main import main
from attnlab.config import DataConfig, ModelConfig, MoEConfig, RunConfig, config_to_dict, load_config
from attnlab.errors import ConversionError
from attnlab.hf import check_exportable, export_model, export_run, import_hf
from attnlab.train.checkpoint import checkpoint_path, save_checkpoint

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4


def minimind_config(**changes) -> ModelConfig:
    """A tiny MiniMind-shaped model: RMSNorm, rotary, GQA, SwiGLU, no biases."""
    values = dict(num_tokens=300, dim=64, depth=2, heads=4, kv_heads=2, dim_head=16, max_seq_len=64,
                  norm="rmsnorm", feed_forward="swiglu", rope_theta=5000.0, tie_embeddings=True)
    return ModelConfig(**{**values, **changes})


def random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """Weights large enough that logits are O(10) and norms are not all ones, so a wrong
    convention (rotary pairing, epsilon, gate/up order) shows far above the tolerance."""
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.15)
    return model


def hf_logits(folder: Path, tokens: torch.Tensor, architecture: str = "LlamaForCausalLM") -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model).__name__ == architecture
    with torch.no_grad():
        return model(tokens).logits


def our_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def write_run(
    run_dir: Path, model: Transformer, data: DataConfig | None = None, ema: Transformer | None = None
) -> Path:
    """A run directory as training leaves it (config.yaml aside): one checkpoint, EMA weights optional."""
    config = RunConfig(name=run_dir.name, out_dir=str(run_dir.parent), model=model.config, data=data or DataConfig())
    save_checkpoint(checkpoint_path(run_dir, 7), {"config": config_to_dict(config), "model": model.state_dict(),
                                                  "ema": None if ema is None else ema.state_dict(), "step": 7})
    return run_dir


@pytest.mark.parametrize("changes", [
    {},  # tied embeddings, GQA, rotary theta 5000, RMSNorm at the machine epsilon
    {"tie_embeddings": False, "kv_heads": 1, "norm_eps": 1e-5, "dim_head": 8, "ff_mult": 3.0},
    {"kv_heads": None, "ff_hidden": 96, "rope_theta": 10000.0},
], ids=["tied-gqa", "untied-mqa-eps", "mha-ff_hidden"])
def test_transformers_logits_equal(tmp_path, changes):
    model = random_model(minimind_config(**changes))
    export_model(model, tmp_path / "hf")
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    ours, theirs = our_logits(model, tokens), hf_logits(tmp_path / "hf", tokens)
    assert ours.abs().max() > 1.0  # the comparison is not between near-zero numbers
    assert (ours - theirs).abs().max() < TOLERANCE
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["tie_word_embeddings"] == model.config.tie_embeddings
    assert written["intermediate_size"] == model.blocks[0].feed_forward.inner.gate.weight.shape[0]


@pytest.mark.parametrize("moe", [
    {"n_experts": 4, "top_k": 2, "n_shared_experts": 1},  # MiniMind's defaults
    {"n_experts": 4, "top_k": 1, "n_shared_experts": 0},  # top-1 keeps its probability
    {"n_experts": 3, "top_k": 2, "n_shared_experts": 2, "normalize_top_k": False},
], ids=["top2-shared1", "top1-unshared", "top2-shared2-unnormalised"])
def test_mixture_of_experts_exports_as_qwen2_moe(tmp_path, moe):
    # hidden width 96: transformers' grouped expert kernel on CPU wants rows of 16-byte multiples
    model = random_model(minimind_config(feed_forward="moe", ff_hidden=96, moe=MoEConfig(**moe)))
    export_model(model, tmp_path / "hf")
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    ours = our_logits(model, tokens)
    assert ours.abs().max() > 1.0
    assert (ours - hf_logits(tmp_path / "hf", tokens, "Qwen2MoeForCausalLM")).abs().max() < TOLERANCE
    assert model.collect_stats()["moe_load/0"] < 1.0  # more than one expert was used
    # and back: identical weights (the doubled, then halved, shared down projection included)
    back = load_model(import_hf(tmp_path / "hf", tmp_path / "run"))
    assert back.config.moe == model.config.moe
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    assert torch.equal(our_logits(back, tokens), ours)


def test_qwen2_moe_with_a_gated_shared_expert_is_refused(tmp_path):
    """A Qwen2-MoE as transformers initialises it gates its shared expert: no attnlab equivalent."""
    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, qkv_bias=False,
    )
    reference = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        reference.model.layers[0].mlp.shared_expert_gate.weight.normal_()
    reference.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match="a sigmoid-gated shared expert has no attnlab equivalent"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_greedy_decoding_with_caches_agrees(tmp_path):
    """transformers' cached generate and attnlab's cached generate pick the same tokens."""
    from attnlab.generate.sampling import SamplingConfig, generate

    model = random_model(minimind_config(max_seq_len=64), seed=5)
    export_model(model, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = theirs.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    ours = generate(model, prompt, 24, SamplingConfig(temperature=0.0))
    assert ours.tolist() == expected.tolist()
    assert len(set(ours[0, 8:].tolist())) > 3  # not a degenerate repeat of one token


def test_a_changed_convention_is_detected(tmp_path):
    """The test above can fail: the same weights with another rotary base or epsilon differ."""
    model = random_model(minimind_config())
    export_model(model, tmp_path / "hf")
    config_file = tmp_path / "hf" / "config.json"
    tokens = torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(2))
    changes = [  # the rotary base in both spellings (transformers 4 reads the first, 5 the second)
        {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        {"rms_norm_eps": 0.1},
    ]
    for change in changes:
        original = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**original, **change}))
        assert (our_logits(model, tokens) - hf_logits(tmp_path / "hf", tokens)).abs().max() > 1e-2
        config_file.write_text(json.dumps(original))


@pytest.mark.parametrize("tokenizer_place", ["run", "shards"])
def test_cli_export_with_tokenizer(tmp_path, capsys, tokenizer_place):
    """The run's tokenizer is found in RUN/tokenizer/ or beside its token shards (data.source=tokens)."""
    from attnlab.data.tokenizer import train_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 50 + "Hello, world! héllo wörld\n" * 50)
    if tokenizer_place == "run":
        run_dir = write_run(tmp_path / "run", random_model(minimind_config()))
        train_tokenizer([corpus], vocab_size=300, out_dir=run_dir / "tokenizer")
    else:
        data = DataConfig(source="tokens", path=str(tmp_path / "shards"))
        run_dir = write_run(tmp_path / "run", random_model(minimind_config()), data)
        train_tokenizer([corpus], vocab_size=300, out_dir=tmp_path / "shards" / "tokenizer")
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["pad_token_id"], written["bos_token_id"], written["eos_token_id"]) == (0, 1, 2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    tokens = tokenizer("def add(a, b):\n    return a + b", return_tensors="pt")["input_ids"]
    model = load_model(run_dir)
    assert (our_logits(model, tokens) - hf_logits(tmp_path / "hf", tokens)).abs().max() < TOLERANCE
    # imported back, the tokenizer comes along and `attnlab sample` encodes and decodes with it
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    copied = tmp_path / "back" / "tokenizer" / "tokenizer.json"
    assert copied.read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "back"), "--prompt", "def add", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def add")
    # a second export into the same folder is refused unless forced
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf"), "--force", "--dtype", "bfloat16"]) == 0


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask-022", "umask-077"])
def test_exported_weights_have_the_mode_of_a_file_written_in_place(tmp_path, umask):
    """model.safetensors (an export's, a run's final weights) is as readable to others as its
    config.json: the umask decides, not the private file the safetensors library makes."""
    import os

    from attnlab.train.portable import write_weights_file

    run_dir = write_run(tmp_path / "run", random_model(minimind_config()))
    previous = os.umask(umask)
    try:
        export_run(run_dir, tmp_path / "hf")
        write_weights_file(run_dir)
    finally:
        os.umask(previous)
    for path in (tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "config.json", run_dir / "model.safetensors"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path


def test_a_weight_beyond_float16_is_refused_in_float16(tmp_path):
    """A weight beyond float16's 65504 became infinite in the cast, silently: the exported model
    computed inf and NaN. Refused in one line before anything is written; bfloat16 takes it."""
    model = random_model(minimind_config(depth=1))
    with torch.no_grad():
        model.head.weight[0, 0] = 1e5
    with pytest.raises(ConversionError, match="not finite in float16"):
        export_model(model, tmp_path / "hf", dtype="float16")
    assert not (tmp_path / "hf").exists()
    export_model(model, tmp_path / "hf", dtype="bfloat16")


def test_tokenized_run_without_its_tokenizer_is_refused(tmp_path):
    data = DataConfig(source="tokens", path=str(tmp_path / "gone"))
    run_dir = write_run(tmp_path / "run", random_model(minimind_config(depth=1)), data)
    with pytest.raises(ConversionError, match="pass --tokenizer DIR"):
        export_run(run_dir, tmp_path / "hf")
    with pytest.raises(ConversionError, match="no tokenizer.json in the tokenizer folder"):
        export_run(run_dir, tmp_path / "hf", tokenizer_dir=tmp_path)


def test_export_chooses_model_or_ema_weights(tmp_path):
    from safetensors.torch import load_file

    model, ema = random_model(minimind_config(depth=1), seed=0), random_model(minimind_config(depth=1), seed=1)
    run_dir = write_run(tmp_path / "run", model, ema=ema)
    for weights, expected in (("auto", ema), ("ema", ema), ("model", model)):
        assert main(["export", str(run_dir), "--out", str(tmp_path / weights), "--weights", weights]) == 0
        written = load_file(str(tmp_path / weights / "model.safetensors"))
        assert torch.equal(written["model.layers.0.self_attn.q_proj.weight"],
                           expected.blocks[0].attention.heads.to_q.weight)


def test_byte_level_export_maps_bytes_to_ids(tmp_path):
    model = random_model(minimind_config(num_tokens=256))
    export_model(model, tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "héllo, wörld\n\t{}"
    assert tokenizer(text)["input_ids"] == list(text.encode("utf-8"))
    assert tokenizer.decode(list(text.encode("utf-8"))) == text


@pytest.mark.parametrize("override, named", [
    ("model.attention.kind=routing", "attention.kind=routing"),  # local attention is Mistral (test_hf_model.py)
    ("model.norm=layernorm", "norm=layernorm"),
    ("model.feed_forward=gelu", "feed_forward=gelu"),
    ("model.position=learned", "position=learned"),
    ("model.position=none", "position=none"),
    ("model.emb_dim=32", "emb_dim=32"),
    ("model.reversible=true", "reversible=true"),
])
def test_architectures_without_llama_equivalent_are_refused(override, named):
    base = ["model.norm=rmsnorm", "model.feed_forward=swiglu", "train.sample_every=0"]  # learned: no 264-token samples
    config = load_config("demo", [*base, override]).model
    with pytest.raises(ConversionError, match=named) as caught:
        check_exportable(config)
    assert "\n" not in str(caught.value)


def test_an_option_unknown_to_the_exporter_is_refused_unless_at_its_default():
    """A model option added after the exporter (here a stand-in logit soft-cap) could change the
    logits: export refuses it once it is switched on."""
    import dataclasses

    Extended = dataclasses.make_dataclass(
        "Extended", [("logit_softcap", float, dataclasses.field(default=0.0))], bases=(ModelConfig,), kw_only=True
    )
    base = minimind_config()
    values = {option.name: getattr(base, option.name) for option in dataclasses.fields(base)}
    check_exportable(Extended(**values))
    with pytest.raises(ConversionError, match="logit_softcap=30.0 .an option the exporter does not know"):
        check_exportable(Extended(**values, logit_softcap=30.0))


def test_a_run_initialised_otherwise_exports_natively(tmp_path):
    """model.init only draws the starting weights: a run trained from GPT-2's initialisation is as
    much a Llama as any (it was exported as attnlab's own type, and --model-type native refused it)."""
    model = random_model(minimind_config(init="gpt2"))
    check_exportable(model.config)
    export_model(model, tmp_path / "hf", model_type="native")
    tokens = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(2))
    assert (our_logits(model, tokens) - hf_logits(tmp_path / "hf", tokens)).abs().max() < TOLERANCE


def test_cli_refuses_a_native_export_of_a_routing_run_in_one_line(tmp_path, capsys):
    """--model-type native refuses what Llama lacks (the default, auto, writes attnlab's own type)."""
    config = load_config("demo", ["model.norm=rmsnorm", "model.feed_forward=swiglu", "model.attention.kind=routing",
                                  "model.dim=32", "model.depth=1", "model.heads=2", "model.dim_head=16"]).model
    run_dir = write_run(tmp_path / "run", Transformer(config))
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf"), "--model-type", "native"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no Hugging Face Llama equivalent: attention.kind=routing" in error
    assert not (tmp_path / "hf").exists()  # nothing written


def test_export_import_round_trip_is_identical(tmp_path):
    for tie in (True, False):
        model = random_model(minimind_config(tie_embeddings=tie, kv_heads=1))
        run_dir = write_run(tmp_path / f"run-{tie}", model)
        export_run(run_dir, tmp_path / f"hf-{tie}")
        assert main(["import-hf", str(tmp_path / f"hf-{tie}"), "--out", str(tmp_path / f"back-{tie}")]) == 0
        back = load_model(tmp_path / f"back-{tie}")
        assert back.state_dict().keys() == model.state_dict().keys()
        for name, value in model.state_dict().items():
            assert torch.equal(back.state_dict()[name], value), name
        assert (back.head.weight is back.token_embedding.embed.weight) == tie
        tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))
        assert torch.equal(our_logits(back, tokens), our_logits(model, tokens))


def test_import_random_transformers_llama(tmp_path, capsys):
    """Any small Llama (here: 1e-5 epsilon, untied, head_dim * heads != hidden_size, 3 layers;
    256 tokens, so `attnlab sample` and `eval` read it as a byte-level model)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=48, intermediate_size=100, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=20000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            parameter.uniform_(0.5, 1.5) if "norm" in name else parameter.normal_(0.0, 0.15)
    reference.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    model = load_model(tmp_path / "run")
    assert (model.config.norm_eps, model.config.rope_theta, model.config.ff_hidden) == (1e-5, 20000.0, 100)
    tokens = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(tokens).logits
    assert expected.abs().max() > 1.0
    assert (our_logits(model, tokens) - expected).abs().max() < TOLERANCE
    # the imported run works with the usual commands
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "4"]) == 0
    assert main(["eval", str(tmp_path / "run"), "--data", str(text), "--windows", "2", "--batch-size", "2",
                 "--seq-len", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 0


@pytest.mark.parametrize("layout", ["sharded-safetensors", "pytorch-bin", "bfloat16"])
def test_import_other_checkpoint_layouts(tmp_path, layout):
    """A sharded safetensors index, a pytorch_model.bin (read with weights_only) and bf16 weights."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    reference = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            parameter.uniform_(0.5, 1.5) if "norm" in name else parameter.normal_(0.0, 0.3)
    if layout == "sharded-safetensors":
        reference.save_pretrained(tmp_path / "hf", max_shard_size="10KB")
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    elif layout == "pytorch-bin":
        (tmp_path / "hf").mkdir()
        config.save_pretrained(tmp_path / "hf")
        torch.save(reference.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    else:  # weights rounded to bf16 in the reference too (not module.to(): it would round inv_freq)
        from safetensors.torch import save_file

        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.copy_(parameter.to(torch.bfloat16))
        config.save_pretrained(tmp_path / "hf")
        tensors = {name: value.to(torch.bfloat16) for name, value in reference.state_dict().items()}
        del tensors["lm_head.weight"]  # tied: stored once
        save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    model = load_model(import_hf(tmp_path / "hf", tmp_path / "run"))
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(tokens).logits
    assert (our_logits(model, tokens) - expected).abs().max() < TOLERANCE


@pytest.mark.parametrize("change, named", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act=gelu"),
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"hidden_size": None}, "config.json lacks hidden_size"),
    # malformed values: each was a traceback (ValueError, TypeError, AttributeError) before
    ({"hidden_size": "sixty-four"}, "malformed values: hidden_size='sixty-four'"),
    ({"num_key_value_heads": 0}, "malformed values: num_key_value_heads=0"),
    ({"rms_norm_eps": None}, "malformed values: rms_norm_eps=None"),
    ({"num_key_value_heads": 3}, "no model attnlab can build: heads=4 must be a multiple of kv_heads=3"),
    ({"head_dim": 15}, "no model attnlab can build: dim_head=15 must be even"),
    ([], "not a model config (a JSON list"),
])
def test_import_refuses_unsupported_llama_options(tmp_path, capsys, change, named):
    export_model(random_model(minimind_config(depth=1)), tmp_path / "hf")
    config_file = tmp_path / "hf" / "config.json"
    config = change if isinstance(change, list) else {**json.loads(config_file.read_text()), **change}
    config_file.write_text(json.dumps(config))
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and named in error
    assert not (tmp_path / "run").exists()


def test_import_into_a_trained_run_is_refused_but_importing_again_is_not(tmp_path, capsys):
    """import-hf --out RUN --force over a run with later checkpoints would write step 0 beneath them,
    and every command would load the old run's latest checkpoint: refused. Over an earlier import
    (step 0 only, replaced) --force works."""
    export_model(random_model(minimind_config(depth=1)), tmp_path / "hf")
    trained = random_model(minimind_config(depth=1, tie_embeddings=False), seed=3)
    write_run(tmp_path / "run", trained)
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--force"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "holds an attnlab run (checkpoints/step-0000007.pt)" in error
    assert not checkpoint_path(tmp_path / "run", 0).exists()
    (tmp_path / "a-file").write_text("keep")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "a-file")]) == 2
    assert "is a file" in capsys.readouterr().err
    import_hf(tmp_path / "hf", tmp_path / "imported")
    assert import_hf(tmp_path / "hf", tmp_path / "imported", overwrite=True) == tmp_path / "imported"


def test_import_refuses_weights_that_do_not_match(tmp_path):
    from safetensors.torch import load_file, save_file

    export_model(random_model(minimind_config(depth=1, tie_embeddings=False)), tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del weights["lm_head.weight"]
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ConversionError, match="missing lm_head.weight; unexpected model.layers.0.self_attn.q_proj"):
        import_hf(tmp_path / "hf", tmp_path / "run")
