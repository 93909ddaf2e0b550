"""Environment frames per second through the real collection path; a benchmark, not a test.

    python benchmarks/envs.py                  # the default run, about 3 minutes
    python benchmarks/envs.py --steps 400      # policy steps per measurement (default 150)

Collects with `parallel.Collector` over `parallel.make_envs` from a parsed config, into a replay, with
a uniform random policy and with the real (untrained) Dreamer policy on the CPU, for:
  dmc_walker_walk, 64x64 images (dmc_vision) and dmc_cartpole_balance, proprio only (dmc_proprio);
  envs 1 and envs 4, in-process and --parallel; on the image task also --parallel with pipes only.
Then it times bare round trips of a trivial environment, through shared memory and through pipes.
Frames are policy steps times action_repeat, summed over the environments. Next to frames per second
it prints the CPU time per 100 frames of this process and the workers together: unlike frames per
second, that depends less on what else the machine runs. Each figure is the best of 3 timed parts.
The policy runs on one thread by default.
"""

import argparse
import functools
import os
import pathlib
import sys
import time

# This file is called envs.py: make `import envs` find the package, not this script.
ROOT = pathlib.Path(__file__).resolve().parent.parent
if sys.path[0] == str(pathlib.Path(__file__).resolve().parent):
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import envs  # noqa: E402
import exploration  # noqa: E402
import parallel  # noqa: E402
import storage  # noqa: E402

TASKS = [("dmc_walker_walk", "dmc_vision"), ("dmc_cartpole_balance", "dmc_proprio")]
# (label, envs, parallel, shared memory)
SETUPS = [("envs 1", 1, False, True), ("envs 1 --parallel", 1, True, True), ("envs 4", 4, False, True),
          ("envs 4 --parallel", 4, True, True), ("envs 4 --parallel, pipes only", 4, True, False)]


def parse_config(task, preset, count, use_parallel):
    return cfg.parse(["--configs", preset, "--task", task, "--device", "cpu", "--compile", "False",
                      "--envs", str(count), "--parallel", str(use_parallel)])


def build_envs(config, shared):
    if shared:
        return parallel.make_envs(config, "train", config.envs)
    # make_envs always shares memory; the same environments with shared memory switched off.
    ctors = [functools.partial(envs.make_env, config, "train", i) for i in range(config.envs)]
    return [parallel.Parallel(ctor, i, shared_memory=False) for i, ctor in enumerate(ctors)]


def cpu_seconds(env_list):
    """CPU time of this process and of the environments' worker processes so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for env in env_list:
        if isinstance(env, parallel.Parallel):
            fields = pathlib.Path(f"/proc/{env.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return total


def measure(env_list, policy, config, steps, chunks=3):
    """Env frames per second and CPU ms per 100 frames over `steps` policy steps after a warm-up.

    The steps are timed in `chunks` parts and the fastest part counts, as with timeit: other
    programs on a shared machine only ever slow a part down.
    """
    replay = storage.Replay(config.dataset_size, len(env_list), config.seed)
    collector = parallel.Collector(env_list, replay, None, lambda episode: None)
    for _ in range(5):  # resets, first policy calls, worker caches
        collector.step(policy)
    results = []
    for _ in range(chunks):
        start, cpu = time.perf_counter(), cpu_seconds(env_list)
        for _ in range(steps // chunks):
            collector.step(policy)
        frames = steps // chunks * len(env_list) * config.action_repeat
        results.append((frames / (time.perf_counter() - start), (cpu_seconds(env_list) - cpu) / frames * 1e5))
    return max(results)


def measure_task(task, preset, steps):
    rows, agent = {}, None
    for label, count, use_parallel, shared in SETUPS:
        if not shared and preset != "dmc_vision":
            continue  # without images nothing goes through shared memory
        config = parse_config(task, preset, count, use_parallel)
        env_list = build_envs(config, shared)
        try:
            if agent is None:
                agent = dreamer.Dreamer(env_list[0].obs_space, env_list[0].act_space, config).to("cpu")
            random_actor = exploration.Random(config, env_list[0].act_space)

            def random_policy(obs, state, actor=random_actor):  # as the prefill in dreamer.run
                return actor.actor(torch.zeros(len(obs["is_first"]), 1)).sample().numpy(), None

            real_policy = functools.partial(agent.policy, mode="train")
            rows[label] = (*measure(env_list, random_policy, config, steps),
                           *measure(env_list, real_policy, config, steps))
        finally:
            for env in env_list:
                env.close()
        print(f"  {task:22s} {label:30s}" + "".join(f" {value:9.0f}" for value in rows[label]), flush=True)
    return rows


class ImageEnv:
    """Does nothing but return a fixed image: the cost of a round trip to a worker alone."""

    def __init__(self, size):
        self.image = np.full((size, size, 3), 7, np.uint8)

    @property
    def obs_space(self):
        import gymnasium

        return {"image": gymnasium.spaces.Box(0, 255, self.image.shape, np.uint8)}

    @property
    def act_space(self):
        import gymnasium

        return gymnasium.spaces.Box(-1, 1, (1,), np.float32)

    def reset(self):
        return {"image": self.image}

    def step(self, action):
        return {"image": self.image}, 0.0, False, {}

    def close(self):
        pass


def round_trips(size, shared, count):
    env = parallel.Parallel(functools.partial(ImageEnv, size), shared_memory=shared)
    try:
        env.reset()()
        action = np.zeros(1, np.float32)
        times = []
        for _ in range(3):  # best of 3, as above
            start = time.perf_counter()
            for _ in range(count // 3):
                env.step(action)()
            times.append((time.perf_counter() - start) / (count // 3) * 1e6)
        return min(times)
    finally:
        env.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="policy steps per measurement")
    parser.add_argument("--round_trips", type=int, default=1000, help="round trips per transport measurement")
    parser.add_argument("--torch_threads", type=int, default=1,
                        help="threads for the policy; with more, a busy 2-core machine makes it 10-30x slower")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {args.steps} policy steps "
          "per measurement")
    print(f"  {'':53s} {'random policy':>19s} {'real policy':>19s}")
    print(f"  {'task':22s} {'setup':30s}" + f" {'frames/s':>9s} {'CPU ms':>9s}" * 2 + "   (CPU ms per 100 frames, "
          "all processes)")
    results = {task: measure_task(task, preset, args.steps) for task, preset in TASKS}

    print("\nRatios (random policy / real policy):")
    comparisons = [("dmc_walker_walk", "envs 4 --parallel", "envs 1", ">= 1.8 with random policy"),
                   ("dmc_walker_walk", "envs 4 --parallel", "envs 4", ""),
                   ("dmc_walker_walk", "envs 4 --parallel", "envs 4 --parallel, pipes only", ""),
                   ("dmc_cartpole_balance", "envs 1 --parallel", "envs 1", ">= 0.85"),
                   ("dmc_cartpole_balance", "envs 4 --parallel", "envs 1", "")]
    for task, a, b, target in comparisons:
        ra, rb = results[task][a], results[task][b]
        note = f"  (target {target})" if target else ""
        print(f"  {task:22s} {a} / {b}: {ra[0] / rb[0]:.2f} / {ra[2] / rb[2]:.2f}{note}")

    print("\nRound trip of a worker returning a fixed image (microseconds per step):")
    for size in (64, 256):
        shared, piped = round_trips(size, True, args.round_trips), round_trips(size, False, args.round_trips)
        print(f"  {size}x{size}x3: shared memory {shared:.0f}, pipes only {piped:.0f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
