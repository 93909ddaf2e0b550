"""Resume on CUDA: the devices' random generators are saved in the checkpoint and restored with the rest
(launch.rng_state / set_rng_state, which storage.Checkpoints saves and restores), checked on the CPU
with torch.cuda stood in for."""

import numpy as np
import torch

import launch


def test_the_checkpoints_random_state_holds_and_restores_the_cuda_generators(monkeypatch):
    """A stand-in for CUDA on the CPU: two devices' generator states, as torch.cuda gives them, go into
    the checkpoint's random state (launch.rng_state, what storage.Checkpoints saves) and come back
    (launch.set_rng_state, what it restores); a run that never used CUDA saves none."""
    replay_rng = np.random.default_rng(0)
    assert launch.rng_state(replay_rng)["cuda"] == []  # this CPU run never initialised CUDA
    devices = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [state.clone() for state in devices])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.extend(states))
    state = launch.rng_state(replay_rng)
    assert [torch.equal(a, b) for a, b in zip(state["cuda"], devices)] == [True, True]
    cpu = torch.get_rng_state()
    launch.set_rng_state(state, replay_rng)
    assert len(restored) == 2 and all(torch.equal(a, b) for a, b in zip(restored, devices))
    assert torch.equal(torch.get_rng_state(), cpu)
