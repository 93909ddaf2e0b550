"""Run the official DreamerV3 (danijar/dreamerv3, JAX) with the settings of a project command.

    python3 benchmarks/official.py --official ~/dreamerv3 --python ~/dreamerv3/venv/bin/python \\
        --configs dmc_proprio recipe2024 size1m --task dmc_cheetah_run --seed 0 --steps 2e4 \\
        --train_ratio 256 --batch_size 16 --batch_length 32 --envs 1 --device cpu --logdir ./logdir/off_s0

Everything after the wrapper's own flags is a `dreamer.py` command line: it is parsed by this project's
parser (presets, overrides, validation), and the settled values are translated to the official flags:
task, seed, frames (`steps`: frames here, policy steps there, `run.steps = steps / action_repeat`),
train ratio, batch size and length, the model size preset (`size1m` ... `size400m`, required: the official
defaults are another size), environments, action repeat (`env.dmc.repeat`), precision
(`jax.compute_dtype`), `replay_context`, the replay's capacity (`dataset_size`: `replay.size`), the one
optimizer's learning rate, warm-up, AGC and epsilon (`model_lr`, `warmup`, `agc`, `opt_eps`: `agent.opt.*`;
the actor's and critic's must equal them) and the device (`jax.platform`). Any other key changed from the
presets' value has no official flag and is refused (where the project logs, evaluates and saves is free).
The official code at the commit the project follows (e3f0224) is the 2024 recipe, so the command must name
`recipe2024`.

How the two runs start, and what the translation cannot remove:
- The start: the official code has no random prefill; it trains once its replay holds one batch, collected by
  its own untrained policy, then at the train ratio. recipe2024's start is the same (`--prefill_policy agent
  --prefill 0 --pretrain 1`, dreamer.agent_prefill); a command that changes it is refused.
- Its train script does not evaluate: only training-episode returns are compared (`train/return`).

The wrapper's own flags: `--official DIR` (a checkout of danijar/dreamerv3 with its requirements installed
in the interpreter `--python`; set them up as its README says; on this project's CPU machines JAX 0.4.33's
CPU wheels and numpy<2 worked), `--threads N` (one thread by default: OMP_NUM_THREADS and XLA's Eigen pool;
the official code overwrites XLA_FLAGS in `embodied.jax.internal.setup`, so the wrapper starts it through a
launcher that puts the caller's flags back after that call, and changes no file of the checkout),
`--dry-run` (print the command and environment, start nothing) and `--convert` (only rewrite the outputs).

Outputs, in LOGDIR: `official/` (the official logdir: its checkpoint, `scores.jsonl`, `metrics.jsonl`),
`metrics.jsonl` in this project's form (one row per training episode: `step` in frames, without the official
counter's reset steps (`frames_of`), `train/return`,
`train/length`, `train/episodes`), rewritten from `official/scores.jsonl` after the run and by `--convert`,
and `config.yaml` (task, seed, the translated settings, `code: official`), so that `benchmarks/plot.py`
and `benchmarks/scores.py` read it as a run of the task. Rerunning the same command resumes from the
official checkpoint. Bad input ends with one line and exit status 2.
"""

import argparse
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import config as cfg  # noqa: E402
import storage  # noqa: E402
import tools  # noqa: E402

SIZES = tuple(f"size{n}m" for n in (1, 12, 25, 50, 100, 200, 400))
SUITES = {"dmc_proprio": "dmc_proprio", "dmc_vision": "dmc_vision"}  # project preset -> official preset
PRECISIONS = {"32": "float32", "bf16": "bfloat16", "16": "float16"}
PLATFORMS = {"cpu": "cpu", "cuda": "cuda"}
IGNORED_PRESETS = ("recipe2024",)  # the official code is this recipe
DMC_EPISODE = 1000  # frames: every DMC task's time limit

