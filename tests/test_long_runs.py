"""Long runs lose nothing (issue 22): checkpoints on a wall clock (save_every) whether the run evaluates
or not, stops that every torchrun rank agrees on, training episodes stored in chunks as they fill
(a kill -9 loses at most one unfinished chunk per environment), and a full disk or read-only logdir
as one line that leaves the checkpoint loadable.

Unit checks use tiny stand-in environments; the runs use the debug preset. The kill -9 and torchrun
checks start processes of their own (the signal is the point); the others run `dreamer.main` here.
"""

import copy
import errno
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers import main, resumed_frame  # noqa: E402
from stand_ins import CountingEnv, latent_policy  # noqa: E402

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import launch  # noqa: E402
import models  # noqa: E402
import parallel  # noqa: E402
import storage  # noqa: E402
import tools  # noqa: E402

PRESETS = cfg.load_presets()
SHORT = ["--configs", "debug", "--eval_episode_num", "0", "--time_limit", "40"]
PROPRIO = ["--configs", "dmc_proprio", "debug", "--device", "cpu", "--eval_episode_num", "0"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def environment():
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"),
                MASTER_ADDR="127.0.0.1")


# -- the pieces: clock, chunk writer, stops, agreement, write errors -------------------------------------


def test_clock_is_due_once_its_seconds_passed_and_restarts_at_reset():
    now = [100.0]
    clock = tools.Clock(5, now=lambda: now[0])
    assert not clock()
    now[0] = 104.9
    assert not clock()
    now[0] = 105.0
    assert clock() and clock()  # due until a save resets it
    clock.reset()
    assert not clock()
    now[0] = 110.0
    assert clock()
    assert not tools.Clock(0, now=lambda: now[0])() and not tools.Clock(-1)()  # 0: never on the clock


def context():
    config = tools.Config({"replay_context": 1, "dyn_deter": 3, "dyn_stoch": 2, "dyn_discrete": 2})
    return models.ReplayContext(config)


def chunk_files(folder):
    return sorted(p for p in pathlib.Path(folder).glob("*.npz") if storage.parse_episode_file(p)[1] is not None)


def whole_files(folder):
    return sorted(p for p in pathlib.Path(folder).glob("*.npz") if storage.parse_episode_file(p)[1] is None)


def test_chunks_fill_while_the_episode_runs_hold_final_latents_and_give_way_to_the_whole_episode(tmp_path):
    replay = storage.Replay(1000, 1)
    finished = []
    collector = parallel.Collector([CountingEnv(10)], replay, tmp_path, finished.append, context=context(),
                                  chunk_size=3)
    collector.step(latent_policy)  # reset (x = 0) and step 1
    collector.step(latent_policy)  # x = 2: three steps before the newest, but step 2's latent is not final
    assert chunk_files(tmp_path) == []
    collector.step(latent_policy)  # x = 3 recorded: steps 0..2 are final
    assert [p.name.split("-", 2)[2] for p in chunk_files(tmp_path)] == ["c00000000-3.npz"]
    for _ in range(4):
        collector.step(latent_policy)  # up to x = 7: the second chunk (3..5) was written at x = 6
    assert len(chunk_files(tmp_path)) == 2  # steps 0..5; 6 and 7 wait (the newest, 7, has no latent yet)
    # What a kill -9 now leaves: the steps of the full chunks, as one partial episode, with their latents.
    spec = {"x": ((), np.dtype(np.float32)), "is_first": ((), np.dtype(bool)), "is_last": ((), np.dtype(bool)),
            "is_terminal": ((), np.dtype(bool)), "action": ((1,), np.dtype(np.float32)),
            "reward": ((), np.dtype(np.float32)), "task": ((), np.dtype(np.int32)), **context().spec}
    (partial,) = storage.load_episodes(tmp_path, spec=spec)
    np.testing.assert_array_equal(partial["x"], np.arange(6))
    np.testing.assert_array_equal(partial["latent_deter"][:, 0], np.arange(6) + 0.5)  # none left at zero
    assert storage.stored_steps(tmp_path) == 5  # the first step has no action: as in a whole episode
    for _ in range(3):
        collector.step(latent_policy)  # x = 10 ends it
    assert len(finished) == 1 and chunk_files(tmp_path) == []
    (whole,) = whole_files(tmp_path)
    assert whole.name.endswith("-11.npz") and storage.stored_steps(tmp_path) == 10
    (loaded,) = storage.load_episodes(tmp_path, spec=spec)
    for key, value in finished[0].items():
        np.testing.assert_array_equal(loaded[key], value)
    # The replay the run trains on held the same steps all along (nothing added twice).
    stream = replay.streams[0]
    np.testing.assert_array_equal(stream.data["x"][:len(stream)], np.arange(11))


