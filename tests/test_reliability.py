"""Reliability (issue 12): a crash never destroys a run, one run per logdir, checkpoints load
without running code, resume honours what the user changed, every bad value is one line.

Short `dreamer.main` runs of the debug preset run in this process; only the signal and lock
checks start processes of their own.
"""

import copy
import os
import pathlib
import shutil
import signal
import subprocess
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
import models  # noqa: E402
import parallel  # noqa: E402
import storage  # noqa: E402
import tools  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESETS = cfg.load_presets()
SHORT = ["--configs", "debug", "--eval_episode_num", "0", "--time_limit", "40"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_config(*flags):
    return cfg.parse(["--configs", "debug", *flags], presets=copy.deepcopy(PRESETS))


def trainer_for(logdir):
    config = make_config(*SHORT[2:], "--logdir", str(logdir))
    env_list = parallel.make_envs(config, "train", 1)
    agent = dreamer.Dreamer(env_list[0].obs_space, env_list[0].act_space, config)
    return dreamer.Trainer(config, agent, logdir, env_list, [])


# -- 1. a crash never overwrites the last good checkpoint ---------------------------------------------


def test_non_finite_loss_ends_the_run_with_one_line_and_keeps_the_checkpoint(run_copy, capsys, monkeypatch):
    before = (run_copy / "latest.pt").read_bytes()
    train_step = models.Update.train_step

    def poisoned(self, batch):
        metrics, latents = train_step(self, batch)
        metrics["model_loss"] = metrics["model_loss"] * float("nan")
        return metrics, latents

    monkeypatch.setattr(models.Update, "train_step", poisoned)
    code, _, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "80")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "non-finite world_model/model_loss (nan) at update" in lines[0], err
    assert "latest.pt keeps frame 40" in lines[0]
    assert (run_copy / "latest.pt").read_bytes() == before


def test_an_exception_during_training_saves_nothing(run_copy, monkeypatch):
    before = (run_copy / "latest.pt").read_bytes()

    def out_of_memory(self, batch):
        raise MemoryError("simulated")

    monkeypatch.setattr(models.Update, "train_step", out_of_memory)
    with pytest.raises(MemoryError):
        dreamer.main([*SHORT, "--logdir", str(run_copy), "--steps", "80"])
    assert (run_copy / "latest.pt").read_bytes() == before
    assert not (run_copy / "previous.pt").exists()


def test_saves_keep_the_previous_checkpoint_and_loading_falls_back_to_it(tmp_path):
    path = tmp_path / "latest.pt"
    storage.save_checkpoint(path, {"w": torch.ones(2), "step": 1})
    storage.save_checkpoint(path, {"w": torch.ones(2), "step": 2})
    assert storage.load_checkpoint(storage.previous_path(path))["step"] == 1
    with pytest.raises(storage.CheckpointError, match="non-finite"):
        storage.save_checkpoint(path, {"w": torch.tensor([1.0, float("inf")]), "step": 3})
    assert storage.load_checkpoint(path)["step"] == 2  # the refused save replaced nothing
    state, used, notes = storage.load_checkpoint_or_previous(path)
    assert (state["step"], used, notes) == (2, path, [])
    for damage in (b"garbage", None):  # unreadable, then non-finite
        if damage is None:
            torch.save({"w": torch.tensor([float("nan")]), "step": 9}, path)
        else:
            path.write_bytes(damage)
        state, used, notes = storage.load_checkpoint_or_previous(path)
        assert state["step"] == 1 and used == tmp_path / "previous.pt"
        assert notes[-1] == f"using the previous checkpoint {used}"
    path.unlink()  # a kill between the two renames of a save
    state, used, notes = storage.load_checkpoint_or_previous(path)
    assert state["step"] == 1 and "is missing" in notes[0]


