"""Asynchronous training (--asynchronous): the samples-per-insert limiter against a plain reference,
and real debug runs: the train ratio held (counted), every collected step in replay once, resume,
a killed worker, Ctrl-C."""

import collections
import gc
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from helpers import resumed_frame  # noqa: E402

import collection  # noqa: E402
import dreamer  # noqa: E402
import parallel  # noqa: E402
import storage  # noqa: E402
import tools  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEBUG = ["--configs", "debug", "--asynchronous", "--time_limit", "60", "--eval_every", "1000"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------------------------
# The rate limiter
# ----------------------------------------------------------------------------------------------


def reference_allowed(inserts, updates, ratio, per_update, tolerance, finished):
    """Plain rules in exact arithmetic: (may the learner update, may the actor insert)."""
    owed = Fraction(inserts * ratio, per_update)
    if finished:
        return updates + 1 <= int(owed), False
    return updates + 1 <= owed + tolerance, owed - updates <= tolerance


@pytest.mark.parametrize("ratio, per_update, tolerance, batch", [(32, 200, 1, 1), (512, 1024, 3, 4),
                                                                 (1024, 1024, 2, 1), (16, 1024, 1, 16)])
def test_limiter_matches_the_reference_and_never_blocks_both_sides(ratio, per_update, tolerance, batch):
    rng = random.Random(0)
    limiter = tools.SamplesPerInsert(ratio, per_update, tolerance)
    inserts = updates = 0
    for step in range(3000):
        finished = step >= 2500
        if step == 2500:
            limiter.finish()
        sample, insert = reference_allowed(inserts, updates, ratio, per_update, tolerance, finished)
        assert (limiter.can_sample(), limiter.can_insert() and not finished) == (sample, insert), (inserts, updates)
        assert sample or insert or finished  # neither side can wait on the other for ever
        owed = Fraction(inserts * ratio, per_update)
        assert -tolerance - Fraction(batch * ratio, per_update) <= updates - owed <= tolerance
        if sample and (not insert or rng.random() < 0.5):
            limiter.sampled()
            updates += 1
        elif insert:
            limiter.inserted(batch)
            inserts += batch
    owed = Fraction(inserts * ratio, per_update)
    assert int(owed) <= updates <= owed + tolerance  # after finish(): the owed ones, unless already ahead
    assert limiter.state_dict() == {"updates": updates, "inserts": inserts}


def test_limiter_between_threads_ends_at_the_owed_updates_and_close_wakes_waiters():
    limiter = tools.SamplesPerInsert(512, 1024, 2)
    seen = []

    def actor():
        for _ in range(400):
            assert limiter.wait_insert(timeout=10)
            limiter.inserted(4)
            seen.append((limiter.inserts, limiter.updates))
        limiter.finish()

    thread = threading.Thread(target=actor)
    thread.start()
    while thread.is_alive() or limiter.can_sample():
        if limiter.wait_sample(timeout=0.01):
            limiter.sampled()
            seen.append((limiter.inserts, limiter.updates))
    thread.join()
    assert 800 <= limiter.updates <= 800 + 2
    assert all(-2 - 2 <= updates - inserts / 2 <= 2 for inserts, updates in seen)
    waiter = threading.Thread(target=lambda: seen.append(limiter.wait_sample()))
    waiter.start()
    limiter.close()
    waiter.join(5)
    assert not waiter.is_alive() and seen[-1] is False


def test_limiter_refuses_a_tolerance_below_one_update():
    with pytest.raises(ValueError, match="at least 1"):
        tools.SamplesPerInsert(512, 1024, 0.5)


# ----------------------------------------------------------------------------------------------
# A real asynchronous run, instrumented
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """Two in-process environments, tolerance 2, weights synced every 3 updates. Records every step
    the collector handed to replay, the limiter after every insert and update, and every sync."""
    logdir = tmp_path_factory.mktemp("async_run")
    seen = {"records": collections.defaultdict(list), "limiter": [], "syncs": []}
    record = parallel.Collector._record
    sampled, inserted = tools.SamplesPerInsert.sampled, tools.SamplesPerInsert.inserted
    train, sync = dreamer.Trainer.train, collection.Collection.sync

    def recording(self, index, obs, action, reward):
        record(self, index, obs, action, reward)
        if self.replay is not None:
            seen["records"][index].append(self.episodes[index][-1])

    def count(method):
        def counted(self, *args):
            method(self, *args)
            seen["limiter"].append((self.inserts, self.updates))
        return counted

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel.Collector, "_record", recording)
        patch.setattr(tools.SamplesPerInsert, "sampled", count(sampled))
        patch.setattr(tools.SamplesPerInsert, "inserted", count(inserted))
        patch.setattr(dreamer.Trainer, "train", lambda self: (seen.update(trainer=self), train(self))[1])
        patch.setattr(collection.Collection, "sync",
                      lambda self, agent, updates: (seen["syncs"].append(updates), sync(self, agent, updates))[1])
        dreamer.main([*DEBUG, "--logdir", str(logdir), "--steps", "200", "--envs", "2", "--ratio_tolerance", "2",
                      "--actor_sync_every", "3"])
    return logdir, seen