def test_chunk_size_zero_writes_whole_episodes_only(tmp_path):
    finished = []
    collector = parallel.Collector([CountingEnv(7)], None, tmp_path, finished.append, chunk_size=0)
    for _ in range(7):
        collector.step(latent_policy)
    assert chunk_files(tmp_path) == [] and len(whole_files(tmp_path)) == 1 and len(finished) == 1


def episode(start, length, first=True):
    x = np.arange(start, start + length, dtype=np.float32)
    return {"x": x, "reward": np.ones(length, np.float32), "is_first": (np.arange(length) == 0) & first}


def write_chunks(folder, length, size):
    """The chunks an EpisodeWriter leaves of an episode of `length` steps so far."""
    writer = storage.EpisodeWriter(folder, size)
    steps = [{k: v[i] for k, v in episode(0, length).items()} for i in range(length)]
    for t in range(1, length + 1):
        writer.add(steps[:t])
    return writer, steps


def test_a_kill_between_the_whole_episode_and_removing_its_chunks_counts_each_step_once(tmp_path):
    writer, steps = write_chunks(tmp_path, 10, 4)  # chunks of steps 0..3 and 4..7
    chunks = chunk_files(tmp_path)
    kept = {p: p.read_bytes() for p in chunks}
    writer.finish({k: np.stack([s[k] for s in steps]) for k in steps[0]})
    for path, data in kept.items():  # as if killed after the whole file was written, before the unlinks
        path.write_bytes(data)
    assert storage.stored_steps(tmp_path) == 9
    (loaded,) = storage.load_episodes(tmp_path)
    np.testing.assert_array_equal(loaded["x"], np.arange(10))


def test_old_episode_files_load_beside_chunks_and_a_missing_chunk_ends_the_partial_episode(tmp_path, capsys):
    old = tmp_path / "20200101T000000000000-0123abcd-5.npz"  # the name every earlier version wrote
    np.savez_compressed(old, **episode(100, 5))
    write_chunks(tmp_path, 13, 4)  # chunks 0, 1, 2 (12 steps)
    assert storage.stored_steps(tmp_path) == 4 + 3 + 4 + 4
    loaded = storage.load_episodes(tmp_path)
    assert [len(e["x"]) for e in loaded] == [5, 12]  # oldest first
    chunk_files(tmp_path)[1].unlink()  # a chunk lost: steps 8.. no longer follow step 3
    loaded = storage.load_episodes(tmp_path)
    np.testing.assert_array_equal(loaded[1]["x"], np.arange(4))
    assert storage.load_episodes(tmp_path, limit=3) == []  # the newest episode alone is over the limit
    (newest,) = storage.load_episodes(tmp_path, limit=8)
    np.testing.assert_array_equal(newest["x"], np.arange(4))
    assert capsys.readouterr().err == ""


