"""The resources a run takes for `--envs auto` and `--parallel auto`, settled from measured costs.

What an environment costs in-process and in worker processes (`measure_env`) and what the policy
and an update cost (`time_agent`) go into a model of the run's throughput (`predict_steps_per_s`):
the environments and the learner take turns (synchronous) or overlap (asynchronous), on the cores
there are. `decide_resources` picks the fewest environments and worker processes within
RESOURCE_TOLERANCE of the best; `Resources` measures (or reuses the logdir's resources.json),
decides and reports, before the environments are built.
"""

import datetime
import functools
import itertools
import json
import os
import time

import numpy as np
import torch

import envs
import launch
import parallel
import storage
import tools


def _seconds_per_step(env_list, steps, budget, rng):
    """Wall-clock seconds per step of all of `env_list` stepping together (resets included, as in
    training), over `steps` steps or fewer once `budget` seconds have passed; 3 untimed steps first."""
    for env in env_list:
        env.reset()()
    act_space = env_list[0].act_space
    timed, start = 0, None
    for i in range(steps + 3):
        if i == 3:
            start = time.perf_counter()
        futures = [env.step(parallel.random_action(act_space, rng)) for env in env_list]
        for env, future in zip(env_list, futures):
            if future()[2]:
                env.reset()()
        timed = i - 2
        if start is not None and timed >= 10 and time.perf_counter() - start > budget:
            break
    return (time.perf_counter() - start) / max(timed, 1)


def measure_env(ctor, steps=200, workers=2, budget=5.0, seed=0):
    """What an environment costs, in-process and in worker processes: a dict of
      step_ms: one step in-process (the caller's thread);
      worker_ms: one step round trip to one worker (its step, the transfer and two wake-ups);
      extra_worker_ms: what each further worker adds to a step of `workers` workers stepping
        together (the parent's serial share: sending, receiving, copying out), 0 if none;
      worker_start_s: from starting a worker until its first observation arrives;
    and the environment's spaces, obs_space and act_space. Each timing runs `steps` steps or
    `budget` seconds, whichever ends first."""
    rng = np.random.default_rng(seed)
    env = parallel.Damy(ctor)
    try:
        out = {"obs_space": env.obs_space, "act_space": env.act_space}
        out["step_ms"] = 1e3 * _seconds_per_step([env], steps, budget, rng)
    finally:
        env.close()
    start = time.perf_counter()
    pool = [parallel.Parallel(ctor, i, restart=False) for i in range(max(1, workers))]
    try:
        pool[0].reset()()
        out["worker_start_s"] = time.perf_counter() - start
        one = _seconds_per_step(pool[:1], steps, budget, rng)
        out["worker_ms"] = 1e3 * one
        together = _seconds_per_step(pool, steps, budget, rng) if len(pool) > 1 else one
        out["extra_worker_ms"] = 1e3 * max(0.0, together - one) / max(len(pool) - 1, 1)
    finally:
        for worker in pool:
            worker.close()
    return out


# The decision takes the fewest environments, then the fewest worker processes, whose predicted
# throughput is within this fraction of the best: more of either costs memory and start-up time
# and buys nothing once the learner sets the pace.
RESOURCE_TOLERANCE = 0.03


def at_threads(costs, key, threads):
    """A cost measured on max_threads torch threads (`key`) and on one (`key` with _1), at `threads`:
    Amdahl's law through the two points, t(L) = t1 * (1 - share + share / L). On a loaded machine
    more threads can be slower (a negative share); with one point (or on a GPU), that one."""
    at_most, at_one, most = costs[key], costs.get(key.replace("_", "_1_", 1)), costs["max_threads"]
    if costs.get("gpu") or at_one is None or most <= 1 or at_one <= 0:
        return at_most
    share = min((1 - at_most / at_one) / (1 - 1 / most), 1.0)  # the part that threads divide
    return at_one * (1 - share + share / threads)