def test_async_run_holds_the_train_ratio_within_the_tolerance(async_run):
    _, seen = async_run
    config = seen["trainer"].config
    per_step = Fraction(config.train_ratio, config.batch_size * config.batch_length)  # updates owed per step
    assert len(seen["limiter"]) > 50
    for inserts, updates in seen["limiter"]:
        gap = updates - inserts * per_step
        assert -config.ratio_tolerance - config.envs * per_step <= gap <= config.ratio_tolerance
    inserts, updates = seen["limiter"][-1]
    assert int(inserts * per_step) <= updates <= inserts * per_step + config.ratio_tolerance
    assert inserts * config.action_repeat == 200


def test_every_collected_step_arrives_in_replay_once_and_in_order(async_run):
    _, seen = async_run
    replay = seen["trainer"].replay
    assert sorted(seen["records"]) == [0, 1]
    for index, steps in seen["records"].items():
        stream = replay.streams[index]
        assert stream.count == len(steps) > 50  # nothing lost, nothing added twice
        for t, step in enumerate(steps):
            for key, array in stream.data.items():
                np.testing.assert_array_equal(array[t], step[key], err_msg=f"stream {index} step {t} {key}")


def test_async_run_logs_the_ratio_utilisation_waits_and_policy_lag(async_run):
    logdir, seen = async_run
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 200 and any("eval/return" in row for row in rows)
    for key in ("perf/train_ratio", "perf/learner_busy", "perf/env_busy", "perf/learner_wait", "perf/env_wait",
                "perf/policy_lag", "world_model/model_loss", "train/return"):
        assert any(key in row for row in rows), key
    assert all(0 <= row[key] <= 1.05 for row in rows for key in ("perf/learner_busy", "perf/env_busy"))
    # The actor's weights are the learner's, copied every actor_sync_every (3) updates.
    syncs = seen["syncs"]
    assert len(syncs) > 3 and all(b - a == 3 for a, b in zip(syncs[1:], syncs[2:]))
    assert all(row["perf/policy_lag"] < 3 for row in rows if "perf/policy_lag" in row)
    trainer = seen["trainer"]
    assert not trainer.collection.thread.thread.is_alive()
    state = torch.load(logdir / "latest.pt", weights_only=False)
    assert state["schedules"]["train"] == trainer.schedules["train"].state_dict()
    assert state["counters"]["policy_steps"] == state["schedules"]["train"]["inserts"] == 100