@pytest.fixture
def handlers():
    """The SIGTERM and SIGINT handlers before the test, put back after it as dreamer.main does once a run has
    closed (a stop leaves launch.Stops' handler in place)."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield before
    signal.signal(signal.SIGTERM, before[0])
    signal.signal(signal.SIGINT, before[1])


class Term(Exception):
    pass


class Int(Exception):
    pass


def test_stops_note_a_signal_take_repeats_as_one_and_a_later_second_stops_at_once(handlers):
    before = handlers
    # A window wide enough that a loaded machine's stall between the two kills stays inside it.
    stops = launch.Stops({signal.SIGTERM: Term, signal.SIGINT: Int}, repeat_after=2.0)
    with stops:
        os.kill(os.getpid(), signal.SIGINT)
        assert stops.code == 1
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's forwarded copy, milliseconds later
        assert stops.code == 2  # SIGTERM wins: the run ends as a SIGTERM would
        time.sleep(2.1)
        with pytest.raises(Int):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs in this thread as soon as the signal arrives
    # The stop under way keeps its handler while the run closes (dreamer.main puts the first ones back):
    # a copy of a burst that lands in an environment's close is still the same request.
    assert signal.getsignal(signal.SIGTERM) == stops.handle and signal.getsignal(signal.SIGINT) == stops.handle
    signal.signal(signal.SIGTERM, before[0])
    signal.signal(signal.SIGINT, before[1])
    with launch.Stops({signal.SIGTERM: Term, signal.SIGINT: Int}) as quiet:  # no signal: the handlers come back
        assert signal.getsignal(signal.SIGTERM) == quiet.handle
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert isinstance(stops.exception(2), Term) and isinstance(stops.exception(1), Int)
    with launch.Stops({signal.SIGTERM: Term, signal.SIGINT: Int}, enabled=False):  # a single process: untouched
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_burst_of_signals_is_one_request_that_no_cleanup_can_swallow(handlers):
    """a682c18's single process raised from the handler wherever the main thread was: two SIGTERMs
    0.05 s apart landed in a video writer's cleanup, Python discarded the exception ("Exception
    ignored in ...") and the run went on to its end. Now the handler only notes the request."""
    class Cleanup:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside a finaliser

    stops = launch.Stops({signal.SIGTERM: Term, signal.SIGINT: Int}, deadline=None)
    with stops:
        for _ in range(5):
            os.kill(os.getpid(), signal.SIGTERM)
            Cleanup()  # collected at once: its signal arrives while Python ignores exceptions
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        assert stops.code == 2  # one request, kept: SIGTERM wins


def test_a_loop_that_misses_its_safe_point_is_stopped_at_the_deadline_again_until_it_stops(handlers):
    stops = launch.Stops({signal.SIGTERM: Term, signal.SIGINT: Int}, deadline=0.2)
    raised, start = 0, time.monotonic()
    with stops:
        os.kill(os.getpid(), signal.SIGTERM)
        while raised < 2 and time.monotonic() - start < 10:
            try:
                time.sleep(0.05)  # a long evaluation that never reaches the loop's safe point
            except Term:
                raised += 1  # the first is swallowed, as a cleanup would: it comes back
    assert raised == 2 and stops.code == 2


def test_a_single_process_acts_on_its_stop_at_any_safe_point_without_a_settle():
    stops = launch.Stops({}, enabled=False)
    agreement = launch.Agreement(launch.SingleProcess(), tools.Clock(10), stops)
    stops.code = 2  # noted by the handler; no update (and so no settle) since
    assert agreement.stop_code == 2


class Ranks(launch.SingleProcess):
    """A stand-in for the other ranks: each collective takes the maximum with their `values`."""

    def __init__(self, others):
        self.others, self.calls = others, 0

    def max_each(self, values):
        self.calls += 1
        return [max(a, b) for a, b in zip(values, self.others)]


def test_agreement_settles_readiness_save_and_stop_in_one_collective():
    now = [0.0]
    ranks = Ranks([0.0, 0.0, 0.0])
    agreement = launch.Agreement(ranks, tools.Clock(10, now=lambda: now[0]), launch.Stops({}, enabled=False))
    assert agreement.settle(True) and not agreement.save_due and not agreement.stop_code
    now[0] = 10.0  # this rank's clock
    assert agreement.settle(True) and agreement.save_due
    agreement.saved()
    assert not agreement.save_due and not agreement.settle(False)  # one rank not ready: no rank updates
    ranks.others = [0.0, 1.0, 2.0]  # another rank's clock is due and it got a SIGTERM
    assert agreement.settle(True) and agreement.save_due and agreement.stop_code == 2
    ranks.others = [0.0, 0.0, 0.0]
    agreement.settle(True)
    assert agreement.stop_code == 2  # kept until acted on
    assert ranks.calls == 5  # one collective per settle


