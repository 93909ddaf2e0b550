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


def test_train_speed_help_prints_usage():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stderr
    assert out.stdout.startswith("usage: python3 benchmarks/train_speed.py") and "Learner throughput" in out.stdout
    assert "--compare" in out.stdout and "--updates" in out.stdout


def test_train_speed_compare_prints_one_row_per_setting_with_operator_calls():
    """Eager only, to stay short: float32 and bf16 side by side at debug size."""
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--configs", "debug",
                          "--compare", "--compile_modes", "False", "--precisions", "32,bf16", "--updates", "1",
                          "--rounds", "2", "--warmup", "1", "--threads", "1", "--batch_size", "4"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.stdout.splitlines()
            if line.startswith("| False")]
    assert [row[:2] for row in rows] == [["False", "32"], ["False", "bf16"]]
    for row in rows:
        assert float(row[2]) > 0 and re.fullmatch(r"\d+\.\d+ \(\d+\.\d+-\d+\.\d+\)", row[3])
        assert int(row[5].replace(",", "")) > 100 and row[6] == "0"  # eager: aten operators, no compiled kernels
    assert rows[0][4] == "1.00x"
    assert re.fullmatch(r"updates_per_s=\d+\.\d+", out.stdout.strip().splitlines()[-1])
    assert out.stderr.count("round: ") == 2


