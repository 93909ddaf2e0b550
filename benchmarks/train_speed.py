"""Learner throughput: seconds per update, split into world model / imagination / actor / critic.

Builds the agent exactly as dreamer.py does for a preset, fills a replay from the real
environment with random actions, then times `--updates` updates after `--warmup` ones.

    python3 benchmarks/train_speed.py --configs dmc_proprio --task dmc_walker_walk --device cpu --updates 10

Takes dreamer.py's --configs presets and --key value overrides, plus --updates, --warmup,
--threads, --profile (phase split and top operators) and --no_malloc_tuning (leave glibc's
allocator as it is, to measure what tools.keep_freed_memory buys). The last line printed is
`updates_per_s=<number>`.
"""

import argparse
import os
import pathlib
import resource
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import dreamer  # noqa: E402
import envs  # noqa: E402
import models  # noqa: E402
import tools  # noqa: E402

PHASES = ("world_model", "imagination", "actor", "critic")


def fill_replay(config, steps):
    """A replay of `steps` random-action steps from one real environment, as the loop would make."""
    env = envs.make_env(config, "train", 0)
    replay = tools.Replay(steps, 1, config.seed)
    zero = np.zeros(env.act_space.shape, np.float32)
    # With replay_context, the latents a policy would have stored (zeros: the initial state).
    latents = {k: np.zeros(shape, dtype) for k, (shape, dtype) in models.ReplayContext(config).spec.items()}
    obs, action, reward = env.reset(), zero, 0.0
    for _ in range(steps):
        replay.add({**{k: v for k, v in obs.items() if not k.startswith("log_")},
                    "action": action, "reward": np.float32(reward), **latents})
        action = env.act_space.sample().astype(np.float32)
        obs, reward, done, _ = env.step(action)
        if done:
            obs, action, reward = env.reset(), zero, 0.0
    return env, replay


def peak_memory_mb(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def phase_times(profiler, updates):
    """Wall seconds per update of each labelled phase, from the profiler's own events."""
    totals = dict.fromkeys(PHASES, 0.0)
    for event in profiler.key_averages():
        if event.key in totals:
            totals[event.key] = event.cpu_time_total / 1e6 / updates
    return totals


def top_operators(profiler, count=6):
    """The operators that take most of the time, as 'name share%' pairs."""
    events = [e for e in profiler.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return "  ".join(f"{e.key[6:]} {100 * e.self_cpu_time_total / total:.0f}%" for e in events[:count])


def main(argv=None):
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no_malloc_tuning", action="store_true",
                        help="leave glibc's allocator as it is (dreamer.py tunes it), to measure what the tuning buys")
    parser.add_argument("--profile", action="store_true", help="split the time into phases (adds overhead)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        config, _ = tools.resolve_device(dreamer.parse(rest))
    except tools.ConfigError as e:
        dreamer.fail(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    tools.seed_everything(config.seed, False)
    torch.set_float32_matmul_precision("high")
    if not args.no_malloc_tuning:
        tools.keep_freed_memory()
    env, replay = fill_replay(config, max(2 * config.batch_length, 1000))
    length = config.batch_length + config.replay_context  # the context steps only give the start latent
    agent = dreamer.Dreamer(env.obs_space, env.act_space, config).to(config.device)
    start = time.perf_counter()
    batch = replay.sample(config.batch_size, length)
    sample_ms = 1000 * (time.perf_counter() - start)
    sync = torch.cuda.synchronize if torch.device(config.device).type == "cuda" else lambda: None
    start = time.perf_counter()
    for _ in range(args.warmup):
        agent.train_step(replay.sample(config.batch_size, length))
    sync()
    warmup_s = time.perf_counter() - start
    batches = [replay.sample(config.batch_size, length) for _ in range(args.updates)]
    start = time.perf_counter()
    for batch in batches:
        metrics = agent.train_step(batch)
    float(metrics["model_loss"])
    sync()
    seconds = (time.perf_counter() - start) / args.updates
    print(f"task {config.task}  device {config.device}  threads {torch.get_num_threads()}  compile {config.compile}  "
          f"precision {config.precision}  batch {config.batch_size}x{config.batch_length}")
    print(f"warm-up: {warmup_s:.1f} s for {args.warmup} updates (includes compilation)")
    replayed = config.batch_size * config.batch_length / seconds
    print(f"seconds per update: {seconds:.3f}   replayed steps/s: {replayed:.0f}"
          f"   batch sampling: {sample_ms:.1f} ms   peak memory: {peak_memory_mb(config.device):.0f} MB")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            for batch in batches[:3]:
                agent.train_step(batch)
            sync()
        split = phase_times(profiler, min(3, len(batches)))
        print("phase split (s/update, profiled): " + "  ".join(f"{k} {v:.3f}" for k, v in split.items()))
        print("top operators (share of self time): " + top_operators(profiler))
    print(f"updates_per_s={1 / seconds:.4f}")
    env.close()


if __name__ == "__main__":
    os.environ.setdefault("MUJOCO_GL", "egl")
    main()