# The start of every program run by the official interpreter (argv[1]: the checkout): the caller's XLA_FLAGS
# are put back after embodied.jax.internal.setup, which replaces the variable before the backend starts and
# would undo the single-thread flags.
KEEP_XLA_FLAGS = """
import os, sys
sys.path.insert(0, sys.argv[1])
_flags = os.environ.get("XLA_FLAGS", "")
from embodied.jax import internal as _internal
_setup = _internal.setup
def _setup_keeping_flags(*a, **k):
    _setup(*a, **k)
    os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), _flags) if f)
_internal.setup = _setup_keeping_flags
"""

# Runs the official main.py with the caller's XLA_FLAGS kept.
LAUNCHER = KEEP_XLA_FLAGS + """
import runpy
root, args = sys.argv[1], sys.argv[2:]
sys.argv = [os.path.join(root, "dreamerv3", "main.py"), *args]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# The project's keys the wrapper passes on (official_flags) or checks (check_start); under update 'joint'
# (recipe2024's, the official code's) one optimizer steps every network at model_lr, warm-up, agc and
# opt_eps, so the actor's and critic's own optimizer keys change nothing (the project warns of them).
TRANSLATED = ("task", "seed", "steps", "train_ratio", "batch_size", "batch_length", "envs", "action_repeat",
              "precision", "replay_context", "replay_online", "device", "prefill", "prefill_policy", "pretrain",
              "dataset_size",
              "model_lr", "warmup", "agc", "opt_eps", "actor.lr", "critic.lr", "actor.eps", "critic.eps")
# Keys that change nothing the official run computes: where and how often the project logs, evaluates and
# saves, and its own machinery (the keys config.SCHEMA marks free on resume, but the asynchronous loop,
# which the official train script does not have).
NO_EFFECT = tuple(key for key, row in cfg.SCHEMA.items() if row.free and key not in ("asynchronous", "eval_only"))


class OfficialError(ValueError):
    """A user mistake in the wrapper's command line: one line, exit status 2."""


def settle(argv):
    """(project Config, suite preset, size preset) of a dreamer.py command line."""
    try:
        config = cfg.parse(argv)
    except tools.ConfigError as e:
        raise OfficialError(str(e)) from None
    names = []
    if "--configs" in argv:
        start = argv.index("--configs") + 1
        while start < len(argv) and not argv[start].startswith("--"):
            names.append(argv[start])
            start += 1
    suites = [n for n in names if n in SUITES]
    sizes = [n for n in names if n in SIZES]
    other = [n for n in names if n not in SUITES and n not in SIZES and n not in IGNORED_PRESETS]
    if len(suites) != 1:
        raise OfficialError(f"--configs must name one suite preset of {', '.join(SUITES)}; got {names or 'none'}")
    if len(sizes) != 1:
        raise OfficialError(f"--configs must name one model size of {', '.join(SIZES)}; got {names or 'none'}")
    if "recipe2024" not in names:
        raise OfficialError("--configs must name recipe2024: the official code is the 2024 recipe (compare the "
                            "paper's v1 recipe against benchmarks/reference_curves.json instead)")
    if other:
        raise OfficialError(f"presets with no official counterpart: {', '.join(other)}; valid: "
                            f"{', '.join((*SUITES, *SIZES, *IGNORED_PRESETS))}")
    if "," in config.task or not config.task.startswith("dmc_"):
        raise OfficialError(f"--task {config.task}: the wrapper runs one DMC task (dmc_<domain>_<task>)")
    # Every other setting must be the presets' own: a change the official flags cannot carry would make the
    # two codes run different settings without a word.
    presets = tools.flatten(cfg.parse(["--configs", *names]).to_dict())
    settled = tools.flatten(config.to_dict())
    untranslated = sorted(key for key, value in settled.items()
                          if value != presets.get(key) and key not in TRANSLATED and key not in NO_EFFECT)
    if untranslated:
        shown = ", ".join(f"--{key} {settled[key]}" for key in untranslated)
        raise OfficialError(f"{shown}: no official flag carries {'this' if len(untranslated) == 1 else 'these'}; "
                            f"the wrapper passes on {', '.join(TRANSLATED)} (and ignores where the project logs, "
                            "evaluates and saves)")
    # (A changed --update is refused above: recipe2024's 'joint' is the official code's one optimizer.)
    if len({config.model_lr, config.actor.lr, config.critic.lr}) > 1 \
            or len({config.opt_eps, config.actor.eps, config.critic.eps}) > 1:
        raise OfficialError("--model_lr, --actor.lr and --critic.lr (and --opt_eps, --actor.eps, --critic.eps) must "
                            "be equal: the official code steps every network with one optimizer")
    return config, SUITES[suites[0]], sizes[0]


