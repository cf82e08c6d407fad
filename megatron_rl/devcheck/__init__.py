"""First run on a real device (``tools/device_check.py``): checks in child processes, one JSON line.

Checks, in order (``CHECKS``), each in a fresh child process so that a crash, a hang or a
poisoned device context in one cannot hide the others:

- ``environment`` (``environment.py``): library versions, device name / count / memory;
- ``attention`` (``attention.py``): every shared-prompt kernel the device has against the
  reference (forward and q/k/v gradients, fp32 and bf16) and its TFLOP/s next to the K-copies
  FlashAttention-style baseline;
- ``rl_hf``, ``resume``, ``rl_vllm`` (``rl.py``): a tiny Llama (head_dim 64) trained by the real
  loop (``trainer.loop.train``) on one rank in fp32 with the hf engine, a checkpoint resumed for
  one step that must reproduce the straight run, and the vLLM engine when installed;
- ``rl_dist``, ``resume_dist``, ``rl_vllm_tp2`` (``rl_dist.py``): the same model on 2 ranks
  (torchrun) in bf16 with fp32 master weights, the distributed optimizer and broadcast weight
  sync, its resume on 2 ranks, and a vLLM engine at TP 2 where 4 devices are visible.

``--set a.b=c`` (``CheckOptions.overrides``) is applied to every RL check's YAML: the user's way
around a part that fails on their machine.

``runner.py`` starts the children and assembles the report; ``child.py`` is a child's entry
point; ``outcome.py`` turns an exception into the recorded error. Statuses: ``pass``, ``fail``,
``skip`` (with a reason); the exit status is 0 only when no check failed.
"""

CHECKS = ("environment", "attention", "rl_hf", "resume", "rl_vllm", "rl_dist", "resume_dist", "rl_vllm_tp2")
# emulated: the host-memory device under CUDA's rules; emulated-npu: under an Ascend 910B's
DEVICES = ("cuda", "npu", "cpu", "emulated", "emulated-npu")
