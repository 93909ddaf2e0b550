"""Episode files, the sequence replay buffer and the training schedules (tools.py)."""

import pathlib
import sys
import time
from fractions import Fraction

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import storage  # noqa: E402
import tools  # noqa: E402


def episode(length, start=0, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.integers(0, 256, (length, 4, 4, 3), dtype=np.uint8),
            "action": rng.uniform(-1, 1, (length, 2)).astype(np.float32),
            "reward": np.arange(start, start + length, dtype=np.float32),
            "is_first": np.arange(length) == 0,
            "is_terminal": np.zeros(length, bool)}


def save_in_order(directory, lengths):
    """Save episodes one after another; their rewards count up so each is recognisable."""
    saved, start = [], 0
    for length in lengths:
        saved.append(episode(length, start))
        storage.save_episode(directory, saved[-1])
        start += length
        time.sleep(0.002)  # distinct time stamps in the names
    return saved


def assert_same_episode(a, b):
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key], b[key])


# ---------------------------------------------------------------------------------------------
# Episode files
# ---------------------------------------------------------------------------------------------


def test_save_episode_writes_one_complete_file_and_no_temporaries(tmp_path):
    ep = episode(7)
    filename = storage.save_episode(tmp_path / "eps", ep)
    files = sorted(p.name for p in (tmp_path / "eps").iterdir())
    assert files == [filename.name]
    assert filename.suffix == ".npz" and filename.stem.endswith("-7")
    with np.load(filename) as data:
        assert_same_episode({k: data[k] for k in data.files}, ep)


def test_save_episode_failing_write_leaves_no_visible_episode(tmp_path, monkeypatch):
    directory = tmp_path / "eps"
    save_in_order(directory, [3])

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(storage.os, "replace", broken_replace)
    with pytest.raises(OSError):
        storage.save_episode(directory, episode(5, start=100))
    monkeypatch.undo()
    assert len(list(directory.glob("*.npz"))) == 1
    loaded = storage.load_episodes(directory)
    assert [len(e["reward"]) for e in loaded] == [3]


def test_load_episodes_all_oldest_first(tmp_path):
    saved = save_in_order(tmp_path, [3, 4, 5, 6])
    loaded = storage.load_episodes(tmp_path)
    assert len(loaded) == 4
    for a, b in zip(loaded, saved):
        assert_same_episode(a, b)


@pytest.mark.parametrize("limit, lengths", [(6, [6]), (10, [6]), (11, [5, 6]), (14, [5, 6]), (15, [4, 5, 6]),
                                            (18, [3, 4, 5, 6]), (100, [3, 4, 5, 6]), (5, [])])
def test_load_episodes_respects_step_limit_newest_first(tmp_path, limit, lengths):
    save_in_order(tmp_path, [3, 4, 5, 6])
    loaded = storage.load_episodes(tmp_path, limit=limit)
    assert [len(e["reward"]) for e in loaded] == lengths
    assert sum(len(e["reward"]) for e in loaded) <= limit
    # Oldest first: rewards count up across the returned episodes.
    rewards = np.concatenate([e["reward"] for e in loaded]) if loaded else np.zeros(0)
    np.testing.assert_array_equal(rewards, np.arange(18 - len(rewards), 18))


def test_load_episodes_missing_directory(tmp_path):
    assert storage.load_episodes(tmp_path / "absent") == []


