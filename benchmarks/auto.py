"""Training frames per second of `--envs auto --parallel auto` against hand-picked settings; a benchmark.

    python3 benchmarks/auto.py                          # both tasks, 30 s of training each: ~15 minutes
    python3 benchmarks/auto.py --seconds 20 --tasks proprio
    python3 benchmarks/auto.py --tasks vision --train_ratio 16   # where the environments matter too

For each task, one `dreamer.py` run per setting, one after another, each in a fresh process and logdir
(under /tmp): first `--envs auto --parallel auto`, which measures and also chooses the learner's torch
threads, then `--envs 1/2/4` x `--parallel False/True` with the learner on the same number of threads
(OMP_NUM_THREADS), so that the comparison is of the environments' setting alone (`--default_threads`:
leave the hand-picked runs on torch's default, all cores, as a user would). The tasks:
dmc_walker_walk from 64x64 images (presets `debug dmc_vision`) and from proprioception (`debug
dmc_proprio`), i.e. the debug preset's small model with the vision/proprio presets' train ratio 512 and the
default batch 16 x 64, on the CPU, evaluation off. A run's frames per second are counted over its training
only: from its first log line after the prefill until `--seconds` later (then it is stopped), from the
`perf/fps` of each log interval in metrics.jsonl. The auto run's measurement time is reported apart.
The line per task says whether auto came within 10% of the best hand-picked setting.
"""

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TASKS = {
    "vision": ["--configs", "debug", "dmc_vision", "--task", "dmc_walker_walk", "--size", "64,64"],
    "proprio": ["--configs", "debug", "dmc_proprio", "--task", "dmc_walker_walk"],
}
# Prefill: 65 steps in each of up to 4 streams (x action repeat 2), so that every setting trains from
# its first step at the train ratio instead of owing a burst of updates once replay is ready.
COMMON = ["--batch_size", "16", "--batch_length", "64", "--prefill", "600", "--pretrain", "0",
          "--eval_episode_num", "0", "--video_pred_log", "False", "--steps", "1000000", "--log_every", "8",
          "--time_limit", "1000"]
SETTINGS = [("auto", "auto"), ("1", "False"), ("1", "True"), ("2", "False"), ("2", "True"), ("4", "False"),
            ("4", "True")]


def command(task, envs, parallel, logdir, train_ratio=512):
    return [sys.executable, str(ROOT / "dreamer.py"), *TASKS[task], *COMMON, "--envs", envs, "--parallel", parallel,
            "--logdir", str(logdir), "--train_ratio", str(train_ratio)]


def rows(logdir):
    path = logdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def frames_per_second(log):
    """Frames over seconds across the log intervals after the first (which holds the start-up)."""
    timed = [row for row in log if "perf/fps" in row]
    frames = seconds = 0.0
    for before, row in zip(timed, timed[1:]):
        if row["perf/fps"] > 0:
            frames += row["step"] - before["step"]
            seconds += (row["step"] - before["step"]) / row["perf/fps"]
    return frames / seconds if seconds else float("nan")


def run(task, envs, parallel, seconds, root, threads=None, train_ratio=512):
    """Train until `seconds` after the first log line; returns (frames/s, setting chosen, measure s, intervals)."""
    name = f"{task}_{envs}_{parallel}_{len(list(root.glob('*.out')))}"  # a repeated setting starts afresh
    logdir = root / name
    with open(root / f"{name}.out", "w") as out:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        process = subprocess.Popen(command(task, envs, parallel, logdir, train_ratio), stdout=out,
                                   stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        start = None
        deadline = time.time() + seconds + 600  # start-up (workers, measurement, prefill) must fit in this
        while process.poll() is None and time.time() < deadline:
            time.sleep(1)
            if start is None and rows(logdir):
                start = time.time()
                deadline = start + seconds
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log = rows(logdir)
    shutil.rmtree(logdir / "train_eps", ignore_errors=True)  # episodes and checkpoints: only the logs stay
    (logdir / "latest.pt").unlink(missing_ok=True)
    record = None
    if envs == "auto" and (logdir / "resources.json").exists():
        record = json.loads((logdir / "resources.json").read_text())
    # Updates per second in the first and last timed intervals: the same work at another speed means
    # the machine's load changed during the run.
    rates = [row["perf/updates_per_s"] for row in log[1:] if "perf/updates_per_s" in row]
    drift = f"{rates[0]:.2f} -> {rates[-1]:.2f}" if rates else "n/a"
    return frames_per_second(log), record, max(len(log) - 1, 0), drift


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30, help="training seconds per setting")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--settings", nargs="+", default=[f"{e},{p}" for e, p in SETTINGS],
                        help="envs,parallel pairs (auto,auto first); default: all seven")
    parser.add_argument("--train_ratio", type=float, default=512,
                        help="replayed steps per policy step (512: the presets'; 16: env and learner comparable)")
    parser.add_argument("--default_threads", action="store_true",
                        help="hand-picked runs on torch's default threads instead of the ones auto chose")
    args = parser.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_auto_"))
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {args.seconds:.0f} s of "
          f"training per setting; outputs in {root}", flush=True)
    for task in args.tasks:
        results, threads = {}, None
        for envs, parallel in (setting.split(",") for setting in args.settings):
            fps, record, intervals, drift = run(task, envs, parallel, args.seconds, root, threads,
                                                args.train_ratio)
            results.setdefault((envs, parallel), []).append(fps)
            extra = f", learner threads {threads or 'default'}"
            if record is not None:
                decision, costs = record["decision"], record["costs"]
                threads = None if args.default_threads else decision["threads"]
                extra = (f"  (chose envs {decision['envs']} --parallel {decision['parallel']}, learner threads "
                         f"{decision['threads']}; predicted {decision['steps_per_s'] * 2:.2f} frames/s; measuring "
                         f"took {record['measure_s']} s; update {costs['update_s']:.2f} s on {costs['max_threads']}"
                         f" threads, {costs.get('update_1_s', float('nan')):.2f} s on 1)")
            print(f"  {task:8s} envs {envs:4s} --parallel {parallel:5s} {fps:8.2f} frames/s over {intervals} "
                  f"log intervals, updates/s {drift}{extra}  [load {os.getloadavg()[0]:.2f}]", flush=True)
        results = {k: sum(v) / len(v) for k, v in results.items()}  # repeated settings: their mean
        hand = {k: v for k, v in results.items() if k[0] != "auto"}
        if not hand or ("auto", "auto") not in results:
            continue
        best = max(hand, key=lambda k: hand[k] if hand[k] == hand[k] else -1)
        ratio = results[("auto", "auto")] / hand[best]
        print(f"  {task}: auto / best hand-picked (envs {best[0]} --parallel {best[1]}) = {ratio:.2f}: "
              f"{'within' if ratio >= 0.9 else 'NOT within'} 10%", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