def test_async_run_resumes_its_counters_and_limiter(async_run, tmp_path):
    logdir = shutil.copytree(async_run[0], tmp_path / "run")  # the module's run stays as it was for the other tests
    saved = torch.load(logdir / "latest.pt", weights_only=False)
    seen, train = {}, dreamer.Trainer.train
    gc.collect()  # the first run's logdir lock goes with its last reference (main's frame, in a cycle)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dreamer.Trainer, "train", lambda self: (seen.update(
            counters=dict(vars(self.counters)), limiter=self.schedules["train"].state_dict()), train(self))[1])
        dreamer.main([*DEBUG, "--logdir", str(logdir), "--steps", "240", "--envs", "2", "--ratio_tolerance", "2"])
    # stored_steps restarts from the episode files (storage.Checkpoints.resume): the checkpoint's also counts the
    # running episodes' steps that their files would hold, which a stop loses with those episodes.
    files = storage.stored_steps(logdir / "train_eps")
    assert seen["counters"]["stored_steps"] == files <= saved["counters"]["stored_steps"]
    assert {k: v for k, v in seen["counters"].items() if k != "stored_steps"} == \
        {k: v for k, v in saved["counters"].items() if k != "stored_steps"}
    assert seen["limiter"] == saved["schedules"]["train"]
    state = torch.load(logdir / "latest.pt", weights_only=False)
    assert state["counters"]["policy_steps"] == 120 and state["schedules"]["train"]["inserts"] == 120
    assert 120 * 32 // 200 <= state["schedules"]["train"]["updates"] <= 120 * 32 / 200 + 2


# ----------------------------------------------------------------------------------------------
# Parallel workers: a killed worker, Ctrl-C
# ----------------------------------------------------------------------------------------------


def workers(pid):
    """Process ids of the environment workers of `pid` (its spawned children but the resource tracker)."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == pid and b"spawn_main" in command:
            found.append(int(stat.parent.name))
    return sorted(found)


def start(logdir, *flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    command = [sys.executable, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(logdir), "--envs", "2",
               "--parallel", "--eval_episode_num", "0", *flags]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(condition, timeout=240):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def test_worker_killed_mid_run_is_restarted_and_the_run_finishes(tmp_path):
    process = start(tmp_path, "--steps", "300")
    wait_for(lambda: len(list((tmp_path / "train_eps").glob("*.npz"))) >= 1)
    os.kill(workers(process.pid)[0], signal.SIGKILL)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 300
    # The kill lands mid-episode (its episode is dropped) or, rarely, as the worker resets between two.
    if "restarting it (dropping its episode)" in err:
        assert rows[-1]["train/dropped_episodes"] == 1
    else:
        assert "restarting it (between episodes, nothing to drop)" in err, err[-3000:]
        assert rows[-1]["train/dropped_episodes"] == 0


def test_ctrl_c_ends_every_thread_and_process_and_saves(tmp_path):
    process = start(tmp_path, "--steps", "100000")
    wait_for(lambda: len(list((tmp_path / "train_eps").glob("*.npz"))) >= 1)
    pids = workers(process.pid)
    assert len(pids) == 2
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=120)
    assert process.returncode != 0  # interrupted, not finished
    assert not [pid for pid in pids if pathlib.Path(f"/proc/{pid}").exists()]
    state = torch.load(tmp_path / "latest.pt", weights_only=False)
    assert state["counters"]["policy_steps"] == state["schedules"]["train"]["inserts"] > 0


def test_kill_9_loses_at_most_unfinished_episodes_and_the_run_resumes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    command = [sys.executable, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(tmp_path), "--envs", "2",
               "--eval_episode_num", "0"]
    process = subprocess.Popen([*command, "--save_every", "1", "--steps", "100000"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)
    wait_for(lambda: len(list((tmp_path / "train_eps").glob("*.npz"))) >= 3 and (tmp_path / "latest.pt").exists())
    process.send_signal(signal.SIGKILL)
    process.wait()
    frame = resumed_frame(tmp_path)  # action repeat 2
    stored = 0
    for path in (tmp_path / "train_eps").glob("*.npz"):
        with np.load(path) as episode:
            assert episode["is_last"][-1] and episode["is_first"][0]  # only whole episodes are on disk
            stored += len(episode["reward"]) - 1
    counters = storage.load_checkpoint_or_previous(tmp_path / "latest.pt")[0]["counters"]
    result = subprocess.run([*command, "--steps", "400"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Run: resumed from frame {frame}" in result.stdout and frame > 0, result.stdout[-3000:]
    assert f"Episodes: {stored} replay steps loaded" in result.stdout, result.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 400
    assert torch.load(tmp_path / "latest.pt", weights_only=False)["counters"]["updates"] > counters["updates"]
