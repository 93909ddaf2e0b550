"""The official DreamerV3's learner speed at the settings of a project command: seconds per update.

    python3 benchmarks/official_speed.py --official ~/dreamerv3 --python ~/dreamerv3/venv/bin/python \\
        --updates 10 --warmup 3 --configs dmc_proprio recipe2024 size1m --task dmc_walker_walk --device cuda

The counterpart of `benchmarks/train_speed.py` for the official code (danijar/dreamerv3, JAX): the same
dreamer.py flags, translated to the official ones by `benchmarks/official.py` (size preset, batch, precision,
replay context, platform; a setting with no official flag is refused there), so that running both scripts with
one command line on one machine gives the two codes' seconds per update side by side.

What it times: `agent.train` (one update of world model, actor and critic in one jitted call) on batches that
are already on the device, `--updates` calls back to back after `--warmup` ones (the first compiles), blocking
on the new weights and carry at the end. train_speed.py times the project's `train_step` the same way, on
batches sampled beforehand. The batches are synthetic, with the official replay stream's keys, shapes and
dtypes (observations, actions, rewards, the flags, and the replay context's latents): speed does not depend on
the values. Its own flags: `--official DIR`, `--python PY` (the interpreter with the official requirements),
`--threads N` (CPU only, as official.py). The last line printed is `updates_per_s=<number>`. Bad input: one
line, exit status 2.

`--interleave ROUNDS` times both codes in one run: this project's update as dreamer.py builds it for the same
command (so `compile auto` settles for the command's `--steps`, as a run of that length would) beside the
official one, in ROUNDS alternating rounds of `--updates` updates (the other code waits meanwhile), one thread
each; both warm up at once. The last line is `ratio=<official seconds per update / the project's>`:

    python3 benchmarks/official_speed.py --official ~/dreamerv3 --python ~/dreamerv3/venv/bin/python \
        --interleave 5 --updates 5 --warmup 2 --configs dmc_proprio recipe2024 size1m \
        --task dmc_cartpole_balance --steps 2e4 --device cpu
"""

import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # last: benchmarks/envs.py must not shadow envs
sys.path.insert(0, str(ROOT))

import official  # noqa: E402
import torch  # noqa: E402
import train_speed  # noqa: E402

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import launch  # noqa: E402

