#!/usr/bin/env bash
# The recorded example of docs/export.md: nsa-small's dense twin (full attention, 200 steps), then NSA
# retrofitted from it (train.init_from, 100 steps) and NSA from scratch for as long; the NSA run
# exported as attnlab's model type (the dense one natively, as Llama), loaded and decoded by
# transformers (greedy = `attnlab sample`), benchmarked by lm-eval on two local tasks, and evaluated
# on its whole validation split.
#   OMP_NUM_THREADS=2 bench/export_example.sh [OUT]       (OUT default /tmp/attnlab-export-example)
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # everything here is local
OUT=${1:-/tmp/attnlab-export-example}
ATTNLAB=${ATTNLAB:-.venv/bin/attnlab}
PYTHON=${PYTHON:-.venv/bin/python}
rm -rf "$OUT"
mkdir -p "$OUT/tasks"
date -u; uptime
common=(out_dir="$OUT/runs" log.progress=false train.sample_every=0 train.eval_every=50)

echo "== 1. dense, 200 steps; NSA retrofitted from it, 100 steps; NSA from scratch, 100 steps"
$ATTNLAB train -p nsa-small name=dense model.attention.kind=full train.max_steps=200 "${common[@]}" 2>&1 \
    | grep -E "^dense:|validation|^done"
$ATTNLAB train -p nsa-small name=nsa train.max_steps=100 train.init_from="$OUT/runs/dense" "${common[@]}" 2>&1 \
    | grep -E "^nsa:|init_from|^  (loaded|new|skipped)|validation|^done"
$ATTNLAB train -p nsa-small name=nsa-scratch train.max_steps=100 "${common[@]}" 2>&1 | grep -E "validation|^done"

echo "== 2. export (the dense run natively, the NSA run as attnlab's type); transformers decodes what attnlab does"
$ATTNLAB export "$OUT/runs/dense" --out "$OUT/hf/dense" && grep '"model_type"' "$OUT/hf/dense/config.json"
$ATTNLAB export "$OUT/runs/nsa" --out "$OUT/hf/nsa" && grep '"model_type"' "$OUT/hf/nsa/config.json"
ls "$OUT/hf/nsa"
$ATTNLAB sample "$OUT/runs/nsa" --prompt "def main(" --max-new-tokens 80 --temperature 0 > "$OUT/attnlab-sample.txt"
$PYTHON - "$OUT" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import attnlab
out = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(f"{out}/hf/nsa", trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(f"{out}/hf/nsa")
ids = tokenizer("def main(", return_tensors="pt")["input_ids"]
with torch.no_grad():
    text = tokenizer.decode(model.generate(ids, max_new_tokens=80, do_sample=False)[0])
ours = attnlab.load_model(f"{out}/runs/nsa")
window = torch.tensor([list(open(attnlab.__file__, "rb").read()[:256])])
with torch.no_grad():
    difference = (model(window).logits - ours(window).logits).abs().max().item()
print(type(model).__name__, "| largest logit difference over 256 tokens:", difference)
print("transformers generate (greedy):", repr(text))
print("attnlab sample --temperature 0:", repr(open(f"{out}/attnlab-sample.txt").read()[:-1]))
print("equal:", text == open(f"{out}/attnlab-sample.txt").read()[:-1])
PY

echo "== 3. lm-eval on local tasks: Python completion (multiple choice), attnlab's sources (rolling bits per byte)"
$PYTHON - "$OUT/tasks" <<'PY'
import json, pathlib, sys
folder = pathlib.Path(sys.argv[1])
items = [
    ("def __init__(self", "):", "]:", ");"), ("if __name__ == '__main", "__':", "__\":", "_':"),
    ("    return sel", "f.", "p.", "x."), ("import o", "s\n", "z\n", "q\n"), ("raise ValueE", "rror(", "rrer(", "xror("),
    ("except KeyErr", "or:", "ar:", "or;"), ("with open(path) as f", ":\n", ";\n", ")\n"),
    ("class Foo(obj", "ect):", "ekt):", "ect]:"), ("from collections import namedt", "uple", "aple", "uble"),
    ("while Tr", "ue:", "ua:", "ee:"), ("        self.assertEqu", "al(", "el(", "al["),
    ("print(\"hello, wor", "ld\")", "ld\"]", "ld')"), ("try:\n    pass\nexc", "ept", "ipt", "opt"),
    ("isinstance(value, s", "tr)", "tr]", "tx)"), ("return None if value is None el", "se", "so", "ze"),
    ("# -*- coding: utf", "-8 -*-", "-9 -*-", "_8 -*-"), ("    @prop", "erty", "arty", "ertx"),
    ("    @staticm", "ethod", "othod", "ethad"), ("import sys\n\nsys.ex", "it(", "at(", "it["),
    ("os.path.jo", "in(", "on(", "in["), ("    yield fr", "om", "um", "am"),
    ("for key, value in items.it", "ems():", "ams():", "ems();"), ("    def __repr__(self", "):", ")", "]:"),
    ("        for i in ran", "ge(", "ga(", "ge["),
]
(folder / "python_choice.jsonl").write_text("".join(
    json.dumps({"context": c, "choices": [a, b, d], "answer": 0}) + "\n" for c, a, b, d in items))
sources = ["errors.py", "registry.py", "model/loss.py", "train/optim.py"]
root = pathlib.Path("src/attnlab")
(folder / "attnlab_sources.jsonl").write_text("".join(
    json.dumps({"text": (root / name).read_text()}) + "\n" for name in sources))
common = f"dataset_path: json\ndataset_kwargs:\n  cache_dir: {folder}/datasets\n  data_files:\n    test: {folder}/"
(folder / "python_choice.yaml").write_text(
    f"task: python_choice\n{common}python_choice.jsonl\ntest_split: test\noutput_type: multiple_choice\n"
    "target_delimiter: ''\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
    "metric_list:\n  - metric: acc\n")
(folder / "attnlab_sources.yaml").write_text(
    f"task: attnlab_sources\n{common}attnlab_sources.jsonl\ntest_split: test\noutput_type: loglikelihood_rolling\n"
    "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: bits_per_byte\n  - metric: byte_perplexity\n")
PY
for run in dense nsa nsa-scratch; do
    $ATTNLAB eval "$OUT/runs/$run" --tasks python_choice,attnlab_sources --include-path "$OUT/tasks" \
        --batch-size 8 2>/dev/null | grep -v "^bootstrapping"
done
$ATTNLAB eval "$OUT/runs/nsa" --tasks python_choise --include-path "$OUT/tasks" 2>&1 | tail -1 || true

echo "== 4. the whole validation split, every byte once (and the usual 64 sampled windows)"
$ATTNLAB eval "$OUT/runs/nsa" --full --batch-size 32
$ATTNLAB eval "$OUT/runs/nsa"
date -u; uptime
