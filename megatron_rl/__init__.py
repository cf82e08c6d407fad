"""megatron_rl: Megatron-style RL post-training for LLMs (GRPO, DAPO, Dr.GRPO, decoupled PPO).

Sub-packages, one concern each (see DESIGN.md): config, platform, models, parallel, attention,
trimodel, algorithms, control, rollout, generation, pipeline, rewards, data, trainer.
"""

__version__ = "0.1.0"

from megatron_rl.platform.quiet import silence_library_noise  # noqa: E402

silence_library_noise()
