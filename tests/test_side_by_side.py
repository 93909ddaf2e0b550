"""benchmarks/official.py (the official code run with a project command's settings) and
benchmarks/learning.py (both codes side by side, resumable, with a verdict per task). The official
code cannot be installed by the suite: a stand-in checkout below has its layout (dreamerv3/main.py,
embodied/jax/internal.py whose setup overwrites XLA_FLAGS as the real one does) and writes
scores.jsonl as the real one does."""

import json
import math
import os
import pathlib
import random
import shlex
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # last: worker processes inherit the path, and benchmarks/envs.py is not envs

import learning  # noqa: E402
import official  # noqa: E402
import official_speed  # noqa: E402

SETTINGS = ["--configs", "dmc_proprio", "recipe2024", "size1m", "--steps", "2e3", "--train_ratio", "256",
            "--batch_size", "16", "--batch_length", "32", "--envs", "1", "--eval_episode_num", "0", "--device", "cpu"]

STAND_IN_SETUP = '''
import os
def setup(**kwargs):
    os.environ["XLA_FLAGS"] = "--xla_gpu_autotune_level=1"  # as the real setup: the caller's flags are gone
'''

# Episodes of 500 policy steps (1000 frames at action repeat 2); returns rise by 10 per episode. As the real
# one, its step counter counts each episode's reset step too: 501 policy steps, 1002 counted frames, an episode.
STAND_IN_MAIN = '''
import json, os, pathlib, sys
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
from embodied.jax import internal
args, key = {}, None
for word in sys.argv[1:]:
    if word.startswith("--"):
        key = word
    else:
        args[key] = word  # a flag's last value is enough here
internal.setup()
logdir = pathlib.Path(args["--logdir"])
logdir.mkdir(parents=True, exist_ok=True)
(logdir / "flags.json").write_text(json.dumps({"argv": sys.argv[1:], "XLA_FLAGS": os.environ["XLA_FLAGS"]}))
repeat, steps = int(args["--env.dmc.repeat"]), int(args["--run.steps"])
with open(logdir / "scores.jsonl", "a") as f:
    for episode in range(steps // 500):
        f.write(json.dumps({"step": (episode + 1) * 501 * repeat, "episode/score": 10.0 * episode}) + "\\n")
'''


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "dreamerv3"
    (root / "embodied" / "jax").mkdir(parents=True)
    (root / "dreamerv3").mkdir()
    for package in (root / "embodied", root / "embodied" / "jax"):
        (package / "__init__.py").write_text("")
    (root / "embodied" / "jax" / "internal.py").write_text(STAND_IN_SETUP)
    (root / "dreamerv3" / "main.py").write_text(STAND_IN_MAIN)
    return root


def flag(argv, name):
    return argv[argv.index(name) + 1]


def run_official(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "official.py"), *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


# ----------------------------------------------------------------------------------------------
# official.py
# ----------------------------------------------------------------------------------------------


def test_the_project_settings_become_the_official_flags(tmp_path):
    config, suite, size = official.settle([*SETTINGS, "--task", "dmc_cheetah_run", "--seed", "3", "--action_repeat",
                                           "2", "--precision", "bf16", "--batch_length", "16"])
    argv = official.official_flags(config, suite, size, tmp_path)
    assert flag(argv, "--configs") == "dmc_proprio" and argv[argv.index("--configs") + 2] == "size1m"
    assert flag(argv, "--task") == "dmc_cheetah_run" and flag(argv, "--seed") == "3"
    assert flag(argv, "--run.steps") == "1000"  # 2,000 frames at action repeat 2: policy steps there
    assert flag(argv, "--env.dmc.repeat") == "2"
    assert float(flag(argv, "--run.train_ratio")) == 256
    assert flag(argv, "--batch_size") == "16" and flag(argv, "--batch_length") == "16"
    assert flag(argv, "--report_length") == "16"  # the official report stream fails above batch_length
    assert flag(argv, "--jax.compute_dtype") == "bfloat16" and flag(argv, "--jax.platform") == "cpu"
    assert flag(argv, "--run.envs") == "1" and flag(argv, "--replay_context") == "1"
    assert flag(argv, "--replay.online") == "True"  # recipe2024's replay_online, the official default
    offline, *_ = official.settle([*SETTINGS, "--task", "dmc_cheetah_run", "--replay_online", "False"])
    assert flag(official.official_flags(offline, suite, size, tmp_path), "--replay.online") == "False"
    cuda, *_ = official.settle([*SETTINGS, "--task", "dmc_cheetah_run", "--device", "cuda"])
    assert flag(official.official_flags(cuda, suite, size, tmp_path), "--jax.platform") == "cuda"


