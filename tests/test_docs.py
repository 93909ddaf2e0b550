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
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "envs" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
RUN_DOCS = [ROOT / "README.md", ROOT / "envs" / "README.md"]  # every shell command in them runs here or is marked


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
    assert "No config key starts with 'nosuchkey' and no preset is called so; groups: actor, " in result.stderr


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
    commands = [split_mark(command)[0] for command in commands]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m")]
    assert ci == ["python3 -m pip install -r requirements.txt", "python3 -m pytest -q"]
    assert all(command in commands for command in ci)
    tests = [split_mark(c)[0] for c in fenced_commands(readme.split("\n## Tests\n")[1].split("\n## ")[0])]
    assert tests == ["python3 -m pytest -q", 'python3 -m pytest -q -m "not slow"', "ruff check ."]


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
    modules = {p.name for p in ROOT.glob("*.py")} | {"envs/", "configs.yaml", "benchmarks/", "docs/"}
    assert named == modules, f"README's code layout: missing {sorted(modules - named)}, extra {sorted(named - modules)}"


# -- the README files' commands run -------------------------------------------------------------------

# What a command needs that a test cannot give it; an unmarked command runs in test_every_readme_command_runs as
# written, a [long] training command with `debug` added and a short --steps.
MARKS = ("[long]", "[gpu]", "[setup]", "[own install]")


def split_mark(command):
    """(the command without its trailing comment, its mark or None)."""
    found = re.search(r"\s+#\s*(\[[^\]]*\])?.*$", command)
    if not found:
        return command.strip(), None
    return command[:found.start()].strip(), found.group(1)


def is_training(command):
    return bool(re.search(r"(^|\s)(\S*dreamer\.py)(\s|$)", command))


def readme_commands():
    return [(doc, *split_mark(command)) for doc in RUN_DOCS for command in fenced_commands(doc.read_text())]


def test_every_readme_command_runs_in_a_test_or_is_marked():
    commands = readme_commands()
    assert len(commands) >= 20
    for doc, command, mark in commands:
        where = f"{doc.relative_to(ROOT)}: {command}"
        assert mark is None or mark in MARKS, f"{where}: unknown mark {mark} (valid: {', '.join(MARKS)})"
        if mark == "[long]":
            assert is_training(command) or command.startswith("python3 -m pytest"), \
                f"{where}: [long] is for training commands (run here with debug) and the test suite itself"
        if mark is None:
            assert re.match(r"(python3 (dreamer\.py|benchmarks/\w+\.py)|torchrun) ", command), \
                f"{where}: an unmarked command must be one the tests run (dreamer.py, torchrun, benchmarks/)"
        # Everything a command writes goes under ./logdir (ignored by git) or /tmp: nothing in the checkout.
        for flag in ("--logdir", "--output", "--out"):
            for value in re.findall(rf"{flag}\s+(\S+)", command):
                assert value.startswith(("./logdir/", "/tmp/")), f"{where}: {flag} {value} is not under ./logdir"
    assert "logdir/" in (ROOT / ".gitignore").read_text().splitlines()


def with_debug(command, steps):
    """A training command with `debug` stacked last and --steps cut short, on the task the command trains
    (`debug` names a task of its own)."""
    words = command.split()
    if "--task" not in words:
        words += ["--task", cfg.parse(dreamer_args(command)).task]
    if "--configs" in words:
        end = words.index("--configs") + 1
        while end < len(words) and not words[end].startswith("--"):
            end += 1
        if "debug" not in words[:end]:
            words.insert(end, "debug")
    else:
        words += ["--configs", "debug"]
    return " ".join(words + ["--steps", str(steps)])


def files_of_checkout():
    skip = {".git", "logdir", "__pycache__", ".pytest_cache", ".ruff_cache", ".venv"}
    return {str(path.relative_to(ROOT)) for path in ROOT.rglob("*")
            if path.is_file() and not skip & set(path.relative_to(ROOT).parts)}


@pytest.mark.slow  # trains: every training command of both README files, with debug and 200 frames
def test_every_readme_command_runs_and_leaves_the_checkout_as_it_was(tmp_path):
    """Each unmarked command as written and each [long] training command with `debug` and --steps 200, in the
    files' order, from the checkout; ./logdir is moved under tmp_path, and the envs README's own environment module
    is saved where its command looks for it. Exit 0 each, and no file of the checkout made or changed."""
    envs_readme = (ROOT / "envs" / "README.md").read_text()
    module = re.search(r"```python\n(# my_envs.py\n.*?)```", envs_readme, re.S).group(1)
    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "my_envs.py").write_text(module)
    before = files_of_checkout()
    ran = []
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for doc, command, mark in readme_commands():
        if mark is not None and not (mark == "[long]" and is_training(command)):
            continue
        if is_training(command):
            command = with_debug(command, 200)
        command = command.replace("./logdir", f"{tmp_path}/logdir").replace("~/my_envs", f"{tmp_path}/my_envs")
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900, cwd=ROOT,
                                env=env)
        assert result.returncode == 0, f"{doc.name}: {command}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
        ran.append(command)
    assert any("dmc_walker_walk,dmc_walker_run,dmc_cheetah_run" in c and "debug" in c for c in ran)  # multi-task
    assert any("--eval_only" in c for c in ran) and any("benchmarks/plot.py" in c for c in ran)
    assert files_of_checkout() == before
    assert (tmp_path / "logdir" / "smoke" / "plot.png").is_file()  # plot.py wrote beside the run, not in the cwd


