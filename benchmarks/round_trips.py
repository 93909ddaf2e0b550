"""Host round trips of the training step, counted on the CPU: per environment step, per eager update and per
update of the compiled stand-in, for the host replay and `--replay_device True`.

    python3 benchmarks/round_trips.py

The counting is tests/test_round_trips.py's (its interceptors on .item/.cpu/.tolist/__bool__/__float__ and on
tensors made from host data; `staged` counts the one pinned, non-blocking copy per step), on its tiny recipe2024
run (3 environments, batch 3 x 6). The test asserts the limits (0 per update, at most 2 per environment step); this
prints what each count is made of. The compiled update itself is stood in for (its graphs read nothing back:
tests/test_whole_update.py); everything around it is counted.
"""

import argparse
import collections
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import pytest  # noqa: E402
import test_round_trips as counting  # noqa: E402


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for replay_device in (False, True):
        patch = pytest.MonkeyPatch()
        try:
            _, agent, _, collector, feed = counting.make(replay_device, pathlib.Path(tempfile.mkdtemp()))
            policy = lambda obs, state, agent=agent: agent.policy(obs, state, "train")  # noqa: E731
            for _ in range(12):  # past the replay's first batch
                collector.step(policy)
            trips = counting.RoundTrips(patch)
            agent.compiled_stand_in = False
            for _ in range(2):  # the steady state: the one-late write-back has one pending
                counting.update(agent, feed, trips.paused)
            with trips.counting() as calls:  # one list for every count: copied before the next
                collector.step(policy)
            step = list(calls)
            with trips.counting() as calls:
                counting.update(agent, feed, trips.paused)
            eager = list(calls)
            agent.compiled_stand_in = True
            with trips.counting() as calls:
                counting.update(agent, feed, trips.paused)
            compiled = list(calls)
        finally:
            patch.undo()
        counts = [f"{name} {len(calls)} {dict(collections.Counter(calls))}"
                  for name, calls in (("env step", step), ("eager update", eager), ("compiled stand-in", compiled))]
        print(f"replay_device={replay_device}: " + "; ".join(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