def collection_seconds(costs, placement, cores):
    """Seconds for one step of every environment, the policy excluded, on `cores` cores.

    placement: [(task, in a worker process)] per environment. The parent sends to every worker,
    steps the in-process environments itself, then collects: the step lasts as long as the longest
    of the parent's serial work, the slowest worker, and all the work spread over the cores."""
    ms_in, ms_worker, extra = costs["env_ms"], costs["worker_ms"], costs["extra_worker_ms"]
    workers = [task for task, process in placement if process]
    local = [task for task, process in placement if not process]
    serial = sum(ms_in[task] for task in local) + len(workers) * extra
    if not workers:
        return serial / 1e3
    slowest = max(ms_worker[task] for task in workers) + (len(workers) - 1) * extra
    work = (sum(ms_worker[task] for task in workers) + sum(ms_in[task] for task in local)) / max(cores, 1)
    return max(serial, slowest, work) / 1e3


def predict_steps_per_s(costs, placement, threads, updates_per_step, asynchronous):
    """Policy steps per second of one candidate (`placement` as in collection_seconds, the learner on
    `threads` torch threads) and what bounds it: 'learner' or 'environments'.

    Synchronous: the environments (with the policy) and the learner take turns, each with every core,
    so their times add. Asynchronous: they overlap, the learner on `threads` cores (one on a GPU)
    and the environments on the rest; the limiter runs both at the slower one's pace."""
    n, cores = len(placement), costs["cores"]
    learn = n * updates_per_step * at_threads(costs, "update_s", threads)
    env_cores = cores - (1 if costs.get("gpu") else threads)
    if not asynchronous or env_cores < 1:  # with no core to spare, the two take turns anyway
        policy = at_threads(costs, "policy_ms", threads) + at_threads(costs, "policy_extra_ms", threads) * (n - 1)
        collect = policy / 1e3 + collection_seconds(costs, placement, cores)
        return n / (collect + learn), "learner" if learn >= collect else "environments"
    # The collector thread runs the policy on one torch thread (parallel.CollectorThread).
    policy = at_threads(costs, "policy_ms", 1) + at_threads(costs, "policy_extra_ms", 1) * (n - 1)
    collect = policy / 1e3 + collection_seconds(costs, placement, env_cores)
    return n / max(collect, learn), "learner" if learn >= collect else "environments"


