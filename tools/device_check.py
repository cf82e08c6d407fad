"""First run on a GPU or Ascend node: one command, one JSON line, exit 0 when nothing fails.

    python tools/device_check.py --device cuda --out device_check.json
    python tools/device_check.py --device npu --out device_check.json
    python tools/device_check.py --device cpu --quick            # here, in the tests

Checks (``megatron_rl.devcheck``), each in its own process: ``environment`` (versions, device,
memory), ``attention`` (shared-prompt kernels vs the reference, forward + q/k/v grads in fp32 /
bf16, TFLOP/s vs the K-copies FlashAttention baseline), ``rl_hf`` (a tiny Llama trained 3 steps
by the real loop with the hf engine, checkpoint every step), ``resume`` (step-2 checkpoint + 1
step == the straight step 3), ``rl_vllm`` (2 steps with vLLM when installed). ``--skip a,b``
skips checks; ``--budget-s`` (480) caps the run. The README section "First run on a GPU or
Ascend node" explains every field and threshold.
"""

import sys

from megatron_rl.devcheck.runner import main

if __name__ == "__main__":
    sys.exit(main())