def test_train_speed_compiles_with_kernel_profiling_only_when_asked(monkeypatch):
    """Inductor's kernel profiling lengthens the C++ compilation (a warm-up no user has): --compare
    and a plain run compile without it unless --kernel_profile asks, and it is set before the replay
    and the agents are made (prepare and compare stubbed: what they would see is recorded)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("bench_train_speed", ROOT / "benchmarks" / "train_speed.py")
    train_speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_speed)
    seen = []

    class Stop(Exception):
        pass

    def prepare(config, threads, malloc_tuning):
        seen.append(torch._inductor.config.cpp.enable_kernel_profile)
        raise Stop

    monkeypatch.setattr(train_speed, "prepare", prepare)
    # Restored by hand: monkeypatch would undo it by deleting the key from Inductor's config (a proxy object),
    # and every later compile in this process would then fail.
    saved = torch._inductor.config.cpp.enable_kernel_profile
    try:
        for flags, expected in ((["--compare"], False), (["--compare", "--kernel_profile"], True), ([], False),
                                (["--profile", "--kernel_profile"], True)):
            torch._inductor.config.cpp.enable_kernel_profile = not expected
            try:
                train_speed.main(["--configs", "debug", *flags])
            except Stop:
                pass
            assert seen[-1] is expected, flags
    finally:
        torch._inductor.config.cpp.enable_kernel_profile = saved
    assert len(seen) == 4


def test_train_speed_rejects_a_bad_key_with_one_line():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--configs", "debug",
                          "--bach_size", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error:") and "batch_size" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_gpu_check_stops_in_its_first_seconds_without_a_usable_gpu(tmp_path):
    """No GPU visible (CUDA_VISIBLE_DEVICES empty; here also a CPU wheel): one line with torch's reason,
    a failing exit status, and none of its steps started."""
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_CHECK_OUT=str(tmp_path)))
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("gpu_check.sh: no usable GPU: "), out.stderr
    assert "== " not in out.stdout and not list(tmp_path.iterdir())


def test_gpu_check_script_parses_and_uses_only_existing_flags():
    """benchmarks/gpu_check.sh cannot run without a GPU; its shell parses, and every command it would
    run (printed by GPU_CHECK_PRINT_ONLY) names existing files, flags and config keys."""
    import shlex

    import config as cfg

    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, GPU_CHECK_PRINT_ONLY="1"))
    assert out.returncode == 0, out.stderr
    commands = [shlex.split(line) for line in out.stdout.strip().splitlines()]
    # tests, a training run, size1m x 3 compile modes x 3 precisions, vision x 2 compile modes, 8 seeds batched,
    # the official code's update at the first row's setting
    assert len(commands) == 15
    assert sum("--seeds" in words for words in commands) == 1
    speeds = [(words[words.index("--configs") + 1], words[words.index("--compile") + 1]) for words in commands
              if "benchmarks/train_speed.py" in words]
    assert {mode for configs, mode in speeds} == {"False", "True", "update"}
    speed_source = (ROOT / "benchmarks" / "train_speed.py").read_text()
    kinds = set()
    for words in commands:
        if "pytest" in words:
            files = [word for word in words if word.startswith("tests/")]
            assert "DREAMER_TEST_DEVICE=cuda" in words and files and all((ROOT / f).exists() for f in files)
            assert all('os.environ.get("DREAMER_TEST_DEVICE"' in (ROOT / f).read_text() for f in files)
            kinds.add("tests")
            continue
        assert words[0] == "python3" and (ROOT / words[1]).exists()
        args = words[2:]
        if words[1] == "benchmarks/official_speed.py":
            import importlib.util
            spec = importlib.util.spec_from_file_location("official_speed", ROOT / "benchmarks" / "official_speed.py")
            official_speed = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(official_speed)
            own, rest = official_speed.parse_args(args)
            assert own.updates >= 10 and own.warmup >= 1
            config, suite, size = official_speed.official.settle(rest)  # refuses what has no official flag
            assert (suite, size, config.device, config.precision) == ("dmc_proprio", "size1m", "cuda", "bf16")
            kinds.add("official")
            continue
        if words[1] == "benchmarks/train_speed.py":
            for flag in ("--updates", "--warmup", "--seeds"):  # train_speed's own flags; the rest are config keys
                if flag == "--seeds" and flag not in args:
                    continue
                assert f'add_argument("{flag}"' in speed_source
                index = args.index(flag)
                del args[index:index + 2]
            kinds.add("speed")
        else:
            assert words[1] == "dreamer.py"
            kinds.add("train")
        config = cfg.parse(args)
        assert config.device == "cuda" and config.compile in (True, False, "update")
        assert config.precision in (16, 32, "bf16")
    assert kinds == {"tests", "train", "speed", "official"}


def test_gpu_learning_check_trains_at_the_reference_setting_and_plots_against_it():
    import shlex

    import config as cfg
    import tools

    script = ROOT / "benchmarks" / "gpu_learning_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, GPU_CHECK_PRINT_ONLY="1"))
    assert out.returncode == 0, out.stderr
    train, plot = [shlex.split(line) for line in out.stdout.strip().splitlines()]
    config = cfg.parse(train[2:])
    # The reference curve's setting: recipe2024 size1m, train ratio 512, action repeat 2, 40K frames.
    assert (config.task, config.train_ratio, config.action_repeat, config.steps) == ("dmc_cartpole_balance", 512,
                                                                                      2, 40000)
    assert (config.dyn_deter, config.update, config.device, config.compile) == (512, "joint", "cuda", "update")
    assert tools.total_updates(config) > 9000  # about 10K updates
    assert plot[:2] == ["python3", "benchmarks/plot.py"] and "--table" in plot


def test_distributed_benchmark_reports_frames_and_replayed_steps_per_second():
    """benchmarks/distributed.py runs dreamer.py under torchrun (here one process, to stay short)."""
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distributed.py"), "--processes", "1", "--",
                          "--configs", "dmc_proprio", "debug", "--device", "cpu", "--steps", "120",
                          "--eval_episode_num", "0", "--log_every", "40"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "scaling=1.00"
    row = [cell.strip() for cell in lines[-2].split("|")]
    assert row[0] == "1" and float(row[1]) > 0 and float(row[2]) > 0


def test_gemm_widths_times_the_two_hot_layer_plain_and_padded_with_equal_outputs():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gemm_widths.py"), "--rows", "96",
                          "--repeats", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert "bins 255 (padded to 256)" in lines[0] and lines[0].endswith("largest output difference 0")
    assert [line.split("|")[1].strip() for line in lines[3:5]] == ["255 outputs", "padded to 256"]
    assert all(float(cell) > 0 for line in lines[3:5] for cell in line.split("|")[2:4])
    assert re.fullmatch(r"speedup_forward=[0-9.]+ speedup_forward_backward=[0-9.]+", lines[5])
    assert lines[7] == "the heads' first layer: features 640  units 64, forward, by rows"
    if lines[-1] != "onednn=unavailable":
        assert [line.split("|")[1].strip() for line in lines[10:-1]] == ["16", "96", "256", "1024"]
        assert all(float(cell) > 0 for line in lines[10:-1] for cell in line.split("|")[2:5])
        assert re.fullmatch(r"onednn_min_rows=[0-9]+", lines[-1])


def test_elementwise_times_both_formulas_of_each_computation_and_checks_them_equal():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "elementwise.py"), "--rows", "32", "--deter", "64",
                          "--twohot_rows", "40", "--repeats", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("threads ") and "tanh rows 32 x 64" in lines[0] and "two-hot rows 40 x 255" in lines[0]
    rows = [line.split("|")[1:-1] for line in lines[3:]]
    assert [row[0].strip() for row in rows] == ["recurrent tanh", "two-hot mean"]
    for _, plain_ms, our_ms, speedup, difference in rows:
        assert float(plain_ms) > 0 and float(our_ms) > 0 and float(speedup) > 0
        assert float(difference) < 1e-5  # rounding level: the two formulas compute the same function


def test_auto_benchmark_commands_parse_and_its_rate_skips_the_start_up():
    """benchmarks/auto.py: every command it would run is a valid dreamer.py config (auto included), and
    frames per second are counted over the log intervals after the first."""
    import importlib.util

    import config as cfg

    spec = importlib.util.spec_from_file_location("bench_auto", ROOT / "benchmarks" / "auto.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    presets = cfg.load_presets()
    for task in bench.TASKS:
        for envs, parallel in bench.SETTINGS:
            words = bench.command(task, envs, parallel, "/tmp/x")
            config = cfg.parse(words[2:], presets=presets)
            assert (str(config.envs), str(config.parallel)) == (envs, parallel)
            assert (config.train_ratio, config.dyn_deter, config.steps) == (512, 32, 1000000)
    # 100 frames at 10/s and 100 at 50/s after a first (start-up) interval: 200 frames in 12 s.
    log = [{"step": 10, "perf/fps": 0.1}, {"step": 110, "perf/fps": 10.0}, {"step": 210, "perf/fps": 50.0}]
    assert abs(bench.frames_per_second(log) - 200 / 12) < 1e-9
