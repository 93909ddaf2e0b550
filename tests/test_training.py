"""End-to-end: a debug training run writes everything a researcher needs, and resumes."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers import resumed_frame
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import compilation
import logs
import tools

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEBUG = ["--configs", "debug", "--task", "dmc_cartpole_balance"]


def train(logdir, *args, timeout=600):
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    command = [sys.executable, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(logdir), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def events(logdir):
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def metrics(logdir):
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("debug_run")
    result = train(logdir, "--steps", "400")
    return logdir, result


def test_debug_run_writes_tensorboard_scalars_and_videos(run):
    logdir, _ = run
    tags = events(logdir).Tags()
    for name in ("train/return", "train/length", "eval/return", "world_model/model_loss", "world_model/kl_loss",
                 "world_model/image_loss", "world_model/rew_loss", "world_model/con_loss",
                 "world_model/model_grad_norm", "actor/actor_loss", "actor/actor_entropy", "actor/actor_grad_norm",
                 "critic/critic_loss", "critic/critic_grad_norm", "perf/fps", "perf/updates", "env/0/steps",
                 "env/0/episodes", "env/0/last_return", "env/0/fps"):
        assert name in tags["scalars"], name
    # SummaryWriter.add_video stores each video as an animated image summary.
    for name in ("eval/policy", "train/openl", "eval/openl"):
        assert name in tags["images"], name
    assert "config/text_summary" in tags["tensors"]


def test_debug_run_writes_metrics_episodes_and_checkpoint(run):
    logdir, result = run
    rows = metrics(logdir)
    assert rows[-1]["step"] == 400
    assert any("train/return" in row for row in rows) and any("eval/return" in row for row in rows)
    assert all(np.isfinite(value) for row in rows for value in row.values())
    episodes = sorted((logdir / "train_eps").glob("*.npz"))
    assert episodes and list((logdir / "eval_eps").glob("*.npz"))
    with np.load(episodes[0]) as episode:
        assert episode["image"].dtype == np.uint8 and episode["image"].shape[1:] == (16, 16, 3)
        assert episode["is_first"][0] and not episode["is_first"][1:].any() and episode["is_last"][-1]
        assert len(episode["reward"]) == 101  # 100 policy steps (time_limit 200 frames) plus the first
    state = torch.load(logdir / "latest.pt", weights_only=False)
    assert state["counters"]["policy_steps"] * 2 == 400
    assert {"agent", "optimizers", "counters", "schedules", "rng"} <= set(state)
    assert not list(logdir.glob(".*.tmp"))
    assert "Run: new" in result.stdout and "frames 400/400" in result.stdout
    # The start-up summary names the changed keys and counts parameters per module.
    assert "Changed from defaults:" in result.stdout and "steps=400" in result.stdout
    assert "task=dmc_cartpole_balance" in result.stdout and "Device: cpu" in result.stdout
    assert "Compile: off" in result.stdout
    params = result.stdout.split("Parameters: ")[1].splitlines()[0]
    assert "world model" in params and "actor" in params and "critic" in params


def test_rerun_resumes_and_continues_the_step_count(run, tmp_path):
    logdir = shutil.copytree(run[0], tmp_path / "run")  # the module's run stays as it was for the other tests
    before = metrics(logdir)[-1]["step"]
    result = train(logdir, "--steps", "600")
    assert "resumed from frame 400" in result.stdout
    steps = [row["step"] for row in metrics(logdir)]
    assert steps == sorted(steps) and steps[-1] == 600 and before in steps
    scalar_steps = [e.step for e in events(logdir).Scalars("perf/updates")]
    assert scalar_steps == sorted(scalar_steps) and scalar_steps[-1] == 600
    state = torch.load(logdir / "latest.pt", weights_only=False)
    assert state["counters"]["policy_steps"] * 2 == 600


def test_eval_only_changes_nothing_but_its_own_outputs(run, tmp_path):
    logdir = shutil.copytree(run[0], tmp_path / "run")
    before = {p: p.read_bytes() for p in logdir.rglob("*") if p.is_file()}
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    command = [sys.executable, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(logdir), "--eval_only",
               "--eval_episode_num", "2"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    after = {p: p.read_bytes() for p in logdir.rglob("*") if p.is_file()}
    assert {p: b for p, b in after.items() if p in before} == before
    assert sorted(p.relative_to(logdir).as_posix() for p in set(after) - set(before)) == [
        "eval_only/episode.mp4", "eval_only/returns.json"]
    returns = json.loads((logdir / "eval_only" / "returns.json").read_text())
    assert len(returns["returns"]) == 2 and "return" in result.stdout
    assert (logdir / "eval_only" / "episode.mp4").read_bytes()[4:8] == b"ftyp"


def test_eval_only_without_checkpoint_is_a_clear_error(tmp_path):
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    command = [sys.executable, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(tmp_path / "none"), "--eval_only"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and "--eval_only needs a checkpoint" in result.stderr
    assert not (tmp_path / "none").exists()


def test_saved_config_warns_on_change_and_refuses_another_task(tmp_path):
    logdir = tmp_path / "run"
    train(logdir, "--steps", "40", "--eval_episode_num", "0")
    result = train(logdir, "--steps", "80", "--eval_episode_num", "0", "--batch_size", "8")
    assert "warning: differs from the saved config: batch_size: 10 -> 8" in result.stdout
    assert "warning: differs from the saved config: steps" not in result.stdout  # budget keys change silently
    # 'auto' keys settle into what the saved config holds: no warning for them.
    assert "saved config: actor.dist" not in result.stdout and "saved config: imag_gradient" not in result.stdout
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    command = [sys.executable, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(logdir), "--task",
               "dmc_walker_walk"]
    bad = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "differs from this run's task 'dmc_cartpole_balance'" in bad.stderr


def test_killed_run_resumes_with_episodes_intact(tmp_path):
    logdir = tmp_path / "killed"
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    command = [sys.executable, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(logdir), "--steps", "100000",
               "--eval_every", "200"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and len(list((logdir / "train_eps").glob("*.npz"))) < 2:
        time.sleep(0.5)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert (logdir / "latest.pt").exists()
    # Episodes finished after the checkpoint were played: the frame count includes them.
    resumed_at = resumed_frame(logdir)
    for path in (logdir / "train_eps").glob("*.npz"):
        with np.load(path) as episode:
            assert episode["is_last"][-1]  # only whole episodes are ever on disk
    result = train(logdir, "--steps", str(resumed_at + 100), "--eval_every", "200")
    assert f"resumed from frame {resumed_at}" in result.stdout
    assert metrics(logdir)[-1]["step"] == resumed_at + 100


FAULTS_AFTER_REALLOCATION = """
import resource, sys
import torch
sys.path.insert(0, sys.argv[2])
import dreamer
import launch
if sys.argv[1] == "tuned":
    assert launch.keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):  # 128 MB blocks, written and freed, until the heap holds a hole that fits one
    block = torch.ones(2**25)
    del block