def check_start(config):
    """The official code's start, recipe2024's own: its untrained policy acts until the replay holds one batch,
    then one update and the train ratio from there (dreamer.agent_prefill)."""
    if config.prefill_policy != "agent" or config.prefill != 0 or config.pretrain != 1:
        raise OfficialError(
            f"--prefill_policy {config.prefill_policy} --prefill {config.prefill:g} --pretrain {config.pretrain}: "
            "the official code starts with its untrained policy and trains once its replay holds one batch; "
            "leave recipe2024's start (--prefill_policy agent --prefill 0 --pretrain 1)")
    if config.steps % config.action_repeat:
        raise OfficialError(f"--steps {config.steps:g} is not a multiple of --action_repeat {config.action_repeat}")


def official_flags(config, suite, size, logdir):
    """The official main.py flags for the settled project config."""
    precision = str(config.precision)
    if precision not in PRECISIONS:
        raise OfficialError(f"--precision {precision}: valid: {', '.join(PRECISIONS)}")
    if config.device not in PLATFORMS:
        raise OfficialError(f"--device {config.device}: the wrapper runs on {', '.join(PLATFORMS)}")
    report_length = min(32, config.batch_length)  # the official report stream needs report_length <= batch_length
    return [
        "--configs", suite, size,
        "--task", config.task,
        "--seed", str(config.seed),
        "--logdir", str(logdir),
        "--batch_size", str(config.batch_size),
        "--batch_length", str(config.batch_length),
        "--report_length", str(report_length),
        "--replay_context", str(config.replay_context),
        "--replay.online", str(bool(config.replay_online)),
        "--replay.size", str(int(config.dataset_size)),
        "--agent.opt.lr", repr(float(config.model_lr)),
        "--agent.opt.warmup", str(int(config.warmup)),
        "--agent.opt.agc", repr(float(config.agc)),
        "--agent.opt.eps", repr(float(config.opt_eps)),
        "--env.dmc.repeat", str(config.action_repeat),
        "--run.steps", str(int(config.steps // config.action_repeat)),
        "--run.train_ratio", str(float(config.train_ratio)),
        "--run.envs", str(config.envs),
        "--run.log_every", "120",  # seconds in the official code
        "--run.report_every", "600",
        "--run.save_every", "300",
        "--jax.platform", PLATFORMS[config.device],
        "--jax.jit", "True",
        "--jax.prealloc", str(config.device == "cuda"),
        "--jax.compute_dtype", PRECISIONS[precision],
        "--logger.outputs", "jsonl",
    ]


def environment(threads, logdir, device):
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MUJOCO_GL", "egl")
    env["JAX_COMPILATION_CACHE_DIR"] = str(logdir / "jax_cache")
    if device == "cpu":
        env["OMP_NUM_THREADS"] = str(threads)
        if threads == 1:  # XLA's CPU client has no thread-count flag: one thread is "no Eigen pool"
            env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false"]).strip()
    return env


def frames_of(step, repeat):
    """The frames an official step count holds. Its counter counts each episode's first (reset) step as a
    policy step of `repeat` frames, which acts on no frame: a DMC episode of 1,000 frames ends 1,000 + repeat
    counted frames later (walker at repeat 2: 1002, 2004, ...). This project counts frames."""
    return int(round(step * DMC_EPISODE / (DMC_EPISODE + repeat)))


def convert(logdir, config, settings):
    """LOGDIR/metrics.jsonl (this project's form, `step` in frames: frames_of) and config.yaml from
    official/scores.jsonl."""
    scores = logdir / "official" / "scores.jsonl"
    rows = []
    if scores.is_file():
        for line in scores.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a run still writing
            if "episode/score" in record:
                rows.append(record)
    lengths = {}
    metrics = logdir / "official" / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "episode/length" in record:
                lengths[record["step"]] = record["episode/length"]
    out = []
    for count, record in enumerate(sorted(rows, key=lambda r: r["step"]), 1):
        row = {"step": frames_of(record["step"], config.action_repeat), "train/return": float(record["episode/score"]),
               "train/episodes": count}
        if record["step"] in lengths:
            row["train/length"] = lengths[record["step"]]
        out.append(json.dumps(row))
    storage.atomic_write_bytes(logdir / "metrics.jsonl", "".join(line + "\n" for line in out).encode())
    saved = {"code": "official", "task": config.task, "seed": config.seed, **settings}
    storage.atomic_write_bytes(logdir / "config.yaml", "".join(f"{k}: {json.dumps(v)}\n" for k, v in saved.items())
                               .encode())
    return len(out)


def check_interpreter(python):
    """--python must name an interpreter this machine can start (checked before the logdir is made)."""
    found = shutil.which(python) if os.sep not in python else python
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        raise OfficialError(f"--python {python}: no executable interpreter there; give the Python that has the "
                            "official code's requirements (e.g. ~/dreamerv3/venv/bin/python)")


def add_checkout_arguments(parser):
    """--official and --python: the official checkout and its interpreter (same_weights.py takes them too)."""
    parser.add_argument("--official", type=pathlib.Path, help="a checkout of danijar/dreamerv3")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with its requirements")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="official.py --official DIR --python PY [--threads N] [--dry-run] "
                                           "[--convert] DREAMER_FLAGS...")
    add_checkout_arguments(parser)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--convert", action="store_true")
    return parser.parse_known_args(argv)


def main(argv=None):
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.threads < 1:
            raise OfficialError(f"--threads {args.threads}: give a whole number >= 1")
        config, suite, size = settle(rest)
        if not config.logdir:
            raise OfficialError("Missing --logdir")
        check_start(config)
        logdir = pathlib.Path(config.logdir).expanduser().resolve()
        flags = official_flags(config, suite, size, logdir / "official")
        settings = {"suite": suite, "size": size, "steps": config.steps, "train_ratio": config.train_ratio,
                    "batch_size": config.batch_size, "batch_length": config.batch_length, "envs": config.envs,
                    "action_repeat": config.action_repeat, "precision": str(config.precision),
                    "device": config.device, "threads": args.threads}
        if args.convert:
            print(f"{convert(logdir, config, settings)} episodes -> {logdir / 'metrics.jsonl'}")
            return 0
        if args.official is None and not args.dry_run:
            raise OfficialError("Missing --official DIR: a checkout of danijar/dreamerv3")
        main_py = (args.official or pathlib.Path("<official>")) / "dreamerv3" / "main.py"
        if not args.dry_run and not main_py.is_file():
            raise OfficialError(f"--official {args.official}: no dreamerv3/main.py there")
        if not args.dry_run:
            check_interpreter(args.python)
    except OfficialError as e:
        print(f"official.py: {e}", file=sys.stderr)
        return 2
    root = str((args.official or pathlib.Path("<official>")).resolve() if args.official else "<official>")
    command = [args.python, "-c", LAUNCHER, root, *flags]
    env = environment(args.threads, logdir, config.device)
    if args.dry_run:
        shown = {k: env[k] for k in ("OMP_NUM_THREADS", "XLA_FLAGS", "MUJOCO_GL") if k in env}
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()), shlex.join([args.python, "-c",
              "<launcher>", root, *flags]))
        return 0
    (logdir / "official").mkdir(parents=True, exist_ok=True)
    code = subprocess.call(command, env=env, cwd=root)
    count = convert(logdir, config, settings)
    print(f"official.py: exit {code}; {count} training episodes -> {logdir / 'metrics.jsonl'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
