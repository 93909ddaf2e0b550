"""Faults (issue 32): a kill -9 at any instant leaks nothing and keeps the newest checkpoint; a
damaged file is one line and skipped, never a blocked resume; what cannot run is refused at start
in one line; a finished run's rerun changes nothing.

Short `dreamer.main` runs of the debug preset run in this process; the kill tests start runs of
their own and kill them at chosen points of the checkpoint write (tools.FAULT_POINT).
"""

import copy
import functools
import os
import pathlib
import re
import signal
import sys
import time

import gymnasium
import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import dreamer  # noqa: E402
import parallel  # noqa: E402
import tools  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESETS = tools.load_presets()
SHORT = ["--configs", "debug", "--eval_episode_num", "0", "--time_limit", "40"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_config(*flags):
    return dreamer.parse(["--configs", "debug", *flags], presets=copy.deepcopy(PRESETS))


def main(capsys, *args):
    """dreamer.main in this process: (exit status, stdout, stderr)."""
    try:
        dreamer.main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:  # escaping main would end the test session instead of failing a test
        code = "KeyboardInterrupt escaped"
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(folder, skip=("run.lock",)):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in pathlib.Path(folder).rglob("*")
            if p.is_file() and p.name not in skip}


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# -- 7, 8, 10. refused at start, before anything is written ------------------------------------------


@pytest.mark.parametrize("flag, value, message", [
    ("--actor.lr", "inf", "Invalid value 'inf' for --actor.lr: expected a finite number"),
    ("--critic.lr", "nan", "Invalid value 'nan' for --critic.lr: expected a finite number"),
    ("--model_lr", "1e30", "Invalid value '1e+30' for --model_lr; valid: a number in (0, 1]"),
    ("--actor.lr", "2", "Invalid value '2.0' for --actor.lr; valid: a number in (0, 1]"),
    ("--kl_free", "inf", "Invalid value 'inf' for --kl_free: expected a finite number"),
    ("--dyn_scale", "1e39", "Invalid value '1e39' for --dyn_scale: expected a finite number (at most 3.4e+38"),
    ("--env_timeout", "0", "Invalid value '0' for --env_timeout; valid: a number > 0 (seconds)"),
])
def test_unrepresentable_values_are_refused_at_start(tmp_path, capsys, flag, value, message):
    code, out, err = main(capsys, *SHORT, "--logdir", str(tmp_path / "run"), flag, value)
    assert code == 2 and out == "" and message in one_error_line(err), err
    assert not (tmp_path / "run").exists()


def test_a_model_that_cannot_be_allocated_is_refused_before_it_is(tmp_path, capsys):
    code, out, err = main(capsys, *SHORT, "--logdir", str(tmp_path / "run"), "--units", "1e12")
    line = one_error_line(err)
    assert code == 2 and out == "", err
    assert "the model has 1,018,000,000,025,800 parameters" in line and "--units 1000000000000" in line, line
    assert not (tmp_path / "run").exists()


def test_a_logdir_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path, capsys):
    logdir = tmp_path / os.fsdecode(b"run-\xff")  # how Python hands over such a command-line argument
    code, out, err = main(capsys, *SHORT, "--logdir", str(logdir))
    line = one_error_line(err)
    assert code == 2 and "for --logdir: not UTF-8 text" in line and "run-\\xff" in line, err
    assert list(tmp_path.iterdir()) == []


def test_a_long_value_is_named_by_its_start_and_length_not_echoed(tmp_path, capsys):
    task = "dmc_" + "x" * 100_000
    code, _, err = main(capsys, *SHORT, "--logdir", str(tmp_path / "run"), "--task", task)
    line = one_error_line(err)
    assert code == 2 and len(line) < 400 and "(100,004 characters)" in line and "closest valid" in line, line[:500]


def test_progress_of_steps_0_and_past_the_end_reads_100_percent():
    assert "frames 2/0 (100.0%)" in tools.Progress(0, 0, interactive=False).line(2)
    progress = tools.Progress(40, 0, interactive=False)
    progress.update(44, fps=10.0)
    assert progress.line(44).startswith("frames 44/40 (100.0%)") and progress.line(44).endswith("ETA 0:00:00")
    assert tools.Progress(40, 0, interactive=False).line(10).startswith("frames 10/40 (25.0%)")


# -- 10. a finished run's rerun ------------------------------------------------------------------------


def test_rerunning_a_finished_run_says_so_and_changes_nothing(run_copy, capsys):
    before = snapshot(run_copy)
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "40")
    assert code == 0 and err == "", err
    assert f"Run finished: {run_copy} completed 40 frames of --steps 40; nothing to do" in out
    assert snapshot(run_copy) == before  # no metrics row, events file, config, previous.pt or latest.pt
    assert not (run_copy / "previous.pt").exists()
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "60")  # more steps: it continues
    assert code == 0 and "Run: resumed from frame 40" in out, err
    assert tools.load_checkpoint(run_copy / "latest.pt")["counters"]["policy_steps"] * 2 == 60


