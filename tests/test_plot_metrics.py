"""``tools/plot_metrics.py`` draws a PNG dashboard from the metrics of a real (tiny, 2-step) run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.rl_fixtures import make_tiny_rl_model, tiny_rl_config, train_run

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import plot_metrics  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plot")
    model = make_tiny_rl_model(tmp / "model")
    log_dir = tmp / "run"
    config = tiny_rl_config(tmp, model, trainer={"steps": 2, "prompts_per_batch": 2, "log_dir": str(log_dir)})
    (history,) = run_distributed(train_run, 1, str(config), timeout_s=600)
    assert len(history) == 2
    return log_dir


def test_plot_metrics_writes_a_png_of_a_real_run(run_dir):
    from matplotlib.image import imread

    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plot_metrics.py"), str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    png = Path(proc.stdout.strip().splitlines()[-1])
    assert png == run_dir / "dashboard.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(png).shape
    assert (width, height) == (16 * 80, int(8.5 * 80))  # figsize x dpi: the 2 x 3 dashboard


def test_dashboard_series_come_from_the_run(run_dir):
    rows = plot_metrics.read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        tput = plot_metrics.throughput(row)
        assert tput["completion tokens/s"] == pytest.approx(row["rollout/response_tokens"] / row["time/step_s"])
    steps, rewards = plot_metrics.series(rows, "rollout/reward_mean")
    assert steps == [0, 1] and len(rewards) == 2
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_metrics.read_metrics(run_dir / "missing")
