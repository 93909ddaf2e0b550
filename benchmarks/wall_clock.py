"""Wall-clock time of a whole short training run, synchronous vs --asynchronous.

For each task, four runs of `dreamer.py` to the same frame budget, at the preset's train ratio with a
small model (so that a run takes minutes on a CPU): `--envs 1` and `--envs 4 --parallel`, each
synchronous and asynchronous. Prints one row per run: wall-clock seconds (the whole process, start-up
included), the async/sync ratio, the learner's and the environments' busy fractions (time-weighted over
the logged intervals), the measured train ratio, and from the synchronous `--envs 1` run the measured
cost of a policy step and of an update, which the README's projection uses.

    python3 benchmarks/wall_clock.py                       # walker (DMC vision), pong (atari100k), crafter
    python3 benchmarks/wall_clock.py --tasks walker --frames 4000 --modes sync,async --setups 1,4p

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
}
# A small model: the same networks at a fraction of the width, so that one update costs about as much
# as a few environment steps on a CPU instead of seconds.
SMALL = ["--dyn_hidden", "64", "--dyn_deter", "64", "--dyn_stoch", "8", "--dyn_discrete", "8", "--units", "64",
         "--encoder.cnn_depth", "8", "--decoder.cnn_depth", "8", "--encoder.mlp_units", "64",
         "--decoder.mlp_units", "64", "--encoder.mlp_layers", "1", "--decoder.mlp_layers", "1",
         "--actor.layers", "1", "--critic.layers", "1", "--reward_head.layers", "1", "--cont_head.layers", "1"]
COMMON = ["--device", "cpu", "--compile", "False", "--eval_episode_num", "0", "--video_pred_log", "False",
          "--pretrain", "1"]
SETUPS = {"1": ["--envs", "1"], "4p": ["--envs", "4", "--parallel"]}


def run(task, frames, mode, setup, extra, root):
    logdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{task}_{mode}_{setup}_", dir=root))
    envs = 4 if setup == "4p" else 1
    flags = [*TASKS[task], *SMALL, *COMMON, *SETUPS[setup], "--steps", str(frames),
             "--log_every", str(frames // 8), "--asynchronous", str(mode == "async"), *extra]
    probe = [sys.executable, str(ROOT / "dreamer.py"), *flags, "--logdir", str(logdir)]
    config = preset_values(flags)
    prefill = 2 * config["batch_length"] * config["action_repeat"] * envs  # a full sequence in every stream
    command = [*probe, "--prefill", str(prefill)]
    start = time.time()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.time() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}\n{result.stderr[-3000:]}")
    return summarise(logdir, wall, config)


def preset_values(flags):
    sys.path.insert(0, str(ROOT))
    import dreamer

    config = dreamer.parse(flags)
    return {"batch_length": config.batch_length, "batch_size": config.batch_size,
            "action_repeat": config.action_repeat, "train_ratio": config.train_ratio}


def summarise(logdir, wall, config):
    """Time-weighted busy fractions over the logged intervals, and costs per step and per update."""
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "perf/learner_busy" in row and row.get("perf/fps", 0) > 0]
    seconds, learner, env, steps, updates, last = 0.0, 0.0, 0.0, 0, 0, None
    for row in rows:
        if last is not None:
            interval = (row["step"] - last["step"]) / row["perf/fps"]
            seconds += interval
            learner += row["perf/learner_busy"] * interval
            env += row["perf/env_busy"] * interval
            steps += (row["step"] - last["step"]) / config["action_repeat"]
            updates += row["perf/updates"] - last["perf/updates"]
        last = row
    replayed = updates * config["batch_size"] * config["batch_length"]
    return {"wall": wall, "learner_busy": learner / max(seconds, 1e-9), "env_busy": env / max(seconds, 1e-9),
            "train_ratio": replayed / max(steps, 1), "env_s_per_step": env / max(steps, 1),
            "learner_s_per_update": learner / max(updates, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", default="walker,pong,crafter")
    parser.add_argument("--frames", type=int, nargs="*", default=None,
                        help="frame budget per task (one value, or one per task); default walker 3000, "
                             "pong 2400, crafter 1500")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--setups", default="1,4p")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    defaults = {"walker": 3000, "pong": 2400, "crafter": 1500}
    frames = args.frames or [defaults[t] for t in tasks]
    frames = frames * len(tasks) if len(frames) == 1 else frames
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    print("| task | setup | mode | frames | wall s | async/sync | learner busy | env busy | train ratio "
          "| env s/step | learner s/update |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="wall_clock_") as root:
        for task, budget in zip(tasks, frames):
            for setup in args.setups.split(","):
                walls = {}
                for mode in args.modes.split(","):
                    out = run(task, budget, mode, setup, args.extra, root)
                    walls[mode] = out["wall"]
                    ratio = f"{out['wall'] / walls['sync']:.2f}" if mode != "sync" and "sync" in walls else ""
                    print(f"| {task} | {setup} | {mode} | {budget} | {out['wall']:.0f} | {ratio} "
                          f"| {out['learner_busy']:.2f} | {out['env_busy']:.2f} | {out['train_ratio']:.0f} "
                          f"| {out['env_s_per_step']:.4f} | {out['learner_s_per_update']:.3f} |", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
