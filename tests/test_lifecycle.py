"""A run's life from the lock to the closing line (issue 54, items 3, 12, 15-20): the lock taken before
anything in the logdir is read, a logdir the file system refuses named in one line, every file write
failing through one line whose advice fits the errno, the frame count on resume counting each stored step
once, and the closing line that says where the results are and what to run next."""

import copy
import errno
import json
import os
import pathlib
import sys
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from helpers import main  # noqa: E402

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import launch  # noqa: E402
import logs  # noqa: E402
import parallel  # noqa: E402
import storage  # noqa: E402
import tools  # noqa: E402

PRESETS = cfg.load_presets()
SHORT = ["--configs", "debug", "--eval_episode_num", "0", "--time_limit", "40"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -- 19, 20: the lock first; a logdir that cannot be made ----------------------------------------------


def test_the_lock_is_taken_before_anything_in_a_new_logdir_is_read_or_cleaned(tmp_path, capsys, monkeypatch):
    """a682c18 built the Trainer, whose resume cleans temporary checkpoint files, before it locked a new
    logdir: a second run started on it meanwhile lost its checkpoint in flight."""
    logdir, other = tmp_path / "new", {}

    def racing(*args, **kwargs):  # a second run, started on the same new logdir while this one builds
        if "lock" not in other:
            logdir.mkdir(exist_ok=True)
            try:
                other["lock"] = storage.lock_logdir(logdir)
            except storage.LogdirBusy:
                other["lock"] = None
                raise tools.ConfigError("the second run found the logdir locked") from None
            other["temp"] = storage.temp_path(logdir / "latest.pt")
            torch.save({"agent": {}}, other["temp"])  # its save in flight
        raise tools.ConfigError("the second run holds the logdir")

    monkeypatch.setattr(parallel, "make_envs", racing)
    code, _, err = main(capsys, *SHORT, "--logdir", str(logdir))
    assert code == 2 and other["lock"] is None, err
    assert not logdir.exists()  # refused before it wrote anything: the folder it made is gone again


def test_a_logdir_the_file_system_cannot_create_is_one_line_before_any_environment(tmp_path, capsys, monkeypatch):
    made = []
    monkeypatch.setattr(parallel, "make_envs", lambda *args, **kwargs: made.append(args) or [])
    code, out, err = main(capsys, *SHORT, "--logdir", str(tmp_path / ("x" * 300)))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and made == [], err
    assert lines[0].startswith("error: Invalid value") and "cannot be created (File name too long)" in lines[0]


# -- 16: the closing line --------------------------------------------------------------------------------


def test_the_closing_line_names_frames_time_return_logdir_and_the_next_commands():
    line = logs.closing_line([(100_000, 512.34, pathlib.Path("logdir/walker"))], pathlib.Path("logdir/walker"), 754.2)
    first, second = line.splitlines()
    assert first == ("Finished: 100,000 frames in 0:12:34, final evaluation return 512.3; results in "
                     "logdir/walker")
    assert second == ("Next: tensorboard --logdir logdir/walker | the same command with --eval_only True "
                      "--eval_episode_num 10 | python3 benchmarks/plot.py logdir/walker")
    seeds = logs.closing_line([(40, 1.5, "l/seed0"), (40, None, "l/seed1")], "l", 3)
    assert seeds.startswith("Finished: 40 frames in 0:00:03, final evaluation returns 1.5, -; results in l\n")
    assert seeds.endswith("benchmarks/plot.py l/seed0 l/seed1")
    assert "no evaluation (--eval_episode_num 0)" in logs.closing_line([(40, None, "l")], "l", 3)


# -- 3, 18: the frame count on resume counts each stored step once --------------------------------------


@pytest.mark.parametrize("chunk_size", [0, 3])
def test_a_save_counts_every_step_taken_once_stored_or_still_to_be_written(tmp_path, chunk_size):
    """A checkpoint's stored_steps is what the episode files will hold of the steps taken by then; a
    resume counts only what its files hold beyond it (storage.Checkpoints.resume). a682c18 saved the
    files' steps alone, so the running episodes' steps after their last chunk (the whole episode with
    chunk_size 0), counted in policy_steps already, were counted again once their files appeared: about
    one episode per environment on every resume, and after a fall-back to previous.pt (item 3)."""
    from stand_ins import CountingEnv

    collector = parallel.Collector([CountingEnv(7), CountingEnv(11)], None, tmp_path, lambda episode: None,
                                   chunk_size=chunk_size)

    def policy(obs, state):
        return torch.zeros(len(obs["x"]), 1).numpy(), None

    for taken in range(1, 40):
        collector.step(policy)
        assert storage.stored_steps(tmp_path) + collector.unstored() == 2 * taken, taken


def test_a_log_at_a_step_logged_before_a_failed_save_writes_no_second_row(tmp_path):
    """After a failed save the run resumes from the checkpoint before; its stored episodes bring it
    back to the frame of its last log, which a682c18 logged again: two rows at one step."""
    for output in (logs.JsonlOutput, logs.CsvOutput):
        first = output(tmp_path, 0, None)
        first.write(10, {"a": 1.0}, {})
        first.write(20, {"a": 2.0}, {})  # logged, then the save failed
        resumed = output(tmp_path, 20, None)
        resumed.write(20, {"a": 3.0}, {})
        resumed.write(30, {"a": 4.0}, {})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["a"]) for row in rows] == [(10, 1.0), (20, 2.0), (30, 4.0)]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[1:] == ["10,1.0", "20,2.0", "30,4.0"]


