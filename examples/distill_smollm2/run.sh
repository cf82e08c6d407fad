#!/usr/bin/env bash
# On-policy distillation on the CPU: examples/distill_smollm2/run.sh [a.b.c=value ...]
#  1. The teacher: the demo (GRPO on single-digit sums) trained for 30 steps with a checkpoint
#     (runs/demo_teacher/step_30/model), unless TEACHER names one already.
#  2. The student, base SmolLM2-135M-Instruct, distilled from it (examples/distill_smollm2/config.yaml);
#     the reward of the first and last 5 steps beside the demo's (RL from scratch, same samples).
# GRPO plus the distillation term instead: examples/distill_smollm2/run.sh algorithm.loss=grpo distill.coef=0.1
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/cpu_run.sh
source examples/cpu_run.sh
TEACHER=${TEACHER:-runs/demo_teacher/step_30/model}
if [ ! -d "$TEACHER" ]; then
  cpu_run demo examples/demo/config.yaml runs/demo_teacher trainer.save_dir=runs/demo_teacher
fi
cpu_run distill_smollm2 examples/distill_smollm2/config.yaml "${LOG_DIR:-runs/distill_smollm2}" \
  "distill.teacher=$TEACHER" "$@"
