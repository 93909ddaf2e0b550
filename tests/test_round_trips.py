"""Host round trips in the training step, counted on the CPU: the calls that on CUDA make the host wait
for the device (a value read back: .item, .cpu, .numpy, bool, float, tolist; a tensor made from host
data, a synchronous host-to-device copy from pageable memory). Per update of recipe2024 (replay context
1, its write-back included) and per environment step (observations in, action and latents out), with
the replay in host memory and on the device (--replay_device True; the CPU stands in for the GPU).

The compiled update's steady state is counted with a stand-in: compiled, the update's regions run as
graphs with no Python in them, and tests/test_whole_update.py checks that a compiled update reads
nothing back (test_no_value_is_read_back_to_the_host_inside_an_update, slow: it compiles); here the
update itself is not counted and everything the learner does around it is (sampling, the batch's
move, the write-back), which must then add nothing.
"""

import contextlib

import numpy as np
import pytest
import torch

import config as cfg
import dreamer
import parallel
import storage

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# Tensor.numpy() is not among them: it works on host memory only, so on CUDA the copy before it (.cpu())
# is the round trip, and counting both would count one copy twice. Nor torch.from_numpy: it copies
# nothing (a copy from it to the device is what waits, and that goes through torch.as_tensor or .to).
READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__")
MADE = ("tensor", "as_tensor")  # a tensor from host data on the device: on CUDA a copy the host waits for


class RoundTrips:
    """Counts READS on tensors and MADE on host data (numpy arrays, Python numbers and lists) while `on`,
    and storage.to_device's copies as "staged" (on CUDA one copy from pinned memory that does not make
    the host wait: test_a_staged_copy_is_one_copy_from_pinned_memory_that_does_not_wait)."""

    def __init__(self, monkeypatch):
        self.calls, self.on = [], False
        to_device = storage.to_device

        def staged(arrays, device):
            if self.on:
                self.calls.append("staged")
            return to_device(arrays, device)

        monkeypatch.setattr(storage, "to_device", staged)
        for name in READS:
            original = getattr(torch.Tensor, name)

            def read(tensor, *args, _name=name, _original=original, **kwargs):
                if self.on:
                    self.calls.append(_name)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, read)
        for name in MADE:
            original = getattr(torch, name)

            def made(data, *args, _name=name, _original=original, **kwargs):
                if self.on and not isinstance(data, torch.Tensor):
                    self.calls.append(_name)
                return _original(data, *args, **kwargs)

            monkeypatch.setattr(torch, name, made)

    @contextlib.contextmanager
    def counting(self):
        self.calls.clear()
        self.on = True
        try:
            yield self.calls
        finally:
            self.on = False

    @contextlib.contextmanager
    def paused(self):
        on, self.on = self.on, False
        try:
            yield
        finally:
            self.on = on


def make(replay_device, tmp_path):
    config = cfg.parse(["--configs", "debug", "recipe2024", "--device", "cpu", "--envs", "3", "--batch_size", "3",
                        "--batch_length", "6", "--imag_horizon", "3", "--replay_device", str(replay_device),
                        "--compile", "False", "--logdir", str(tmp_path)])
    train_envs = parallel.make_envs(config, "train", config.envs)
    torch.manual_seed(0)
    agent = dreamer.Dreamer(train_envs[0].obs_space, train_envs[0].act_space, config)
    replay = storage.Replay(1000, config.envs, seed=0, device=config.device if replay_device else None)
    collector = parallel.Collector(train_envs, replay, tmp_path / "train_eps", lambda episode: None,
                                   config.action_repeat, agent.context)
    feed = storage.Prefetcher(replay, config.batch_size, config.batch_length + agent.context.steps, config.device)
    return config, agent, replay, collector, feed


def update(agent, feed, pause=None):
    """One update as dreamer.Trainer.update makes it: the batch, the update, the write-back. On CUDA the
    batch comes from the Prefetcher's pinned memory, copied without waiting (tests/test_prefetch.py);
    here the host batch is made tensors uncounted, as that copy would."""
    batch, ids, data = feed.next()
    if data is None:
        with pause():
            data = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}
    with pause() if pause is not None and agent.compiled_stand_in else contextlib.nullcontext():
        _, latents = agent.update.train_step(batch, data)
    agent.context.write_back(feed, ids, latents)


@pytest.mark.parametrize("replay_device", [False, True])
def test_round_trips_per_update_and_per_environment_step(replay_device, tmp_path, monkeypatch):
    config, agent, replay, collector, feed = make(replay_device, tmp_path)
    policy = lambda obs, state: agent.policy(obs, state, "train")  # noqa: E731
    for _ in range(12):  # the replay holds sequences of K + T steps
        collector.step(policy)
    trips = RoundTrips(monkeypatch)
    agent.compiled_stand_in = False
    update(agent, feed, trips.paused)  # the first update: optimizer state made, nothing pending yet
    update(agent, feed, trips.paused)
    with trips.counting() as calls:
        collector.step(policy)
    step_calls = list(calls)
    with trips.counting() as calls:
        update(agent, feed, trips.paused)
    eager_calls = list(calls)
    agent.compiled_stand_in = True
    with trips.counting() as calls:
        update(agent, feed, trips.paused)
    compiled_calls = list(calls)
    # An environment step: the observations in, one staged copy (a replay on the device stages the
    # new steps and their latents for the next batch's copy); the action and latents back, one read.
    waits = lambda calls: [call for call in calls if call != "staged"]  # noqa: E731
    assert step_calls.count("staged") == 1 and len(waits(step_calls)) <= 1, step_calls
    assert len(step_calls) <= 2, step_calls
    # An update: nothing waits; a replay on the device moves its staged steps and the batch's indices
    # in one staged copy.
    assert waits(eager_calls) == [] and eager_calls.count("staged") == (1 if replay_device else 0), eager_calls
    assert waits(compiled_calls) == [], compiled_calls



def test_a_staged_copy_is_one_copy_from_pinned_memory_that_does_not_wait(monkeypatch):
    """storage.to_device on CUDA, stood in for on the CPU: the arrays (every dtype, with their shapes)
    packed into one pinned buffer and copied once with non_blocking=True; the tensors it gives back
    hold the arrays' values."""
    pinned, copies = [], []
    zeros, to = torch.zeros, torch.Tensor.to

    def fake_zeros(*args, pin_memory=False, **kwargs):
        pinned.append(pin_memory)
        return zeros(*args, **kwargs)

    def fake_to(tensor, device, non_blocking=False):
        copies.append((str(device), non_blocking))
        return to(tensor, "cpu")

    monkeypatch.setattr(torch, "zeros", fake_zeros)
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    rng = np.random.default_rng(0)
    arrays = {"image": rng.integers(0, 255, (3, 4, 4, 3), dtype=np.uint8), "flag": np.array([True, False, True]),
              "vector": rng.normal(size=(3, 5)).astype(np.float32), "index": np.arange(7, dtype=np.int64)[::2],
              "empty": np.zeros((0, 2), np.float32)}
    moved = storage.to_device(arrays, "cuda")
    assert pinned == [True] and copies == [("cuda", True)]
    for key, array in arrays.items():
        np.testing.assert_array_equal(moved[key].numpy(), array, err_msg=key)
        assert moved[key].shape == array.shape