def split_envs(count, tasks, costs):
    """Environments per task: equal shares, the remainder to the most expensive tasks first."""
    order = sorted(tasks, key=lambda task: -costs["env_ms"][task])
    return {task: count // len(tasks) + (order.index(task) < count % len(tasks)) for task in tasks}


def decide_resources(costs, tasks, train_ratio, batch_size, batch_length, asynchronous=False,
                     envs=None, parallel=None, threads=None, max_envs=None, steps=None):
    """How many environments, which tasks' environments run in worker processes, and the learner's
    torch threads (on a CPU), for the most policy steps per second predicted from measured `costs`.

    A pure function of its arguments (tests pass stand-in costs). `costs`: env_ms and worker_ms
    {task: ms per step in-process / round trip to one worker}, extra_worker_ms (what each further
    worker adds to a step), policy_ms (batch of one), policy_extra_ms (per further environment) and
    update_s (one update), each on max_threads torch threads and optionally on one (policy_1_ms,
    policy_1_extra_ms, update_1_s; see at_threads), cores, max_threads, gpu. The learner needs
    train_ratio / (batch_size * batch_length) updates per policy step. `envs`, `parallel` and
    `threads` given are kept. With the run's length in policy steps (`steps`), the workers' start-up
    (worker_start_s; they start together) counts against the rate: a short run may not earn it back.
    Among the candidates within RESOURCE_TOLERANCE of the best, the fewest
    environments and then the fewest worker processes win. Expensive tasks get the worker processes
    (and any remainder environment) first: a cheap task may do better in-process, where a step
    costs no round trip.

    Returns {envs, parallel (True, False or 'mixed'), threads (None on a GPU: left alone),
    tasks: {task: {envs, processes}}, steps_per_s, bound}."""
    updates_per_step = tools.updates_owed(1, train_ratio, batch_size * batch_length)
    most = max(1, int(costs["max_threads"]))
    if envs is not None:
        counts = [envs]
    else:
        counts = range(len(tasks), max(max_envs or max(4, 2 * costs["cores"]), len(tasks)) + 1)
    if parallel is not None:
        flag_sets = [(parallel,) * len(tasks)]
    elif len(tasks) > 6:  # 2^tasks placements; beyond a few tasks all or none
        flag_sets = [(False,) * len(tasks), (True,) * len(tasks)]
    else:
        flag_sets = list(itertools.product((False, True), repeat=len(tasks)))
    thread_options = [threads or most] if threads is not None or costs.get("gpu") else range(1, most + 1)
    candidates = []
    for count in counts:
        per_task = split_envs(count, tasks, costs)
        for flags in flag_sets:
            placement = [(task, flag) for task, flag in zip(tasks, flags) for _ in range(per_task[task])]
            for option in thread_options:
                rate, bound = predict_steps_per_s(costs, placement, option, updates_per_step, asynchronous)
                processes = sum(process for _, process in placement)
                if steps and processes:
                    rate = steps / (steps / rate + costs["worker_start_s"])
                candidates.append((rate, bound, count, processes, option, per_task, flags))
    best = max(c[0] for c in candidates)
    good = [c for c in candidates if c[0] >= (1 - RESOURCE_TOLERANCE) * best]
    # Ties (threads not measured on one) keep the threads the learner was measured on.
    rate, bound, count, processes, option, per_task, flags = min(good, key=lambda c: (c[2], c[3], -c[0], -c[4]))
    mode = True if all(flags) else False if not any(flags) else "mixed"
    return {"envs": count, "parallel": mode, "threads": None if costs.get("gpu") else option,
            "tasks": {task: {"envs": per_task[task], "processes": flag} for task, flag in zip(tasks, flags)},
            "steps_per_s": rate, "bound": bound}


def dummy_batch(obs_space, act_space, batch_size, batch_length, seed=0):
    """A replayed batch (B, T, ...) of random observations and actions, for timing updates."""
    rng = np.random.default_rng(seed)
    data = {}
    for key, space in obs_space.items():
        shape = (batch_size, batch_length, *space.shape)
        if np.dtype(space.dtype) == np.uint8:
            data[key] = rng.integers(0, 256, shape, dtype=np.uint8)
        elif np.dtype(space.dtype) == bool:
            data[key] = np.zeros(shape, bool)
        else:
            data[key] = rng.normal(size=shape).astype(np.float32)
    data["is_first"][:, 0] = True
    data["action"] = np.stack([parallel.random_action(act_space, rng) for _ in range(batch_size * batch_length)])
    data["action"] = data["action"].reshape(batch_size, batch_length, -1)
    data["reward"] = rng.normal(size=(batch_size, batch_length)).astype(np.float32)
    return data


def measure_costs(config, tasks, max_threads, make_agent):
    """The costs `decide_resources` takes: each task's environment in-process and in workers
    (measure_env), and the policy and a few updates of a fresh, uncompiled agent on a
    dummy batch (thrown away afterwards; the run's random state is kept). make_agent(obs_space,
    act_space, config) builds the agent (this module knows nothing of models)."""
    costs = {"env_ms": {}, "worker_ms": {}, "cores": available_cores(), "max_threads": max_threads}
    extra, starts = [], []
    for task in tasks:
        measured = measure_env(functools.partial(envs.make_env, config, "train", 0, task), seed=config.seed)
        costs["env_ms"][task], costs["worker_ms"][task] = measured["step_ms"], measured["worker_ms"]
        extra.append(measured["extra_worker_ms"])
        starts.append(measured["worker_start_s"])
    costs["extra_worker_ms"], costs["worker_start_s"] = float(np.mean(extra)), max(starts)
    costs["gpu"] = torch.device(config.device).type == "cuda"
    with launch.kept_random_state():
        agent = make_agent(measured["obs_space"], measured["act_space"], config.replace(compile=False))
        costs.update(time_agent(agent.to(config.device), measured["obs_space"], measured["act_space"], config,
                                max_threads, costs["gpu"]))
        del agent
    if costs["gpu"]:
        torch.cuda.empty_cache()
    return costs


def time_agent(agent, obs_space, act_space, config, max_threads, gpu):
    """policy_ms at a batch of one, policy_extra_ms per further observation and update_s (one update,
    after one warm-up update) on max_threads torch threads, and the same on one thread (policy_1_ms, ...)."""
    obs = {k: np.stack([space.sample() for _ in range(4)]) for k, space in obs_space.items()}

    def policy_ms(n, calls=10):
        batch = {k: v[:n] for k, v in obs.items()}
        agent.policy(batch, None)  # warm-up
        start = time.perf_counter()
        for _ in range(calls):
            agent.policy(batch, None)
        return 1e3 * (time.perf_counter() - start) / calls

    batch = dummy_batch(obs_space, act_space, config.batch_size, config.batch_length)

    def update_s(count):
        start = time.perf_counter()
        for _ in range(count):
            agent.update.train_step(batch)
        if gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / count

    # On max_threads and on one thread: which is faster depends on the model and on the machine's load
    # (a loaded 2-core machine measured a small model's update 17x slower on 2 threads than on 1).
    options = ((1, "_1"), (max_threads, "")) if max_threads > 1 and not gpu else ((max_threads, ""),)
    torch.set_num_threads(options[0][0])
    update_s(1)  # warm-up (first-call allocations), on the thread count that is likely cheaper
    out = {}
    for threads, tag in options:
        torch.set_num_threads(threads)
        out[f"policy{tag}_ms"] = policy_ms(1)
        out[f"policy{tag}_extra_ms"] = max(0.0, (policy_ms(4) - out[f"policy{tag}_ms"]) / 3)
        out[f"update{tag}_s"] = update_s(1)
    torch.set_num_threads(max_threads)
    return out


def available_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Resources:
    """Settles `--envs auto` and `--parallel auto` before the environments are built.

    Measures what the environments and the learner cost (`measure_costs`), or reuses the decision
    saved in the logdir's resources.json by an earlier start of the run with the same settings,
    decides (`decide_resources`), sets the learner's torch threads on a CPU (unless OMP_NUM_THREADS
    fixes them), and reports the costs and the decision in the start-up summary and in the logdir.
    Explicit values win: only the keys that are 'auto' change."""

    FILE = "resources.json"

    def __init__(self, config, logdir, make_agent):
        self.config, self.path, self.make_agent = config, logdir / self.FILE, make_agent
        self.auto = [key for key in ("envs", "parallel") if getattr(config, key) == "auto"]
        self.record, self.lines = None, []

    def settings(self):
        """What the decision depends on besides the measured costs; another value re-measures."""
        config = self.config
        return {"task": config.task, "train_ratio": config.train_ratio, "batch_size": config.batch_size,
                "batch_length": config.batch_length, "asynchronous": bool(config.asynchronous),
                "device": torch.device(config.device).type, "cores": available_cores()}

    def settle(self):
        """The config with envs and parallel settled (a new one; the same without 'auto')."""
        config = self.config
        if not self.auto:
            return config
        if config.offline_traindir or config.eval_only:  # nothing is collected: one evaluation env, in-process
            self.config = config.replace({key: value for key, value in (("envs", 1), ("parallel", False))
                                          if key in self.auto})
            self.lines = ["Resources: auto: nothing to collect, 1 environment in-process"]
            return self.config
        start = time.time()
        self.record = self.load()
        reused = self.record is not None
        if not reused:
            fixed_threads = torch.get_num_threads() if "OMP_NUM_THREADS" in os.environ else None
            tasks = envs.parse_tasks(config.task)  # each task of a list is measured on its own
            print(f"Resources: measuring for {', '.join(self.auto)} auto: the environment in-process and in workers, "
                  "then the policy and a few updates (about a minute at full size on a CPU)", flush=True)
            costs = measure_costs(config, tasks, torch.get_num_threads(), self.make_agent)
            decision = decide_resources(
                costs, tasks, config.train_ratio, config.batch_size, config.batch_length, config.asynchronous,
                envs=None if config.envs == "auto" else config.envs,
                parallel=None if config.parallel == "auto" else config.parallel, threads=fixed_threads,
                steps=max(1, (config.steps - tools.prefill_frames(config)) // config.action_repeat))
            self.record = {"settings": self.settings(), "costs": costs, "decision": decision,
                           "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "measure_s": round(time.time() - start, 1)}
        decision = self.record["decision"]
        self.config = config.replace({key: decision[key] is True if key == "parallel" else decision[key]
                                      for key in self.auto})
        if decision["threads"] and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(decision["threads"])
        self.lines = self.describe(reused)
        return self.config

    def load(self):
        """The saved record if it was made with this run's settings; None to measure afresh."""
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("settings") != self.settings() or "decision" not in record:
            return None
        return record

    def describe(self, reused):
        config, costs, decision = self.config, self.record["costs"], self.record["decision"]
        where = {True: "in worker processes", False: "in-process", "mixed": "some in worker processes"}
        count = decision["threads"]
        threads = f"learner on {count} torch thread{'s' * (count > 1)}" if count else "learner threads left alone (GPU)"
        how = (f"reused from {self.path} (measured {self.record['measured']}; pass --envs and --parallel to choose)"
               if reused else f"measured in {self.record['measure_s']:.0f} s")
        updates = tools.updates_owed(1, config.train_ratio, tools.replayed_per_update(config))
        fps = decision["steps_per_s"] * config.action_repeat
        lines = [f"Resources: {', '.join(self.auto)} auto, {how}: {decision['envs']} environment"
                 f"{'s' * (decision['envs'] > 1)} "
                 f"{where[decision['parallel']]}, {threads}; predicted {fps:.1f} frames/s, {decision['bound']}-bound"]
        for task in costs["env_ms"]:
            lines.append(f"  {task}: step {costs['env_ms'][task]:.2f} ms in-process, {costs['worker_ms'][task]:.2f} ms "
                         f"in a worker; {decision['tasks'][task]['envs']} of the environments")
        one = (f" ({costs['update_1_s']:.3f} s and {costs['policy_1_ms']:.2f} ms on 1)"
               if costs.get("update_1_s") else "")
        lines.append(f"  each further worker +{costs['extra_worker_ms']:.2f} ms per step, worker start "
                     f"{costs['worker_start_s']:.1f} s; policy {costs['policy_ms']:.2f} ms "
                     f"(+{costs['policy_extra_ms']:.2f} ms per environment); "
                     f"update {costs['update_s']:.3f} s, on {costs['max_threads']} threads{one}; "
                     f"{updates:.4g} updates per policy step; {costs['cores']} cores")
        return lines

    def weights(self):
        """Per task of --task, the weights that make envs.assign_tasks give each task the number of
        environments decided (None without a decision: round-robin). assign_tasks gives every task
        one and the rest in proportion to the weights by largest remainder, so `count - 1` (plus a
        hair, as weights must be positive) reproduces the counts exactly."""
        if self.record is None:  # with --envs given and --parallel auto the split is still the decision's
            return None
        counts = self.record["decision"]["tasks"]
        return [counts[task]["envs"] - 1 + 1e-6 for task in envs.parse_tasks(self.config.task)]

    def processes(self):
        """{task: whether its environments run in worker processes} (for make_envs); None
        (config.parallel for all) without a decision or with --parallel given."""
        if self.record is None or "parallel" not in self.auto:
            return None
        return {task: placement["processes"] for task, placement in self.record["decision"]["tasks"].items()}

    def save(self):
        if self.record is not None:
            storage.atomic_write_bytes(self.path, json.dumps(self.record, indent=2).encode())