def test_the_optimizer_and_replay_settings_reach_the_official_flags(tmp_path):
    """The one optimizer's learning rate, warm-up, AGC and epsilon and the replay's capacity are passed on:
    agent.opt.* and replay.size (the official defaults differ from the project's dataset_size)."""
    config, suite, size = official.settle([*SETTINGS, "--task", "dmc_cheetah_run", "--model_lr", "1e-4",
                                           "--actor.lr", "1e-4", "--critic.lr", "1e-4", "--warmup", "100",
                                           "--agc", "0.5", "--dataset_size", "50000"])
    argv = official.official_flags(config, suite, size, tmp_path)
    assert float(flag(argv, "--agent.opt.lr")) == 1e-4 and flag(argv, "--agent.opt.warmup") == "100"
    assert float(flag(argv, "--agent.opt.agc")) == 0.5 and float(flag(argv, "--agent.opt.eps")) == 1e-20
    assert flag(argv, "--replay.size") == "50000"
    # Where the project logs, evaluates and saves changes nothing there.
    official.settle([*SETTINGS, "--task", "dmc_cheetah_run", "--log_every", "7", "--save_every", "60",
                     "--eval_episode_num", "3", "--logger", "jsonl"])


@pytest.mark.parametrize("change, words", [
    (["--configs", "dmc_proprio", "size1m"], "must name recipe2024"),
    (["--configs", "dmc_proprio", "recipe2024"], "model size"),
    (["--configs", "recipe2024", "size1m"], "suite preset"),
    (["--prefill", "2500"], "leave recipe2024's start"),
    (["--prefill_policy", "random"], "--prefill_policy random --prefill 0 --pretrain 1"),
    (["--task", "atari_pong"], "one DMC task"),
    (["--steps", "1e9x"], "Invalid value"),
    (["--units", "128"], "--units 128: no official flag carries this"),
    (["--update", "sequential", "--imag_gradient", "dynamics"], "no official flag carries these"),
    (["--asynchronous", "True"], "--asynchronous True: no official flag"),
    (["--model_lr", "1e-4"], "must be equal: the official code steps every network with one optimizer"),
])
def test_settings_the_official_code_cannot_take_are_one_line_and_exit_2(tmp_path, change, words):
    argv = [*SETTINGS, "--task", "dmc_cheetah_run", "--logdir", str(tmp_path / "run"), *change]
    if change[0] == "--configs":
        i = argv.index("--configs")
        argv = argv[:i] + argv[i + 4:]  # drop the default presets, keep the change's
    result = run_official("--dry-run", *argv)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_an_interpreter_that_does_not_exist_is_one_line_and_exit_2_before_the_logdir(checkout, tmp_path):
    for python in ("/nonexistent", str(tmp_path)):  # no file; a folder, not an executable
        result = run_official("--official", str(checkout), "--python", python, *SETTINGS, "--task", "dmc_cheetah_run",
                              "--logdir", str(tmp_path / "run"))
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == f"official.py: --python {python}: no executable interpreter there; give the " \
            "Python that has the official code's requirements (e.g. ~/dreamerv3/venv/bin/python)"
        assert result.stdout == "" and not (tmp_path / "run").exists()


def test_the_run_keeps_the_single_thread_flags_and_writes_the_project_form(checkout, tmp_path):
    logdir = tmp_path / "run"
    result = run_official("--official", str(checkout), "--python", sys.executable, *SETTINGS,
                          "--task", "dmc_cheetah_run", "--action_repeat", "2", "--logdir", str(logdir))
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads((logdir / "official" / "flags.json").read_text())
    # The stand-in's setup replaced XLA_FLAGS; the launcher put the single-thread flag back after it.
    assert "--xla_cpu_multi_thread_eigen=false" in seen["XLA_FLAGS"].split()
    assert "--xla_gpu_autotune_level=1" in seen["XLA_FLAGS"].split()
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1000, 2000] and [r["train/return"] for r in rows] == [0.0, 10.0]  # frames
    assert [r["train/episodes"] for r in rows] == [1, 2]
    import plot

    assert plot.task_of(logdir, plot.read_config(logdir)) == "dmc_cheetah_run"
    steps, values = plot.series(plot.read_metrics(logdir), "train/return")
    assert list(steps) == [1000, 2000]


