"""storage.Prefetcher: batches sampled ahead are the batches plain sampling gives, write-back included;
on CUDA they are sampled into pinned memory and copied without waiting (stand-ins here)."""

import pathlib
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import models  # noqa: E402
import storage  # noqa: E402

K, T, B = 1, 6, 8  # replay context steps, trained steps, batch size


def make_replay(seed=3):
    """Two streams of 20 steps: consecutive batches of 8 x 7 steps share many steps."""
    replay = storage.Replay(100, 2, seed=seed)
    rng = np.random.default_rng(0)
    for t in range(20):
        for stream in range(2):
            replay.add({"x": rng.normal(size=3).astype(np.float32), "is_first": np.bool_(t == 0),
                        "latent_deter": np.zeros(4, np.float32), "latent_stoch": np.zeros((2, 2), np.float32)},
                       stream)
    return replay


def context():
    config = cfg.parse(["--configs", "debug", "--replay_context", str(K), "--dyn_deter", "4", "--dyn_stoch", "2",
                        "--dyn_discrete", "2"])
    return models.ReplayContext(config)


def fake_update(batch, i):
    """What an update returns for the write-back: posteriors that depend on the batch's
    stored latents (as the real ones do, through the start latent) and on the update's index."""
    start = batch["latent_deter"][:, K - 1].sum(-1)  # (B,)
    deter = start[:, None, None] + batch["x"][:, K:, :1] + i + 1  # (B, T, 1) -> (B, T, 4)
    post = {"deter": torch.as_tensor(np.repeat(deter, 4, -1)),
            "stoch": torch.as_tensor(np.repeat(deter[..., None], 2, -1).repeat(2, -2)[..., :2, :])}
    return context().latents(post)


def plain_run(replay, updates):
    out, ctx = [], context()
    for i in range(updates):
        batch, ids = replay.sample(B, K + T, ids=True)
        out.append(({k: v.copy() for k, v in batch.items()}, ids.copy()))
        ctx.write_back(replay, ids, fake_update(batch, i))
    return out


def prefetched_run(feed, updates):
    out, ctx = [], context()
    for i in range(updates):
        batch, ids, data = feed.next(more=i + 1 < updates)
        assert data is None  # on a CPU the learner converts the host arrays itself
        out.append(({k: v.copy() for k, v in batch.items()}, ids.copy()))
        ctx.write_back(feed, ids, fake_update(batch, i))
    return out


def assert_same_runs(a, b):
    assert len(a) == len(b)
    for (batch_a, ids_a), (batch_b, ids_b) in zip(a, b):
        np.testing.assert_array_equal(ids_a, ids_b)
        assert batch_a.keys() == batch_b.keys()
        for key in batch_a:
            np.testing.assert_array_equal(batch_a[key], batch_b[key], err_msg=key)


def assert_same_replays(a, b):
    for stream_a, stream_b in zip(a.streams, b.streams):
        for key in stream_a.data:
            np.testing.assert_array_equal(stream_a.data[key][:len(stream_a)], stream_b.data[key][:len(stream_b)])


def test_prefetched_batches_and_write_back_equal_plain_sampling():
    plain_replay, ahead_replay = make_replay(), make_replay()
    plain = plain_run(plain_replay, 12)
    ahead = prefetched_run(storage.Prefetcher(ahead_replay, B, K + T, "cpu", ahead=True), 12)
    assert_same_runs(plain, ahead)
    assert_same_replays(plain_replay, ahead_replay)  # every write-back went to the steps it was computed for


def test_without_the_overlay_a_batch_sampled_ahead_would_miss_the_write_back():
    """The test above can fail: sampled ahead without patching, later batches hold stale latents."""

    class Stale(storage.Prefetcher):
        def update(self, ids, values):
            if self.pending is not None:
                self.pending[0].join()
            self.replay.update(ids, values)

    plain = plain_run(make_replay(), 12)
    stale = prefetched_run(Stale(make_replay(), B, K + T, "cpu", ahead=True), 12)
    with pytest.raises(AssertionError):
        assert_same_runs(plain, stale)