# Run by the official interpreter: argv = checkout, warm-up updates, timed updates, "serve" or "once", official
# flags...
OFFICIAL_SIDE = official.KEEP_XLA_FLAGS + r'''
import time
warmup, updates, serve, flags = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "serve", sys.argv[5:]
from embodied.jax import internal
import elements, jax
import numpy as np
# Newer JAX (0.7 on) takes jit's shardings and static arguments by keyword only; the official code, written
# for 0.4.33, passes them by position. The wrapper names them, changing nothing else.
_jit = jax.jit
def jit_by_position(fun=None, *args, **kwargs):
    names = ("in_shardings", "out_shardings", "static_argnums", "static_argnames", "donate_argnums")
    kwargs.update(zip(names, args))
    return _jit(**kwargs) if fun is None else _jit(fun, **kwargs)
jax.jit = jit_by_position
import ruamel.yaml as yaml
from dreamerv3 import main as official_main

# The config as the official main() settles it: defaults, the named presets, then the flags.
configs = yaml.YAML(typ="safe").load(elements.Path(official_main.folder / "configs.yaml").read())
parsed, other = elements.Flags(configs=["defaults"]).parse_known(flags)
config = elements.Config(configs["defaults"])
for name in parsed.configs:
    config = config.update(configs[name])
config = elements.Flags(config).parse(other)
start = time.perf_counter()
agent = official_main.make_agent(config)
build_s = time.perf_counter() - start

rng = np.random.default_rng(0)
B, T = config.batch_size, config.batch_length + config.replay_context
def batch():
    data = {}
    for key, space in agent.spaces.items():
        shape = (B, T, *space.shape)
        if space.dtype == bool:
            value = np.zeros(shape, bool)
            value[:, 0] = key == "is_first"
        elif key.endswith("/stoch"):  # one-hot latents of the replay context
            value = np.eye(space.shape[-1], dtype=space.dtype)[rng.integers(0, space.shape[-1], shape[:-1])]
        elif space.discrete:
            value = rng.integers(space.low, space.high, shape).astype(space.dtype)
        elif np.isfinite(space.low).all() and np.isfinite(space.high).all():
            value = rng.uniform(space.low, space.high, shape).astype(space.dtype)
        else:
            value = rng.normal(0, 1, shape).astype(space.dtype)
        data[key] = value
    return data
batches = []
for i in range(warmup + updates):
    data = internal.device_put(batch(), agent.train_sharded)
    data["seed"] = agent._seeds(i, agent.train_mirrored)
    batches.append(data)
jax.block_until_ready(batches)
carry = agent.init_train(config.batch_size)
start = time.perf_counter()
for data in batches[:warmup]:
    carry, _, _ = agent.train(carry, data)
jax.block_until_ready((agent.params, carry))
warmup_s = time.perf_counter() - start
def timed():
    global carry
    start = time.perf_counter()
    for data in batches[warmup:]:
        carry, _, _ = agent.train(carry, dict(data))  # train pops the seed: each round needs its own dict
    jax.block_until_ready((agent.params, carry))
    return (time.perf_counter() - start) / updates
if serve:  # interleaved with the project's rounds: one round per line read, its seconds per update back
    print(f"ready build_s={build_s:.2f} warmup_s={warmup_s:.2f}", flush=True)
    rounds = []
    for _ in iter(sys.stdin.readline, ""):
        rounds.append(timed())
        print(f"round {rounds[-1]:.6f}", flush=True)
    seconds = sorted(rounds)[len(rounds) // 2]
else:
    seconds = timed()
losses = {k: float(np.mean(v)) for k, v in agent._take_outs(agent.pending_mets).items() if k.startswith("loss/")}
assert losses and all(np.isfinite(v) for v in losses.values()), losses
params = sum(int(np.prod(v.shape)) for v in agent.params.values())
print(f"official code: jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), "
      f"{config.jax.compute_dtype}, batch {config.batch_size}x{config.batch_length}, {params:,} parameters "
      f"(optimizer state included)")
print(f"build and first compile: {build_s:.1f} s; warm-up: {warmup_s:.1f} s for {warmup} updates")
print(f"seconds per update: {seconds:.4f}   replayed steps/s: {B * config.batch_length / seconds:.0f}")
print(f"updates_per_s={1 / seconds:.4f}", flush=True)
os._exit(0)  # the official prefetch threads are not daemons
'''


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="official_speed.py --official DIR --python PY [--updates N] "
                                           "[--warmup N] [--threads N] DREAMER_FLAGS...")
    official.add_checkout_arguments(parser)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="time this project's update too, alternating ROUNDS rounds of --updates updates")
    return parser.parse_known_args(argv)


def command(args, rest, logdir):
    """(the official interpreter's command, its environment) for a project command line."""
    for name in ("updates", "warmup", "threads") + (("interleave",) if args.interleave else ()):
        if getattr(args, name) < 1:
            raise official.OfficialError(f"--{name} {getattr(args, name)}: give a whole number >= 1")
    if args.official is None:
        raise official.OfficialError("Missing --official DIR: a checkout of danijar/dreamerv3")
    if not (args.official / "dreamerv3" / "main.py").is_file():
        raise official.OfficialError(f"--official {args.official}: no dreamerv3/main.py there")
    config, suite, size = official.settle(rest)
    flags = official.official_flags(config, suite, size, logdir)
    root = str(args.official.resolve())
    env = official.environment(args.threads, logdir, config.device)
    serve = "serve" if args.interleave else "once"
    return [args.python, "-c", OFFICIAL_SIDE, root, str(args.warmup), str(args.updates), serve, *flags], env


