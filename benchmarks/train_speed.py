"""Learner throughput: seconds per update, split into world model / imagination / actor / critic.

Builds the agent exactly as dreamer.py does for a preset, fills a replay from the real
environment with random actions, then times `--updates` updates after `--warmup` ones.

    python3 benchmarks/train_speed.py --configs dmc_proprio --task dmc_walker_walk --device cpu --updates 10

Takes dreamer.py's --configs presets and --key value overrides, plus --updates, --warmup,
--threads, --profile (phase split, top operators and operator calls per update),
--kernel_profile (compile with Inductor's kernel profiling, which names every compiled kernel in
the profile, so that --profile and --compare count compiled kernel calls; it lengthens the C++
compilation, by 25-50 s of a 260-300 s warm-up at recipe2024 size1m, so a warm-up timed with it is
not a user's) and --no_malloc_tuning (leave glibc's allocator as it is, to measure what
launch.keep_freed_memory buys). The last line printed is `updates_per_s=<number>`.

--compare times several settings side by side in one process, interleaved over --rounds rounds
of --updates updates each (so that a shared machine's load affects all alike): every --compile
value of --compile_modes (False: eager, True: per-step compile, update: the whole update) at every --precision of
--precisions. It prints one table row per setting: warm-up seconds (the first --warmup updates,
compilation included), seconds per update (median over the rounds), speed relative to the first
setting, operator calls in one profiled update: aten operators (leaf calls, those that call no
other aten operator: about one kernel launch each on a GPU) and compiled (fused) kernels (counted
with --kernel_profile; without it a compiled setting's count reads "not counted"), and the
warm-up's CPU seconds (this process and the compiler processes it ran; on a loaded machine the
work the warm-up took).

    python3 benchmarks/train_speed.py --configs dmc_proprio recipe2024 size1m --task dmc_cartpole_balance \
        --device cpu --batch_size 16 --batch_length 64 --threads 1 --compare --updates 3 --rounds 3

--seeds N times one seed's update alone (at the given --compile) against N seeds in one batched
update (seeds.py, eager), interleaved over --rounds rounds; its last line is `ratio: X`, the
seed-updates per second of the N batched over those of one alone.

    python3 benchmarks/train_speed.py --configs dmc_proprio recipe2024 size1m --task dmc_cartpole_balance \
        --device cpu --threads 1 --seeds 4 --compile False --updates 5 --rounds 3
"""

import argparse
import os
import pathlib
import resource
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import envs  # noqa: E402
import launch  # noqa: E402
import models  # noqa: E402
import seeds  # noqa: E402
import storage  # noqa: E402
import tools  # noqa: E402

PHASES = ("world_model", "imagination", "actor", "critic")


def fill_replay(config, steps):
    """A replay of `steps` random-action steps from one real environment, as the loop would make."""
    env = envs.make_env(config, "train", 0)
    replay = storage.Replay(steps, 1, config.seed)
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


def prepare(config, threads, malloc_tuning=True):
    """The process set up as dreamer.py sets up a run (torch threads, 0: torch's default; seeds, matmul
    precision, glibc's allocator) and a replay to time updates on: (environment, replay, length of a
    sampled sequence)."""
    if threads:
        torch.set_num_threads(threads)
    launch.seed_everything(config.seed, False)
    torch.set_float32_matmul_precision("high")
    if malloc_tuning:
        launch.keep_freed_memory()
    env, replay = fill_replay(config, max(2 * config.batch_length, 1000))
    return env, replay, config.batch_length + config.replay_context  # the context steps only give the start latent


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


def usage():
    return ("usage: python3 benchmarks/train_speed.py [--configs PRESET ...] [--KEY VALUE ...] [--updates N] "
            "[--warmup N] [--threads N] [--profile] [--kernel_profile] [--no_malloc_tuning] "
            "[--compare [--compile_modes M,...] [--precisions P,...] [--rounds N]] [--seeds N [--rounds N]]\n\n"
            + __doc__.strip() + "\n\nConfig keys and presets: python3 dreamer.py --help")


def leaf_operator_calls(profiler):
    """(aten operator calls that call no other aten operator, compiled kernel calls) in the
    profiled events. The compiled kernels are visible only with inductor's kernel profiling on
    (--kernel_profile, set before anything compiles)."""
    aten = kernels = 0
    for event in profiler.events():
        if event.name.startswith("aten::"):
            aten += not any(child.name.startswith("aten::") for child in event.cpu_children)
        elif "cpp_fused" in event.name or "triton_" in event.name:
            kernels += 1
    return aten, kernels


