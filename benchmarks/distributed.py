"""Data-parallel throughput: replayed steps and environment frames per second on 1, 2, ... processes.

Runs dreamer.py for real under torchrun (`--nproc_per_node N`, on 127.0.0.1) once per process
count, each in a fresh temporary logdir, and reads the rates rank 0 logged (perf/fps,
perf/updates_per_s; logs after the first, which holds the prefill and warm-up). Every rank runs
at the rate rank 0 does (they update in lockstep), so the totals are N times rank 0's:

    env frames/s    = N * perf/fps
    replayed steps/s = N * perf/updates_per_s * batch_size * batch_length

    python3 benchmarks/distributed.py --processes 1 2 --threads 1 -- --configs dmc_proprio debug --steps 2000

Arguments after `--` go to dreamer.py (--device cpu means gloo, cuda NCCL with one GPU per
process). The last line printed is `scaling=<replayed steps/s on the most processes / on 1>`.
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
sys.path.insert(0, str(ROOT))

import config as cfg  # noqa: E402


def run(processes, threads, flags):
    config = cfg.parse(flags)
    with tempfile.TemporaryDirectory() as logdir:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(processes), str(ROOT / "dreamer.py"), *flags, "--logdir", logdir]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MASTER_ADDR="127.0.0.1")
        start = time.time()
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        seconds = time.time() - start
        if result.returncode:
            sys.exit(f"{processes} processes failed:\n{result.stderr[-3000:]}")
        rows = [json.loads(line) for line in (pathlib.Path(logdir) / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows[1:] if "perf/fps" in row] or rows
    fps = sum(row["perf/fps"] for row in rows) / len(rows)
    updates = sum(row["perf/updates_per_s"] for row in rows) / len(rows)
    return {"processes": processes, "env_fps": processes * fps,
            "replayed_per_s": processes * updates * config.batch_size * config.batch_length,
            "updates_per_s": updates, "wall_s": seconds}


def main():
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process")
    args = parser.parse_args(own)
    results = [run(n, args.threads, flags) for n in args.processes]
    print(f"dreamer.py {' '.join(flags)}; {args.threads} thread(s) per process")
    print("processes | env frames/s | replayed steps/s | updates/s per rank | wall s")
    for r in results:
        print(f"{r['processes']:9d} | {r['env_fps']:12.1f} | {r['replayed_per_s']:16.1f} | "
              f"{r['updates_per_s']:18.2f} | {r['wall_s']:6.1f}")
    print(f"scaling={results[-1]['replayed_per_s'] / results[0]['replayed_per_s']:.2f}")


if __name__ == "__main__":
    main()
