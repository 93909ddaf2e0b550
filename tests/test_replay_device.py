"""replay_device: the training replay's arrays as torch tensors on the device.

On this machine the device is the CPU, which stands in for a GPU: the same code gathers batches and
writes latents back with torch indexing instead of numpy's. benchmarks/gpu_check.sh runs this file
with DREAMER_TEST_DEVICE=cuda.
"""

import os

import numpy as np
import pytest
import torch

import config as cfg
import dreamer
import models
import storage

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = os.environ.get("DREAMER_TEST_DEVICE", "cpu")


def filled(device, steps=300, streams=2, capacity=250):
    """A replay over `streams` streams, one step of each per iteration, with image, vector, flag
    and latent keys; capacity below what is added, so that the ring buffers wrap."""
    replay = storage.Replay(capacity, streams, seed=3, device=device)
    rng = np.random.default_rng(0)
    for t in range(steps):
        for stream in range(streams):
            replay.add({"image": rng.integers(0, 255, (4, 4, 3), dtype=np.uint8),
                        "action": rng.normal(size=2).astype(np.float32), "is_first": np.bool_(t % 37 == 0),
                        "reward": np.float32(t), "latent_deter": rng.normal(size=5).astype(np.float32)}, stream)
    return replay


def as_numpy(batch):
    return {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_a_replay_on_the_device_samples_the_host_replays_batches():
    host, device = filled(None), filled(DEVICE)
    assert host.nbytes == device.nbytes and len(host) == len(device)
    for _ in range(3):
        want, want_ids = host.sample(6, 10, ids=True)
        got, got_ids = device.sample(6, 10, ids=True)
        assert all(isinstance(v, torch.Tensor) and v.device.type == torch.device(DEVICE).type for v in got.values())
        np.testing.assert_array_equal(got_ids, want_ids)
        got = as_numpy(got)
        for key in want:
            assert got[key].dtype == want[key].dtype, key
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_replay_on_the_device_grows_past_its_first_allocation():
    host, device = filled(None, steps=1500, streams=1, capacity=3000), filled(DEVICE, steps=1500, streams=1,
                                                                               capacity=3000)
    assert len(device) == 1500 and device.streams[0].data["image"].shape[0] == 2048  # grown from 1024
    want, got = host.sample(4, 10), as_numpy(device.sample(4, 10))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_the_write_back_reaches_a_replay_on_the_device():
    host, device = filled(None), filled(DEVICE)
    _, ids = host.sample(4, 8, ids=True)
    device.sample(4, 8)  # the same random draws on both
    values = {"latent_deter": np.arange(4 * 8 * 5, dtype=np.float32).reshape(4, 8, 5)}
    host.update(ids, values)
    device.update(ids, {"latent_deter": torch.as_tensor(values["latent_deter"], device=DEVICE)})
    for _ in range(3):
        np.testing.assert_array_equal(as_numpy(device.sample(8, 8))["latent_deter"], host.sample(8, 8)["latent_deter"])


def test_the_replay_context_writes_back_tensors_on_the_device():
    config = cfg.parse(["--configs", "debug", "recipe2024", "--dyn_deter", "5", "--dyn_blocks", "1",
                        "--dyn_discrete", "0", "--dyn_stoch", "3"])
    context = models.ReplayContext(config)
    replay = storage.Replay(100, 1, seed=0, device=DEVICE)
    for t in range(40):
        replay.add({"reward": np.float32(t), **{k: v[0] for k, v in context.entries(None, 1).items()}})
    feed = storage.Prefetcher(replay, 2, 6, DEVICE)
    batch, ids, data = feed.next()
    assert data is batch  # gathered on the device: nothing to copy
    post = {"deter": torch.ones(2, 5, 5, device=DEVICE), "stoch": torch.full((2, 5, 3), 2.0, device=DEVICE)}
    latents = context.latents(post)  # they stay on the device, as the replay's steps do
    assert latents["latent_deter"].device.type == torch.device(DEVICE).type
    context.write_back(feed, ids, latents)
    context.flush()  # written one update late (tests/test_replay_context.py); here at once
    stored = replay.streams[0].data
    for row, (_, first) in enumerate(ids):  # the trained steps (after the one context step) hold the posterior
        steps = torch.arange(first + 1, first + 6)
        assert torch.equal(stored["latent_deter"][steps].cpu(), torch.ones(5, 5)), row
        assert torch.equal(stored["latent_stoch"][steps].cpu(), torch.full((5, 3), 2.0)), row


@pytest.mark.slow  # two in-process training runs
def test_a_debug_run_trains_and_resumes_with_the_replay_on_the_device(tmp_path, capsys):
    logdir = tmp_path / "run"
    # debug's one-frame random prefill: recipe2024's own start would act until one batch (200 steps) is held.
    flags = ["--configs", "debug", "recipe2024", "--device", DEVICE, "--replay_device", "True", "--time_limit", "40",
             "--prefill_policy", "random", "--logdir", str(logdir)]
    dreamer.main([*flags, "--steps", "60"])  # one whole episode of 20 steps stored, one running
    first = torch.load(logdir / "latest.pt", weights_only=False)["counters"]
    assert first["policy_steps"] == 30 and first["updates"] > 0
    capsys.readouterr()
    dreamer.main([*flags, "--steps", "80"])  # resumed: the replay is refilled on the device from the episode files
    out = capsys.readouterr().out
    assert "Run: resumed from frame 60" in out, out
    loaded = int(out.split("Episodes: ")[1].split(" replay steps loaded")[0])
    # Every step the episode files hold, back in the replay on the device (the checkpoint's stored_steps also
    # counts the running episode's steps that its file will hold: Collection.stored_steps).
    assert loaded == storage.stored_steps(logdir / "train_eps") > 0, out
    state = torch.load(logdir / "latest.pt", weights_only=False)["counters"]
    assert state["policy_steps"] == 40 and state["updates"] > first["updates"]  # it went on from the checkpoint
    rows = [line for line in (logdir / "metrics.jsonl").read_text().splitlines() if "world_model/model_loss" in line]
    assert rows, "no update was logged"


def test_the_cost_line_counts_the_replay_against_the_devices_memory():
    config = cfg.parse(["--configs", "debug", "--replay_device", "True", "--dataset_size", "1000"])
    spec = {"image": ((64, 64, 3), np.dtype(np.uint8))}
    lines = storage.cost_lines(config, spec, free=10)
    assert "of CPU memory by the end (300 steps" in lines[0]
    assert "WARNING" in lines[1] and "--replay_device False" in lines[1]