def test_non_finite_weights_are_never_saved(run_copy):
    before = (run_copy / "latest.pt").read_bytes()
    trainer = trainer_for(run_copy)
    with torch.no_grad():
        next(trainer.agent.parameters())[0] = float("nan")
    with pytest.raises(storage.NonFiniteError, match=r"non-finite weights .* \(latest.pt keeps frame 40\)"):
        trainer.save()
    assert (run_copy / "latest.pt").read_bytes() == before and not (run_copy / "previous.pt").exists()
    trainer.train_envs[0].close()


def test_the_finite_check_reduces_per_device_as_a_cuda_checkpoint_needs():
    """A CUDA run's checkpoint holds weights on the GPU and counters and random states on the host; the
    finite check stacked them into one tensor, which CUDA refuses (the first GPU run could not save). The
    meta device stands in for the GPU here."""
    bad = torch.tensor([1.0, float("nan")])
    tree = {"weights": [torch.zeros(3, device="meta"), torch.ones(2, device="meta")],
            "host": {"ok": torch.ones(2), "bad": bad, "count": torch.tensor(3)}}
    flags = tools.finite_flags(tree)
    assert set(flags) == {torch.device("meta"), torch.device("cpu")}
    assert flags[torch.device("meta")].device.type == "meta" and not bool(flags[torch.device("cpu")])
    assert tools.all_finite({"a": torch.ones(2), "b": [torch.zeros(1)]}) and not tools.all_finite([bad])
    assert tools.all_finite({"count": torch.tensor(3)})  # no floating-point tensor: nothing to check


# -- 2. episode files are validated against the run's spaces ------------------------------------------


SPACES = ({"image": gymnasium.spaces.Box(0, 255, (4, 4, 3), np.uint8),
           "is_first": gymnasium.spaces.Box(0, 1, (), bool)},
          gymnasium.spaces.Box(-1, 1, (2,), np.float32))


def fitting_episode(length=5):
    return {"image": np.zeros((length, 4, 4, 3), np.uint8), "is_first": np.arange(length) == 0,
            "action": np.zeros((length, 2), np.float32), "reward": np.zeros(length, np.float32),
            "log_extra": np.zeros(length)}


@pytest.mark.parametrize("change, problem", [
    (lambda e: e.pop("image"), "missing keys ['image']"),
    (lambda e: e.update(other=e["reward"]), "unexpected keys ['other']"),
    (lambda e: e.update(image=np.zeros((5, 8, 8, 3), np.uint8)),
     "'image' has step shape (8, 8, 3), expected (4, 4, 3)"),
    (lambda e: e.update(action=e["action"].astype(np.float64)), "'action' has dtype float64, expected float32"),
    (lambda e: e.update(reward=e["reward"][:3]), "keys of different or zero lengths [3, 5]"),
])
def test_episodes_that_do_not_fit_the_spaces_are_skipped_with_one_line(tmp_path, capsys, change, problem):
    storage.save_episode(tmp_path, fitting_episode())
    time.sleep(0.01)  # names sort by time
    bad = fitting_episode()
    change(bad)
    storage.save_episode(tmp_path, bad)
    skipped = []
    loaded = storage.load_episodes(tmp_path, spec=storage.episode_spec(*SPACES),
                                 on_skip=lambda f, p: skipped.append(p))
    assert len(loaded) == 1 and skipped == [problem]
    storage.load_episodes(tmp_path, spec=storage.episode_spec(*SPACES))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: skipping episode") and problem in lines[0]


def test_start_up_summary_counts_skipped_episodes(run_copy, capsys):
    good = sorted((run_copy / "train_eps").glob("*.npz"))[0]
    with np.load(good) as data:
        episode = {k: data[k] for k in data.keys() if k != "velocity"}
    storage.save_episode(run_copy / "train_eps", episode)
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "80")
    assert code == 0
    assert "Episodes: 20 replay steps loaded, 1 files skipped" in out
    assert "missing keys ['velocity']" in err


# -- 3. one run per logdir ------------------------------------------------------------------------------

