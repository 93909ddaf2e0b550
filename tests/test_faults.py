"""Faults (issue 32): a kill -9 at any instant leaks nothing and keeps the newest checkpoint; a
damaged file is one line and skipped, never a blocked resume; what cannot run is refused at start
in one line; a finished run's rerun changes nothing.

Short `dreamer.main` runs of the debug preset run in this process; the kill tests start runs of
their own and kill them at chosen points of the checkpoint write (KILL_AT patches the write's steps).
"""

import copy
import io
import json
import os
import pathlib
import pickle
import re
import signal
import sys
import time

import gymnasium
import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from helpers import main, snapshot  # noqa: E402

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import logs  # noqa: E402
import models  # noqa: E402
import parallel  # noqa: E402
import storage  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESETS = cfg.load_presets()
SHORT = ["--configs", "debug", "--eval_episode_num", "0", "--time_limit", "40"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_config(*flags):
    return cfg.parse(["--configs", "debug", *flags], presets=copy.deepcopy(PRESETS))


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


def test_a_replay_that_could_never_fit_is_refused_at_start(tmp_path, capsys):
    code, out, err = main(capsys, *SHORT, "--logdir", str(tmp_path / "run"), "--dataset_size", "1e12")
    line = one_error_line(err)
    assert code == 2 and out == "" and "the replay needs" in line and "in all: lower --dataset_size" in line, err
    assert "--dataset_size 1,000,000,000,000 steps x" in line and not (tmp_path / "run").exists()


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
    assert "frames 2/0 (100.0%)" in logs.Progress(0, 0, interactive=False).line(2)
    progress = logs.Progress(40, 0, interactive=False)
    progress.update(44, fps=10.0)
    assert progress.line(44).startswith("frames 44/40 (100.0%)") and progress.line(44).endswith("ETA 0:00:00")
    assert logs.Progress(40, 0, interactive=False).line(10).startswith("frames 10/40 (25.0%)")


# -- 10. a finished run's rerun ------------------------------------------------------------------------


def test_rerunning_a_finished_run_says_so_and_changes_nothing(run_copy, capsys, monkeypatch):
    before = snapshot(run_copy)
    made = []  # a682c18 started the environment workers before it said there was nothing to do
    monkeypatch.setattr(parallel, "make_envs", lambda *args, **kwargs: made.append(args) or [])
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "40")
    monkeypatch.undo()
    assert code == 0 and err == "" and made == [], err
    assert f"Run finished: {run_copy} completed 40 frames of --steps 40; nothing to do" in out
    assert snapshot(run_copy) == before  # no metrics row, events file, config, previous.pt or latest.pt
    assert not (run_copy / "previous.pt").exists()
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "60")  # more steps: it continues
    assert code == 0 and "Run: resumed from frame 40" in out, err
    assert storage.load_checkpoint(run_copy / "latest.pt")["counters"]["policy_steps"] * 2 == 60
    # The closing line (a682c18 ended on its last status line): where the results are, what to run next.
    assert re.search(r"^Finished: 60 frames in \d+:\d\d:\d\d, no evaluation \(--eval_episode_num 0\); results in "
                     f"{re.escape(str(run_copy))}\nNext: tensorboard --logdir {re.escape(str(run_copy))} \\| ",
                     out, re.M), out[-500:]


# -- 7. non-finite values: the promised line ----------------------------------------------------------


def test_non_finite_actor_weights_stop_with_one_line_naming_the_learner(run_copy, capsys, monkeypatch):
    """torch.distributions refuses the NaN parameters that NaN weights give, inside the update or the
    policy, before any loss is checked: that too is the one line, naming the learner."""
    before = (run_copy / "latest.pt").read_bytes()
    train_step = models.Update.train_step

    def poisoned(self, *args):
        result = train_step(self, *args)
        with torch.no_grad():
            for p in self.behavior.actor.parameters():
                p.fill_(float("nan"))
        return result

    monkeypatch.setattr(models.Update, "train_step", poisoned)
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
    replay = storage.Replay(100, 1)
    collector = parallel.Collector([env], replay, tmp_path, lambda episode: None, chunk_size=1)
    policy = lambda obs, state: (np.zeros((1, 2), np.float32), None)  # noqa: E731
    collector.step(policy)
    collector.step(policy)
    with pytest.raises(parallel.NonFiniteStep) as caught:
        collector.step(policy)
    assert str(caught.value) == ("Environment 2 (nan_task) returned a non-finite reward at step 3 of its episode; "
                                 "it was not stored")
    assert len(replay) == 3 and all(np.isfinite(e["reward"]).all() for e in storage.load_episodes(tmp_path))
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