def kernel_launches(agent, batches, sync):
    """Kernel and CUDA-graph launches from the host per update on CUDA (the runtime calls that
    start work on the GPU, counted by torch.profiler over len(batches) updates): the number a
    launch-bound update pays for; a captured CUDA graph is one launch."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for batch in batches:
            agent.update.train_step(batch)
        sync()
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch",
             "cudaMemcpyAsync", "cudaMemsetAsync")
    return sum(event.name in names for event in profiler.events()) / len(batches)


def cpu_seconds():
    """CPU seconds of this process and of its ended children (Inductor's C++ compiler runs): on a
    loaded machine the work a warm-up took, which its wall time overstates."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def compare(args, config, env, replay, length):
    """Every setting of --compile_modes x --precisions on one replay, interleaved; one table."""
    import statistics

    sync = torch.cuda.synchronize if torch.device(config.device).type == "cuda" else lambda: None
    settings = [(cfg.parse(["--compile", mode]).compile, cfg.parse(["--precision", precision]).precision)
                for mode in args.compile_modes.split(",") for precision in args.precisions.split(",")]
    agents, warmups, warmup_cpu = {}, {}, {}
    for setting in settings:
        compile_, precision = setting
        torch.manual_seed(config.seed)
        agent_config = config.replace(compile=compile_, precision=precision)
        agents[setting] = dreamer.Dreamer(env.obs_space, env.act_space, agent_config).to(config.device)
        start, cpu = time.perf_counter(), cpu_seconds()
        for _ in range(args.warmup):
            agents[setting].update.train_step(replay.sample(config.batch_size, length))
        sync()
        warmups[setting], warmup_cpu[setting] = time.perf_counter() - start, cpu_seconds() - cpu
        print(f"compile {compile_} precision {precision}: warm-up {warmups[setting]:.1f} s "
              f"({warmup_cpu[setting]:.1f} CPU s)", file=sys.stderr, flush=True)
    times = {setting: [] for setting in settings}
    for _ in range(args.rounds):
        batches = [replay.sample(config.batch_size, length) for _ in range(args.updates)]
        for setting in settings:
            start = time.perf_counter()
            for batch in batches:
                metrics, _ = agents[setting].update.train_step(batch)
            float(metrics["model_loss"])
            sync()
            times[setting].append((time.perf_counter() - start) / args.updates)
        print("round: " + "  ".join(f"{t[-1]:.3f}" for t in times.values()) + " s/update", file=sys.stderr, flush=True)
    calls = {}
    for setting in settings:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            agents[setting].update.train_step(replay.sample(config.batch_size, length))
            sync()
        aten, kernels = leaf_operator_calls(profiler)
        # An eager update (compile False, or auto settled so) runs no compiled kernel.
        counted = args.kernel_profile or agents[setting].config.compile is False
        calls[setting] = (f"{aten:,}", f"{kernels:,}" if counted else "not counted")
    print(f"task {config.task}  device {config.device}  threads {torch.get_num_threads()}  "
          f"batch {config.batch_size}x{config.batch_length}  torch {torch.__version__}  "
          f"{args.rounds} rounds x {args.updates} updates after {args.warmup} warm-up updates")
    print("| compile | precision | warm-up s | s/update (median; range) | speed vs first | aten ops/update "
          "| compiled kernels/update | warm-up CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    first = statistics.median(times[settings[0]])
    for setting in settings:
        median = statistics.median(times[setting])
        print(f"| {setting[0]} | {setting[1]} | {warmups[setting]:.2f} | {median:.3f} "
              f"({min(times[setting]):.3f}-{max(times[setting]):.3f}) | {first / median:.2f}x "
              f"| {calls[setting][0]} | {calls[setting][1]} | {warmup_cpu[setting]:.1f} |")
    print(f"updates_per_s={1 / statistics.median(times[settings[-1]]):.4f}")


def seeds_speed(args, config, env, replay, length):
    """--seeds N: one seed's update alone (at the config's --compile) and N seeds' batched update
    (eager, as --seeds runs it), interleaved over --rounds rounds of --updates updates each; prints
    the seed-updates per second of both and `ratio: X`, the batched ones over the alone ones."""
    if args.seeds < 1:
        cfg.fail(f"Invalid value '{args.seeds}' for --seeds; valid: a whole number >= 1")
    alone = dreamer.Dreamer(env.obs_space, env.act_space, config).to(config.device)
    eager = config.replace(compile=False)
    agents, generators = [], []
    for k in range(args.seeds):
        torch.manual_seed(config.seed + k)
        agents.append(dreamer.Dreamer(env.obs_space, env.act_space, eager).to(config.device))
        generators.append(seeds.seed_generator(config.device))
    batched = seeds.BatchedUpdate(agents, generators)
    sync = torch.cuda.synchronize if torch.device(config.device).type == "cuda" else lambda: None

    def one(batches):
        for batch in batches[0]:
            metrics, _ = alone.update.train_step(batch)
        float(metrics["model_loss"])

    def many(batches):
        for i in range(args.updates):
            results = batched.run({k: (batches[k][i], None) for k in range(args.seeds)})
        float(results[0][0]["model_loss"])

    def sample():
        return [[replay.sample(config.batch_size, length) for _ in range(args.updates)] for _ in range(args.seeds)]

    start = time.perf_counter()
    for _ in range(args.warmup):
        one(sample())
        many(sample())
    sync()
    warmup_s = time.perf_counter() - start
    times = {"one": [], "many": []}
    for _ in range(args.rounds):
        for name, fn in (("one", one), ("many", many)):
            batches = sample()
            start = time.perf_counter()
            fn(batches)
            sync()
            times[name].append((time.perf_counter() - start) / args.updates)
    alone_s, batched_s = statistics.median(times["one"]), statistics.median(times["many"])
    print(f"task {config.task}  device {config.device}  threads {torch.get_num_threads()}  batch "
          f"{config.batch_size}x{config.batch_length}  one seed: compile {alone.config.compile}; {args.seeds} seeds "
          f"batched: eager  ({args.rounds} rounds of {args.updates} updates, warm-up {warmup_s:.1f} s)")
    print(f"one seed: {alone_s:.3f} s per update, {1 / alone_s:.3f} seed-updates/s")
    print(f"{args.seeds} seeds batched: {batched_s:.3f} s per update, {args.seeds / batched_s:.3f} seed-updates/s "
          f"({batched_s / alone_s:.2f}x one seed's time)   peak memory: {peak_memory_mb(config.device):.0f} MB")
    print(f"ratio: {(args.seeds / batched_s) / (1 / alone_s):.2f}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(usage())
        return
    # allow_abbrev off: --compile is the config key, not an abbreviation of --compile_modes
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no_malloc_tuning", action="store_true",
                        help="leave glibc's allocator as it is (dreamer.py tunes it), to measure what the tuning buys")
    parser.add_argument("--profile", action="store_true", help="split the time into phases (adds overhead)")
    parser.add_argument("--kernel_profile", action="store_true",
                        help="compile with Inductor's kernel profiling, to count compiled kernels (a longer warm-up)")
    parser.add_argument("--compare", action="store_true", help="time --compile_modes x --precisions side by side")
    parser.add_argument("--compile_modes", default="False,True")
    parser.add_argument("--precisions", default="32,bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=0,
                        help="time N seeds in one batched update (seeds.py) against one seed alone")
    args, rest = parser.parse_known_args(argv)
    try:
        config, _ = launch.resolve_device(cfg.parse(rest))
        for precision in args.precisions.split(",") if args.compare else ():
            cfg.parse([*rest, "--precision", precision])
        for mode in args.compile_modes.split(",") if args.compare else ():
            cfg.parse([*rest, "--compile", mode])
    except tools.ConfigError as e:
        cfg.fail(str(e))
    # Set before anything compiles: it changes the generated code.
    torch._inductor.config.cpp.enable_kernel_profile = args.kernel_profile
    env, replay, length = prepare(config, args.threads, malloc_tuning=not args.no_malloc_tuning)
    if args.compare:
        compare(args, config, env, replay, length)
        env.close()
        return
    if args.seeds:
        seeds_speed(args, config, env, replay, length)
        env.close()
        return
    agent = dreamer.Dreamer(env.obs_space, env.act_space, config).to(config.device)
    start = time.perf_counter()
    batch = replay.sample(config.batch_size, length)
    sample_ms = 1000 * (time.perf_counter() - start)
    sync = torch.cuda.synchronize if torch.device(config.device).type == "cuda" else lambda: None
    start = time.perf_counter()
    for _ in range(args.warmup):
        agent.update.train_step(replay.sample(config.batch_size, length))
    sync()
    warmup_s = time.perf_counter() - start
    batches = [replay.sample(config.batch_size, length) for _ in range(args.updates)]
    start = time.perf_counter()
    for batch in batches:
        metrics, _ = agent.update.train_step(batch)
    float(metrics["model_loss"])
    sync()
    seconds = (time.perf_counter() - start) / args.updates
    print(f"task {config.task}  device {config.device}  threads {torch.get_num_threads()}  compile {config.compile}  "
          f"precision {config.precision}  batch {config.batch_size}x{config.batch_length}")
    print(f"warm-up: {warmup_s:.1f} s for {args.warmup} updates (includes compilation)")
    replayed = config.batch_size * config.batch_length / seconds
    print(f"seconds per update: {seconds:.3f}   replayed steps/s: {replayed:.0f}"
          f"   batch sampling: {sample_ms:.1f} ms   peak memory: {peak_memory_mb(config.device):.0f} MB")
    if torch.device(config.device).type == "cuda":
        print(f"kernel launches per update: {kernel_launches(agent, batches[:2], sync):.0f}")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            for batch in batches[:3]:
                agent.update.train_step(batch)
            sync()
        profiled = min(3, len(batches))
        split = phase_times(profiler, profiled)
        print("phase split (s/update, profiled): " + "  ".join(f"{k} {v:.3f}" for k, v in split.items()))
        print("top operators (share of self time): " + top_operators(profiler))
        aten, kernels = leaf_operator_calls(profiler)
        counted = args.kernel_profile or agent.config.compile is False
        print(f"operator calls per update: {aten / profiled:.0f} aten (leaf), "
              + (f"{kernels / profiled:.0f} compiled kernels" if counted else "compiled kernels not counted "
                 "(--kernel_profile counts them)"))
    print(f"updates_per_s={1 / seconds:.4f}")
    env.close()


if __name__ == "__main__":
    os.environ.setdefault("MUJOCO_GL", "egl")
    main()