def test_load_episodes_skips_corrupt_files_with_a_warning(tmp_path, capsys):
    save_in_order(tmp_path, [3, 4])
    # Newest by name: garbage bytes, and a real episode file cut in half.
    (tmp_path / "99990101T000000000000-deadbeef-5.npz").write_bytes(b"not an npz file at all")
    good = storage.save_episode(tmp_path / "tmp", episode(8))
    raw = good.read_bytes()
    (tmp_path / "99990101T000000000001-cafecafe-8.npz").write_bytes(raw[:len(raw) // 2])
    loaded = storage.load_episodes(tmp_path)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("warning: skipping episode") for line in lines), lines
    assert all("unreadable" in line for line in lines)
    assert [len(e["reward"]) for e in loaded] == [3, 4]


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------


def step(stream, t):
    """One step whose `id` says where it came from: stream * 100000 + t."""
    return {"id": np.int64(stream * 100000 + t), "obs": np.full((2, 3), t, np.float32),
            "is_first": np.bool_(t % 7 == 0), "reward": np.float32(t)}


def fill(replay, stream, count, offset=0):
    for t in range(offset, offset + count):
        replay.add(step(stream, t), stream)


def test_replay_sample_shapes_and_dtypes():
    replay = storage.Replay(capacity=100, streams=2, seed=0)
    fill(replay, 0, 20)
    fill(replay, 1, 15)
    out = replay.sample(batch=6, length=5)
    assert set(out) == {"id", "obs", "is_first", "reward"}
    assert out["id"].shape == (6, 5) and out["id"].dtype == np.int64
    assert out["obs"].shape == (6, 5, 2, 3) and out["obs"].dtype == np.float32
    assert out["is_first"].shape == (6, 5) and out["is_first"].dtype == np.bool_
    assert out["reward"].shape == (6, 5) and out["reward"].dtype == np.float32


def test_replay_sequences_are_consecutive_steps_of_one_stream():
    replay = storage.Replay(capacity=300, streams=3, seed=1)
    for stream, count in enumerate([40, 25, 60]):
        fill(replay, stream, count)
    out = replay.sample(batch=200, length=8)
    ids = out["id"]
    streams, t = ids // 100000, ids % 100000
    assert (streams == streams[:, :1]).all()
    np.testing.assert_array_equal(np.diff(t, axis=1), 1)
    for row in range(len(ids)):  # every field of a row comes from the same steps
        np.testing.assert_array_equal(out["obs"][row, :, 0, 0], t[row])
        np.testing.assert_array_equal(out["reward"][row], t[row])
        np.testing.assert_array_equal(out["is_first"][row], t[row] % 7 == 0)
    assert set(np.unique(streams)) == {0, 1, 2}


def test_replay_samples_every_valid_start_uniformly():
    replay = storage.Replay(capacity=100, streams=2, seed=2)
    fill(replay, 0, 5)
    fill(replay, 1, 10)
    out = replay.sample(batch=5000, length=3)
    starts = out["id"][:, 0]
    valid = [0, 1, 2] + [100000 + t for t in range(8)]  # 3 + 8 start positions
    values, counts = np.unique(starts, return_counts=True)
    assert sorted(values.tolist()) == valid
    np.testing.assert_allclose(counts / counts.sum(), 1 / 11, atol=0.02)


def test_replay_ring_overwrite_drops_oldest():
    replay = storage.Replay(capacity=10, streams=1, seed=3)
    fill(replay, 0, 25)
    assert len(replay) == 10
    out = replay.sample(batch=4, length=10)
    np.testing.assert_array_equal(out["id"], np.tile(np.arange(15, 25), (4, 1)))
    out = replay.sample(batch=300, length=3)
    assert out["id"].min() >= 15 and out["id"].max() <= 24
    np.testing.assert_array_equal(np.diff(out["id"], axis=1), 1)
    assert set(out["id"][:, 0].tolist()) == set(range(15, 23))


@pytest.mark.parametrize("capacity, count", [(3000, 2500), (1500, 2000), (2048, 2049)])
def test_replay_growth_keeps_every_step(capacity, count):
    replay = storage.Replay(capacity=capacity, streams=1, seed=4)
    fill(replay, 0, count)
    held = min(capacity, count)
    assert len(replay) == held
    out = replay.sample(batch=1, length=held)
    np.testing.assert_array_equal(out["id"][0], np.arange(count - held, count))


def test_replay_capacity_is_split_across_streams():
    replay = storage.Replay(capacity=10, streams=3, seed=5)
    for stream in range(3):
        fill(replay, stream, 10)
    per_stream = int(np.ceil(10 / 3))  # 4
    assert len(replay) == 3 * per_stream
    out = replay.sample(batch=300, length=per_stream)
    np.testing.assert_array_equal(out["id"] % 100000, np.tile(np.arange(6, 10), (300, 1)))
    with pytest.raises(RuntimeError):
        replay.sample(batch=1, length=per_stream + 1)


def test_replay_ready_and_empty():
    replay = storage.Replay(capacity=100, streams=2, seed=6)
    assert not replay.ready(4) and len(replay) == 0
    with pytest.raises(RuntimeError, match="no sequence"):
        replay.sample(batch=2, length=4)
    fill(replay, 0, 3)
    fill(replay, 1, 3)
    assert not replay.ready(4)  # 6 steps in total, but no single stream holds 4 consecutive
    with pytest.raises(RuntimeError):
        replay.sample(batch=2, length=4)
    fill(replay, 1, 1, offset=3)
    assert replay.ready(4)
    assert (replay.sample(batch=5, length=4)["id"] // 100000 == 1).all()


def test_replay_add_episode_keeps_order():
    replay = storage.Replay(capacity=50, streams=2, seed=7)
    ep = episode(12, start=40)
    replay.add_episode(ep, stream=1)
    assert len(replay) == 12 and len(replay.streams[0]) == 0
    out = replay.sample(batch=3, length=12)
    for key in ep:
        np.testing.assert_array_equal(out[key][0], ep[key])


def official_online_queue(counts, length):
    """The official replay's online queue (embodied/core/replay.py, Replay.add with online=True), written
    out: per stream a deque of the newest steps; once it holds `length`, the oldest leaves it and starts an
    item, which is queued when the number of steps added before the current one is a multiple of length."""
    queue, deques, added = [], {}, {}
    for stream, count in counts:
        for _ in range(count):
            window = deques.setdefault(stream, [])
            window.append(added.get(stream, 0))
            if len(window) >= length:
                first = window.pop(0)
                if added.get(stream, 0) % length == 0:
                    queue.append((stream, first))
            added[stream] = added.get(stream, 0) + 1
    return queue


def test_online_replay_trains_each_new_sequence_once_first_as_the_official_queue():
    length = 4
    replay = storage.Replay(capacity=1000, streams=2, seed=8, online=length)
    counts = [(0, 6), (1, 9), (0, 7)]
    for stream, count in counts:
        fill(replay, stream, count, offset=len(replay.streams[stream]))
    queued = official_online_queue(counts, length)
    assert queued == [(0, 1), (1, 1), (1, 5), (0, 5), (0, 9)]
    out = replay.sample(batch=3, length=length)  # the three oldest queued, then nothing uniform
    want = [stream * 100000 + first + np.arange(length) for stream, first in queued[:3]]
    np.testing.assert_array_equal(out["id"], want)
    out, ids = replay.sample(batch=6, length=length, ids=True)  # the last two queued, four uniform rows
    np.testing.assert_array_equal(out["id"][:2], [s * 100000 + f + np.arange(length) for s, f in queued[3:]])
    np.testing.assert_array_equal(ids[:2], queued[3:])
    np.testing.assert_array_equal(np.diff(out["id"][2:], axis=1), 1)
    assert not replay.queue
    # Batches of another length (an evaluation's) leave the queue alone; a queued sequence whose steps were
    # dropped for newer ones is skipped.
    fill(replay, 0, 4, offset=13)
    assert list(replay.queue) == [(0, 13)]
    replay.sample(batch=2, length=length + 1)
    assert list(replay.queue) == [(0, 13)]
    small = storage.Replay(capacity=8, streams=1, seed=9, online=length)
    fill(small, 0, 9)  # queued starts 1 and 5; 8 steps held: 1..8
    fill(small, 0, 4, offset=9)  # start 9 queued; held: 5..12, so start 1 is gone
    out = small.sample(batch=3, length=length)
    np.testing.assert_array_equal(out["id"][:2], [np.arange(5, 9), np.arange(9, 13)])


def test_a_replay_without_the_queue_samples_as_before():
    """online=0 draws the same batches as a replay that never had the queue (the same random calls)."""
    replay = storage.Replay(capacity=100, streams=2, seed=10)
    fill(replay, 0, 30)
    fill(replay, 1, 20)
    rng = np.random.default_rng(10)
    counts = np.array([27.0, 17.0])
    which = rng.choice(2, size=5, p=counts / counts.sum())
    starts = np.zeros(5, np.int64)
    for index in np.unique(which):
        rows = np.nonzero(which == index)[0]
        starts[rows] = rng.integers(0, counts[index], size=len(rows))
    out = replay.sample(batch=5, length=4)
    np.testing.assert_array_equal(out["id"][:, 0], which * 100000 + starts)


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------


def context_steps(count, seed=0):
    """`count` steps of an environment stream with random actions, counting rewards and a latent each."""
    rng = np.random.default_rng(seed)
    return [{"action": rng.uniform(-1, 1, 2).astype(np.float32), "reward": np.float32(t),
             "is_first": np.bool_(t % 10 == 0), "latent_deter": np.full(3, -1.0, np.float32)} for t in range(count)]


def written_back(replay, steps):
    """A replay holding `steps`, its latents then overwritten as an update's write-back would: step t's is t."""
    for step in steps:
        replay.add(step)
    held = len(replay.streams[0])
    first = replay.streams[0].first()
    ids = np.arange(first, first + held, dtype=np.float32)
    replay.update([[0, first]], {"latent_deter": np.repeat(ids[None, :, None], 3, 2)})
    return replay


def latents(replay):
    stream = replay.streams[0]
    phys = stream.indices(np.zeros(1, np.int64), len(stream))[0]
    return stream.data["latent_deter"][phys, 0], stream.data["reward"][phys]


@pytest.mark.parametrize("reloaded, placed", [
    (slice(0, 50), 50),   # the files hold all: a run stopped at an episode's end
    (slice(0, 40), 40),   # an episode still running at the save is not in the files
    (slice(0, 60), 50),   # after a kill -9 the files hold 10 steps stored since the save
    (slice(20, 60), 30),  # the replay had dropped its oldest steps: a later window reloads
])
def test_a_checkpoints_replay_latents_and_queue_go_back_onto_the_reloaded_steps(reloaded, placed):
    """Replay.context_state / load_context_state: the written-back latents land on the steps they were
    computed for, found by action and reward, whatever part of the saved steps the files hold; the files'
    latents stay on steps the checkpoint did not hold; queued sequences keep their steps."""
    steps = context_steps(60)
    saved = written_back(storage.Replay(100, 1, online=8), steps[:50])
    state = saved.context_state(["latent_deter"])
    queued = [first for _, first in saved.queue]
    assert queued == [1, 9, 17, 25, 33, 41]  # the official online queue: a sequence of 8 every 8 steps
    reload = storage.Replay(100, 1, online=8)
    for step in steps[reloaded]:
        reload.add_episode({k: np.asarray(v)[None] for k, v in step.items()})
    assert reload.load_context_state(state) == 0
    latent, reward = latents(reload)
    # Steps the checkpoint held carry their written-back latent (= their reward here), the others the files' -1.
    expected = np.where(reward < 50, reward, -1.0)
    assert np.array_equal(latent, expected) and (latent >= 0).sum() == placed
    # Each queued sequence still starts at the same step, by its reward, if reloaded.
    starts = [float(reward[first - reload.streams[0].first()]) for _, first in reload.queue]
    assert starts == [float(steps[first]["reward"]) for first in queued if reloaded.start <= first < reloaded.stop]


def test_a_checkpoints_replay_state_that_fits_no_reloaded_step_is_counted_not_placed():
    saved = written_back(storage.Replay(100, 1, online=8), context_steps(50))
    state = saved.context_state(["latent_deter"])
    other = storage.Replay(100, 1, online=8)
    for step in context_steps(50, seed=1):  # other actions: another run's episodes
        other.add(step)
    assert other.load_context_state(state) == 1
    assert (latents(other)[0] == -1).all() and not other.queue


def test_every_fires_once_per_interval():
    every = tools.Every(10)
    steps = [0, 3, 9, 10, 11, 19, 20, 35, 39, 40, 41, 100]
    fired = [step for step in steps if every(step)]
    assert fired == [0, 10, 20, 35, 40, 100]
    # Reference: fires whenever `step` reaches the last firing point plus a whole interval.
    every, last, want = tools.Every(7), None, []
    for s in range(0, 200, 3):
        if last is None or s >= last + 7:
            last = s if last is None else last + 7 * ((s - last) // 7)
            want.append(s)
    assert [s for s in range(0, 200, 3) if every(s)] == want


def test_every_with_a_start_point_and_disabled():
    every = tools.Every(5, last=0)
    assert [s for s in range(0, 16) if every(s)] == [5, 10, 15]
    assert not any(tools.Every(0)(s) for s in range(10))
    assert not any(tools.Every(-3)(s) for s in range(10))


@pytest.mark.parametrize("ratio, replayed", [(512, 1024), (32, 200), (3, 7), (100, 7), (1.5, 7), (17, 200),
                                             (0.5, 16)])
def test_ratio_owes_exactly_the_updates_for_the_replay_ratio(ratio, replayed):
    schedule = tools.Ratio(ratio, replayed)
    total = 0
    for steps in range(0, 2000, 5):
        total += schedule(steps)
        # Exact arithmetic: floor(steps * ratio / replayed) updates are owed after `steps` steps.
        assert total == int(Fraction(steps) * Fraction(ratio) / Fraction(replayed)), steps
    assert schedule(steps) == 0  # asking again at the same step count owes nothing more


def test_ratio_never_negative_and_catches_up():
    schedule = tools.Ratio(32, 200)  # one update per 6.25 steps
    assert schedule(0) == 0
    assert schedule(100) == 16
    assert schedule(50) == 0
    assert schedule(1000) == 160 - 16
