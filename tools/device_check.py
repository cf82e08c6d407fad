"""First run on a GPU or Ascend node: one command, one JSON line, exit 0 when nothing fails.

    python tools/device_check.py --device cuda --out device_check.json
    python tools/device_check.py --device npu --out device_check.json
    python tools/device_check.py --device npu --set attention.backend=split   # work around a part
    python tools/device_check.py --device emulated-npu --quick    # here: the emulated 910B (the tests)

Checks (``megatron_rl.devcheck``), each in its own process: ``environment`` (versions, device,
memory; on ``npu`` it fails first when torch_npu / CANN is missing), ``attention`` (shared-prompt
kernels vs the reference, forward + q/k/v grads in fp32 / bf16, TFLOP/s vs the K-copies
FlashAttention baseline), ``rl_hf`` (a tiny Llama, head_dim 64, trained 3 steps by the real loop
with the hf engine, checkpoint every step), ``resume`` (step-2 checkpoint + 1 step == the straight
step 3), ``rl_vllm`` (2 steps with vLLM when installed), ``rl_dist`` (2 ranks via torchrun, bf16 +
fp32 master weights, distributed optimizer, broadcast weight sync), ``resume_dist`` (its resume on
2 ranks), ``rl_vllm_tp2`` (a vLLM engine at TP 2 beside the 2 ranks, >= 4 devices). ``--skip a,b``
skips checks; ``--set a.b=c`` (repeatable) overrides the RL checks' own YAML; ``--budget-s`` (900)
caps the run. The README section "First run on a GPU or Ascend node" explains every field and
threshold.
"""

import sys

from megatron_rl.devcheck.runner import main

if __name__ == "__main__":
    sys.exit(main())
