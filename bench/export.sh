#!/usr/bin/env bash
# Hugging Face export at MiniMind's size: cost (export, transformers load, import) and logit
# agreement, for minimind-pretrain (LlamaForCausalLM) and minimind-moe (Qwen2MoeForCausalLM).
# Figures: docs/benchmarks.md, section "Hugging Face export".
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=2
uptime
.venv/bin/python bench/export_fidelity.py
uptime