# -- 17: every file the run writes fails through one line ----------------------------------------------


class FailingEvents:
    """A TensorBoard writer on a disk that refuses more: flush and close raise as torch's do."""

    def __init__(self, code):
        self.code = code

    def _fail(self, *args, **kwargs):
        raise OSError(self.code, os.strerror(self.code))

    add_scalar = add_video = add_text = lambda self, *args, **kwargs: None
    flush = close = _fail


@pytest.mark.parametrize("code, advice", [
    (errno.ENOSPC, "free space and rerun to resume"),
    (errno.EFBIG, "raise the file-size limit (ulimit -f) or use a file system that takes larger files and rerun"),
    (errno.EACCES, "make it writable and rerun to resume"),
    (errno.EROFS, "the file system is read-only: remount it writable or use another --logdir and rerun"),
])
def test_an_event_file_that_cannot_be_written_is_a_write_error_with_advice_for_its_errno(tmp_path, code, advice):
    """a682c18: the event writer's flush and close were unguarded (146 lines, two tracebacks), and a
    file-size limit was told to "make it writable"."""
    logger = logs.Logger(tmp_path, 0, ["tensorboard", "jsonl"])
    tensorboard = logger.outputs[0]
    tensorboard.writer.close()
    tensorboard.writer = FailingEvents(code)
    logger.scalar("a", 1.0)
    with pytest.raises(storage.WriteError) as error:
        logger.write(10)
    assert str(error.value).startswith(f"cannot write {tensorboard.path}: {os.strerror(code)} (errno {code})")
    assert error.value.hint.startswith(advice)
    with pytest.raises(storage.WriteError):  # closing: every back end closes, the failure is raised once
        logger.close()


def test_a_metrics_file_that_cannot_be_written_is_a_write_error_and_a_failed_close_never_raises_twice(tmp_path):
    run_log = logs.RunLog.__new__(logs.RunLog)  # its close only: the progress bar and the logger
    run_log.progress = logs.Progress(10, 0, interactive=False)
    run_log.logger = logs.Logger(tmp_path, 0, ["jsonl"])
    (tmp_path / "metrics.jsonl").mkdir()  # a path that cannot be opened for writing
    run_log.logger.scalar("a", 1.0)
    with pytest.raises(storage.WriteError, match=r"cannot write .*metrics\.jsonl: Is a directory"):
        run_log.logger.write(10)
    run_log.logger.outputs[0].close = FailingEvents(errno.ENOSPC).close
    run_log.close(quiet=True)  # the run ends on the first error already
    with pytest.raises(storage.WriteError):
        run_log.close()


def test_a_run_under_a_file_size_limit_ends_with_one_line_that_says_so(tmp_path):
    """The issue's reproduction: the events file outgrows `ulimit -f` first; a682c18 printed 146 lines
    and two tracebacks."""
    import resource
    import subprocess

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(pathlib.Path(dreamer.__file__)), *SHORT, "--steps", "400",
                             "--logdir", str(tmp_path / "run")], capture_output=True, text=True, env=env,
                            preexec_fn=limit, timeout=600)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: cannot write ") and "File too large (errno 27)" in lines[0]
    assert "raise the file-size limit (ulimit -f)" in lines[0]


# -- 12: the ETA -----------------------------------------------------------------------------------------


def test_the_eta_leaves_the_evaluations_out_of_the_training_pace_and_adds_those_still_due(tmp_path, capsys):
    """The first log's 1,000 frames took 100 s, 90 of them an evaluation; 9,000 frames and one evaluation
    are left: 9,000 frames at 100 fps and 90 s, 3 minutes. a682c18 divided by the first log's fps,
    evaluation included (10 fps): 15 minutes."""
    config = cfg.parse([*SHORT, "--steps", "10000", "--eval_every", "9000", "--action_repeat", "2",
                        "--logger", "jsonl"], presets=copy.deepcopy(PRESETS))
    counters = dreamer.Counters()
    run_log = logs.RunLog(config, tmp_path, counters, launch.SingleProcess(), ["dmc_walker_walk"],
                          storage.Replay(10, 1), None, lambda: "nothing saved", None)
    run_log.open()
    run_log.progress.interactive = False
    run_log.last_log = (time.time() - 100, 0, 0)
    run_log.evaluated(90.0)
    counters.policy_steps = 500  # 1,000 frames
    run_log.log({"learner": 0.5, "env": 0.5})
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("frames 1000/10000") and line.endswith("ETA 0:03:00"), line
    run_log.close()
    assert logs.eta_seconds(9000, 1000, 10.0, 90.0) == 180.0


# -- 15: what a run says -----------------------------------------------------------------------------------


