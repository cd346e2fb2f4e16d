"""Distillation toward a teacher (train/distill.py): the loss, the training loop and the draft CLI."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.cli.main import main
from attnlab.errors import ConfigError
from attnlab.train.checkpoint import load_model
from attnlab.train.distill import distillation_loss
from attnlab.train.loop import train
from attnlab.train.metrics import read_metrics
from test_train import assert_resume_matches, text_file, tiny  # noqa: F401  (the fixture is shared)


def test_loss_is_kl_of_teacher_to_model():
    torch.manual_seed(0)
    logits, teacher = torch.randn(2, 2, 5, 7).unbind(0)
    expected = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher, -1), log_target=True, reduction="none")
    torch.testing.assert_close(distillation_loss(logits, teacher), expected.sum(-1).mean())
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 0, 0, 0, 1]])
    masked = (expected.sum(-1) * mask).sum() / mask.sum()
    torch.testing.assert_close(distillation_loss(logits, teacher, mask), masked)
    assert distillation_loss(teacher, teacher).abs() < 1e-6


def test_tv_loss_is_one_minus_the_acceptance_probability():
    """TV(p, q) = 1 - sum min(p, q): the chance that speculative sampling rejects a draft token."""
    torch.manual_seed(1)
    logits, teacher = torch.randn(2, 3, 4, 9).unbind(0)
    p, q = teacher.softmax(-1), logits.softmax(-1)
    expected = 1 - torch.minimum(p, q).sum(-1)  # [3, 4]
    torch.testing.assert_close(distillation_loss(logits, teacher, kind="tv"), expected.mean())
    mask = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 1]])
    torch.testing.assert_close(distillation_loss(logits, teacher, mask, "tv"), (expected * mask).sum() / mask.sum())
    assert distillation_loss(teacher, teacher, kind="tv").abs() < 1e-6
    with pytest.raises(ValueError, match="unknown distillation loss"):
        distillation_loss(logits, teacher, kind="js")


def test_tv_distillation_trains_toward_the_teacher(tmp_path, text_file):  # noqa: F811
    teacher = train(tiny(tmp_path, text_file, "teacher", "train.max_steps=20", "train.lr=3e-3"))
    common = ["model.depth=1", "train.max_steps=20", "train.lr=3e-3", f"train.distill_from={teacher.run_dir}",
              "train.distill_weight=1.0"]
    distilled = train(tiny(tmp_path, text_file, "tv", *common, "train.distill_loss=tv"))
    records = [r for r in read_metrics(distilled.run_dir) if "distill" in r]
    assert all(0 <= r["distill"] <= 1 for r in records)  # a total variation distance
    assert records[-1]["distill"] < records[0]["distill"]


def kl_to(teacher_dir, student_dir, tokens) -> float:
    teacher, student = load_model(teacher_dir), load_model(student_dir)
    with torch.no_grad():
        return float(distillation_loss(student(tokens).logits, teacher(tokens).logits))


def test_distilled_model_is_closer_to_its_teacher(tmp_path, text_file):  # noqa: F811
    teacher = train(tiny(tmp_path, text_file, "teacher", "train.max_steps=20", "train.lr=3e-3"))
    common = ["model.depth=1", "train.max_steps=20", "train.lr=3e-3"]
    plain = train(tiny(tmp_path, text_file, "plain", *common))
    distilled = train(tiny(tmp_path, text_file, "distilled", *common, f"train.distill_from={teacher.run_dir}",
                           "train.distill_weight=1.0"))
    records = [r for r in read_metrics(distilled.run_dir) if "loss" in r]
    assert all(r["loss"] == pytest.approx(r["distill"], rel=1e-5) for r in records)  # weight 1: the KL alone
    tokens = torch.tensor(list(text_file.read_bytes()[1000:1000 + 4 * 32])).view(4, 32)
    assert kl_to(teacher.run_dir, distilled.run_dir, tokens) < kl_to(teacher.run_dir, plain.run_dir, tokens)


def test_distilled_training_resumes_exactly(tmp_path, text_file):  # noqa: F811
    teacher = train(tiny(tmp_path, text_file, "teacher", "train.max_steps=5"))
    extra = [f"train.distill_from={teacher.run_dir}", "train.distill_weight=0.3"]
    whole = train(tiny(tmp_path, text_file, "whole", *extra))
    assert_resume_matches(whole.run_dir, tmp_path, text_file, *extra)


@pytest.mark.parametrize("extra, message", [
    (["train.distill_weight=0"], "distill_weight"),
    (["model.loss_chunk_size=16"], "loss_chunk_size"),
    (["model.num_tokens=300"], "share a vocabulary"),
    (["train.distill_loss=js"], "train.distill_loss: 'js' is not one of 'kl', 'tv'"),
])
def test_bad_distillation_is_refused(tmp_path, text_file, extra, message):  # noqa: F811
    teacher = train(tiny(tmp_path, text_file, "teacher", "train.max_steps=1"))
    with pytest.raises(ConfigError, match=message):
        train(tiny(tmp_path, text_file, "student", f"train.distill_from={teacher.run_dir}", *extra))


def test_a_teacher_whose_learned_positions_end_before_the_windows_is_refused(tmp_path, text_file):  # noqa: F811
    teacher = train(tiny(tmp_path, text_file, "teacher", "train.max_steps=1", "model.position=learned",
                         "model.max_seq_len=16", "train.seq_len=16", "train.sample_every=0"))
    with pytest.raises(ConfigError, match="train.distill_from: .* make 32 tokens; this model's learned positions end "
                       "at model.max_seq_len=16"):
        train(tiny(tmp_path, text_file, "student", f"train.distill_from={teacher.run_dir}"))


def test_positions_are_checked_in_one_place_the_model_s():
    """Distillation, evaluation and generation check a length against a model's learned positions
    with one check, the model's own: training and evaluation import nothing of generation for it."""
    import ast
    import inspect

    from attnlab import evaluate
    from attnlab.generate import sampling
    from attnlab.model import transformer
    from attnlab.train import distill

    assert distill.check_length is evaluate.check_length is sampling.check_length is transformer.check_length
    for module in (distill, evaluate):
        tree = ast.parse(inspect.getsource(module))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "attnlab.generate.sampling" not in imported, module.__name__


def test_missing_teacher_is_a_clear_error(tmp_path, text_file):  # noqa: F811
    with pytest.raises(ConfigError, match="train.distill_from"):
        train(tiny(tmp_path, text_file, "student", f"train.distill_from={tmp_path / 'nowhere'}"))


def test_speculative_train_distills_the_draft(tmp_path, text_file, capsys):  # noqa: F811
    shared = [f"out_dir={tmp_path / 'runs'}", "data.source=file", f"data.path={text_file}",
              "model.dim=32", "model.heads=2", "model.dim_head=16", "model.max_seq_len=64",
              "train.seq_len=32", "train.batch_size=4", "train.max_steps=3", "train.eval_every=3",
              "train.eval_batches=1", "train.save_every=3", "log.progress=false", "target.model.depth=2"]
    assert main(["speculative", "train", "--target-preset", "spec-small-target", "--draft-preset",
                 "spec-small-draft", "--distill", "0.5", *shared]) == 0
    draft_dir = tmp_path / "runs" / "spec-small-draft"
    config = load_model(draft_dir).run_config
    assert config.train.distill_from == str(tmp_path / "runs" / "spec-small-target")
    assert config.train.distill_weight == 0.5
    assert all("distill" in r for r in read_metrics(draft_dir) if "loss" in r)
