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
"""

import argparse
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # last: benchmarks/envs.py must not shadow envs
sys.path.insert(0, str(ROOT))

import official  # noqa: E402

# Run by the official interpreter: argv = checkout, warm-up updates, timed updates, official flags...
OFFICIAL_SIDE = official.KEEP_XLA_FLAGS + r'''
import time
warmup, updates, flags = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
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
start = time.perf_counter()
for data in batches[warmup:]:
    carry, _, metrics = agent.train(carry, data)
jax.block_until_ready((agent.params, carry))
seconds = (time.perf_counter() - start) / updates
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
    return parser.parse_known_args(argv)


def command(args, rest, logdir):
    """(the official interpreter's command, its environment) for a project command line."""
    for name in ("updates", "warmup", "threads"):
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
    return [args.python, "-c", OFFICIAL_SIDE, root, str(args.warmup), str(args.updates), *flags], env


def main(argv=None):
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="official_speed_") as logdir:
        try:
            cmd, env = command(args, rest, pathlib.Path(logdir))
        except official.OfficialError as e:
            print(f"official_speed.py: {e}", file=sys.stderr)
            return 2
        return subprocess.call(cmd, env=env, cwd=cmd[3])


if __name__ == "__main__":
    sys.exit(main())