def test_two_seeds_printing_at_once_never_share_a_line():
    """print writes its text and its newline in two calls; a682c18 prefixed each call, so seed1's text
    written between seed0's two landed on seed0's line: `seed0: aseed1: b`."""
    import io
    import threading

    import seeds

    stream = io.StringIO()
    output = seeds.SeedOutput(stream)
    turns = [threading.Event() for _ in range(4)]

    def seed(k):
        turns[k].wait()
        output.write(f"line of seed{k}")  # print's text ...
        turns[k + 1].set()
        turns[k + 2].wait()
        output.write("\n")  # ... and its newline, after the other seed's text
        if k + 3 < len(turns):
            turns[k + 3].set()

    threads = [threading.Thread(target=seed, args=(k,), name=f"seed{k}") for k in range(2)]
    for thread in threads:
        thread.start()
    turns[0].set()
    for thread in threads:
        thread.join(10)
    output.write("main\n")
    threads = [threading.Thread(target=output.write, args=("unfinished",), name="seed2")]
    threads[0].start()
    threads[0].join()
    output.finish()
    assert stream.getvalue().splitlines() == ["seed0: line of seed0", "seed1: line of seed1", "main",
                                              "seed2: unfinished"]


@pytest.mark.parametrize("context, online, warned", [
    ({}, False, None),  # v1: nothing beyond the episode files to restore, nothing to warn about
    ({"deter": ((3,), np.float32)}, False, "the replay's written-back latents of 1 environment stream(s)"),
    ({}, True, "the replay's online queue of 1 environment stream(s)"),
])
def test_a_resume_warns_about_replay_state_only_where_the_run_keeps_some(context, online, warned):
    """a682c18 warned that a v1 run's written-back latents were not restored after a Ctrl-C, though v1
    writes none back."""
    import types

    config = cfg.parse(["--configs", "debug", "--replay_online", str(online)], presets=copy.deepcopy(PRESETS))
    replay = storage.Replay(100, 1)
    for t in range(30):
        replay.add({"action": np.full(1, t, np.float32), "reward": np.float32(t), "is_first": t == 0})
    saved = {"action": torch.full((20, 1), -1.0), "reward": torch.full((20,), -1.0)}  # steps the files lack
    agent = types.SimpleNamespace(context=types.SimpleNamespace(spec=context))
    checkpoints = storage.Checkpoints(None, config, agent, dreamer.Counters(), {}, replay, launch.SingleProcess())
    lines = checkpoints.restore_replay({"replay": {"streams": [saved], "queue": []}})
    assert lines == [] if warned is None else (len(lines) == 1 and warned in lines[0]), lines


def test_episode_files_another_suite_wrote_are_skipped_in_one_line(tmp_path, capsys):
    """A logdir resumed with another suite's preset: a682c18 printed one warning per file before its advice."""
    for _ in range(5):
        storage.save_episode(tmp_path / "train_eps", {"image": np.zeros((5, 8, 8, 3), np.uint8),
                                                      "reward": np.zeros(5, np.float32), "is_first": np.eye(5)[0] > 0})
    config = cfg.parse(["--configs", "debug"], presets=copy.deepcopy(PRESETS))
    from stand_ins import CountingEnv

    stored = storage.StoredEpisodes(config, tmp_path, 0, CountingEnv(3), {})
    err = capsys.readouterr().err.strip().splitlines()
    assert stored.skipped == 5 and len(err) == 1, err
    assert err[0].startswith("warning: skipping 5 episode files that do not load or fit this run, the first ")


# -- 20: damaged, refused and missing files ---------------------------------------------------------------


def test_two_damaged_checkpoints_are_refused_in_a_line_that_says_what_to_do(tmp_path):
    (tmp_path / "latest.pt").write_bytes(bytes(10))
    storage.previous_path(tmp_path / "latest.pt").write_bytes(b"")
    with pytest.raises(storage.CheckpointError) as error:
        storage.load_checkpoint_or_previous(tmp_path / "latest.pt")
    line = str(error.value)
    assert "\n" not in line and line.startswith("no usable checkpoint: cannot read")
    assert line.endswith(f"Move latest.pt and previous.pt out of {tmp_path} to train from fresh weights (the stored "
                         "episodes are kept and counted), or use another --logdir")


class Crafted:
    def __reduce__(self):
        return (os.getcwd, ())


def test_a_crafted_checkpoint_is_never_skipped_and_the_line_says_how_to_resume_from_the_previous(tmp_path):
    """README: a checkpoint that could run code is refused, never skipped for previous.pt (someone changed a
    file of the run); the line says how to resume from previous.pt after setting it aside."""
    torch.save({"agent": {}}, storage.previous_path(tmp_path / "latest.pt"))
    torch.save({"agent": Crafted()}, tmp_path / "latest.pt")
    with pytest.raises(storage.CheckpointError) as error:
        storage.load_checkpoint_or_previous(tmp_path / "latest.pt")
    assert error.value.unsafe and str(error.value).startswith(f"refusing to load {tmp_path / 'latest.pt'}")
    assert str(error.value).endswith("It is never skipped: move it out of the logdir (keep it to inspect) and rerun "
                                     "to resume from previous.pt")
