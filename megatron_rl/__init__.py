"""megatron_rl: Megatron-style RL post-training for LLMs (GRPO, DAPO, Dr.GRPO, decoupled PPO).

Sub-packages, one concern each (see DESIGN.md): config, platform, models, parallel, attention,
trimodel, algorithms, control, rollout, pipeline, rewards, data, trainer.
"""

__version__ = "0.1.0"
