#!/usr/bin/env bash
# The Hugging Face export/import tests (tests/test_export.py) under transformers 4.46.3 as well as
# the installed transformers 5: docs/export.md states that the exported Llama and Qwen2-MoE
# checkpoints load with equal logits in both. transformers 4 and the tokenizers/hub versions it
# needs go into a separate folder put first on PYTHONPATH; torch and safetensors are the venv's.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
target=${TRANSFORMERS4_DIR:-/tmp/attnlab-transformers4}
if [ ! -d "$target/transformers" ]; then
    "$python" -m pip install -q --target "$target" --no-deps \
        "transformers==4.46.3" "tokenizers==0.20.3" "huggingface_hub==0.26.5"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "transformers $("$python" -c 'import transformers; print(transformers.__version__)')"
"$python" -m pytest tests/test_export.py -q -p no:cacheprovider
echo "transformers $(PYTHONPATH="$target" "$python" -c 'import transformers; print(transformers.__version__)')"
PYTHONPATH="$target" "$python" -m pytest tests/test_export.py -q -p no:cacheprovider
