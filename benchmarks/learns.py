"""Does it still learn? A tiny agent trained on Steering for about two minutes of one CPU thread.

    python3 benchmarks/learns.py                                     # the project's default recipe (v1)
    python3 benchmarks/learns.py --model_lr 1e-12 --actor.lr 1e-12 --critic.lr 1e-12   # a broken learner
    python3 benchmarks/learns.py --configs recipe2024 steering --model_lr 4e-4 --actor.lr 4e-4 \\
        --critic.lr 4e-4 --warmup 100                                # the 2024 recipe

Runs `dreamer.py --configs steering` (configs.yaml; `--configs` given here replaces that list, so name
`steering` last in it) with every other flag passed on as given, on one torch thread, into `--logdir` (by
default a new folder under the system's temporary one), printing its progress: the evaluation return at
every evaluation is the curve to watch. Then one line, the verdict, and exit status 0 whichever it is:

    learned: eval return 15.5 at frame 1000 against 4.7 for random actions (+10.9) and 3.1 at its
    untrained start (+12.4); learned means more than +4.0 over both          (one line)

The rule: the run LEARNED when its last evaluation's mean return (100 episodes, five passes through the
targets of envs.steering.GOALS) exceeds both the mean return of uniform random actions on the same targets and its
own first evaluation, which the preset places after the prefill and before any update (the untrained
start: the agent at its initial weights), each by more than MARGIN. The first evaluation is checked to
come before any update (metrics.jsonl `perf/updates` 0 there). MARGIN and the runs that set it are in
benchmarks/README.md, learns.py. dreamer.py's own errors keep its exit status; a run this check cannot
judge (another task, no evaluations, an update before the first) is one line and exit 2.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from envs import steering  # noqa: E402

# The least lead, in return over an episode of 20 steps (best attainable about 19.2), that the last
# evaluation must have over random actions and over the untrained start: evidence in benchmarks/README.md.
MARGIN = 4.0
RANDOM_PASSES = 100  # random-action episodes per target of GOALS: the baseline's standard error about 0.05


def random_return(repeat, seed=0):
    """Mean return of uniform random actions in [-1, 1] over RANDOM_PASSES passes through GOALS."""
    rng = np.random.default_rng(seed)
    env = steering.Steering(seed, goals=steering.GOALS, repeat=repeat)
    returns = []
    for _ in range(RANDOM_PASSES * len(steering.GOALS)):
        env.reset()
        done, total = False, 0.0
        while not done:
            _, reward, done, _ = env.step(rng.uniform(-1, 1, 1))
            total += reward
        returns.append(total)
    return float(np.mean(returns))


def evaluations(logdir):
    """(frame, mean eval return, updates done by then) of every evaluation in the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(int(row["step"]), float(row["eval/return"]), int(row.get("perf/updates", 0)))
            for row in rows if "eval/return" in row]


def verdict(final, frame, random, start):
    """The one line: learned or did not learn, with the returns and leads the rule compares."""
    learned = final - random > MARGIN and final - start > MARGIN
    return (f"{'learned' if learned else 'did not learn'}: eval return {final:.1f} at frame {frame} against "
            f"{random:.1f} for random actions ({final - random:+.1f}) and {start:.1f} at its untrained start "
            f"({final - start:+.1f}); learned means more than +{MARGIN:.1f} over both")


def judge(logdir):
    """The verdict line for a finished run in `logdir`; raises ValueError where the run cannot be judged."""
    config = yaml.safe_load((logdir / "config.yaml").read_text())
    if not str(config["task"]).startswith("steering_"):
        raise ValueError(f"Invalid value '{config['task']}' for --task: the check runs on steering_reach only")
    if "jsonl" not in str(config["logger"]):
        raise ValueError(f"Invalid value '{config['logger']}' for --logger: the check reads metrics.jsonl; "
                         "keep jsonl among the loggers")
    evals = evaluations(logdir)
    if len(evals) < 2:
        raise ValueError("the run made fewer than two evaluations; give --eval_episode_num > 0 and --eval_every "
                         "below --steps")
    (_, start, updates), (frame, final, _) = evals[0], evals[-1]
    if updates:
        raise ValueError(f"the first evaluation came after {updates} updates, not at the untrained start; "
                         "give --pretrain 0 (the steering preset's)")
    return verdict(final, frame, random_return(int(config["action_repeat"])), start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [--logdir DIR] [--configs PRESET ...] [dreamer.py flags]")
    parser.add_argument("--logdir", type=pathlib.Path, default=None,
                        help="the run's folder (default: a new one under the system's temporary folder)")
    parser.add_argument("--configs", nargs="+", default=["steering"], help="presets (default: steering)")
    args, rest = parser.parse_known_args(argv)
    logdir = args.logdir or pathlib.Path(tempfile.mkdtemp(prefix="learns-"))
    command = [sys.executable, str(ROOT / "dreamer.py"), "--configs", *args.configs, *rest, "--logdir", str(logdir)]
    print("$ " + " ".join(command), flush=True)
    # One thread: the check's time and its figures are those of one CPU thread.
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    code = subprocess.run(command, env={**os.environ, **threads}, cwd=ROOT).returncode
    if code:
        return code
    try:
        line = judge(logdir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"(logs in {logdir})", flush=True)
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
