"""Wall-clock time of a whole short training run, synchronous vs --asynchronous.

For each task, four runs of `dreamer.py` to the same frame budget, at the preset's train ratio with a
small model (so that a run takes minutes on a CPU): `--envs 1` and `--envs 4 --parallel`, each
synchronous and asynchronous. Prints one row per run: wall-clock seconds (the whole process, start-up
included) and of the training loop alone (from the end of the prefill), the async/sync ratios, the
learner's and the environments' busy fractions (time-weighted over the logged intervals), the measured
train ratio, and the measured cost of a policy step and of an update.

    python3 benchmarks/wall_clock.py                  # walker (DMC vision), pong (atari100k), crafter, walker16
    python3 benchmarks/wall_clock.py --tasks walker16 --frames 960 --setups 4p

Runs go to a temporary folder that is removed afterwards. `--extra` adds dreamer.py flags to every run.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

TASKS = {
    "walker": ["--configs", "dmc_vision", "--task", "dmc_walker_walk"],
    "pong": ["--configs", "atari100k", "--task", "atari_pong"],
    "crafter": ["--configs", "crafter", "--task", "crafter_reward"],
    # The minecraft preset's train ratio on the rendered walker: on a CPU, where an update of even the
    # small model costs seconds, the ratio at which environment and learner costs are comparable.
    "walker16": ["--configs", "dmc_vision", "--task", "dmc_walker_walk", "--train_ratio", "16"],
}
FRAMES = {"walker": 60, "pong": 60, "crafter": 30, "walker16": 1920}  # after the prefill: ~15 updates each
# A small model: the same networks at a fraction of the width, so that one update costs about as much
# as a few environment steps on a CPU instead of seconds.
SMALL = ["--dyn_hidden", "32", "--dyn_deter", "32", "--dyn_stoch", "4", "--dyn_discrete", "4", "--units", "32",
         "--encoder.cnn_depth", "4", "--decoder.cnn_depth", "4", "--encoder.mlp_units", "32",
         "--decoder.mlp_units", "32", "--encoder.mlp_layers", "1", "--decoder.mlp_layers", "1",
         "--actor.layers", "1", "--critic.layers", "1", "--reward_head.layers", "1", "--cont_head.layers", "1"]
COMMON = ["--device", "cpu", "--compile", "False", "--eval_episode_num", "0", "--video_pred_log", "False",
          "--pretrain", "1"]
SETUPS = {"1": ["--envs", "1"], "1p": ["--envs", "1", "--parallel"], "4p": ["--envs", "4", "--parallel"]}


def run(task, frames, mode, setup, extra, root, threads=None):
    """One training run of `frames` frames after a prefill that gives every stream one sequence; `threads`
    sets OMP_NUM_THREADS, the learner's torch threads (the async actor thread always uses one)."""
    logdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{task}_{mode}_{setup}_", dir=root))
    envs = int(setup.rstrip("p"))
    flags = [*TASKS[task], *SMALL, *COMMON, *SETUPS[setup], "--log_every", str(max(1, frames // 6)),
             "--asynchronous", str(mode == "async"), *extra]
    config = preset_values(flags)
    prefill = config["batch_length"] * config["action_repeat"] * envs
    command = [sys.executable, str(ROOT / "dreamer.py"), *flags, "--logdir", str(logdir), "--prefill", str(prefill),
               "--steps", str(prefill + frames)]
    start = time.time()
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.time() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}\n{result.stderr[-3000:]}")
    return summarise(logdir, wall, config)


def preset_values(flags):
    sys.path.insert(0, str(ROOT))
    import config as cfg

    config = cfg.parse(flags)
    return {"batch_length": config.batch_length, "batch_size": config.batch_size,
            "action_repeat": config.action_repeat, "train_ratio": config.train_ratio}


def summarise(logdir, wall, config):
    """Time-weighted busy fractions over the logged intervals, and costs per step and per update."""
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "perf/learner_busy" in row]
    seconds, learner, env, steps, updates, last = 0.0, 0.0, 0.0, 0, 0, None
    for row in rows:
        if last is not None:  # the interval's seconds, from its frame or (the learner's last one) update rate
            if row["perf/fps"] > 0:
                interval = (row["step"] - last["step"]) / row["perf/fps"]
            else:
                interval = (row["perf/updates"] - last["perf/updates"]) / max(row["perf/updates_per_s"], 1e-9)
            seconds += interval
            learner += row["perf/learner_busy"] * interval
            env += row["perf/env_busy"] * interval
            steps += (row["step"] - last["step"]) / config["action_repeat"]
            updates += row["perf/updates"] - last["perf/updates"]
        last = row
    replayed = updates * config["batch_size"] * config["batch_length"]
    busy = {"learner_busy": learner / max(seconds, 1e-9), "env_busy": env / max(seconds, 1e-9)}
    return {"wall": wall, "loop": seconds, **busy, "train_ratio": replayed / max(steps, 1),
            "env_s_per_step": env / max(steps, 1), "learner_s_per_update": learner / max(updates, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", default="walker,pong,crafter")
    parser.add_argument("--frames", type=int, nargs="*", default=None,
                        help="frames after the prefill, per task (one value, or one per task); default FRAMES")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--setups", default="1,4p", help=f"from {sorted(SETUPS)}")
    parser.add_argument("--threads", default="",
                        help="comma-separated learner thread counts (OMP_NUM_THREADS) to try per mode; "
                             "default: torch's own")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every row this often, interleaved, and report the median (shared machines)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    frames = args.frames or [FRAMES[t] for t in tasks]
    frames = frames * len(tasks) if len(frames) == 1 else frames
    threads = [int(t) for t in args.threads.split(",") if t] or [None]
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    print("| task | setup | mode | threads | frames | wall s | loop s | loop / best sync | learner busy | env busy "
          "| train ratio | env s/step | learner s/update |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="wall_clock_") as root:
        for task, budget in zip(tasks, frames):
            for setup in args.setups.split(","):
                rows = [(mode, n) for mode in args.modes.split(",") for n in threads]
                outs = {row: [] for row in rows}
                for _ in range(args.repeats):  # interleaved, so that a burst of load hits every row alike
                    for mode, n in rows:
                        outs[mode, n].append(run(task, budget, mode, setup, args.extra, root, n))
                medians = {row: median_run(runs) for row, runs in outs.items()}
                syncs = [out["loop"] for (mode, _), out in medians.items() if mode == "sync"]
                for (mode, n), out in medians.items():
                    ratio = f"{out['loop'] / min(syncs):.2f}" if syncs else ""
                    print(f"| {task} | {setup} | {mode} | {n or 'torch'} | {budget} | {out['wall']:.0f} "
                          f"| {out['loop']:.0f} | {ratio} | {out['learner_busy']:.2f} | {out['env_busy']:.2f} "
                          f"| {out['train_ratio']:.0f} "
                          f"| {out['env_s_per_step']:.4f} | {out['learner_s_per_update']:.3f} |", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}", flush=True)


def median_run(runs):
    """The run with the median loop time (its other figures come with it)."""
    return sorted(runs, key=lambda out: out["loop"])[len(runs) // 2]


if __name__ == "__main__":
    main()
