"""benchmarks/train_speed.py runs on a preset and reports what the issue asks for (nothing is timed here)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_train_speed_reports_phases_operators_memory_and_updates_per_second():
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--configs", "debug",
                          "--updates", "2", "--warmup", "1", "--threads", "1", "--profile", "--batch_size", "4"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"updates_per_s=\d+\.\d+", lines[-1]) and float(lines[-1].split("=")[1]) > 0
    assert "batch 4x20" in out.stdout  # the --key value override reached the agent
    phases = re.search(r"phase split \(s/update, profiled\): (.*)", out.stdout).group(1).split()
    assert phases[::2] == ["world_model", "imagination", "actor", "critic"]
    assert all(float(v) > 0 for v in phases[1::2])
    assert re.search(r"peak memory: \d+ MB", out.stdout)
    top = re.search(r"top operators \(share of self time\): (.*)", out.stdout).group(1)
    assert len(re.findall(r"\w+ \d+%", top)) == 6


def test_train_speed_rejects_a_bad_key_with_one_line():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--configs", "debug",
                          "--bach_size", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error:") and "batch_size" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