# ----------------------------------------------------------------------------------------------
# official_speed.py (its official side needs JAX and the checkout: a stand-in interpreter records what it is
# given; the real side ran on this CPU with JAX 0.4.33 and 0.11.2, benchmarks/README)
# ----------------------------------------------------------------------------------------------

STAND_IN_PYTHON = """#!{python}
import json, os, pathlib, sys
pathlib.Path(__file__).with_name("given.json").write_text(json.dumps(
    {{"argv": sys.argv[1:], "cwd": os.getcwd(), "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}}))
print("updates_per_s=2.5000")
"""


def run_official_speed(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "official_speed.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_official_speed_gives_the_official_interpreter_the_translated_flags(checkout, tmp_path):
    python = tmp_path / "python"
    python.write_text(STAND_IN_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    result = run_official_speed("--official", str(checkout), "--python", str(python), "--updates", "4",
                                "--warmup", "2", *SETTINGS, "--task", "dmc_walker_walk", "--precision", "bf16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "updates_per_s=2.5000"
    given = json.loads((tmp_path / "given.json").read_text())
    argv = given["argv"]
    assert argv[0] == "-c" and "agent.train(" in argv[1]  # the official side, timing the official update
    assert argv[2] == given["cwd"] == str(checkout.resolve()) and argv[3:6] == ["2", "4", "once"]  # warm-up, timed
    flags = argv[6:]
    assert flag(flags, "--configs") == "dmc_proprio" and flags[flags.index("--configs") + 2] == "size1m"
    assert flag(flags, "--task") == "dmc_walker_walk" and flag(flags, "--jax.compute_dtype") == "bfloat16"
    assert (flag(flags, "--batch_size"), flag(flags, "--batch_length")) == ("16", "32")
    assert flag(flags, "--jax.platform") == "cpu" and "--xla_cpu_multi_thread_eigen=false" in given["XLA_FLAGS"]


# The official side in serve mode as a stand-in: ready, then one round per line read (0.5 s, 1.5 s, ... per
# update), then its summary once its input closes; or one that stops after its first round. Both print other
# lines too, as the official code does.
SERVING_PYTHON = """#!{python}
import sys
assert sys.argv[6] == "serve", sys.argv[6]  # after -c, the program, checkout, warm-up, updates
print("Observations")  # as the official agent prints its spaces
print("  vector  Space(float32, shape=(5,))")
print("ready build_s=10.00 warmup_s=20.00", flush=True)
for i, _ in enumerate(iter(sys.stdin.readline, "")):
    print("Optimizer opt has 637,446 params")
    if {stop} and i == 1:
        print("XlaRuntimeError: stand-in", file=sys.stderr)
        sys.exit(3)
    print(f"round {{0.5 + i:.6f}}", flush=True)
print("official code: stand-in")
print("updates_per_s=1.0000")
"""


@pytest.mark.parametrize("stop", [False, True])
def test_interleave_alternates_rounds_of_both_codes_and_reports_their_ratio(checkout, tmp_path, stop):
    python = tmp_path / "python"
    python.write_text(SERVING_PYTHON.format(python=sys.executable, stop=stop))
    python.chmod(0o755)
    result = run_official_speed("--official", str(checkout), "--python", str(python), "--interleave", "2",
                                "--updates", "1", "--warmup", "1", *SETTINGS, "--task", "dmc_cartpole_balance")
    if stop:  # one message and the side's log tail, exit 1, no table
        assert result.returncode == 1 and "| official |" not in result.stdout
        assert "the official side ended before 'round'" in result.stderr and "XlaRuntimeError" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    rounds = [line for line in result.stderr.splitlines() if line.startswith("round: ")]
    assert len(rounds) == 2 and rounds[1].endswith("official 1.500 s/update")  # each official round after one of ours
    lines = result.stdout.strip().splitlines()
    assert lines[1].startswith("project compile: off (auto: on a CPU: ")  # 2K frames: too short to repay compiling
    assert lines[2] == "official code: stand-in"
    ours = next(line for line in lines if line.startswith("| this project |"))
    theirs = next(line for line in lines if line.startswith("| official |"))
    assert theirs == "| official | 30.0 | 1.000 (0.500-1.500) |"  # build + warm-up; median and range of 0.5, 1.5
    project = float(ours.split("|")[3].split()[0])  # its median, to 3 decimals
    assert lines[-1].startswith("ratio=") and float(lines[-1][6:]) == pytest.approx(1.0 / project, rel=3e-3)


@pytest.mark.parametrize("args, words", [
    (["--official", "CHECKOUT", "--updates", "0"], "--updates 0: give a whole number >= 1"),
    (["--official", "CHECKOUT", "--interleave", "-1"], "--interleave -1: give a whole number >= 1"),
    (["--official", "/nonexistent"], "no dreamerv3/main.py there"),
    ([], "Missing --official DIR"),
    (["--official", "CHECKOUT", "--task", "atari_pong"], "one DMC task"),
    (["--official", "CHECKOUT", "--units", "128"], "no official flag carries this"),
])
def test_official_speed_mistakes_are_one_line_and_exit_2(checkout, args, words, capsys):
    args = [str(checkout) if word == "CHECKOUT" else word for word in args]
    assert official_speed.main([*SETTINGS, "--task", "dmc_walker_walk", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------------------------
# learning.py
# ----------------------------------------------------------------------------------------------


def test_the_dry_run_gives_both_codes_the_same_flags_and_cuda_reaches_both(tmp_path, capsys, monkeypatch):
    import launch

    monkeypatch.setattr(launch, "cuda_problem", lambda device: None)  # stand-ins for a usable GPU
    monkeypatch.setattr(learning, "gpu_problem", lambda: None)
    code = learning.main(["--tasks", "dmc_cheetah_run,dmc_walker_walk", "--seeds", "0,1", "--out", str(tmp_path),
                          "--dry-run", "--", *SETTINGS[:-1], "cuda"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 8  # 2 tasks x 2 seeds x 2 codes
    project = [line for line in lines if "dreamer.py" in line]
    officials = [line for line in lines if "official.py" in line]
    assert len(project) == len(officials) == 4
    for p, o in zip(project, officials):
        assert p.split("dreamer.py", 1)[1].split("#")[0].replace("project_s", "CODE_s") == \
            o.split("--threads 1", 1)[1].split("#")[0].replace("official_s", "CODE_s")
        assert "--device cuda" in p and "to run" in p
    result = run_official("--dry-run", *SETTINGS[:-1], "cuda", "--task", "dmc_cheetah_run", "--logdir",
                          str(tmp_path / "x"))
    assert result.returncode == 0 and "--jax.platform cuda" in result.stdout


@pytest.mark.slow  # learning.main starts the runs as processes
def test_runs_are_resumable_a_finished_run_is_not_started_again(checkout, tmp_path, capsys):
    argv = ["--tasks", "dmc_cheetah_run", "--seeds", "0,1", "--codes", "official", "--official", str(checkout),
            "--official-python", sys.executable, "--out", str(tmp_path), "--bin", "1000", "--",
            *SETTINGS, "--action_repeat", "2"]
    assert learning.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("learning.py: started") == 2 and out.count("finished (exit 0)") == 2
    for seed in (0, 1):
        logdir = tmp_path / "dmc_cheetah_run" / f"official_s{seed}"
        assert json.loads((logdir / "runner.json").read_text())["status"] == "finished"
    scores = (tmp_path / "dmc_cheetah_run" / "official_s0" / "official" / "scores.jsonl").read_text()
    assert learning.main(argv) == 0
    out = capsys.readouterr().out
    assert "started" not in out and out.count("finished before, not rerun") == 2
    assert (tmp_path / "dmc_cheetah_run" / "official_s0" / "official" / "scores.jsonl").read_text() == scores
    report = (tmp_path / "learning.md").read_text()
    assert "| official | 2 | 0 (0-0) | 10 (10-10) |" in report
    assert (tmp_path / "learning.png").stat().st_size > 0


@pytest.mark.slow  # learning.main starts the runs as processes
def test_a_failed_run_is_recorded_and_started_again(checkout, tmp_path, capsys):
    broken = checkout
    (broken / "dreamerv3" / "main.py").write_text("print('a line before')\nraise SystemExit('the stand-in fails: "
                                                  "no module named jax')\n")
    argv = ["--tasks", "dmc_cheetah_run", "--seeds", "0", "--codes", "official", "--official", str(broken),
            "--official-python", sys.executable, "--out", str(tmp_path / "out"), "--", *SETTINGS]
    assert learning.main(argv) == 1  # a failed run fails the runner
    err = capsys.readouterr().err
    assert "the last lines of" in err and "the stand-in fails: no module named jax" in err  # its reason, shown
    assert "1 run(s) did not finish" in err
    logdir = tmp_path / "out" / "dmc_cheetah_run" / "official_s0"
    assert json.loads((logdir / "runner.json").read_text())["status"] == "failed"
    assert "Verdict: **incomplete**" in (tmp_path / "out" / "learning.md").read_text()
    capsys.readouterr()
    learning.main([*argv[:-len(SETTINGS) - 1], "--dry-run", "--", *SETTINGS])
    assert "# to run" in capsys.readouterr().out


@pytest.mark.parametrize("project, official_last, official_first_best, want", [
    ([50.0, 60.0], [40.0, 70.0, 55.0], [12.0, 14.0, 9.0], "matches"),
    ([20.0, 25.0], [40.0, 70.0, 55.0], [12.0, 14.0, 9.0], "below"),
    ([90.0, 95.0], [40.0, 70.0, 55.0], [12.0, 14.0, 9.0], "above"),
    ([50.0], [8.0, 7.0, 55.0], [12.0, 14.0, 9.0], "no learning to compare"),
    # dmc_cheetah_run at 20K frames, 2026-12-02: the official last quarter (10) above its first quarter's
    # mean (about 9) but below its best first-quarter episode (14.6): noise, not learning.
    ([5.0], [10.0], [14.6], "no learning to compare"),
    ([], [40.0], [8.0], "incomplete"),
])
def test_the_verdict_rule(project, official_last, official_first_best, want):
    assert learning.verdict(project, official_last, official_first_best) == want


def test_quarter_means_split_the_frames_as_the_rule_says():
    steps = np.array([1000, 5000, 9000, 16000, 20000])
    values = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert learning.quarter_means(steps, values, 20000) == (1.5, 4.5)
    assert learning.first_quarter_best(steps, values, 20000) == 2.0
    assert learning.first_quarter_best(steps[2:], values[2:], 20000) is None


def test_welch_t_and_the_spread_line_against_a_plain_computation():
    project, official = [32.0, 40.0, 22.0], [44.0, 32.0, 74.0]  # round 3's last quarters, cheetah_run

    def mean(xs):
        return sum(xs) / len(xs)

    def var(xs):
        return sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)

    want = (mean(official) - mean(project)) / math.sqrt(var(project) / 3 + var(official) / 3)
    assert learning.welch_t(project, official) == pytest.approx(want, rel=1e-12)
    assert round(want, 2) == 1.38
    assert learning.welch_t([30.0], official) is None and learning.welch_t([1.0, 1.0], [1.0, 1.0]) is None
    stats = {"project": {"last": project, "first": [10.3, 12.7, 12.2]},
             "official": {"last": official, "first": [11.8, None, 13.6]}}
    assert learning.spread(stats) == (
        "Last quarter: project 31.3 (sd 9.0, 3 seeds), official 50.0 (sd 21.6, 3 seeds); Welch t 1.38; "
        "Levene W 0.75, p 0.44 (equal spread); equal codes fall outside the official range by chance 37% of the "
        "time at these seed counts. "
        "Best first-quarter episode per seed: project 10.3, 12.7, 12.2; official 11.8, -, 13.6.")
    assert learning.spread({"project": {"last": [], "first": []}}) == "Last quarter: none finished."


def test_levenes_test_of_equal_spread_against_a_plain_computation():
    """Brown-Forsythe's W (absolute deviations from each group's median) and its p-value: for two
    groups of three, F(1, 4), whose tail is 1 - 1.5 s + 0.5 s^3 with s = sqrt(W / (4 + W))."""
    project, official = [32.0, 40.0, 22.0], [44.0, 32.0, 74.0]
    groups = [sorted(project), sorted(official)]
    z = [[abs(x - g[1]) for x in g] for g in groups]  # the median of three is the middle one
    means = [sum(zi) / 3 for zi in z]
    grand = sum(means) / 2
    w = (6 - 2) / (2 - 1) * sum(3 * (m - grand) ** 2 for m in means) / sum(
        (x - m) ** 2 for zi, m in zip(z, means) for x in zi)
    s = math.sqrt(w / (4 + w))
    got = learning.equal_spread(project, official)
    assert got == pytest.approx((w, 1 - 1.5 * s + 0.5 * s ** 3), rel=1e-9)
    assert w == pytest.approx(0.75)
    assert learning.equal_spread([1.0], official) is None
    assert learning.equal_spread([1.0, 5.0], official) is None  # two seeds: no spread about their median


def test_official_steps_become_frames_and_both_codes_are_read_over_the_frames_both_reach(tmp_path):
    """The official counter counts each episode's reset step (repeat frames): a 1,000-frame episode ends
    1,000 + repeat counted frames later, so a run of 20K counted frames ends its last episode at 19K frames
    and its last quarter would end a whole episode before this project's. Both are read over (14K, 19K]."""
    for repeat in (1, 2, 4):
        counted = [k * (1000 // repeat + 1) * repeat for k in range(1, 21)]
        assert [official.frames_of(step, repeat) for step in counted] == [k * 1000 for k in range(1, 21)]
    assert learning.window_end([(np.array([1000.0, 20000.0]), None), (np.array([19000.0]), None)], 20000) == 19000
    assert learning.window_end([(np.array([20000.0]), None), (None, 19000.0)], 20000) == 19000
    assert learning.window_end([], 20000) == 20000
    write_run(learning.run_dir(tmp_path, "dmc_walker_walk", "project", 0), 100.0)
    official_dir = learning.run_dir(tmp_path, "dmc_walker_walk", "official", 0)
    write_run(official_dir, 80.0)
    rows = [json.loads(line) for line in (official_dir / "metrics.jsonl").read_text().splitlines()][:-1]
    (official_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))  # ends at 19K
    text = learning.report(tmp_path, ["dmc_walker_walk"], [0], ["project", "official"], 20000, 5000)
    assert "Last quarter: frames (14,000, 19,000]" in text
    assert "| project | 1 |" in text and " 91 |" in text  # (55 + 4 x 100) / 5: episodes 15-19, not 16-20
    assert " 75 |" in text  # (55 + 4 x 80) / 5


def write_run(logdir, level, command="", commit=None, status="finished"):
    """A run of 20 episodes of 1K frames: 40 to 15K frames, then `level`; finished unless told."""
    logdir.mkdir(parents=True)
    rows = [{"step": step, "train/return": level if step > 15000 else 40.0 + step / 1000}
            for step in range(1000, 20001, 1000)]
    (logdir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (learning.runner_dir(logdir) / "runner.json").write_text(
        json.dumps({"status": status, "exit": 0, "command": command, "commit": commit}))


def test_kept_official_summaries_stand_in_for_official_runs(tmp_path):
    """--kept: a task whose official runs are not under --out takes the official seeds kept as published
    (benchmarks/learning_rounds.json: last quarter and best first-quarter episode) for the verdict and the
    statistics, and the report names them."""
    kept = learning.load_kept(ROOT / "benchmarks" / "learning_rounds.json")
    walker = {seed: kept["runs"][("dmc_walker_walk", "official", seed)] for seed in (0, 1, 2)}
    assert [walker[s]["last"] for s in (0, 1, 2)] == [78, 91, 119]
    assert [walker[s]["first_best"] for s in (0, 1, 2)] == [73.3, 59.9, 83.9]
    for seed, level in enumerate((100.0, 90.0, 110.0)):
        write_run(learning.run_dir(tmp_path, "dmc_walker_walk", "project", seed), level)
    text = learning.report(tmp_path, ["dmc_walker_walk"], [0, 1, 2], ["project"], 20000, 5000, kept)
    assert "| official | 3 (3 without a curve) |" in text and "78, 91, 119 |" in text
    # The kept official means cover the episodes ending at 15K-19K frames (the official runs' last quarter:
    # their last episode ends at 19K frames), so the project's runs under --out are read over the same
    # frames: (55 + 4 x level) / 5, not the kept seed 0.
    assert "Last quarter: frames (14,000, 19,000], the last episode every run reaches" in text
    assert "| project | 3 |" in text and "91, 83, 99 |" in text
    assert "Verdict: **matches**" in text  # mean 91 within 78-119, and the official seeds learned
    assert "official 96.0 (sd 21.0, 3 seeds)" in text and "Levene W" in text
    assert "Kept from earlier rounds: official seeds 0 (round 5, e3f0224), 1 (round 5, e3f0224)" in text
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(learning.RunnerError, match="--kept .*bad.json"):
        learning.load_kept(bad)
    with pytest.raises(learning.RunnerError, match="--kept .*typo.json"):  # a mistyped file is no empty file
        learning.load_kept(tmp_path / "typo.json")


def test_keep_writes_finished_runs_that_report_as_the_runs_did(tmp_path, capsys):
    """--keep ROUND writes each finished run's episodes with its commit; a later report with no runs under
    --out reads the same table from the kept file, curve included. Unfinished runs are not kept; flags
    other than the file's, or a run without a recorded commit, are one line and exit 2."""
    flags = ["--configs", "dmc_proprio", "recipe2024", "size1m", "--steps", "2e4"]
    command = shlex.join(["python3", "dreamer.py", *flags, "--seeds", "2", "--task", "dmc_walker_walk"])
    first = tmp_path / "first"
    for seed, level in ((3, 100.0), (4, 70.0)):
        logdir = learning.run_dir(first, "dmc_walker_walk", "project", seed, batched=3)
        if seed == 3:
            logdir.parent.mkdir(parents=True)
        write_run(logdir, level, command, "abc1234")
    write_run(learning.run_dir(first, "dmc_walker_walk", "official", 3), 90.0, "official.py " + shlex.join(flags),
              "e3f0224", status="timed out")
    kept_file = tmp_path / "kept.json"
    base = ["--tasks", "dmc_walker_walk", "--seeds", "3,4", "--kept", str(kept_file), "--bin", "5000"]
    argv = [*base, "--codes", "project,official", "--batched", "--report", "--keep", "7", "--out", str(first)]
    assert learning.main([*argv, "--", *flags]) == 0
    assert "kept 2 finished run(s)" in capsys.readouterr().out
    runs = learning.load_kept(kept_file)["runs"]
    assert set(runs) == {("dmc_walker_walk", "project", 3), ("dmc_walker_walk", "project", 4)}
    assert runs[("dmc_walker_walk", "project", 4)]["commit"] == "abc1234"
    assert runs[("dmc_walker_walk", "project", 4)]["round"] == 7
    assert runs[("dmc_walker_walk", "project", 4)]["episodes"][-1] == [20000, 70.0]

    def project_row(text):
        return next(line for line in text.splitlines() if line.startswith("| project |"))

    row = project_row((first / "learning.md").read_text())
    assert row == "| project | 2 | 43 (43-43) | 48 (48-48) | 53 (53-53) | 85 (70-100) | 100, 70 |"
    later = tmp_path / "later"  # not made: a report of kept runs alone makes its folder
    assert learning.main([*base, "--codes", "project", "--report", "--out", str(later), "--", *flags]) == 0
    text = (later / "learning.md").read_text()
    assert project_row(text) == row and (later / "learning.png").is_file()
    assert "project seeds 3 (round 7, abc1234), 4 (round 7, abc1234)" in text
    capsys.readouterr()
    assert learning.main([*argv, "--", *flags, "--train_ratio", "512"]) == 2
    assert "--keep: the flags after -- are not those of" in capsys.readouterr().err
    (first / "dmc_walker_walk" / learning.BATCHED / "runner.json").write_text(
        json.dumps({"status": "finished", "exit": 0, "command": command, "commit": None}))
    assert learning.main([*argv, "--", *flags]) == 2
    assert "records no commit" in capsys.readouterr().err


def test_the_chance_that_equal_codes_fall_outside_the_range_against_exact_values_and_a_plain_simulation():
    # one project seed among n official ones, all exchangeable: it lies outside their range when it is the
    # lowest or the highest of the n + 1, so 2 / (n + 1) whatever the distribution
    for n in (2, 3, 5):
        assert learning.chance_outside(1, n) == pytest.approx(2 / (n + 1), abs=0.005)
    rng = random.Random(1)
    outside = 0
    for _ in range(20_000):
        mean = sum(rng.gauss(0, 1) for _ in range(3)) / 3
        official = [rng.gauss(0, 1) for _ in range(3)]
        outside += not min(official) <= mean <= max(official)
    assert learning.chance_outside(3, 3) == pytest.approx(outside / 20_000, abs=0.015)
    assert 0.3 < learning.chance_outside(3, 3) < 0.45  # the point: a 3-seed range verdict is weak evidence


@pytest.mark.parametrize("argv, words", [
    (["--tasks", "dmc_cheetah_run", "--codes", "jax"], "valid: project, official"),
    (["--tasks", "dmc_cheetah_run", "--seeds", "a"], "--seeds a"),
    (["--tasks", "dmc_cheetah_run", "--parallel", "0"], "--parallel 0"),
    (["--tasks", "dmc_cheetah_run"], "--official None"),
    (["--tasks", "dmc_cheetah_run", "--codes", "project", "--", "--task", "x"], "--task after --"),
    (["--tasks", "dmc_cheetah_run", "--report"], "no run of dmc_cheetah_run with an episode under --out"),
    (["--tasks", "", "--codes", "project"], "--tasks '': name at least one task"),
    (["--tasks", ",", "--codes", "project", "--dry-run"], "--tasks ',': name at least one task"),
    # --dry-run checks every task and code it would start, as each run checks itself:
    (["--tasks", "dmc_cheetah_run,dmc_cheetah_runn", "--dry-run", "--", *SETTINGS],
     "project run of dmc_cheetah_runn: Unknown DMC task 'dmc_cheetah_runn'; closest valid: dmc_cheetah_run"),
    (["--tasks", "dmc_cheetah_run", "--codes", "official", "--dry-run", "--", *SETTINGS[:-1], "cuda"],
     "official run of dmc_cheetah_run: --device cuda cannot be used: no GPU (stand-in)"),
    (["--tasks", "dmc_cheetah_run", "--codes", "project", "--dry-run", "--", *SETTINGS[:-1], "cuda"],
     "project run of dmc_cheetah_run: --device cuda cannot be used: no GPU (stand-in)"),
    (["--tasks", "dmc_cheetah_run", "--dry-run", "--", *[w for w in SETTINGS if w != "recipe2024"]],
     "official run of dmc_cheetah_run: --configs must name recipe2024"),
    (["--tasks", "dmc_cheetah_run", "--codes", "official", "--dry-run", "--", *SETTINGS, "--dyn_hidden", "256"],
     "official run of dmc_cheetah_run: --dyn_hidden 256: no official flag carries this"),
])
def test_runner_mistakes_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, words):
    import launch

    monkeypatch.setattr(launch, "cuda_problem", lambda device: "no GPU (stand-in)")  # whatever this machine has
    monkeypatch.setattr(learning, "gpu_problem", lambda: "no GPU (stand-in)")
    assert learning.main([*argv[:2], "--out", str(tmp_path), *argv[2:]]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing half-done: no report over no runs


def test_batched_runs_the_project_seeds_of_a_task_as_one_process_and_reports_them(tmp_path, capsys):
    """--batched: one dreamer.py --seeds N per task, whose seed<k> folders the report reads as seeds
    first .. first + N - 1, finished once their process is; non-consecutive seeds are exit 2."""
    code = learning.main(["--tasks", "dmc_walker_walk", "--seeds", "3,4,5", "--codes", "project", "--batched",
                          "--out", str(tmp_path), "--dry-run", "--", *SETTINGS])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(lines) == 1
    assert "--seeds 3 --task dmc_walker_walk --seed 3 --logdir" in lines[0] and lines[0].endswith("# to run")
    assert learning.main(["--tasks", "dmc_walker_walk", "--seeds", "0,2", "--codes", "project", "--batched",
                          "--out", str(tmp_path), "--dry-run", "--", *SETTINGS]) == 2
    assert "--batched needs consecutive seeds" in capsys.readouterr().err
    process = tmp_path / "dmc_walker_walk" / learning.BATCHED
    for seed, level in zip((3, 4, 5), (100.0, 90.0, 110.0)):
        logdir = learning.run_dir(tmp_path, "dmc_walker_walk", "project", seed, batched=3)
        assert logdir == process / f"seed{seed - 3}"
        logdir.mkdir(parents=True)
        rows = [{"step": step, "train/return": level if step > 15000 else 40.0} for step in range(1000, 20001, 1000)]
        (logdir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert not learning.finished(process / "seed0")
    (process / "runner.json").write_text(json.dumps({"status": "finished", "exit": 0}))
    assert learning.finished(process / "seed0")
    text = learning.report(tmp_path, ["dmc_walker_walk"], [3, 4, 5], ["project"], 20000, 5000, None, 3)
    assert "| project | 3 |" in text and "| 100, 90, 110 |" in text and "project 100.0 (sd 10.0, 3 seeds)" in text