STATUS_FIELD = re.compile(r"(?:^| \| )([a-z_]+) ")


@pytest.mark.slow  # trains: the smoke run as README shows it
def test_the_readmes_sample_status_line_is_a_real_runs(tmp_path):
    """README's sample status line has the fields of the smoke run's last status line, in order, and says that a
    terminal shows a tqdm bar instead; it names the commit and date it was printed at."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("\n## Quick start\n")[1].split("\n## ")[0]
    sample = re.search(r"```text\n(frames .*)\n```", quick).group(1)
    assert "tqdm" in quick and re.search(r"commit [0-9a-f]{7}, \d{4}-\d{2}-\d{2}", quick)
    smoke = next(c for doc, c, mark in readme_commands() if mark is None and "./logdir/smoke" in c and
                 "--eval_only" not in c)
    assert smoke == "python3 dreamer.py --configs debug --logdir ./logdir/smoke"
    result = run_cli("--configs", "debug", "--logdir", str(tmp_path / "smoke"))
    assert result.returncode == 0, result.stderr[-2000:]
    last = [line for line in result.stdout.splitlines() if line.startswith("frames ")][-1]
    assert last.startswith("frames 600/600 (100.0%) | ")
    assert STATUS_FIELD.findall(sample) == STATUS_FIELD.findall(last), (sample, last)


def test_the_readme_is_short_and_starts_with_a_run():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("python3 dreamer.py"))
    assert first <= 50


def test_the_wheel_choice_is_three_commands():
    commands = [c for _, c, mark in readme_commands() if c.startswith("python3 -m pip install torch==")]
    assert commands == ["python3 -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
                        "python3 -m pip install torch==2.13.0",
                        "python3 -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"]
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert all(f"torch=={pinned}" in c for c in commands)


def test_the_readme_states_what_it_does_not_know_and_the_facts_agree_with_the_sources():
    readme = (ROOT / "README.md").read_text()
    clone = next(c for _, c, _ in readme_commands() if c.startswith("git clone"))
    assert "<" not in clone and "REPOSITORY" in clone and "no public address" in readme  # a placeholder, said so
    # The GPU visit's bugs: README and benchmarks/README count the same.
    bench = (ROOT / "benchmarks" / "README.md").read_text()
    visit = re.search(r"^### The first GPU visit .*?, (\w+) CUDA bugs$", bench, re.M).group(1)
    assert visit == "two" and "found and fixed two bugs" in readme
    # The official commit the recipe follows: configs.yaml, official.py and README name the same.
    commit = re.search(r"at the commit the project follows \(([0-9a-f]{7})\)",
                       (ROOT / "benchmarks" / "official.py").read_text()).group(1)
    header = (ROOT / "configs.yaml").read_text().split("\nrecipe2024:")[0].rsplit("\n\n", 1)[1]
    assert f"commit {commit}" in header and "HEAD" not in header
    assert f"at commit {commit}" in readme
    # The recipe commands' replay: the official 5e6 said beside them.
    recipes = readme.split("\n## Two recipes\n")[1].split("```")[0]
    assert "5e6" in recipes and "dataset_size" in recipes
    shown = [c for _, c, _ in readme_commands()]
    assert any("--expl_behavior plan2explore" in c for c in shown)  # Plan2Explore's flag, as a command
    assert "ruff check ." in shown


def test_the_envs_readme_example_environment_runs_and_shadows_nothing(tmp_path):
    import gymnasium

    text = (ROOT / "envs" / "README.md").read_text()
    assert "Reacher-v0" not in text.replace("PointReacher-v0", "")
    module = re.search(r"```python\n(# my_envs.py\n.*?)```", text, re.S).group(1)
    ids = re.findall(r'gymnasium.register\("([^"]+)"', module)
    assert ids and not set(ids) & set(gymnasium.registry), "the example registers over one of Gymnasium's own ids"
    (tmp_path / "my_envs.py").write_text(module)
    sys.path.insert(0, str(tmp_path))
    try:
        import my_envs  # noqa: F401
        env = gymnasium.make(ids[0], disable_env_checker=True)
        obs, _ = env.reset(seed=0)
        assert env.observation_space.contains(obs)
        obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        assert env.observation_space.contains(obs) and reward <= 0 and not truncated
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_envs", None)
        for name in ids:
            gymnasium.registry.pop(name, None)