# Another run as the kernel sees it: a process holding flock on run.lock (without the cost of
# importing torch; storage.lock_logdir's own pid line is checked below).
HOLD_LOCK = """
import fcntl, os, socket, sys, time
f = open(os.path.join(sys.argv[1], "run.lock"), "a+")
fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
f.truncate(0)
f.write(f"pid {os.getpid()} on {socket.gethostname()}")
f.flush()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_run_stops_with_one_line_and_a_killed_holder_leaves_no_lock(run_copy, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_copy)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run_copy, skip=())
        code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "80")
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"in use by another run (pid {holder.pid} on " in lines[0], err
        assert snapshot(run_copy, skip=()) == before
    finally:
        holder.kill()  # kill -9: the kernel releases the lock
        holder.wait()
    lock = storage.lock_logdir(run_copy)
    with pytest.raises(storage.LogdirBusy, match=f"pid {os.getpid()} on"):
        storage.lock_logdir(run_copy)
    lock.close()


# -- 4. checkpoints load without running code ------------------------------------------------------------


class Malicious:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_a_crafted_checkpoint_runs_nothing_and_says_why(run_copy, capsys):
    marker = run_copy.parent / "pwned"
    state = storage.load_checkpoint(run_copy / "latest.pt")
    state["counters"]["note"] = Malicious(marker)
    torch.save(state, run_copy / "latest.pt")
    code, _, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--eval_only", "--eval_episode_num", "1")
    assert not marker.exists()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "could run code" in err, err
    code, _, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "80")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "refusing to load" in err, err
    with pytest.raises(storage.CheckpointError, match="refusing to load"):
        storage.load_checkpoint_or_previous(run_copy / "latest.pt")  # never falls back past a tampered file
    assert not marker.exists()


def test_a_checkpoint_of_another_format_is_refused_in_one_line(run_copy, capsys):
    """No migration: a checkpoint saved before checkpoints had a format, or of an older one, ends a resumed run
    and --eval_only in one line that names the file, its format and the one this version reads."""
    latest = run_copy / "latest.pt"
    state = storage.load_checkpoint(latest)
    assert state["format"] == storage.CHECKPOINT_FORMAT
    for found, named in ((None, "none (older)"), (storage.CHECKPOINT_FORMAT - 1, storage.CHECKPOINT_FORMAT - 1)):
        if found is None:
            del state["format"]
        else:
            state["format"] = found
        storage.save_checkpoint(latest, state)
        for flags in (("--steps", "80"), ("--eval_only", "--eval_episode_num", "1")):
            code, _, err = main(capsys, *SHORT, "--logdir", str(run_copy), *flags)
            assert code == 2 and len(err.strip().splitlines()) == 1, err
            assert (f"{latest} is a checkpoint of format {named} and this version reads format "
                    f"{storage.CHECKPOINT_FORMAT} only") in err, err


# -- 5. resume honours what the user changed ----------------------------------------------------------------


def test_changed_optimizer_settings_apply_on_resume_and_are_reported(run_copy, capsys):
    code, out, _ = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "60", "--model_lr", "3e-4",
                        "--actor.eps", "1e-6", "--critic.lr", "2e-5", "--weight_decay", "0.1")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("Optimizer settings from this config"))
    for change in ("model lr 0.0001 -> 0.0003", "actor eps 1e-05 -> 1e-06", "critic lr 3e-05 -> 2e-05",
                   "model weight_decay 0 -> 0.1"):
        assert change in line
    saved = storage.load_checkpoint(run_copy / "latest.pt")["optimizers"]
    assert saved["model"]["opt"]["param_groups"][0]["lr"] == pytest.approx(3e-4)
    assert saved["model"]["opt"]["param_groups"][0]["weight_decay"] == pytest.approx(0.1)
    assert saved["task"]["actor"]["opt"]["param_groups"][0]["eps"] == pytest.approx(1e-6)
    assert saved["task"]["critic"]["opt"]["param_groups"][0]["lr"] == pytest.approx(2e-5)


def test_a_config_that_does_not_fit_the_checkpoint_is_one_line_and_writes_nothing(run_copy, capsys):
    before = snapshot(run_copy)
    code, out, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "80", "--units", "48")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "does not fit this config" in lines[0] and ", 48) here)" in lines[0], err
    assert snapshot(run_copy) == before


def test_frames_of_episodes_stored_after_the_checkpoint_count_towards_the_budget(run_copy):
    """What a kill -9 leaves: episodes written after the last checkpoint."""
    episodes = sorted((run_copy / "train_eps").glob("*.npz"))
    for i, path in enumerate(episodes):
        shutil.copy(path, path.with_name(f"99990101T00000000000{i}-after000-{path.stem.rsplit('-', 1)[1]}.npz"))
    trainer = trainer_for(run_copy)
    assert trainer.resumed and trainer.frames == 80  # 40 checkpointed + 20 steps of 2 frames stored afterwards
    assert "Counted 40 frames of episodes stored after the checkpoint (frame 40)" in trainer.notes
    assert trainer.counters.stored_steps == 40  # each stored step counts once
    trainer.train_envs[0].close()


def test_a_missing_checkpoint_beside_episodes_is_said_loudly(run_copy):
    (run_copy / "latest.pt").unlink()
    trainer = trainer_for(run_copy)
    assert not trainer.resumed and trainer.frames == 40
    assert any(n.startswith("WARNING: no checkpoint in") and "40 frames of episodes" in n for n in trainer.notes)
    trainer.train_envs[0].close()


def test_an_emptied_episode_folder_is_named_as_missing(run_copy):
    """a682c18 resumed with an empty replay without a word."""
    for path in (run_copy / "train_eps").glob("*.npz"):
        path.unlink()
    trainer = trainer_for(run_copy)
    assert any(note.startswith(f"WARNING: episode files missing: {run_copy / 'train_eps'} holds none, and the "
                               "checkpoint counted 40 frames") for note in trainer.notes), trainer.notes
    trainer.train_envs[0].close()


@pytest.mark.parametrize("signals", [1, 5])
def test_sigterm_saves_once_and_ends_with_one_line(tmp_path, signals):
    """What cluster schedulers send before a kill; its own process, since the handler is the point. Five
    SIGTERMs 0.02 s apart, as a scheduler and a wrapper script may send them: a682c18 raised from the
    handler wherever the main thread was, and a raise that landed in a cleanup was lost (the run went on
    and exited 0); a copy that came after Python's shutdown had put the default action back killed the
    process (exit -15). Now each only notes the request: one save, one line, exit 143."""
    logdir = tmp_path / "run"
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"), OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, str(ROOT / "dreamer.py"), *SHORT, "--time_limit", "20", "--logdir",
                                str(logdir), "--steps", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not list((logdir / "train_eps").glob("*.npz")):
        time.sleep(0.2)
    for _ in range(signals):
        process.send_signal(signal.SIGTERM)
        time.sleep(0.02)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert err.strip().splitlines() == ["Stopped by SIGTERM; rerun the same command to resume."]
    state = storage.load_checkpoint(logdir / "latest.pt")
    assert state["counters"]["policy_steps"] >= 10 and state["counters"]["stored_steps"] >= 10


def test_ctrl_c_saves_and_ends_without_a_traceback(run_copy, capsys, monkeypatch):
    """Ctrl-C raises KeyboardInterrupt wherever the main thread is; here in the third update."""
    train_step, calls = models.Update.train_step, []

    def interrupted(self, batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return train_step(self, batch)

    monkeypatch.setattr(models.Update, "train_step", interrupted)
    code, _, err = main(capsys, *SHORT, "--logdir", str(run_copy), "--steps", "400")
    assert code == 130 and err.strip().splitlines() == ["Stopped by Ctrl-C; rerun the same command to resume."]
    state = storage.load_checkpoint(run_copy / "latest.pt")
    assert state["counters"]["updates"] > storage.load_checkpoint(run_copy / "previous.pt")["counters"]["updates"]


# -- 6. every bad value is one line ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--batch_length", "0"], "Invalid value '0' for --batch_length; valid: a whole number >= 1"),
    (["--replay_context", "-1"], "Invalid value '-1' for --replay_context; valid: a whole number >= 0 (0 for none)"),
    (["--train_ratio", "0"], "Invalid value '0' for --train_ratio; valid: a number > 0"),
    (["--train_ratio", "-1"], "Invalid value '-1' for --train_ratio"),
    (["--action_repeat", "0"], "Invalid value '0' for --action_repeat"),
    (["--action_repeat", "-2"], "Invalid value '-2' for --action_repeat"),
    (["--size", "0,0"], "Invalid value '0,0' for --size; valid: two whole numbers >= 1"),
    (["--envs", "0"], "Invalid value '0' for --envs; valid: auto or a whole number >= 1 (0 only with"),
    (["--envs", "-1"], "Invalid value '-1' for --envs"),
    (["--encoder.cnn_keys", "ima(ge"], "Invalid value 'ima(ge' for --encoder.cnn_keys; valid: a regular expression"),
    (["--decoder.mlp_keys", "*"], "Invalid value '*' for --decoder.mlp_keys"),
    (["--offline_traindir", "{tmp}/absent"], "for --offline_traindir: no such folder"),
    (["--offline_traindir", "{tmp}"], "for --offline_traindir: no episode files (*.npz) in it"),
    (["--logdir", "{tmp}/file"], "for --logdir: it is a file, not a folder"),
    (["--logdir", "{tmp}/file/run"], "is a file, not a folder"),
    (["--logdir", "/proc/no_such_run/run"], "for --logdir: cannot write in /proc"),
])
def test_bad_values_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, args, message):
    (tmp_path / "file").write_text("")
    logdir = tmp_path / "run"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, out, err = main(capsys, *SHORT, "--logdir", str(logdir), *args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_an_offline_run_whose_episodes_are_all_skipped_fails_at_start(tmp_path, capsys):
    """Offline, the episodes are all there is to learn from: when every file is skipped (here one of
    another task's spaces) the run would finish with zero updates; it ends at start in one line."""
    offline = tmp_path / "offline"
    storage.save_episode(offline, {"image": np.zeros((50, 8, 8, 3), np.uint8), "action": np.zeros((50, 2), np.float32),
                                   "reward": np.zeros(50, np.float32), "is_first": np.eye(50, dtype=bool)[0],
                                   "is_last": np.zeros(50, bool), "is_terminal": np.zeros(50, bool)})
    logdir = tmp_path / "run"
    code, out, err = main(capsys, *SHORT[:2], "--eval_episode_num", "1", "--time_limit", "40", "--logdir", str(logdir),
                          "--offline_traindir", str(offline), "--envs", "0")
    lines = err.strip().splitlines()
    assert code == 2 and out == "", err
    assert lines[0].startswith("warning: skipping episode") and len(lines) == 2, err
    assert lines[-1] == (f"error: Invalid value '{offline}' for --offline_traindir: its episodes hold no sequence "
                         "of 20 steps to train on (0 replay steps loaded, 1 files skipped)")
    assert not logdir.exists()  # nothing written


def test_an_invalid_saved_config_is_one_line(run_copy, capsys):
    (run_copy / "config.yaml").write_text("task: [unclosed\n")
    before = snapshot(run_copy)
    code, _, err = main(capsys, *SHORT, "--logdir", str(run_copy))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Cannot read" in err and "fix or delete it" in err
    assert snapshot(run_copy) == before


def test_zero_envs_is_meaningful_only_offline():
    assert make_config("--envs", "0", "--offline_traindir", "x").envs == 0
    assert make_config("--envs", "0", "--eval_only").envs == 0
    with pytest.raises(tools.ConfigError, match="--envs"):
        make_config("--envs", "0")


def test_help_prints_usage_and_presets(capsys):
    code, out, err = main(capsys, "--help")
    assert code == 0 and err == ""
    assert out.startswith("usage: python3 dreamer.py")
    assert "Presets" in out and all(name in out for name in PRESETS if name != "defaults")