# -- 1, 2. a kill -9 at each step of a checkpoint or episode write ------------------------------------

# A run of dreamer.main that kills itself (SIGKILL, as kill -9) at the `nth` time a write of a file
# of `kind` reaches `point`: "half written" (half of the temporary file on disk), "written" (all of
# it, flushed), "previous kept" (latest.pt renamed to previous.pt) or "replaced" (the temporary file
# renamed to its name). The steps are storage.write_synced and os.replace, wrapped in the child.
KILL_AT = """
import os, pathlib, signal, sys
sys.path.insert(0, {root!r})
import dreamer, storage
point, kind, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen = []

def reached(name, path):
    if name == point and kind in path.name:
        seen.append(path)
        if len(seen) == nth:
            os.kill(os.getpid(), signal.SIGKILL)

def write_synced(path, data, write=storage.write_synced):
    path = pathlib.Path(path)
    if point == "half written" and kind in path.name:
        with path.open("wb") as f:
            f.write(data[:len(data) // 2])
            f.flush()
        reached("half written", path)
    write(path, data)
    reached("written", path)

def replace(source, target, rename=os.replace):
    rename(source, target)
    source, target = pathlib.Path(source), pathlib.Path(target)
    if storage.TEMP_PATTERN.match(source.name):
        reached("replaced", target)
    elif target == storage.previous_path(source):
        reached("previous kept", source)

storage.write_synced, os.replace = write_synced, replace
dreamer.main(sys.argv[4:])
"""


def run_killed_at(point, kind, nth, *flags):
    import subprocess

    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    result = subprocess.run([sys.executable, "-c", KILL_AT.format(root=str(ROOT)), point, kind, str(nth), *flags],
                            capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]


def temps(folder):
    return sorted(p.name for p in pathlib.Path(folder).rglob(".*.tmp"))


def frame_of(path):
    return storage.load_checkpoint(path)["counters"]["policy_steps"] * 2


def resumed(logdir):
    """A Trainer built on `logdir` as a rerun builds it (its start recovers, then resumes)."""
    config = make_config(*SHORT[2:], "--logdir", str(logdir), "--steps", "120")
    env_list = parallel.make_envs(config, "train", 1)
    try:
        agent = dreamer.Dreamer(env_list[0].obs_space, env_list[0].act_space, config)
        return dreamer.Trainer(config, agent, logdir, env_list, [])
    finally:
        env_list[0].close()


# point -> (frame of latest.pt at the next start, frame of previous.pt, whether the start says it recovered)
CHECKPOINT_KILLS = {
    "half written": (40, None, True),  # the temporary file is cut short: removed; latest.pt was untouched
    "written": (80, 40, True),  # complete, before any rename: promoted, as the save would have done
    "previous kept": (80, 40, True),  # between the renames: latest.pt missing until the start promotes
    "replaced": (80, 40, False),  # the save was done
}


@pytest.mark.parametrize("point", list(CHECKPOINT_KILLS))
def test_a_kill_at_each_step_of_a_checkpoint_write_resumes_the_newest_complete_one(run_copy, point):
    """The base run holds latest.pt at frame 40; a run to frame 80 is killed in its final save."""
    run_killed_at(point, "latest.pt", 1, *SHORT, "--logdir", str(run_copy), "--steps", "80")
    left = temps(run_copy)
    assert bool(left) == (point != "replaced"), left  # what the kill leaves, for the start to find
    latest, previous, recovers = CHECKPOINT_KILLS[point]
    trainer = resumed(run_copy)
    assert temps(run_copy) == []  # nothing survives the next start
    assert trainer.resumed and trainer.checkpoints.saved_frames == latest
    assert frame_of(run_copy / "latest.pt") == latest
    assert (frame_of(run_copy / "previous.pt") if (run_copy / "previous.pt").exists() else None) == previous
    lines = [note for note in trainer.notes if "Recovered from a kill during a checkpoint write" in note]
    assert len(lines) == int(recovers), trainer.notes
    if point == "half written":
        assert "removed 1 incomplete" in lines[0] and "promoted" not in lines[0]
    elif recovers:
        assert "promoted the complete .latest.pt." in lines[0] and "to latest.pt" in lines[0]


