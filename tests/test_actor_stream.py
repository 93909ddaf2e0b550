"""The asynchronous actor on a CUDA stream of its own (launch.SideStream, used by
collection.Collection.actor_policy and sync), checked on the CPU with torch.cuda's streams stood in
for: its policy runs on its stream, a weight copy waits for the stream's queued work and the stream's
later work for the copy; on a CPU nothing changes."""

import threading
import types

import torch

import collection
import launch


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name, self.device = log, name, torch.device("cuda", 0)

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


def stand_in(monkeypatch):
    log, current = [], []
    default = FakeStream(log, "default")

    class Context:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream)
            log.append(f"enter {self.stream.name}")

        def __exit__(self, *exc):
            current.pop()
            log.append(f"exit {self.stream.name}")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream(log, "side"))
    monkeypatch.setattr(torch.cuda, "stream", Context)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1] if current else default)
    return log, current


def test_the_actors_policy_runs_on_its_own_stream_and_weight_copies_are_ordered_with_it(monkeypatch):
    log, current = stand_in(monkeypatch)
    seen = []
    run = types.SimpleNamespace(
        actor_stream=launch.SideStream("cuda"), thread=types.SimpleNamespace(frames=0, policy_lock=threading.Lock()),
        mode=lambda frames: "train",
        actor=types.SimpleNamespace(
            policy=lambda obs, state, mode: seen.append(torch.cuda.current_stream().name) or ("action", state),
            load_state_dict=lambda state: log.append("copy weights")))
    assert collection.Collection.actor_policy(run, {}, None) == ("action", None)
    assert seen == ["side"] and log == ["enter side", "exit side"]
    log.clear()
    collection.Collection.sync(run, types.SimpleNamespace(state_dict=lambda: {}), 3)
    assert log == ["default waits for side", "copy weights", "side waits for default"]
    assert run.synced == 3


def test_on_a_cpu_the_side_stream_does_nothing():
    side = launch.SideStream("cpu")
    assert side.stream is None
    with side(), side.handover():
        pass