before = faults()
block = torch.ones(2**25)
print(faults() - before)
"""


def test_keep_freed_memory_reuses_large_blocks_without_page_faults():
    """dreamer.py's allocator setting: a freed 128 MB block is reused, not mapped afresh, so writing
    the next one costs no page faults (counted by the kernel; nothing here is timed)."""
    counts = {}
    for mode in ("plain", "tuned"):
        out = subprocess.run([sys.executable, "-c", FAULTS_AFTER_REALLOCATION, mode, str(ROOT)],
                             capture_output=True, text=True, check=True, timeout=120)
        counts[mode] = int(out.stdout.strip().splitlines()[-1])
    assert counts["plain"] >= 32, counts  # glibc's default: fresh pages (even 2 MB ones fault 64 times)
    assert counts["tuned"] < 8, counts


def test_summary_says_what_compile_gains_and_costs_on_a_cpu():
    import config as cfg

    for device, want in (("cpu", "1.1-1.6x faster per update after a warm-up"), ("cuda:0", "include compilation")):
        config = cfg.parse(["--configs", "debug", "--compile", "True", "--device", device])
        assert want in cfg.compile_note(config)
    assert cfg.compile_note(cfg.parse(["--configs", "debug"])) == "off"


def test_start_up_phases_print_progress_lines_in_a_log_file(run):
    """stdout is a file here (not a tty): every phase before training says when it starts and ends."""
    _, result = run
    # debug's prefill of 1 frame leaves no full sequence to replay: the pretraining does 0 of 1 updates.
    for line in ("prefill: 0/1 frames", "prefill: done, 1 frames in", "pretrain: 0/1 updates",
                 "pretrain: done, 0 updates in"):
        assert line in result.stdout, result.stdout[:2000]
    assert result.stdout.index("prefill: done") < result.stdout.index("pretrain: 0/1")


def test_phase_lines_give_rate_and_eta(capsys, monkeypatch):
    clock = iter([100.0, 102.0, 104.0, 108.0, 110.0])
    monkeypatch.setattr(tools.time, "time", lambda: next(clock))
    phase = logs.Phase("pretrain", 100, "update", interactive=False, every=5.0)  # starts at t=100
    phase.update(10)  # t=102: the first step gives the rate at once: 10 in 2 s, 90 to go at 5/s
    phase.update(20)  # t=104: 2 s since the last line, no line
    phase.update(30)  # t=108: 6 s since the last line: 30 in 8 s, 70 to go at 3.75/s
    phase.close()  # t=110
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["pretrain: 0/100 updates",
                     "pretrain: 10/100 updates (10%) | 5.00 updates/s | elapsed 0:00:02 | ETA 0:00:18",
                     "pretrain: 30/100 updates (30%) | 3.75 updates/s | elapsed 0:00:08 | ETA 0:00:18",
                     "pretrain: done, 30 updates in 10.0 s"]


def test_phase_heartbeat_reports_while_one_step_takes_long(capsys):
    """A step longer than `every` (a compiling first update, a full-size update on a loaded CPU)
    still gets lines: the heartbeat prints the state every `every` seconds."""

    phase = logs.Phase("compile warm-up (first update)", 1, "call", interactive=False, every=0.2)
    lines, deadline = [], time.monotonic() + 60  # one long step: until two heartbeats came (a loaded machine waits)
    waiting = lambda: [line for line in lines  # noqa: E731
                       if line.startswith("compile warm-up (first update): 0/1 calls (0%) | 0.00")]
    while len(waiting()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        lines += capsys.readouterr().out.splitlines()
    phase.update(1)
    phase.close()
    lines += capsys.readouterr().out.splitlines()
    assert len(waiting()) >= 2 and "ETA ?" in waiting()[0], lines
    assert lines[-1].startswith("compile warm-up (first update): done, 1 calls in")


@pytest.mark.slow  # in-process training runs
def test_cpu_runs_a_short_run_eager_unless_compile_is_asked_for_and_the_warm_up_says_so(tmp_path, capsys,
                                                                                         monkeypatch):
    """compile auto on a CPU runs a short run eagerly and says why; an explicit --compile True compiles, and the
    first (compiling) update is announced and timed (compilation itself stubbed out here)."""
    import dreamer

    common = ["--configs", "debug", "--device", "cpu", "--steps", "40", "--eval_episode_num", "0"]
    dreamer.main([*common, "--compile", "auto", "--logdir", str(tmp_path / "auto")])
    out = capsys.readouterr().out
    assert "Compile: off (auto: on a CPU: 4 updates x ~" in out
    assert "less than the ~290 s warm-up of compiling the whole update; --compile update compiles)" in out
    assert "compile warm-up" not in out

    monkeypatch.setitem(compilation.COMPILERS, True, lambda agent, bodies: ["stub"])
    dreamer.main([*common, "--compile", "True", "--logdir", str(tmp_path / "explicit")])
    out = capsys.readouterr().out
    assert "Compile: on, step by step (on a CPU measured 1.1-1.6x faster per update after a warm-up" in out
    for name in ("first update", "first policy step"):
        assert f"compile warm-up ({name}): 0/1 calls" in out
        assert out.count(f"compile warm-up ({name}): done, 1 calls in") == 1