# -- 7. non-finite values: the promised line ----------------------------------------------------------


def test_non_finite_actor_weights_stop_with_one_line_naming_the_learner(run_copy, capsys, monkeypatch):
    """torch.distributions refuses the NaN parameters that NaN weights give, inside the update or the
    policy, before any loss is checked: that too is the one line, naming the learner."""
    before = (run_copy / "latest.pt").read_bytes()
    train_step = dreamer.Dreamer.train_step

    def poisoned(self, *args):
        metrics = train_step(self, *args)
        with torch.no_grad():
            for p in self.task_behavior.actor.parameters():
                p.fill_(float("nan"))
        return metrics

    monkeypatch.setattr(dreamer.Dreamer, "train_step", poisoned)
    code, _, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "80")
    line = one_error_line(err)
    assert code == 1 and "non-finite actor" in line and "weights" in line, err
    assert re.search(r"weights (at update \d+|in the policy step at frame \d+) \(after update \d+\);", line), line
    assert line.endswith("the run stops without saving (latest.pt keeps frame 40)"), line
    assert (run_copy / "latest.pt").read_bytes() == before


class NaNRewardEnv:
    """A vector environment whose third step returns a NaN reward."""

    obs_space = {"vector": gymnasium.spaces.Box(-np.inf, np.inf, (3,), np.float32)}
    act_space = gymnasium.spaces.Box(-1, 1, (2,), np.float32)

    def __init__(self):
        self.t = 0

    def _obs(self):
        return {"vector": np.zeros(3, np.float32), "is_first": self.t == 0, "is_last": False, "is_terminal": False}

    def reset(self):
        self.t = 0
        return self._obs()

    def step(self, action):
        self.t += 1
        return self._obs(), float("nan") if self.t == 3 else 1.0, False, {}

    def close(self):
        pass


def test_a_non_finite_environment_step_is_refused_before_it_is_stored(tmp_path):
    env = parallel.Damy(NaNRewardEnv, 2, name="nan_task")
    replay = tools.Replay(100, 1)
    collector = parallel.Collector([env], replay, tmp_path, lambda episode: None, chunk_size=1)
    policy = lambda obs, state: (np.zeros((1, 2), np.float32), None)  # noqa: E731
    collector.step(policy)
    collector.step(policy)
    with pytest.raises(parallel.NonFiniteStep) as caught:
        collector.step(policy)
    assert str(caught.value) == ("Environment 2 (nan_task) returned a non-finite reward at step 3 of its episode; "
                                 "it was not stored")
    assert len(replay) == 3 and all(np.isfinite(e["reward"]).all() for e in tools.load_episodes(tmp_path))
    with pytest.raises(parallel.NonFiniteStep, match="the policy gave non-finite actions"):
        parallel.Collector([env], None, None, lambda e: None).step(lambda obs, state: (np.full((1, 2), np.nan), None))


# -- 8, 9. workers under env_failure stop, and the step timeout -----------------------------------------


def test_env_timeout_is_the_workers_step_timeout():
    config = make_config("--parallel", "True", "--env_timeout", "7.5")
    created = parallel.make_envs(config, "train", 1)
    try:
        assert created[0].timeout == 7.5 and created[0].name == "dmc_cartpole_balance"
    finally:
        created[0].close()
    assert PRESETS["defaults"]["env_timeout"] == 600


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_stopped_worker_under_env_failure_stop_is_one_line(run_copy, capsys, monkeypatch, how):
    collect, calls, stopped = dreamer.Trainer.collect, [], []

    def collect_then_fail(self, policy):
        calls.append(1)
        if len(calls) == 3:
            os.kill(self.train_envs[0].pid, getattr(signal, how))
            stopped.append(time.monotonic())
        return collect(self, policy)

    monkeypatch.setattr(dreamer.Trainer, "collect", collect_then_fail)
    before = (run_copy / "latest.pt").read_bytes()
    code, _, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "80", "--parallel", "True",
                        "--env_failure", "stop", "--env_timeout", "3")
    line = one_error_line(err)
    reason = "died from signal SIGKILL" if how == "SIGKILL" else "did not answer within 3 s (env_timeout)"
    assert code == 1 and line == (f"error: Environment 0 (dmc_cartpole_balance): the worker process {reason}; not "
                                  "restarted (restart=False, env_failure: stop); the last checkpoint is kept, rerun "
                                  "the same command to resume"), err
    assert time.monotonic() - stopped[0] < 30
    assert (run_copy / "latest.pt").read_bytes() == before
