"""What a user reads before a run: --help from configs.yaml, the start-up summary's costs, the
one-line environment status, `debug` on any task, and the README files' commands, flags and links."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import config as cfg
import envs
import logs
import storage
import tools

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "envs" / "README.md"]


def run_cli(*args, timeout=300):
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "dreamer.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


# -- --help from configs.yaml ----------------------------------------------------------------------


def test_every_default_key_has_a_comment_and_appears_in_help():
    rows = cfg.config_reference()
    defaults = tools.flatten(cfg.load_presets()["defaults"])
    assert [key for key, _, _ in rows] == list(defaults)  # every key, in the file's order
    assert not [key for key, _, comment in rows if not comment], "keys without a comment in configs.yaml"
    text = cfg.usage()
    for key, default, comment in rows:
        line = next((line for line in text.splitlines() if line.strip().startswith(f"--{key} ")), None)
        assert line is not None, key
        assert default in line and comment[:40] in line, line


def test_help_topic_narrows_and_an_unknown_one_is_one_line():
    result = run_cli("--help", "critic")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines and all(line.strip().startswith("--critic.") for line in lines), lines
    assert any("--critic.repval 0.0" in line and "replay value loss" in line for line in lines)
    result = run_cli("--help", "nosuchkey")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "No config key starts with 'nosuchkey'; groups: actor, " in result.stderr


def test_continuation_comment_lines_join_their_key():
    rows = {key: comment for key, _, comment in cfg.config_reference()}
    assert rows["imag_gradient"].endswith("(backprop through the model) | reinforce | both")


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_script_answers_help(script):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.lower().startswith("usage"), result.stdout[:300]


# -- the run's cost in the start-up summary ----------------------------------------------------------


@pytest.mark.parametrize("preset, expected", [
    # pretrain + (steps - prefill) / action_repeat * train_ratio / (batch_size * batch_length), by hand:
    ("dmc_proprio", 100 + (500_000 - 2500) // 2 * 512 // (16 * 64)),  # 124,475
    ("atari100k", 100 + (400_000 - 2500) // 4 * 1024 // (16 * 64)),  # 99,475
    ("debug", 1 + int((600 - 1) / 2 * 32 / (10 * 20))),  # 48
])
def test_total_updates_equal_a_hand_computation(preset, expected):
    config = cfg.parse(["--configs", preset])
    assert tools.total_updates(config) == expected


@pytest.mark.slow  # steps the environment 2,050 times
def test_replay_memory_estimate_matches_a_filled_replay():
    config = cfg.parse(["--configs", "debug", "--dataset_size", "2000"])
    env = envs.make_env(config, "train", 0)
    spec = storage.episode_spec(env.obs_space, env.act_space)
    replay = storage.Replay(config.dataset_size, 1)
    obs, rng = env.reset(), np.random.default_rng(0)
    for _ in range(config.dataset_size + 50):  # filled to capacity, and past it
        action = rng.uniform(-1, 1, env.act_space.shape).astype(np.float32)
        replay.add(storage.strip_logs({**obs, "action": action, "reward": np.float32(0), "task": np.int32(0)}))
        obs, _, done, _ = env.step(action)
        if done:
            obs = env.reset()
    estimate = storage.step_bytes(spec) * config.dataset_size
    assert replay.nbytes == pytest.approx(estimate, rel=0.1)
    lines = storage.cost_lines(config, spec, free=10**12)
    assert len(lines) == 1 and lines[0].startswith("Cost: 48 updates to 600 frames; replay ")
    step = storage.step_bytes(spec)  # 600 frames at action repeat 2: 300 of the 2,000 steps
    assert f"by the end (300 steps x {step:,} bytes; at its capacity of 2,000 steps " in lines[0]


@pytest.mark.parametrize("preset, frames, stored", [
    ("dmc_vision", 24_000, 12_000),  # a short run stores what it collects, far below its capacity
    ("atari100k", 400_000, 100_000),
    ("dmc_vision", 4_000_000, 1_000_000),  # a long one fills it
])
def test_the_cost_line_counts_what_the_run_will_store(preset, frames, stored):
    config = cfg.parse(["--configs", preset, "--steps", str(frames)])
    spec = {"image": ((64, 64, 3), np.dtype(np.uint8)), "action": ((6,), np.dtype(np.float32))}
    step = storage.step_bytes(spec)
    replay = stored * step
    lines = storage.cost_lines(config, spec, free=replay + 1)  # room for what it stores: no warning
    assert len(lines) == 1, lines
    gb = f"{replay / 1e9:.3g} GB" if replay >= 1e9 else f"{replay / 1e6:.3g} MB"
    assert f"replay {gb} of memory by the end ({stored:,} steps x {step:,} bytes; at its capacity of " \
           f"1,000,000 steps {step * 1e6 / 1e9:.3g} GB)" in lines[0], lines[0]
    assert storage.cost_lines(config, spec, free=replay - 1)[1].startswith(f"WARNING: the replay will hold {gb} ")


def test_a_replay_that_cannot_fit_in_memory_is_a_warning_naming_dataset_size():
    config = cfg.parse(["--configs", "dmc_vision"])
    spec = {"image": ((64, 64, 3), np.dtype(np.uint8)), "action": ((6,), np.dtype(np.float32))}
    lines = storage.cost_lines(config, spec, free=2 * 10**9)
    assert lines[0].startswith("Cost: 249,475 updates to 1,000,000 frames; replay 6.16 GB of memory by the end "
                               "(500,000 steps x 12,312 bytes; at its capacity of 1,000,000 steps 12.3 GB)")
    assert lines[1].startswith("WARNING: the replay will hold 6.16 GB by the end (500,000 steps) and 2 GB of "
                               "memory is free")
    assert "--dataset_size" in lines[1]


# -- the environments' status in one line -------------------------------------------------------------


def test_status_of_many_environments_is_one_line():
    rows = [{"steps": 100 + i, "episodes": 1, "last_return": 0.0, "restarts": 2 if i == 5 else 0,
             "fps": 10.0 + i, "step_ms": 5.0 if i else float("nan")} for i in range(16)]
    line = logs.env_status_line(rows)
    assert "\n" not in line
    assert line == ("  envs 16 (min/median/max): steps 100/108/115 | episodes 16 | fps 10.0/17.5/25.0 | "
                    "step 5.0/5.0/5.0 ms | restarted: env 5 (2x)")


# -- debug on any task; seeds in range ---------------------------------------------------------------


@pytest.mark.parametrize("task", ["gym_CartPole-v1", "crafter_reward"])
def test_debug_runs_on_vector_and_image_tasks(tmp_path, task):
    result = run_cli("--configs", "debug", "--task", task, "--logdir", str(tmp_path / "run"), "--steps", "60",
                     "--eval_episode_num", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "latest.pt").exists()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 60 and rows[-1]["perf/updates"] > 0  # it trained
    assert any(math.isfinite(row.get("world_model/model_loss", math.nan)) for row in rows), rows[-1]


def test_seed_out_of_range_is_one_line():
    result = run_cli("--configs", "debug", "--seed", "-1", "--logdir", "/tmp/never-written")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: Invalid value '-1' for --seed; valid: a whole number in [0, 2^31)"
    assert not pathlib.Path("/tmp/never-written").exists()


def test_choice_errors_name_auto():
    for key in ("compile", "parallel"):
        with pytest.raises(tools.ConfigError, match=f"Invalid value 'maybe' for --{key}; valid: auto, True, False"):
            cfg.parse([f"--{key}", "maybe"])


# -- the README files ----------------------------------------------------------------------------------


def fenced_commands(text):
    """The lines of the shell blocks (```sh, ```bash or a bare ```), continuations joined."""
    commands, block = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if block is None:
                block = [] if line.strip() in ("```", "```sh", "```bash", "```shell") else False
            else:
                if block:
                    joined = re.sub(r"\\\n\s*", " ", "\n".join(block))
                    commands += [c.strip().removeprefix("$ ") for c in joined.splitlines() if c.strip()]
                block = None
        elif block is not None and block is not False:
            block.append(line)
    return commands


def dreamer_args(command):
    """The arguments after `dreamer.py` in a shell command line, without env assignments or pipes."""
    words = command.split("|")[0].split("#")[0].split()
    if "dreamer.py" not in " ".join(words):
        return None
    index = next(i for i, word in enumerate(words) if word.endswith("dreamer.py"))
    args = []
    for word in words[index + 1:]:
        if word in ("&&", ";", ">", "2>&1") or word.startswith(">"):
            break
        args.append(word.strip("'\"").removesuffix(";"))
        if word.endswith(";"):
            break
    return args


def test_ci_runs_the_readmes_install_and_whole_suite():
    """.ci/run runs the README's install line and its Tests block's command, the whole suite (no -m)."""
    readme = (ROOT / "README.md").read_text()
    commands = fenced_commands(readme)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m")]
    assert ci == ["python3 -m pip install -r requirements.txt", "python3 -m pytest -q"]
    assert all(command in commands for command in ci)
    tests = fenced_commands(readme.split("\n## Tests\n")[1].split("\n## ")[0])
    assert tests == ["python3 -m pytest -q", 'python3 -m pytest -q -m "not slow"']


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_dreamer_command_parses(doc):
    lines = fenced_commands(doc.read_text())
    variables = dict(re.findall(r'^(\w+)="([^"]*)"$', "\n".join(lines), re.M))  # NAME="..." lines of a block
    for name, value in variables.items():
        lines = [line.replace(f"${name}", value) for line in lines]
    commands = [dreamer_args(c) for c in lines]
    commands = [c for c in commands if c is not None]
    if doc.name == "README.md" and doc.parent == ROOT:
        assert len(commands) >= 5, "the README shows how to run"
    for args in commands:
        if "--help" in args:
            continue
        known = []  # a shell variable's value is not known here: it and the flag it belongs to are left out
        for arg in args:
            if "$" in arg:
                if known and known[-1].startswith("--"):
                    known.pop()
                continue
            known.append(arg)
        cfg.parse(known)  # raises ConfigError on any bad key or value


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_named_in_the_prose_exists(doc):
    keys = set(tools.flatten(cfg.load_presets()["defaults"])) | {"configs", "help", "print_config"}
    script_flags = set()
    for script in (ROOT / "benchmarks").glob("*.py"):
        script_flags |= set(re.findall(r"add_argument\(\s*\"--([\w-]+)\"", script.read_text()))
    torchrun = {"nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "standalone", "rdzv_backend",
                "rdzv_endpoint", "rdzv_id", "index-url", "extra-index-url", "upgrade"}
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    unknown = {flag for flag in re.findall(r"(?<![\w-])--([a-zA-Z][\w.-]*)", text)
               if flag not in keys | script_flags | torchrun}
    assert not unknown, f"flags in {doc.name} that nothing takes: {sorted(unknown)}"


def anchors(text):
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: link to {target}: no {file}"
        if anchor:
            assert file.suffix == ".md" and anchor in anchors(file.read_text()), f"{doc.name}: no anchor {target}"


def test_code_layout_table_names_every_top_level_module():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Code layout"):]
    table = table[:table.index("\n## ", 4)]
    named = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
    modules = {p.name for p in ROOT.glob("*.py")} | {"envs/", "configs.yaml", "benchmarks/"}
    assert named == modules, f"README's code layout: missing {sorted(modules - named)}, extra {sorted(named - modules)}"