@pytest.mark.parametrize("point", ["half written", "written"])
def test_a_kill_in_an_episode_chunk_write_leaves_no_temporary_file_and_keeps_every_complete_chunk(run_copy, point):
    traindir = run_copy / "train_eps"
    before = storage.stored_steps(traindir)
    run_killed_at(point, ".npz", 3, *SHORT, "--logdir", str(run_copy), "--steps", "80", "--chunk_size", "5")
    assert len(temps(traindir)) == 1
    on_disk = storage.stored_steps(traindir)
    trainer = resumed(run_copy)
    assert temps(run_copy) == []
    line = next(note for note in trainer.notes if note.startswith("WARNING: Recovered episode files in"))
    if point == "written":  # the third chunk was complete: kept, as the rename would have kept it
        assert "1 complete temporary file(s) became their episode file" in line
        assert storage.stored_steps(traindir) == on_disk + 5
    else:
        assert "removed 1 incomplete temporary file(s)" in line
        assert storage.stored_steps(traindir) == on_disk
    assert on_disk == before + 9  # chunks 0 (first step and 4 more) and 1 of the killed run's episode
    assert trainer.counters.stored_steps == storage.stored_steps(traindir)


def test_recovery_promotes_only_a_complete_temporary_checkpoint_and_removes_every_other(tmp_path):
    path = tmp_path / "latest.pt"
    storage.save_checkpoint(path, {"step": torch.tensor(1)})
    complete, cut, older = (tmp_path / f".latest.pt.{n:08x}.tmp" for n in (1, 2, 3))
    buffer = io.BytesIO()
    torch.save({"step": torch.tensor(2)}, buffer)
    older.write_bytes(buffer.getvalue())
    os.utime(older, (1, 1))  # an old complete one (several kills): removed, the newest promoted
    torch.save({"step": torch.tensor(3)}, complete)
    cut.write_bytes(buffer.getvalue()[:100])
    os.utime(cut, (time.time() + 10,) * 2)  # the newest is cut short: skipped for the complete one before it
    nested = tmp_path / "..latest.pt.0000000a.tmp.0000000b.tmp"  # how saves wrote before issue 32
    nested.write_bytes(b"")
    other = tmp_path / ".previous.pt.00000001.tmp"  # not a temporary file of latest.pt's own naming
    other.write_bytes(b"")
    size = sum(p.stat().st_size for p in (older, cut, nested))
    line = storage.recover_checkpoint(path)
    assert line == ("Recovered from a kill during a checkpoint write: promoted the complete .latest.pt.00000001.tmp to "
                    f"latest.pt and removed 3 incomplete or older temporary checkpoint file(s) ({size / 1e6:.3g} MB)")
    assert int(storage.load_checkpoint(path)["step"]) == 3
    assert int(storage.load_checkpoint(tmp_path / "previous.pt")["step"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".previous.pt.00000001.tmp", "latest.pt", "previous.pt"]
    assert storage.recover_checkpoint(path) is None  # nothing left to do


def test_the_start_removes_the_temporary_files_of_the_logdirs_other_rewrites(tmp_path):
    path = tmp_path / "latest.pt"
    storage.save_checkpoint(path, {"step": torch.tensor(1)})
    (tmp_path / "config.yaml").write_text("task: x\n")
    for name in (".config.yaml.0000abcd.tmp", ".metrics.jsonl.00001234.tmp"):
        (tmp_path / name).write_text("cut")
    state, used, notes = storage.resume_checkpoint(path)
    assert int(state["step"]) == 1 and used == path
    assert notes == [f"Removed 2 temporary file(s) a kill left in {tmp_path} (of config.yaml, metrics.jsonl; each is "
                     "as it was before)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "latest.pt"]


# -- 3, 4, 6. damaged files are named and skipped ------------------------------------------------------


def test_an_unreadable_chunk_keeps_the_chunks_before_it(tmp_path, capsys):
    steps = [{"reward": np.float32(i), "action": np.zeros(2, np.float32)} for i in range(31)]
    writer = storage.EpisodeWriter(tmp_path, 10)
    for i in range(1, len(steps) + 1):
        writer.add(steps[:i])
    chunks = sorted(tmp_path.glob("*-c*.npz"))
    assert len(chunks) == 3
    chunks[1].write_bytes(b"damaged")
    episodes = storage.load_episodes(tmp_path)
    assert [len(e["reward"]) for e in episodes] == [10]  # chunk 0 stays; chunk 2 cannot follow it
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"skipping episode {chunks[1]} (and its 1 later chunks): unreadable" in lines[0]
    assert lines[0].endswith("the episode's chunks before it are kept"), lines


def test_a_stored_episode_with_a_nan_reward_is_named_and_skipped(run_copy, capsys, spaces):
    good = sorted((run_copy / "train_eps").glob("*.npz"))[0]
    with np.load(good) as data:
        episode = {k: data[k] for k in data.keys()}
    episode["reward"][3] = np.nan
    poisoned = storage.save_episode(run_copy / "train_eps", episode)
    assert storage.load_episodes(run_copy / "train_eps", spec=storage.episode_spec(*spaces)) != []
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: skipping episode {poisoned}: non-finite values in 'reward'"], err
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "60")
    assert code == 0 and "1 files skipped" in out and f"{poisoned}: non-finite values in 'reward'" in err, err


@pytest.mark.parametrize("damage", ["empty", "cut", "no optimizers", "not a dict"])
def test_a_damaged_latest_checkpoint_falls_back_to_previous_with_one_line(run_copy, capsys, damage):
    main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "60")  # latest.pt at frame 60, previous.pt at 40
    latest = run_copy / "latest.pt"
    data = latest.read_bytes()
    if damage == "empty":
        latest.write_bytes(b"")
    elif damage == "cut":
        latest.write_bytes(data[:len(data) // 2])
    else:
        state = storage.load_checkpoint(latest)
        torch.save({k: v for k, v in state.items() if k != "optimizers"} if damage == "no optimizers" else [1], latest)
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "80")
    assert code == 0 and "Traceback" not in err, err
    warnings_ = [line for line in out.splitlines() if line.startswith("WARNING:") and "latest.pt" in line]
    assert len(warnings_) == 1 and "Run: resumed from frame" in out, out
    expected = {"empty": "empty or cut short", "cut": "cannot read", "no optimizers": "without 'optimizers'",
                "not a dict": "incomplete, without 'agent'"}[damage]
    assert expected in warnings_[0] and "using the previous checkpoint" in warnings_[0], warnings_
    assert "kept the damaged latest.pt aside as latest.pt.damaged" in warnings_[0]
    assert (run_copy / "latest.pt.damaged").exists() and frame_of(run_copy / "previous.pt") == 40
    assert frame_of(run_copy / "latest.pt") == 80


class Payload:
    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.mark.parametrize("how", ["os.system", "exec", "eval", "plain pickle"])
def test_a_checkpoint_torch_refuses_as_unsafe_stops_the_run_with_one_line(run_copy, capsys, how):
    marker = run_copy.parent / "ran"
    latest = run_copy / "latest.pt"
    state = storage.load_checkpoint(latest)
    payload = {"os.system": Payload(os.system, f"touch {marker}"),
               "exec": Payload(exec, f"open({str(marker)!r}, 'w')"),
               "eval": Payload(eval, f"open({str(marker)!r}, 'w')"),
               "plain pickle": Payload(os.system, f"touch {marker}")}[how]
    if how == "plain pickle":  # not a torch.save archive at all
        latest.write_bytes(pickle.dumps({**state, "counters": payload}))
    else:
        state["counters"]["note"] = payload
        torch.save(state, latest)
    (run_copy / "previous.pt").write_bytes(b"")  # a fallback exists, and is not taken
    before = snapshot(run_copy)
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "80")
    line = one_error_line(err)
    assert code == 2 and not marker.exists(), err
    assert line.startswith(f"error: refusing to load {latest}: it holds objects other than tensors and plain "
                           "data ("), line
    assert "which could run code; torch: " in line and "weights_only" not in line, line
    named = {"os.system": "posix.system", "exec": "exec", "eval": "eval", "plain pickle": "posix.system"}[how]
    assert named in line
    assert snapshot(run_copy) == before  # nothing renamed, removed or written


@pytest.mark.parametrize("damage", [b'{"step": 40, "a": 1.0\n', b'\xff\xfe not text\n', b'[1, 2]\n'])
def test_a_damaged_metrics_line_is_set_aside_with_a_warning_and_the_run_goes_on(run_copy, capsys, damage):
    metrics = run_copy / "metrics.jsonl"
    original = metrics.read_bytes()
    metrics.write_bytes(original + damage)
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "60")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "metrics.jsonl" in line]
    assert len(lines) == 1 and "1 damaged line(s) left out" in lines[0] and "metrics.jsonl.damaged" in lines[0], err
    assert (run_copy / "metrics.jsonl.damaged").read_bytes() == original + damage
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows[-1]["step"] == 60 and metrics.read_bytes().startswith(original)