def failing_fsync(match, code=errno.ENOSPC):
    """os.fsync that fails as a full disk would for files whose path contains `match`."""
    fsync = os.fsync

    def fake(fd):
        if match(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(code, os.strerror(code))
        return fsync(fd)

    return fake


def test_a_failed_write_names_the_file_leaves_it_untouched_and_no_temporary_behind(tmp_path, monkeypatch):
    path = tmp_path / "latest.pt"
    storage.save_checkpoint(path, {"step": 1})
    monkeypatch.setattr(os, "fsync", failing_fsync(lambda name: True))
    with pytest.raises(storage.WriteError) as error:
        storage.save_checkpoint(path, {"step": 2})
    assert str(error.value) == f"cannot write {path}: No space left on device (errno 28)"
    assert error.value.hint == "free space and rerun to resume"
    with pytest.raises(storage.WriteError, match=r"episodes/.*-5\.npz: No space left"):
        storage.save_episode(tmp_path / "episodes", episode(0, 5))
    monkeypatch.undo()
    assert storage.load_checkpoint(path)["step"] == 1 and not storage.previous_path(path).exists()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["latest.pt"]
    readonly = storage.WriteError(path, OSError(errno.EROFS, os.strerror(errno.EROFS)))
    assert readonly.hint == ("the file system is read-only: remount it writable or use another --logdir and rerun "
                             "to resume")
    denied = storage.WriteError(path, OSError(errno.EACCES, os.strerror(errno.EACCES)))
    assert denied.hint == "make it writable and rerun to resume"


@pytest.mark.parametrize("args, message", [
    (["--save_every", "-1"], "Invalid value '-1' for --save_every; valid: a number >= 0"),
    (["--chunk_size", "1.5"], "Invalid value '1.5' for --chunk_size; valid: a whole number >= 0"),
    (["--chunk_size", "-4"], "Invalid value '-4' for --chunk_size"),
])
def test_bad_save_every_and_chunk_size_are_one_line(tmp_path, capsys, args, message):
    code, out, err = main(capsys, *SHORT, "--logdir", str(tmp_path / "run"), *args)
    assert code == 2 and out == "" and err.strip().splitlines() == [err.strip()] and message in err, err
    assert not (tmp_path / "run").exists()


def test_defaults_save_every_900_seconds_in_chunks_of_1024_steps():
    config = cfg.parse([], presets=copy.deepcopy(PRESETS))
    assert (config.save_every, config.chunk_size) == (900, 1024)
    minecraft = cfg.parse(["--configs", "minecraft"], presets=copy.deepcopy(PRESETS))
    assert minecraft.eval_episode_num == 0 and minecraft.save_every == 900  # saves without evaluating


# -- runs: the clock without evaluation, then kill -9 ---------------------------------------------------


def test_a_run_without_evaluation_checkpoints_on_the_clock_and_resumes_after_kill_9(tmp_path, capsys):
    logdir = tmp_path / "run"
    command = [sys.executable, str(ROOT / "dreamer.py"), *SHORT, "--save_every", "0.5", "--steps", "100000",
               "--logdir", str(logdir)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (logdir / "previous.pt").exists():  # the second save on the clock
            time.sleep(0.1)
        assert (logdir / "previous.pt").exists(), process.stderr.read() if process.poll() is not None else ""
    finally:
        process.kill()  # kill -9
        process.wait()
    state, _, _ = storage.load_checkpoint_or_previous(logdir / "latest.pt")
    assert state["counters"]["policy_steps"] > 0 and not (logdir / "eval_eps").exists()
    frame = resumed_frame(logdir)
    assert frame >= 2 * state["counters"]["policy_steps"]
    code, out, err = main(capsys, *SHORT, "--save_every", "0", "--logdir", str(logdir), "--steps", str(frame + 20))
    assert code == 0, err
    assert f"resumed from frame {frame}" in out
    assert storage.load_checkpoint(logdir / "latest.pt")["counters"]["policy_steps"] * 2 == frame + 20


# -- runs: kill -9 mid-episode keeps every full chunk -----------------------------------------------------

# dreamer.main with a kill -9 of its own process right after the 350th step of the second episode
# (351 steps with the first): chunks of steps 0..99, 100..199, 200..299 are on disk, 51 steps are not.
KILLED_MID_EPISODE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import storage

add = storage.EpisodeWriter.add

def add_then_die(self, steps):
    path = add(self, steps)
    if len(steps) == 351 and any(storage.parse_episode_file(p)[1] is None for p in self.directory.glob("*.npz")):
        os.kill(os.getpid(), signal.SIGKILL)
    return path

storage.EpisodeWriter.add = add_then_die
import dreamer
dreamer.main()
"""


def test_kill_9_mid_episode_keeps_every_full_chunk_and_the_rerun_replays_each_step_once(tmp_path):
    logdir = tmp_path / "run"
    script = tmp_path / "killed.py"
    script.write_text(KILLED_MID_EPISODE.format(root=str(ROOT)))
    # 500-step episodes (1000 frames at action repeat 2) in chunks of 100, with the policy's latents stored.
    flags = [*PROPRIO, "--time_limit", "1000", "--chunk_size", "100", "--replay_context", "1", "--train_ratio", "8",
             "--save_every", "0", "--logdir", str(logdir)]
    result = subprocess.run([sys.executable, str(script), *flags, "--steps", "100000"], capture_output=True,
                            text=True, env=environment(), timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    traindir = logdir / "train_eps"
    (whole,) = whole_files(traindir)
    chunks = chunk_files(traindir)
    assert whole.name.endswith("-501.npz")  # the first episode, its chunks removed
    assert [p.name.split("-", 2)[2] for p in chunks] == ["c00000000-100.npz", "c00000001-100.npz",
                                                         "c00000002-100.npz"]
    assert storage.stored_steps(traindir) == 500 + 299
    for path in chunks:
        with np.load(path) as chunk:
            assert len(chunk["reward"]) == 100 and not chunk["is_last"].any()
            assert chunk["is_first"][0] == (path == chunks[0]) and chunk["is_first"].sum() <= 1
            assert (np.abs(chunk["latent_deter"]).sum(-1) > 0).all()  # every step's latent was final when written

    config = cfg.parse([*flags, "--steps", "2000"], presets=copy.deepcopy(PRESETS))
    env_list = parallel.make_envs(config, "train", 1)
    try:
        agent = dreamer.Dreamer(env_list[0].obs_space, env_list[0].act_space, config)
        trainer = dreamer.Trainer(config, agent, logdir, env_list, [])
        assert "Episodes: 799 replay steps loaded, 0 files skipped" in trainer.notes
        assert not trainer.resumed and trainer.frames == 2 * 799  # no checkpoint: the stored frames count
        stream = trainer.replay.streams[0]
        steps = np.concatenate([stream.data["position"][:len(stream)], stream.data["velocity"][:len(stream)]], 1)
        assert len(stream) == 501 + 300 and len(np.unique(steps, axis=0)) == len(stream)  # no step twice
        assert stream.data["is_first"][:len(stream)].nonzero()[0].tolist() == [0, 501]
    finally:
        env_list[0].close()


# -- runs: torchrun, SIGTERM to the whole group --------------------------------------------------------------


def torchrun_command(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(ROOT / "dreamer.py"), *map(str, args)]


def test_sigterm_to_a_torchrun_group_saves_once_ends_every_rank_and_resumes(tmp_path):
    logdir = tmp_path / "run"
    flags = [*PROPRIO, "--save_every", "0", "--logdir", logdir]  # no save but the stop's
    process = subprocess.Popen(torchrun_command(*flags, "--steps", "100000"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environment(), cwd=ROOT,
                               start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (logdir / "metrics.jsonl").exists() and process.poll() is None:
            time.sleep(0.2)  # the first log: both ranks are in the training loop
        assert process.poll() is None, process.communicate()[1][-3000:]
        os.killpg(process.pid, signal.SIGTERM)  # as a scheduler does: torchrun and every rank
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert err.count("Stopped by SIGTERM; rerun the same command to resume.") == 2, err[-3000:]  # both ranks
    assert "Not saved" not in err and "dreamer.py\", line" not in err  # (torchrun prints a traceback of its own)
    assert not (logdir / "previous.pt").exists()  # one save: the stop's
    state = storage.load_checkpoint(logdir / "latest.pt")
    assert state["world_size"] == 2 and state["counters"]["policy_steps"] > 0
    frame = 2 * state["counters"]["policy_steps"]
    # Each rank's stored steps at the save: those on disk and those its running episodes' files will hold
    # (Collection.stored_steps); the resume below counts no step twice (it resumes at the saved frame).
    assert storage.stored_steps(logdir / "train_eps") <= state["counters"]["stored_steps"]
    assert storage.stored_steps(logdir / "train_eps" / "rank1") <= state["ranks"][0]["stored_steps"]
    result = subprocess.run(torchrun_command(*flags, "--steps", frame + 40), capture_output=True, text=True,
                            env=environment(), cwd=ROOT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"resumed from frame {frame}") == 1
    assert storage.load_checkpoint(logdir / "latest.pt")["counters"]["policy_steps"] * 2 == frame + 40


# -- runs: a full disk or read-only logdir at each of the three writes ------------------------------------------


def is_episode(name):
    return "train_eps" in name and ".npz." in name and "-c0" not in name


# (what fails, its match on the temporary file's path, extra flags, the file the line names, errno)
WRITES = {
    "episode": (is_episode, [], r"train_eps/[0-9T]+-[0-9a-f]{8}-21\.npz", errno.ENOSPC),
    "chunk": (lambda name: "-c0" in name, ["--chunk_size", "5"], r"train_eps/[0-9T]+-[0-9a-f]{8}-c00000000-5\.npz",
              errno.ENOSPC),
    "checkpoint": (lambda name: ".latest.pt." in name, [], r"latest\.pt", errno.ENOSPC),
    "read-only episode": (is_episode, [], r"train_eps/.*-21\.npz", errno.EROFS),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_that_fails_stops_with_one_line_keeps_the_checkpoint_and_the_rerun_resumes(
        run_copy, capsys, monkeypatch, write):
    import re

    match, flags, named, code = WRITES[write]
    before = (run_copy / "latest.pt").read_bytes()
    monkeypatch.setattr(os, "fsync", failing_fsync(match, code))
    status, _, err = main(capsys, *SHORT, *flags, "--save_every", "0", "--logdir", str(run_copy), "--steps", "80")
    monkeypatch.undo()
    assert status == 1
    lines = err.strip().splitlines()
    hint = {errno.ENOSPC: "free space",
            errno.EROFS: "the file system is read-only: remount it writable or use another --logdir"}[code]
    pattern = (rf"error: cannot write {re.escape(str(run_copy))}/{named}: {os.strerror(code)} \(errno {code}\); "
               rf"latest\.pt keeps frame 40; {re.escape(hint)} and rerun to resume")
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), err
    assert (run_copy / "latest.pt").read_bytes() == before and not (run_copy / "previous.pt").exists()
    assert not list(run_copy.rglob("*.tmp"))  # the space a failed write took is given back
    frame = resumed_frame(run_copy)
    status, out, err = main(capsys, *SHORT, *flags, "--logdir", str(run_copy), "--steps", "80")
    assert status == 0 and f"resumed from frame {frame}" in out, err


@pytest.mark.slow  # two in-process training runs
def test_a_stop_in_the_prefill_saves_and_the_rerun_finishes_the_prefill_and_pretrains(tmp_path, capsys, monkeypatch):
    logdir, calls = tmp_path / "run", []
    collect = dreamer.Trainer.collect

    def interrupted(self, policy):  # the fifth step of the 30-step prefill is interrupted
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return collect(self, policy)

    monkeypatch.setattr(dreamer.Trainer, "collect", interrupted)
    flags = [*SHORT, "--prefill", "60", "--pretrain", "2", "--steps", "80", "--logdir", str(logdir)]
    code, _, err = main(capsys, *flags)
    assert code == 130, err
    counters = storage.load_checkpoint(logdir / "latest.pt")["counters"]
    assert (counters["policy_steps"], counters["updates"]) == (4, 0)
    monkeypatch.undo()
    code, out, err = main(capsys, *flags)
    assert code == 0 and "resumed from frame 8" in out, err
    assert "prefill: done, 60 frames" in out and "pretrain: done, 2 updates" in out
