"""benchmarks/gpu_learning_check.sh's last step on the CPU: its training runs without evaluation
episodes, so its table must read the train return; here a tiny run of the same kind (dmc_cartpole_balance,
--eval_episode_num 0) and the script's own plot command (printed by GPU_CHECK_PRINT_ONLY) on its logdir."""

import os
import pathlib
import shlex
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import dreamer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # an in-process training run
def test_the_learning_checks_table_step_passes_on_a_run_without_evaluation(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_learning_check.sh")], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, GPU_CHECK_PRINT_ONLY="1",
                                                         GPU_CHECK_OUT=str(tmp_path / "check")))
    assert out.returncode == 0, out.stderr
    train, plot = [shlex.split(line) for line in out.stdout.strip().splitlines()]
    assert train[train.index("--eval_episode_num") + 1] == "0"
    logdir = tmp_path / "check" / "logdir"
    assert train[train.index("--logdir") + 1] == str(logdir) and str(logdir) in plot
    os.environ.setdefault("MUJOCO_GL", "egl")
    dreamer.main(["--configs", "dmc_proprio", "debug", "--task", "dmc_cartpole_balance", "--device", "cpu",
                  "--eval_episode_num", "0", "--time_limit", "50", "--action_repeat", "2", "--steps", "400",
                  "--log_every", "100", "--logdir", str(logdir)])
    done = subprocess.run(plot, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "check" / "curve.png").exists()
    # The table: the run's returns by 10K frames beside the official curve's.
    assert "this project: 0-10K" in done.stdout and "DreamerV3 paper: 0-10K" in done.stdout, done.stdout