def interleaved(args, rest, cmd, env, logdir):
    """Both codes' seconds per update, timed in alternate rounds (while one code is timed the other
    waits, so that a shared machine's load falls on both alike): the project's update as dreamer.py
    builds it for the command (compile as `auto` settles it for the command's --steps), on batches
    of one environment's random-action replay (train_speed.py's), and the official one (its side in
    serve mode). Both warm up at once, one core each. Prints a table and `ratio=<official s/update
    over the project's>`; returns the exit status."""
    log = open(logdir / "official_side.err", "w")
    side = subprocess.Popen(cmd, env=env, cwd=cmd[3], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                            text=True)

    def official_line(want):
        """The side's next protocol line that starts with `want`, as words (the official code's own
        printing, its spaces and parameter tables, passes by)."""
        for line in iter(side.stdout.readline, ""):
            if line.startswith(want):
                return line.split()
        raise SideFailed(f"official_speed.py: the official side ended before '{want}'; the end of its errors:")

    try:
        return interleave_rounds(args, rest, side, official_line)
    except SideFailed as e:
        side.kill()
        side.wait()
        print(e, *(logdir / "official_side.err").read_text().splitlines()[-15:], sep="\n", file=sys.stderr)
        return 1
    finally:
        if side.poll() is None:
            side.kill()
        log.close()


class SideFailed(RuntimeError):
    """The official side ended or wrote something else than the protocol's next line."""


def interleave_rounds(args, rest, side, official_line):
    """The project's warm-up, then the alternating rounds, then the table (interleaved's work)."""
    config, _ = launch.resolve_device(cfg.parse(rest))
    environment, replay, length = train_speed.prepare(config, args.threads)
    build = time.perf_counter()
    agent = dreamer.Dreamer(environment.obs_space, environment.act_space, config).to(config.device)
    for _ in range(args.warmup):
        agent.update.train_step(replay.sample(config.batch_size, length))
    warmup_s = time.perf_counter() - build
    ready = dict(word.split("=") for word in official_line("ready")[1:])
    project, official_rounds = [], []
    for _ in range(args.interleave):
        batches = [replay.sample(config.batch_size, length) for _ in range(args.updates)]
        start = time.perf_counter()
        for batch in batches:
            metrics, _ = agent.update.train_step(batch)
        float(metrics["model_loss"])
        project.append((time.perf_counter() - start) / args.updates)
        side.stdin.write("go\n")
        side.stdin.flush()
        official_rounds.append(float(official_line("round")[1]))
        print(f"round: project {project[-1]:.3f}  official {official_rounds[-1]:.3f} s/update", file=sys.stderr,
              flush=True)
    side.stdin.close()
    summary = official_line("official code:")
    if side.wait() != 0:
        raise SideFailed(f"official_speed.py: the official side failed after its rounds (exit {side.returncode})")
    environment.close()
    compile_note = cfg.compile_note(agent.config, agent.resolved.get("compile"))  # None: given, not auto
    print(f"task {config.task}  device {config.device}  threads {args.threads} each  precision {config.precision}  "
          f"batch {config.batch_size}x{config.batch_length}  torch {torch.__version__}  "
          f"{args.interleave} rounds x {args.updates} updates after {args.warmup} warm-up updates, alternating")
    print(f"project compile: {compile_note}")
    print(" ".join(summary))  # the official side's versions, dtype and sizes
    mid_project, mid_official = statistics.median(project), statistics.median(official_rounds)
    print("| code | warm-up s (both at once) | s/update (median; range) |")
    print("|---|---|---|")
    print(f"| this project | {warmup_s:.1f} | {mid_project:.3f} ({min(project):.3f}-{max(project):.3f}) |")
    print(f"| official | {float(ready['build_s']) + float(ready['warmup_s']):.1f} | {mid_official:.3f} "
          f"({min(official_rounds):.3f}-{max(official_rounds):.3f}) |")
    print(f"ratio={mid_official / mid_project:.3f}")
    return 0


def main(argv=None):
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="official_speed_") as logdir:
        try:
            cmd, env = command(args, rest, pathlib.Path(logdir))
        except official.OfficialError as e:
            print(f"official_speed.py: {e}", file=sys.stderr)
            return 2
        if args.interleave:
            return interleaved(args, rest, cmd, env, pathlib.Path(logdir))
        return subprocess.call(cmd, env=env, cwd=cmd[3])


if __name__ == "__main__":
    sys.exit(main())
