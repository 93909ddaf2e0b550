"""Configuration merging and every command-line form, including the errors."""

import os
import pathlib
import subprocess
import sys

import pytest

import config as cfg
import dreamer
import launch
import tools

ROOT = pathlib.Path(__file__).resolve().parents[1]

PRESETS = {
    "defaults": {"steps": 10, "lr": 1e-4, "flag": False, "size": [64, 64], "name": "a",
                 "group": {"depth": 32, "keys": "image", "act": "SiLU"}},
    "first": {"steps": 20, "group": {"depth": 48}},
    "second": {"steps": 30, "group": {"keys": "$^"}},
}


def run_cli(*args, cwd=None):
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    return subprocess.run([sys.executable, str(ROOT / "dreamer.py"), *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_presets_merge_in_order_and_key_by_key():
    config = cfg.parse(["--configs", "first", "second"], PRESETS)
    assert config.steps == 30  # later preset wins
    assert config.group.depth == 48  # nested groups merge key by key
    assert config.group.keys == "$^"
    assert config.group.act == "SiLU"
    assert cfg.parse(["--configs", "second", "first"], PRESETS).steps == 20


def test_overrides_follow_presets_and_parse_types():
    config = cfg.parse(["--configs", "first", "--steps", "1e6", "--lr", "3e-5", "--group.depth", "96",
                        "--size", "32,48", "--name", "b"], PRESETS)
    assert config.steps == 1_000_000 and isinstance(config.steps, int)
    assert config.lr == pytest.approx(3e-5)
    assert config.group.depth == 96
    assert config.size == [32, 48]
    assert config.name == "b"


@pytest.mark.parametrize("args, expected", [
    (["--flag"], True), (["--flag", "True"], True), (["--flag", "true"], True), (["--flag", "1"], True),
    (["--flag", "False"], False), (["--flag", "false"], False), (["--flag", "0"], False),
    (["--flag", "--steps", "5"], True), (["--flag=false"], False),
])
def test_boolean_forms(args, expected):
    assert cfg.parse(args, PRESETS).flag is expected


@pytest.mark.parametrize("args, message", [
    (["--configs", "frist"], "Unknown preset 'frist' (closest: first"),
    (["--stepz", "3"], "Unknown config key '--stepz' (closest: --steps"),
    (["--group.dpeth", "3"], "closest: --group.depth"),
    (["--steps", "many"], "Invalid value 'many' for --steps: expected a number"),
    (["--flag", "maybe"], "Invalid value 'maybe' for --flag"),
    (["--steps"], "Missing value for --steps"),
])
def test_config_errors_name_the_problem(args, message):
    with pytest.raises(tools.ConfigError) as error:
        cfg.parse(args, PRESETS)
    assert message in str(error.value)


def test_real_presets_and_verbatim_commands_parse():
    config = cfg.parse(["--configs", "dmc_vision", "--task", "dmc_walker_walk", "--envs", "4", "--parallel",
                        "--logdir", "./logdir/dmc_walker_walk_parallel"])
    assert (config.envs, config.parallel, config.steps, config.encoder.cnn_keys) == (4, True, 1_000_000, "image")
    config = cfg.parse(["--configs", "dmc_vision", "--task", "dmc_walker_walk", "--logdir",
                        "./logdir/dmc_walker_walk"])
    assert config.parallel is False and config.device == "auto" and config.compile == "auto"
    config = cfg.parse(["--configs", "dmc_proprio", "--actor.lr", "1e-4", "--encoder.cnn_depth", "48"])
    assert config.actor.lr == pytest.approx(1e-4) and config.encoder.cnn_depth == 48
    assert config.encoder.mlp_keys == ".*" and config.steps == 500_000


def test_every_preset_parses():
    for name in cfg.load_presets():
        cfg.parse(["--configs", name])


def test_choice_keys_list_valid_values():
    with pytest.raises(tools.ConfigError, match="valid: auto, dynamics, reinforce, both"):
        cfg.parse(["--imag_gradient", "magic"])
    with pytest.raises(tools.ConfigError, match="valid: 16, 32"):
        cfg.parse(["--precision", "8"])


@pytest.mark.parametrize("args, message", [
    (["--configs", "dmc_visoin"], "Unknown preset 'dmc_visoin' (closest: dmc_vision"),
    (["--configs", "debug", "--stepz", "5"], "Unknown config key '--stepz' (closest: --steps"),
    (["--configs", "debug", "--envs", "four"], "Invalid value 'four' for --envs"),
    (["--configs", "debug", "--task", "dcm_walker_walk"], "Unknown suite in task 'dcm_walker_walk'"),
    (["--configs", "debug", "--task", "dmc_walker_wlak"], "closest valid: dmc_walker_walk"),
    (["--configs", "debug", "--device", "tpu:0"], "Invalid value 'tpu:0' for --device"),
    (["--configs", "minecraft", "debug", "--task", "minecraft_diamond"], "Minecraft tasks need MineRL"),
    (["--configs", "debug", "--task", "atari_pong", "--actor.dist", "normal"],
     "Invalid value 'normal' for --actor.dist: task 'atari_pong' has discrete actions; use --actor.dist onehot"),
    (["--configs", "debug", "--actor.dist", "onehot"],
     "task 'dmc_cartpole_balance' has continuous actions; use --actor.dist normal"),
    (["--configs", "debug", "--compile", "maybe"], "Invalid value 'maybe' for --compile"),
])
def test_cli_errors_exit_2_with_one_line_and_create_nothing(tmp_path, args, message):
    logdir = tmp_path / "run"
    result = run_cli(*args, "--logdir", str(logdir))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not logdir.exists()


def test_missing_logdir_is_a_clear_error():
    result = run_cli("--configs", "debug")
    assert result.returncode == 2
    assert "Missing --logdir" in result.stderr


# Stand-ins for torch on machines whose CUDA cannot be used, each raising torch's own words
# (torch.cuda._lazy_init's messages): (torch.version.cuda, what torch.cuda.init raises, device count).
TOO_OLD = ("The NVIDIA driver on your system is too old (found version 12020). Please update your GPU driver by "
           "downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx")
NO_DRIVER = ("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed a "
             "driver from http://www.nvidia.com/Download/index.aspx")
UNUSABLE = {
    "cpu wheel": (None, None, 0, "is a CPU build, without CUDA", "--force-reinstall torch==2.13.0"),
    "driver too old": ("13.0", RuntimeError(TOO_OLD), 0, "The NVIDIA driver on your system is too old (found "
                       "version 12020); torch", "NVIDIA driver R580 or newer"),
    "no driver": ("13.0", RuntimeError(NO_DRIVER), 0, "Found no NVIDIA driver on your system;", "whl/cu126"),
    "no gpu": ("12.6", RuntimeError("No CUDA GPUs are available"), 0, "No CUDA GPUs are available;",
               "NVIDIA driver R525 or newer"),
}


def stand_in_cuda(monkeypatch, built, raises, count, name="Stand-in GPU"):
    def init():
        if raises is not None:
            raise raises
        if built is None:
            raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(launch.torch.version, "cuda", built)
    monkeypatch.setattr(launch.torch.cuda, "init", init)
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: raises is None and built is not None and count > 0)
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(launch.torch.cuda, "get_device_name", lambda index=0: name)


@pytest.mark.parametrize("case", sorted(UNUSABLE))
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_an_explicit_cuda_that_cannot_be_used_stops_with_torchs_reason(monkeypatch, capsys, tmp_path, case, device):
    built, raises, count, reason, fix = UNUSABLE[case]
    stand_in_cuda(monkeypatch, built, raises, count)
    logdir = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        dreamer.main(["--configs", "debug", "--device", device, "--logdir", str(logdir)])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --device {device} cannot be used: "), lines
    assert reason in lines[0] and fix in lines[0] and "--device cpu" in lines[0], lines[0]
    assert not logdir.exists()


def test_a_gpu_index_past_the_last_is_an_error(monkeypatch):
    stand_in_cuda(monkeypatch, "13.0", None, 2)
    with pytest.raises(tools.ConfigError, match=r"there is no GPU 2: this machine has 2 \(cuda:0 to cuda:1\)"):
        launch.resolve_device(cfg.parse(["--configs", "debug", "--device", "cuda:2"]))
    config, note = launch.resolve_device(cfg.parse(["--configs", "debug", "--device", "cuda:1"]))
    assert config.device == "cuda:1" and note is None


@pytest.mark.parametrize("case", sorted(UNUSABLE))
def test_auto_falls_back_to_the_cpu_and_says_why(monkeypatch, case):
    built, raises, count, reason, _ = UNUSABLE[case]
    stand_in_cuda(monkeypatch, built, raises, count)
    config, note = launch.resolve_device(cfg.parse(["--configs", "debug", "--device", "auto"]))
    assert config.device == "cpu" and note.startswith("auto: no usable GPU, so the CPU: ")
    assert reason.rstrip(";").removesuffix("; torch") in note, note


def test_auto_is_the_default_and_takes_a_usable_gpu(monkeypatch):
    assert cfg.parse([]).device == "auto"
    stand_in_cuda(monkeypatch, "13.0", None, 1)
    config, note = launch.resolve_device(cfg.parse(["--configs", "debug", "--device", "auto"]))
    assert config.device == "cuda:0" and note == "auto: CUDA is usable (Stand-in GPU)"
    config, note = launch.resolve_device(cfg.parse(["--configs", "debug", "--device", "cpu"]))
    assert config.device == "cpu" and note is None


def test_the_summary_says_why_auto_chose_the_cpu(tmp_path, monkeypatch, capsys):
    stand_in_cuda(monkeypatch, *UNUSABLE["driver too old"][:3])
    dreamer.main(["--configs", "debug", "--device", "auto", "--steps", "0", "--prefill", "0", "--pretrain", "0",
                  "--eval_episode_num", "0", "--logdir", str(tmp_path / "run")])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Device: "))
    assert line == ("Device: cpu (auto: no usable GPU, so the CPU: The NVIDIA driver on your system is too old "
                    "(found version 12020))"), line


def test_verbatim_parallel_vision_command_starts(tmp_path):
    """The README's command with 4 parallel workers builds envs and the full-size agent; the budget
    flags only stop it right after start-up."""
    logdir = tmp_path / "walker"
    result = run_cli("--configs", "dmc_vision", "--task", "dmc_walker_walk", "--envs", "4", "--parallel",
                     "--logdir", str(logdir), "--device", "cpu", "--compile", "False", "--steps", "0",
                     "--prefill", "0", "--pretrain", "0", "--eval_episode_num", "0")
    assert result.returncode == 0, result.stderr
    assert "Environments: 4 (parallel processes)" in result.stdout
    assert (logdir / "latest.pt").exists() and (logdir / "config.yaml").exists()


@pytest.mark.parametrize("where", ["setup", "building the agent"])
def test_a_bug_keeps_its_traceback_where_user_mistakes_are_one_line(tmp_path, monkeypatch, capsys, where):
    """Only ConfigError (and envs.TaskError) are user mistakes: a ValueError raised by a bug in the set-up or
    while building the agent reaches the caller as itself, with its traceback, not as a one-line exit 2."""
    import compilation

    def bug(*args, **kwargs):
        raise ValueError("a bug, not a user mistake")

    monkeypatch.setattr(*((launch, "resolve_device") if where == "setup" else (compilation, "resolve_auto")), bug)
    with pytest.raises(ValueError, match="a bug, not a user mistake"):
        dreamer.main(["--configs", "debug", "--device", "cpu", "--steps", "10", "--logdir", str(tmp_path / "run")])
    assert "error:" not in capsys.readouterr().err


# -- issue 54: the command line's remaining edges ----------------------------------------------------


def test_print_config_prints_the_settled_config_as_yaml_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from ruamel.yaml import YAML

    monkeypatch.chdir(tmp_path)
    logdir = tmp_path / "run"
    dreamer.main(["--configs", "debug", "recipe2024", "--batch_size", "7", "--logdir", str(logdir),
                  "--print_config"])
    out = capsys.readouterr().out
    printed = YAML(typ="safe", pure=True).load(out)
    # recipe2024's keys over debug's, the override over both, --device auto settled (debug sets cpu)
    assert (printed["norm"], printed["dyn_cell"], printed["opt"], printed["decoder"]["cnn"]) == \
        ("rms", "blockgru", "laprop", "upsample")
    assert (printed["batch_size"], printed["steps"], printed["device"], printed["logdir"]) == (7, 600, "cpu",
                                                                                              str(logdir))
    assert printed == cfg.parse(["--configs", "debug", "recipe2024", "--batch_size", "7",
                                 "--logdir", str(logdir)]).to_dict()
    assert "still auto, settled when the run is built: actor.dist" in out  # from the action space
    assert list(tmp_path.iterdir()) == []  # no logdir, nothing in the current folder
    with pytest.raises(SystemExit) as stop:  # its mistakes are the run's: one line, exit 2
        dreamer.main(["--configs", "debug", "--batch_size", "0", "--print_config"])
    assert stop.value.code == 2 and capsys.readouterr().err.startswith("error: Invalid value '0' for --batch_size")


def test_print_config_settles_compile_auto_on_cuda(monkeypatch, capsys):
    """On CUDA --compile auto settles before a run is built (compilation.compile_choice): the whole update.
    CUDA is stood in for here: launch.cuda_problem says the device can be used."""
    from ruamel.yaml import YAML

    import launch

    monkeypatch.setattr(launch, "cuda_problem", lambda device: None)
    dreamer.main(["--configs", "debug", "--device", "cuda:0", "--compile", "auto", "--print_config"])
    printed = YAML(typ="safe", pure=True).load(capsys.readouterr().out)
    assert (printed["device"], printed["compile"]) == ("cuda:0", "update")


def test_help_keeps_the_sections_of_configs_yaml():
    text = cfg.usage()
    headings = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")
                and " " not in line.rstrip(":").replace("world model", "world_model")]
    expected = [line.strip()[6:-4] for line in (ROOT / "configs.yaml").read_text().splitlines()
                if line.startswith("  # --- ")]
    assert headings == expected and len(expected) == 6, headings
    lines = text.splitlines()
    assert lines.index("training:") < next(i for i, line in enumerate(lines) if line.startswith("  --batch_size "))
    assert lines.index("behaviour:") > next(i for i, line in enumerate(lines) if line.startswith("  --batch_size "))


