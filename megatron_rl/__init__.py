"""megatron_rl: Megatron-style RL post-training for LLMs (GRPO, DAPO, Dr.GRPO, decoupled PPO).

Sub-packages, one concern each (DESIGN.md; README "Layout"), in import tiers, lowest first (a
package imports its own tier and lower ones; ``tests/test_import_direction.py`` checks it):
config < platform < models, attention, parallel, lora, algorithms, data, rewards, environments,
control < trimodel, weight_sync, rollout, gateway < generation < pipeline < trainer < bench, devcheck, plan < cli
"""

__version__ = "0.1.0"

from megatron_rl.platform.quiet import silence_library_noise  # noqa: E402

silence_library_noise()
