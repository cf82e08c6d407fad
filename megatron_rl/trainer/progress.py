"""What the leader shows on the console: the resolved config once, one line per step, and (on a
terminal) a progress bar with step, tokens/s/device, reward, G and the time left."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import yaml
from tqdm import tqdm

from megatron_rl.config import Config, config_to_dict


def format_config(cfg: Config) -> str:
    """The config as it resolved (defaults, overrides and derived values), as YAML."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


class Progress:
    """Console output of the leader's training loop; the bar only when stderr is a terminal."""

    def __init__(self, cfg: Config, *, first_step: int) -> None:
        print(f"megatron_rl: resolved config\n{format_config(cfg)}", flush=True)
        self._bar = tqdm(
            total=cfg.trainer.steps,
            initial=first_step,
            unit="step",
            dynamic_ncols=True,
            disable=None,
            file=sys.stderr,
            desc="train",
        )

    def step(self, line: str, metrics: Mapping[str, float]) -> None:
        """Print ``line`` (above the bar) and advance the bar by one step."""
        self._bar.write(line, file=sys.stdout)
        sys.stdout.flush()
        self._bar.set_postfix(
            {
                "tok/s/dev": f"{metrics.get('throughput/tokens_per_s_per_device', 0.0):.1f}",
                "reward": f"{metrics.get('rollout/reward_mean', 0.0):.3f}",
                "G": f"{metrics.get('rollout/group_size', 0.0):.0f}",
                **({"turns": f"{metrics['multiturn/turns_mean']:.2f}"} if "multiturn/turns_mean" in metrics else {}),
            },
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
