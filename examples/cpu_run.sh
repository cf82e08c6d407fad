# shellcheck shell=bash
# The single-process CPU examples' common run (sourced by examples/demo/run.sh and
# examples/tool_calc_smollm2/run.sh): prepare SmolLM2-135M-Instruct from its GGUF, train CONFIG,
# print the wall time, the mean reward of the first and last 5 steps, and draw the dashboard.
#   cpu_run NAME CONFIG LOG_DIR [a.b.c=value ...]
cpu_run() {
  local name=$1 config=$2 log_dir=$3 start
  shift 3
  PY=${PY:-.venv/bin/python}
  export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
  "$PY" tools/prepare_model.py --out .cache/models/smollm2-135m-instruct --dtype float32
  rm -f "$log_dir/metrics.jsonl"
  start=$(date +%s)
  "$PY" -m megatron_rl train "$config" "trainer.log_dir=$log_dir" "$@"
  echo "megatron_rl $name: $(( $(date +%s) - start )) s"
  "$PY" - "$name" "$log_dir/metrics.jsonl" <<'PYEOF'
import json, sys
name, path = sys.argv[1:]
reward = [json.loads(line)["rollout/reward_mean"] for line in open(path)]
k = min(5, len(reward) // 2)
if k:
    print(f"megatron_rl {name}: mean reward, first {k} steps {sum(reward[:k]) / k:.3f} -> "
          f"last {k} steps {sum(reward[-k:]) / k:.3f}")
PYEOF
  echo "metrics: $log_dir/metrics.jsonl (TensorBoard: $log_dir/tensorboard)"
  echo "dashboard: $("$PY" tools/plot_metrics.py "$log_dir")"
}