def test_help_preset_shows_what_the_preset_sets(capsys):
    dreamer.main(["--help", "debug"])
    lines = capsys.readouterr().out.splitlines()
    debug = tools.flatten(cfg.load_presets()["debug"])
    assert lines[0].startswith("Preset debug (configs.yaml:") and f"sets {len(debug)} keys" in lines[0]
    assert len(lines) == 1 + len(debug)
    assert any(line.split() == ["--batch_size", "10", "(default", "16)"] for line in lines), lines
    assert any(line.split() == ["--size", "16,16", "(default", "64,64)"] for line in lines), lines
    assert any(line.split()[:2] == ["--encoder.cnn_depth", "4"] for line in lines), lines


@pytest.mark.parametrize("steps", ["1e30", "1e16", str(2**53 + 2)])
def test_steps_beyond_what_a_counter_holds_are_refused_at_start(tmp_path, capsys, steps):
    with pytest.raises(SystemExit) as stop:
        dreamer.main(["--configs", "debug", "--steps", steps, "--logdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: Invalid value") and "--steps: at most 2^53" in err, err
    assert len(err.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []
    assert cfg.parse(["--steps", str(2**53)]).steps == 2**53


def test_the_largest_steps_accepted_prints_its_status_line():
    """--steps 2^53 at a slow first rate: the ETA is capped where a timedelta ends, no OverflowError."""
    import logs

    progress = logs.Progress(cfg.LARGEST_COUNT, 0, interactive=False)
    progress.update(100, fps=0.5)
    assert progress.line(100).endswith("ETA 999999999 days, 23:59:59")


@pytest.mark.parametrize("inside", [False, True])
def test_a_symlink_loop_as_logdir_is_one_line(tmp_path, capsys, inside):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    logdir = tmp_path / "a" / "run" if inside else tmp_path / "a"
    with pytest.raises(SystemExit) as stop:
        dreamer.main(["--configs", "debug", "--logdir", str(logdir)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "for --logdir" in err and "symbolic link" in err, err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("value, library, message", [
    ("nonsense", "libEGL.so.1", "Invalid value 'nonsense' for the environment variable MUJOCO_GL; valid: egl"),
    ("osmesa", None, "MUJOCO_GL=osmesa needs libOSMesa, which is not installed: apt-get install libosmesa6"),
    ("egl", None, "MUJOCO_GL=egl needs libEGL, which is not installed: apt-get install libegl1"),
])
def test_mujoco_gl_is_checked_before_dm_control_is_imported(monkeypatch, value, library, message):
    import envs

    environ = {"MUJOCO_GL": value}
    with pytest.raises(envs.TaskError, match=message.replace("(", r"\(")):
        envs.check_rendering(["dmc_walker_walk"], environ, lambda name: library)
    envs.check_rendering(["atari_pong"], environ, lambda name: library)  # renders without MuJoCo
    envs.check_rendering(["dmc_walker_walk"], {}, lambda name: None)  # unset: wrappers.headless_rendering's egl
    envs.check_rendering(["dmc_walker_walk"], {"MUJOCO_GL": "disabled"}, lambda name: None)  # rendering off


def test_a_bad_mujoco_gl_stops_the_script_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MUJOCO_GL", "nonsense")
    with pytest.raises(SystemExit) as stop:
        dreamer.main(["--configs", "debug", "--logdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "MUJOCO_GL; valid: egl" in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_an_ascii_only_stdout_prints_a_non_ascii_logdir_escaped(tmp_path, monkeypatch):
    import io

    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stdout)
    logdir = tmp_path / "r\u00e9sum\u00e9"
    dreamer.main(["--configs", "debug", "--logdir", str(logdir), "--print_config"])
    stdout.flush()
    text = stdout.buffer.getvalue().decode("ascii")
    assert "r\\xe9sum\\xe9" in text and not logdir.exists()


def test_the_bad_input_battery_still_applies_to_configs_yaml(tmp_path, capsys):
    """benchmarks/bad_inputs.py: every edit still finds its text in configs.yaml (an edit that no longer
    applies stops the battery), and its own bad arguments are one line and exit 2."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bad_inputs", ROOT / "benchmarks" / "bad_inputs.py")
    battery = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(battery)
    text = (ROOT / "configs.yaml").read_text()
    for name, (_, args, edit, _, _, expected, _) in battery.CASES.items():
        assert expected in ("refused", "done") and args, name
        if edit is not None:
            assert edit(text) != text, name
    battery.copy_checkout(tmp_path)
    assert {"dreamer.py", "config.py", "configs.yaml", "envs"} <= {p.name for p in tmp_path.iterdir()}
    assert battery.main(["--only", "nosuchcase"]) == 2
    assert "unknown case 'nosuchcase'" in capsys.readouterr().err