def test_write_back_reaches_the_ids_of_its_own_batch():
    replay = make_replay()
    feed = storage.Prefetcher(replay, B, K + T, "cpu", ahead=True)
    ctx = context()
    first, first_ids, _ = feed.next(more=True)  # the second batch is sampled meanwhile
    latents = fake_update(first, 0)
    ctx.write_back(feed, first_ids, latents)  # one update late, as the official code: pending until the next
    assert not any(stream.data["latent_deter"][:len(stream)].any() for stream in replay.streams)
    ctx.flush()
    second, second_ids, _ = feed.next()
    for row, (stream, start) in enumerate(first_ids):
        got = replay.streams[stream].data["latent_deter"][start + K:start + K + T]  # no step dropped yet
        np.testing.assert_array_equal(got, latents["latent_deter"][row].numpy())
    assert not np.array_equal(second_ids, first_ids)


def test_overlay_by_hand():
    batch = {"v": np.zeros((2, 4), np.float32)}
    ids = np.array([[0, 10], [1, 3]])  # rows: stream 0 steps 10..13, stream 1 steps 3..6
    written = np.array([[0, 12], [1, 0], [0, 8]])  # stream 0 steps 12..14, stream 1 0..2, stream 0 8..10
    values = {"v": np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.float32)}
    storage.overlay(batch, ids, 4, written, values)
    np.testing.assert_array_equal(batch["v"], [[9, 0, 1, 2], [0, 0, 0, 0]])


def test_an_error_while_sampling_ahead_reaches_the_learner():
    feed = storage.Prefetcher(make_replay(), B, K + T, "cpu", ahead=True)
    feed.next(more=True)
    feed.length = 1000  # the batch sampled next cannot exist; it was already sampled, the one after fails
    feed.next(more=True)
    with pytest.raises(RuntimeError, match="no sequence of length 1000"):
        feed.next()


def test_on_cuda_batches_go_to_pinned_memory_and_are_copied_without_waiting(monkeypatch):
    """Stand-ins for CUDA: record what pinned allocations and copies the Prefetcher asks for."""
    empty, to = torch.empty, torch.Tensor.to
    pinned, copies = [], []

    def recording_empty(*args, pin_memory=False, **kwargs):
        pinned.append(pin_memory)
        return empty(*args, **kwargs)

    def recording_to(self, device, non_blocking=False):
        copies.append((str(device), non_blocking, self.data_ptr()))
        return to(self, "cpu")

    monkeypatch.setattr(torch, "empty", recording_empty)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    plain = make_replay().sample(B, K + T)
    cpu = storage.Prefetcher(make_replay(), B, K + T, "cpu")
    assert cpu.ahead is False
    batch, _, data = cpu.next()
    assert data is None and not pinned and not copies  # nothing pinned, nothing copied on a CPU
    cuda = storage.Prefetcher(make_replay(), B, K + T, "cuda:0")
    assert cuda.ahead is True
    batch, _, data = cuda.next()
    assert pinned == [True] * len(batch)
    assert {(device, non_blocking) for device, non_blocking, _ in copies} == {("cuda:0", True)}
    # Each copy starts from the pinned tensor the batch was sampled into.
    assert sorted(ptr for _, _, ptr in copies) == sorted(v.ctypes.data for v in batch.values())
    assert all(storage.host_tensor(v).data_ptr() == v.ctypes.data for v in batch.values())
    for key in plain:
        np.testing.assert_array_equal(batch[key], plain[key])
        np.testing.assert_array_equal(data[key].numpy(), plain[key])


@pytest.mark.slow  # in-process training runs
def test_a_run_trains_the_same_with_batches_sampled_ahead(tmp_path, monkeypatch):
    """recipe2024 at debug size (replay_context 1, several updates per step): the same weights after
    a short run whether the batches are sampled on demand or ahead on a thread."""
    common = ["--configs", "debug", "recipe2024", "--eval_episode_num", "0", "--time_limit", "20", "--envs", "2",
              "--batch_size", "3", "--batch_length", "6", "--train_ratio", "64", "--steps", "60"]
    dreamer.main([*common, "--logdir", str(tmp_path / "plain")])
    init = storage.Prefetcher.__init__
    monkeypatch.setattr(storage.Prefetcher, "__init__", lambda self, *args, **kwargs: init(self, *args, ahead=True))
    dreamer.main([*common, "--logdir", str(tmp_path / "ahead")])
    plain, ahead = (storage.load_checkpoint(tmp_path / name / "latest.pt") for name in ("plain", "ahead"))
    assert plain["counters"]["updates"] == ahead["counters"]["updates"] > 10
    for (key, a), b in zip(plain["agent"].items(), ahead["agent"].values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=key)
