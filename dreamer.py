"""DreamerV3 training script: the one entry point.

    python3 dreamer.py --configs dmc_vision --task dmc_walker_walk --logdir ./logdir/walker

It reads top to bottom in the order a run goes: `main` parses and checks the command line
(`setup`), takes the logdir's lock, sizes the resources (resources.Resources), builds the
environments (parallel.make_envs), settles every `auto` value (models.resolve_auto), builds the
agent (`Dreamer`) and hands it to the `Trainer`, whose loop (`Trainer.train`) reads in the order
it runs: count, evaluate, log and save when due, collect, train by the ratio (asynchronously, a
collector thread collects: parallel.CollectorThread); its checkpoint (storage.Checkpoints), logs
(logs.RunLog) and evaluation (logs.Evaluation) are built from what they read, not from the
Trainer; and last --eval_only. Rerunning the same command resumes.

The config's schema, parser, --help, argument checks and start-up summary live in config.py,
episode files and the replay in storage.py, logging and progress in logs.py, experience collection
in parallel.py, resource sizing in resources.py, processes, devices and random state in launch.py,
the world model, actor-critic and the update (models.Update.train_step) in models.py.
"""

import collections
import contextlib
import functools
import os
import pathlib
import signal
import sys
import traceback

import torch
from torch import nn

import config as cfg
import distributions
import envs
import exploration
import launch
import logs
import models
import networks
import parallel
import resources
import seeds
import storage
import tools


def main(argv=None):
    """Parse, build, train; Ctrl-C and SIGTERM save and end without a traceback."""
    argv = sys.argv[1:] if argv is None else argv
    for stream in (sys.stdout, sys.stderr):  # a logdir or task in any script prints on an ASCII-only terminal
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    if "--print_config" in argv:
        try:
            print(cfg.print_config([arg for arg in argv if arg != "--print_config"]))
        except (tools.ConfigError, envs.TaskError) as e:
            cfg.fail(str(e))
        return None
    if "--help" in argv or "-h" in argv:
        at = argv.index("--help" if "--help" in argv else "-h")
        topic = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None
        try:
            print(cfg.usage(topic))
        except tools.ConfigError as e:
            cfg.fail(str(e))
        return None
    previous_handler = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        try:
            config, logdir, device_note, changed = setup(argv)
        except (tools.ConfigError, envs.TaskError) as e:  # a user mistake; any other error keeps its traceback
            cfg.fail(str(e))
        ranks = launch.processes(config.device)
        try:
            return run_processes(config, logdir, device_note, changed, ranks)
        finally:
            ranks.close()
    except KeyboardInterrupt as e:
        name = "SIGTERM" if isinstance(e, Interrupted) else "Ctrl-C"
        print(f"Stopped by {name}; rerun the same command to resume.", file=sys.stderr, flush=True)
        sys.exit(143 if isinstance(e, Interrupted) else 130)
    except (storage.NonFiniteError, parallel.NonFiniteStep) as e:  # the latter from an evaluation's environment
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except storage.WriteError as e:  # a full disk or a read-only logdir: one line on every rank that hit it
        found = launch.torchrun_rank()
        where = f"rank {found[0]} of {found[1]}: " if found else ""
        print(f"error: {where}{e}; {e.hint}", file=sys.stderr, flush=True)
        sys.exit(1)
    except parallel.WorkerError as e:  # env_failure stop: a worker died, stalled or its environment raised
        if e.traceback:  # the environment's own error, a bug to read: its traceback, not this process's
            print(f"Traceback in the worker process:\n{e.traceback.rstrip()}", file=sys.stderr)
        found = launch.torchrun_rank()
        where = f"rank {found[0]} of {found[1]}: " if found else ""
        print(f"error: {where}{str(e).splitlines()[0]}; the last checkpoint is kept, rerun the same command to "
              "resume", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:
        found = launch.torchrun_rank()
        if found is None:
            raise
        # torchrun ends the other processes once this one exits; this line says which one failed.
        traceback.print_exc()
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: rank {found[0]} of {found[1]} failed: {type(e).__name__}: {message}", file=sys.stderr,
              flush=True)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)


def setup(argv):
    """Parse and check everything that can be wrong before any file is written. Returns the
    config (its task spelled canonically, its device one that can be used), the logdir, why --device
    auto chose its device (or None) and the differences from the run's saved config."""
    config = cfg.parse(sys.argv[1:] if argv is None else argv)
    cfg.check_text(config)
    cfg.check_processes(config)
    logs.check_loggers(config.logger)  # wandb missing: one line, before the logdir exists
    if not config.logdir:
        raise tools.ConfigError("Missing --logdir: give the folder for this run, e.g. --logdir ./logdir/walker")
    config = cfg.check_tasks(config)
    logdir = pathlib.Path(config.logdir).expanduser()
    cfg.check_logdir(logdir)
    cfg.check_offline_traindir(config)
    warnings_ = []
    if (logdir / "config.yaml").exists():
        warnings_ = cfg.compare_saved_config(config, logdir / "config.yaml")
    checkpoint = logdir / "latest.pt"
    if config.eval_only and not (checkpoint.exists() or storage.previous_path(checkpoint).exists()):
        raise tools.ConfigError(f"--eval_only needs a checkpoint, but {checkpoint} does not exist")
    config, device_note = launch.resolve_device(config)
    found = launch.torchrun_rank()
    seeds.check(config, 1 if found is None else found[1])
    return config, logdir, device_note, warnings_


def run_processes(config, logdir, device_note, changed, ranks):
    """Build the run on this process (one of `ranks`) and train; the config is settled here, once:
    the device of this rank, --envs/--parallel auto (Resources), the actor and compile auto from the
    action space and device (models.resolve_auto). It is printed and saved, and read-only after."""
    config = config.replace(device=ranks.device(config.device))
    if config.seeds > 1:
        return run_seeds(config, logdir, device_note, changed, ranks)
    if not ranks.is_main:  # the main process alone prints progress; errors still reach stderr
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    # One run per logdir, held until this process ends. A logdir that exists may be in use: check
    # before building anything; a new one is locked once created. --eval_only only reads, so it
    # may run beside training. Under torchrun the main process holds it for all.
    try:
        lock = storage.lock_logdir(logdir) if logdir.is_dir() and not config.eval_only and ranks.is_main else None
    except storage.LogdirBusy as e:
        cfg.fail(str(e))
    ranks.barrier()  # the others start only once the main process has the logdir
    launch.seed_everything(config.seed + 1000 * ranks.rank, config.deterministic_run)
    torch.set_float32_matmul_precision("high")
    launch.keep_freed_memory()
    train_envs, eval_envs = [], []
    sizing = resources.Resources(config, logdir, Dreamer)
    try:
        config = sizing.settle()  # --envs, --parallel auto: measured (or reused) before any environment is built
        if not config.offline_traindir and not config.eval_only:
            train_envs = parallel.make_envs(config, "train", config.envs, ranks.rank * config.envs,
                                            sizing.weights(), sizing.processes())
        # The main process alone evaluates; with several tasks, on as many environments per task
        # as it trains on (at least one).
        per_task = max(config.envs // len(envs.parse_tasks(config.task)), 1)
        eval_count = min(per_task, config.eval_episode_num) if ranks.is_main else 0
        eval_envs = parallel.make_envs(config, "eval", eval_count) if eval_count else []
        if not train_envs and not eval_envs:
            raise tools.ConfigError("Nothing to act in: offline training and --eval_only need --eval_episode_num > 0")
        env = (train_envs or eval_envs)[0]
        config, resolved = models.resolve_auto(config, env.act_space, env.obs_space)  # the last 'auto' keys
        check_memory(config, env.obs_space, env.act_space)
        agent = Dreamer(env.obs_space, env.act_space, config).to(config.device)
        agent.distribute(ranks)  # resuming, every rank loads the same checkpoint after this
    except (tools.ConfigError, envs.TaskError, ImportError, parallel.WorkerError) as e:
        # A user mistake, or a suite whose package is missing: its last line says what to do.
        for env in train_envs + eval_envs:
            env.close()
        cfg.fail(str(e).strip().splitlines()[-1])
    try:
        try:
            if config.eval_only:
                return evaluate_checkpoint(config, agent, logdir, eval_envs)
            trainer = Trainer(config, agent, logdir, train_envs, eval_envs, ranks)  # a new logdir: nothing written yet
            logdir.mkdir(parents=True, exist_ok=True)
            if ranks.is_main:
                lock = lock or storage.lock_logdir(logdir)  # noqa: F841 - held until this process ends
        except (tools.ConfigError, storage.CheckpointError, storage.LogdirBusy) as e:
            cfg.fail(str(e))
        if trainer.done:  # writes nothing: no metrics row, events file, config or checkpoint
            for line in trainer.notes:
                print(line, flush=True)
            print(f"Run finished: {config.logdir} completed {trainer.frames} frames of --steps {config.steps}; "
                  "nothing to do (a larger --steps continues it)", flush=True)
            return None
        spec = {**storage.episode_spec(env.obs_space, env.act_space), **agent.context.spec}
        print(cfg.summary(config, agent, device_note, trainer.frames if trainer.resumed else None, ranks,
                          sizing.weights(), resolved, spec), flush=True)
        for line in sizing.lines:
            print(line, flush=True)
        for line in trainer.notes:
            print(line, flush=True)
        for line in changed:
            print(f"warning: differs from the saved config: {line}", flush=True)
        for line in models.ignored_keys(config):  # keys the update mode reads nowhere
            print(f"warning: {line}", flush=True)
        if ranks.is_main:
            cfg.save_config(config, logdir / "config.yaml")
            sizing.save()
        trainer.train()
    finally:
        for env in train_envs + eval_envs:
            env.close()


def run_seeds(config, logdir, device_note, changed, ranks):
    """--seeds N: the seeds seed .. seed + N - 1 in this process, each a run of its own in
    <logdir>/seed<k> (its environments, replay, Trainer, checkpoint and random streams, built as
    run_processes builds a run alone), trained together by one batched update (seeds.py). A
    rerun resumes every seed; one that finished its --steps waits for the others."""
    if config.compile == "auto":  # the batched update runs eager (seeds.check)
        config = config.replace(compile=False)
    torch.set_float32_matmul_precision("high")
    launch.keep_freed_memory()
    trainers, agents, generators, seed_envs, locks, settled = [], [], [], [], [], None
    try:
        for k in range(config.seeds):
            own_dir = logdir / f"seed{k}"
            own = config.replace(seed=config.seed + k, logdir=str(own_dir))
            if k == 0 and (own_dir / "config.yaml").exists():
                changed = cfg.compare_saved_config(own, own_dir / "config.yaml")
            try:
                locks.append(storage.lock_logdir(own_dir) if own_dir.is_dir() else None)
            except storage.LogdirBusy as e:
                cfg.fail(str(e))
            launch.seed_everything(own.seed, own.deterministic_run)
            try:
                if settled is None:  # --envs and --parallel auto: measured once, for every seed
                    sizing = resources.Resources(own, own_dir, Dreamer)
                    settled = sizing.settle()
                own = own.replace(envs=settled.envs, parallel=settled.parallel)
                seed_envs.append([])  # each seed's thread closes its own: a rendering context is bound to it
                train_envs = parallel.make_envs(own, "train", own.envs, 0, sizing.weights(), sizing.processes())
                seed_envs[-1] += train_envs
                eval_count = min(max(own.envs // len(envs.parse_tasks(own.task)), 1), own.eval_episode_num)
                eval_envs = parallel.make_envs(own, "eval", eval_count) if eval_count else []
                seed_envs[-1] += eval_envs
                env = train_envs[0]
                own, resolved = models.resolve_auto(own, env.act_space, env.obs_space)
                check_memory(own, env.obs_space, env.act_space)
                agent = Dreamer(env.obs_space, env.act_space, own).to(own.device)
            except (tools.ConfigError, envs.TaskError, ImportError, parallel.WorkerError) as e:
                cfg.fail(str(e).strip().splitlines()[-1])
            generators.append(seeds.seed_generator(own.device))  # where this seed alone would draw on from
            try:
                with distributions.generator(generators[-1]):  # a resumed seed's random state is its own
                    trainer = Trainer(own, agent, own_dir, train_envs, eval_envs, ranks)
            except (tools.ConfigError, storage.CheckpointError, storage.LogdirBusy) as e:
                cfg.fail(str(e))
            own_dir.mkdir(parents=True, exist_ok=True)
            locks[-1] = locks[-1] or storage.lock_logdir(own_dir)
            trainers.append(trainer)
            agents.append(agent)
        batched = seeds.BatchedUpdate(agents, generators)
        for k, trainer in enumerate(trainers):
            trainer.learner = seeds.SeedLearner(batched, k)
        first = trainers[0]
        spec = {**storage.episode_spec(env.obs_space, env.act_space), **agents[0].context.spec}
        print(cfg.summary(first.config, agents[0], device_note, first.frames if first.resumed else None, ranks,
                          sizing.weights(), resolved, spec), flush=True)
        for line in [*sizing.lines, seeds.cost_line(agents[0], first.config, spec)]:
            print(line, flush=True)
        for line in changed:
            print(f"warning: differs from the saved config: {line}", flush=True)
        for line in models.ignored_keys(first.config):
            print(f"warning: {line}", flush=True)
        for k, trainer in enumerate(trainers):
            for line in trainer.notes:
                print(f"seed{k}: {line}", flush=True)
            if not trainer.done:
                cfg.save_config(trainer.config, trainer.logdir / "config.yaml")
        sizing.save()
        seeds.train_together(trainers, generators, batched, seed_envs)
    finally:
        for env in [env for own in seed_envs for env in own]:  # those no seed's thread closed
            env.close()


def check_memory(config, obs_space, act_space):
    """Refuse a model or replay that cannot be allocated, before it is. The model (--units 1e12): its
    parameters are counted on the meta device, which allocates nothing, and their weights, gradients
    and two optimizer moments (4 x 4 bytes each) must fit the memory free on the run's device. The
    replay grows as it fills, so it is refused only when it could never fit: more bytes at capacity
    than its device has in all (one that does not fit what is free now is the summary's WARNING,
    storage.cost_lines)."""
    try:
        with torch.device("meta"):
            agent = Dreamer(obs_space, act_space, config.replace(compile=False))
    except (NotImplementedError, RuntimeError):  # a part that cannot be built on meta: the real build will tell
        return
    spec = {**storage.episode_spec(obs_space, act_space), **agent.context.spec}
    replay_device = config.device if config.replay_device else "cpu"
    replay, total = storage.step_bytes(spec) * config.dataset_size, storage.total_memory(replay_device)
    if total is not None and replay > total:
        raise tools.ConfigError(f"the replay needs {replay / 1e9:,.3g} GB at capacity (--dataset_size "
                                f"{config.dataset_size:,} steps x {storage.step_bytes(spec):,} bytes) and the "
                                f"{replay_device} memory is {total / 1e9:.3g} GB in all: lower --dataset_size")
    params = sum(p.numel() for p in agent.parameters())
    need, free = 16 * params, storage.available_memory(config.device)
    if free is None or need <= free:
        return
    flat = tools.flatten(config.to_dict())
    sizes = [key for key, row in cfg.SCHEMA.items() if row.size and key in flat]
    largest = sorted(sizes, key=lambda key: -flat[key])[:3]
    raise tools.ConfigError(f"the model has {params:,} parameters, whose weights, gradients and optimizer moments "
                            f"need {need / 1e9:,.3g} GB, and {free / 1e9:.3g} GB of {config.device} memory is free: "
                            f"make it smaller (its largest sizes: {', '.join(f'--{k} {flat[k]}' for k in largest)})")


# ==================================================================================================
# The agent
# ==================================================================================================


class Dreamer(nn.Module):
    """World model, task actor-critic and exploration behaviour: acts in batches and learns."""

    def __init__(self, obs_space, act_space, config):
        super().__init__()
        # A config settled by main settles to itself; one straight from parse (tests, benchmarks)
        # gets its 'auto' keys settled here, before anything is built.
        config, self.resolved = models.resolve_auto(config, act_space, obs_space)
        self.config = config
        self.act_size = act_space.shape[0]
        self.wm = models.WorldModel(obs_space, act_space, config)
        self.task_behavior = models.ActorCritic(config, self.wm, act_space, self.extrinsic_reward)
        self.context = models.ReplayContext(config)
        self.expl_behavior = exploration.make_behavior(config, self.wm, act_space)
        # The whole update of every learner: self.update.train_step(batch) (models.Update).
        self.update = models.Update(config, self.wm, self.task_behavior, self.context, self.expl_behavior)
        compiler = models.COMPILERS[config.compile]
        self.compiled = compiler(self, networks.COMPILED + exploration.COMPILED) if compiler else []

    def regions(self):
        """What compile 'update' compiles whole (models.compile_update): (owner, method name) of the
        update strategy's regions (its losses, optimizer steps and slow critic), the exploration's,
        and the policy step."""
        regions = [*self.update.regions(), (self, "act")]
        if isinstance(self.expl_behavior, exploration.Plan2Explore):
            regions += self.expl_behavior.regions()
        return regions

    def extrinsic_reward(self, feat, state, action):
        return self.wm.heads["reward"](feat).mean()

    @torch.no_grad()
    def policy(self, obs, state, mode="train"):
        """obs: dict of (N, ...) arrays; state: (latent, action) or None; mode: train, explore or eval.

        Returns actions (N, A) as numpy and the new state.
        """
        data = self.wm.preprocess(obs)
        embed = self.wm.encoder(data)
        if state is None:
            n = len(embed)
            latent = self.wm.rssm.initial(n)
            action = torch.zeros(n, self.act_size, device=embed.device)
        else:
            latent, action = state
        latent, action = self.act(embed, data["is_first"], latent, action, mode)
        return action.cpu().numpy(), (latent, action)

    def act(self, embed, is_first, latent, action, mode):
        """The policy step on the device: embed (N, E), is_first (N,), the last latent and action
        (N, A) -> the new latent and the action to take."""
        sample = not (mode == "eval" and self.config.eval_state_mean)
        latent, _ = self.wm.rssm.obs_step(latent, action, embed, is_first, sample)
        feat = self.wm.rssm.get_feat(latent)
        if mode == "eval":
            policy = self.task_behavior.actor(feat)
            action = policy.sample() if self.config.eval_sample else policy.mode()
        elif mode == "explore" and self.expl_behavior is not None:
            action = self.expl_behavior.actor(feat).sample()
        else:
            action = self.task_behavior.actor(feat).sample()
        return latent, action

    def distribute(self, ranks):
        """Train as one of the processes `ranks` (launch.SingleProcess or launch.Distributed): every
        optimizer averages its gradients over them, every return normalisation takes its
        percentiles over all of them, Plan2Explore counts its ensemble's pairs over all of them,
        and all weights and buffers (the slow critic, the return EMAs) start from the main
        process's, so that they stay identical on every process."""
        if self.config.compile == "update" and ranks.world_size > 1:
            raise tools.ConfigError("--compile update does not run under torchrun yet: the return normalisation "
                                    "all-gathers inside a compiled loss; use --compile True (step by step)")
        for module in self.modules():
            if isinstance(module, (models.ReturnNorm, exploration.Plan2Explore)):
                module.ranks = ranks
        for optimizer in self.optimizers().values():
            optimizer.ranks = ranks
        ranks.broadcast_(self.state_dict().values())

    def optimizers(self):
        """Every optimizer this agent steps, by its place in the checkpoint: model, task/actor and
        task/critic under update 'sequential', update under 'joint' (models.UPDATES); expl/... for
        Plan2Explore's ensemble and actor-critic."""
        names = {"model": "model", "actor": "task/actor", "critic": "task/critic", "joint": "update"}
        found = {names[name]: opt for name, (opt, _) in self.update.optimizers.items()}
        if isinstance(self.expl_behavior, exploration.Plan2Explore):
            found["expl/ensemble"] = self.expl_behavior.optimizer
            found.update({f"expl/behavior/{name}": opt for name, (opt, _) in self.expl_behavior.optimizers.items()})
        return found

    def optimizer_state(self):
        """The optimizers' states as a nest of dicts by their names (see `optimizers`)."""
        state = {}
        for name, optimizer in self.optimizers().items():
            *path, last = name.split("/")
            node = state
            for part in path:
                node = node.setdefault(part, {})
            node[last] = optimizer.state_dict()
        return state

    def load_optimizer_state(self, state):
        """Returns the optimizer settings of this config that replace differing saved ones. A state
        saved under update 'joint' before its unused per-network optimizers were dropped holds them
        too: they are not read."""
        changes = []
        for name, optimizer in self.optimizers().items():
            node = state
            for part in name.split("/"):
                if not isinstance(node, dict) or part not in node:
                    saved = ", ".join(sorted(state)) if isinstance(state, dict) else type(state).__name__
                    raise storage.CheckpointError(
                        f"the checkpoint holds no state for the optimizer '{name}' (it holds {saved}): it was saved "
                        "with another --update or --expl_behavior; restore those of the saved config.yaml or use "
                        "another --logdir")
                node = node[part]
            changes += optimizer.load_state_dict(node)
        return changes

# ==================================================================================================
# The Trainer: counters and schedules; prefill, pretraining and the loop
# ==================================================================================================


class Counters:
    """Progress of a run; everything here is saved in the checkpoint."""

    def __init__(self):
        self.policy_steps = 0
        self.updates = 0
        self.episodes = 0
        self.stored_steps = 0  # policy steps in the training episode files when last saved
        self.completed = 0  # the --steps the run ended at (its last evaluation, log and save done); 0: not yet


class Trainer:
    """Owns a run's counters and schedules; `train()` is the loop, in the order it runs.

    Its stored episodes and replay (storage.StoredEpisodes), checkpoint (storage.Checkpoints), logs
    (logs.RunLog) and evaluation (logs.Evaluation) are components of their own, built from the
    parts they read. Under torchrun (`ranks` a launch.Distributed) every process runs this loop in
    lockstep with its own environments, replay and episode folder (rank k > 0: train_eps/rank<k>);
    the counters and schedules are the same on all of them, so that each makes the same updates.
    The main process alone logs, evaluates and writes the checkpoint, which holds every rank's
    random state.
    """

    def __init__(self, config, agent, logdir, train_envs, eval_envs, ranks=None):
        self.config, self.agent, self.logdir = config, agent, logdir
        # What takes the updates: the agent's own (models.Update), or its seed's share of one
        # batched update of several seeds (seeds.SeedLearner, set by run_seeds).
        self.learner = agent.update if agent is not None else None
        self.ranks = ranks or launch.SingleProcess()
        self.train_envs, self.eval_envs = train_envs, eval_envs
        self.tasks = envs.parse_tasks(config.task)  # a stored step's `task` indexes this list
        self.counters = Counters()
        per_update = tools.replayed_per_update(config)
        # Asynchronous collection: a limiter between the collector thread and the learner (train_asynchronously).
        train = (tools.SamplesPerInsert(config.train_ratio, per_update, config.ratio_tolerance) if config.asynchronous
                 else tools.Ratio(config.train_ratio, per_update))
        self.schedules = {"train": train, "log": tools.Every(config.log_every), "eval": tools.Every(config.eval_every)}
        env = (train_envs or eval_envs or [None])[0]  # without one, stored episodes are taken on trust
        stored = storage.StoredEpisodes(config, logdir, self.ranks.rank, env,
                                        agent.context.spec if env is not None else {})
        self.traindir, self.evaldir = stored.traindir, stored.evaldir
        self.replay, self.eval_replay = stored.replay, stored.eval_replay
        self.notes = [*stored.recovered, stored.note]  # lines for the start-up summary
        length = config.batch_length + (agent.context.steps if agent is not None else 0)
        if config.offline_traindir and not self.replay.ready(length):  # it would finish with no update
            raise tools.ConfigError(f"Invalid value '{config.offline_traindir}' for --offline_traindir: its episodes "
                                    f"hold no sequence of {length} steps to train on ({stored.note[10:]})")
        self.checkpoints = storage.Checkpoints(logdir / "latest.pt", config, agent, self.counters, self.schedules,
                                               self.replay, self.ranks)
        self.resumed, notes = self.checkpoints.resume(None if config.offline_traindir else self.traindir)
        self.notes += notes
        # Every rank counts the frames of the rank that stored the most (they differ only after a
        # kill -9), so that all run the same number of iterations.
        self.counters.policy_steps = self.ranks.max(self.counters.policy_steps)
        self.finished = collections.deque()  # episodes the collector finished, not yet counted and logged
        self.collector = (parallel.Collector(train_envs, self.replay, self.traindir, self.finished.append,
                                             config.action_repeat, agent.context, config.chunk_size)
                          if train_envs else None)
        self.actor = self.actor_agent = self.synced = None  # asynchronous: the collector thread, from the loop on
        # Checkpoints on the save_every clock, and stops under torchrun, agreed at the update boundary.
        stops = launch.Stops({signal.SIGTERM: Interrupted, signal.SIGINT: KeyboardInterrupt}, self.ranks.world_size > 1)
        self.agreement = launch.Agreement(self.ranks, tools.Clock(config.save_every), stops)
        waits = ("learner_wait", "env_wait") if config.asynchronous else ()
        self.stopwatch = tools.Stopwatch(("learner", "env", *waits))
        # The open-loop videos: the main process alone writes them, and they need an image decoder.
        films = (agent is not None and self.ranks.is_main and config.video_pred_log
                 and bool(agent.wm.heads["decoder"].cnn_shapes))
        predict = (lambda data: agent.wm.video_pred(agent.wm.preprocess(data))) if films else None
        self.run_log = logs.RunLog(config, logdir, self.counters, self.ranks, self.tasks, self.replay,
                                   self.collector, self.checkpoints.kept, predict)
        run_episodes = (functools.partial(parallel.run_episodes, agent, eval_envs, config.eval_episode_num,
                                          self.evaldir) if eval_envs else None)
        self.evaluation = logs.Evaluation(config, run_episodes, self.eval_replay, self.ranks.is_main, predict)
        self.first_calls = logs.FirstCalls("compile warm-up", lambda: self.progress.interactive)

    @property
    def frames(self):
        return self.counters.policy_steps * self.config.action_repeat

    @property
    def done(self):
        """A resumed run that completed its --steps already: a rerun has nothing to do (a larger --steps
        continues it). `completed` holds the --steps that run ended at, so a checkpoint of an earlier,
        smaller --steps is not taken as the end of this one, even with stored episodes counted past it."""
        return self.resumed and self.counters.completed >= self.config.steps and self.frames >= self.config.steps

    @functools.cached_property
    def feed(self):
        """The learner's replay batches (storage.Prefetcher), made at the first update."""
        config = self.config
        return storage.Prefetcher(self.replay, config.batch_size, config.batch_length + self.agent.context.steps,
                                config.device)

    progress = property(lambda self: self.run_log.progress)
    evaluates = property(lambda self: self.evaluation.enabled)

    # -- the loop -----------------------------------------------------------------------------------

    def train(self):
        """Prefill and pretrain; then, until `steps` frames: count what was collected, evaluate, log and
        save when due (`maintain`), collect, train by the ratio; then the end's evaluation, log and save.
        Synchronous, the learner collects and trains in turn; asynchronous, a collector thread collects
        (`train_asynchronously`)."""
        self.run_log.open()
        try:
            with self.agreement.stops:  # under torchrun: a signal becomes a stop every rank agrees on
                if not self.resumed or not self.counters.updates:  # a stop in the prefill resumes it
                    prefill_and_pretrain(self)
                if self.config.asynchronous:
                    self.train_asynchronously()
                else:  # the learner waits while the environments step and the environments while it trains
                    while self.frames < self.config.steps:
                        self.maintain()
                        with self.stopwatch.time("env"):
                            self.collect(self.policy)
                        with self.stopwatch.time("learner"):
                            self.update(self.schedules["train"](self.counters.policy_steps))
                # The end evaluates and logs, and counts as the schedules' turn where one is due: a
                # run continued from here with more --steps does not do them again at this frame.
                self.schedules["eval"](self.frames)
                self.schedules["log"](self.frames)
                if self.evaluates:
                    self.evaluate()
                self.log()
                self.stop_collection()
                self.counters.completed = self.config.steps
                self.save()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the progress; any other error keeps the last save
            self.stop_collection()  # the collector stops first, so that the checkpoint is taken between two steps
            self.save_on_interrupt()
            raise
        except storage.WriteError as e:  # a full disk or a read-only logdir: one line, and what is kept
            raise storage.WriteError(e.path, e, self.checkpoints.kept()) from None
        finally:
            self.stop_collection()  # after any other error too: no thread outlives the run
            self.run_log.close()

    def train_asynchronously(self):
        """The learner trains in this thread while a collector thread (parallel.CollectorThread) steps
        every environment under one batched call of a copy of the policy, refreshed every
        `actor_sync_every` updates, and hands each step over through a queue: this thread alone
        counts them (`count`). The limiter (tools.SamplesPerInsert) holds the train ratio within
        `ratio_tolerance` updates: the learner waits when it runs ahead, the collector when the
        learner falls behind. The collector thread uses one torch thread; the learner keeps its own
        (README, Going faster)."""
        config, limiter, env = self.config, self.schedules["train"], self.train_envs[0]
        limiter.load_state_dict({"updates": limiter.updates, "inserts": self.counters.policy_steps})
        self.actor_agent = Dreamer(env.obs_space, env.act_space, config.replace(compile=False))  # never compiled
        self.actor_agent.to(config.device).requires_grad_(False)
        self.actor = parallel.CollectorThread(self.collector, self.actor_policy, limiter, self.counters.policy_steps,
                                              config.steps, self.stopwatch)
        self.sync_actor()
        print(f"Asynchronous: learner on {config.device} with {torch.get_num_threads()} torch threads, actor thread "
              f"with 1, {len(self.train_envs)} environments; weights synced every {config.actor_sync_every} "
              "updates", flush=True)
        self.actor.start()
        while not (self.actor.done.is_set() and not limiter.can_sample()):
            self.maintain()
            if self.actor.error is not None:
                self.raise_actor_error()
            with self.stopwatch.time("learner_wait"):
                if not limiter.wait_sample(timeout=0.05):
                    continue
            with self.stopwatch.time("learner"):
                self.update(1)
            limiter.sampled()
            if self.counters.updates - self.synced >= config.actor_sync_every:
                self.sync_actor()
        self.count()  # the steps handed over since the last maintain
        if self.actor.error is not None:
            self.raise_actor_error()

    def maintain(self):
        """Between two steps: count what was collected, evaluate, log and save when due."""
        self.count()
        evaluated = self.evaluates and self.schedules["eval"](self.frames)
        if evaluated:
            self.evaluate()
        self.progress.update(self.frames)
        # The log before the save: a run resumed from this checkpoint neither logs this frame again
        # nor loses the metrics of the updates since the last log.
        if self.schedules["log"](self.frames):
            self.log()
        if evaluated or self.agreement.save_due:  # save_every: due on any rank, agreed at the last update
            self.save()
        self.stop_if_asked()

    # -- collecting and counting ----------------------------------------------------------------------

    def collect(self, policy):
        if self.collector is None:  # offline: time advances as if the agent were collecting
            self.counters.policy_steps += max(1, self.config.envs)
            return
        try:
            self.counters.policy_steps += self.collector.step(policy)
        except ValueError as e:  # parallel.NonFiniteStep, or torch.distributions refusing NaN parameters
            self.raise_non_finite(e, f"in the policy step at frame {self.frames}")
            raise

    def count(self):
        """Count what collection handed over: the collector thread's steps (a synchronous step is counted
        where it is taken, `collect`) and the episodes finished since the last count."""
        if self.actor is not None:
            for steps, episodes in self.actor.take():
                self.counters.policy_steps += steps
                self.finished.extend(episodes)
        while self.finished:
            episode = self.finished.popleft()
            self.counters.episodes += 1
            self.counters.stored_steps += len(episode["reward"]) - 1
            self.run_log.add_episode(episode)

    def mode(self, frames):
        """The training policy's mode at `frames`: exploring until expl_until."""
        config = self.config
        explore = config.expl_behavior != "greedy" and (not config.expl_until or frames < config.expl_until)
        return "explore" if explore else "train"

    def policy(self, obs, state):
        """The learner's training policy; with compile on, its first call (it compiles) is a phase."""
        return self.announce_compilation("first policy step", self.agent.policy, obs, state, self.mode(self.frames))

    def actor_policy(self, obs, state):
        """The collector thread's: the agent's copy, at the frames that thread counted."""
        return self.actor_agent.policy(obs, state, self.mode(self.actor.frames))

    def sync_actor(self):
        with self.actor.policy_lock:
            self.actor_agent.load_state_dict(self.agent.state_dict())
        self.synced = self.counters.updates

    def raise_actor_error(self):
        """The collector thread's error, in the learner's thread; a ValueError as `collect` words it."""
        error = self.actor.error
        if isinstance(error, ValueError):  # its weights are the learner's, copied
            self.raise_non_finite(error, f"in the actor's policy step at frame {self.frames}")
        raise error

    def stop_collection(self):
        if self.actor is not None:
            self.actor.close()

    def raise_non_finite(self, error, where):
        """The NonFiniteError line for a ValueError raised `where` (the update or the policy step): one
        that non-finite weights caused names their learners, a non-finite environment step says which
        (parallel.NonFiniteStep). Returns for any other ValueError: a bug, which keeps its traceback."""
        agent = self.agent
        learners = {"world model": agent.wm, "actor": agent.task_behavior.actor, "critic": agent.task_behavior.critic}
        if agent.expl_behavior is not None:
            learners["exploration"] = agent.expl_behavior
        bad = [name for name, module in learners.items() if not tools.all_finite(list(module.parameters()))]
        kept = self.checkpoints.kept()
        if bad:
            raise storage.NonFiniteError(f"non-finite {' and '.join(bad)} weights {where} (after update "
                                         f"{self.counters.updates}); the run stops without saving ({kept})") from None
        if isinstance(error, parallel.NonFiniteStep):
            raise storage.NonFiniteError(f"{error} {where}; the run stops without saving ({kept})") from None

    # -- learning -------------------------------------------------------------------------------------

    def announce_compilation(self, name, fn, *args):
        """fn(*args); with compile on, the first call of each kind (it compiles) is a phase of its own."""
        return self.first_calls(name, fn, *args) if self.agent.compiled else fn(*args)

    def update(self, count, phase=None):
        config = self.config
        # Every rank updates or none does: the updates average gradients over all of them.
        context = self.agent.context
        length = config.batch_length + context.steps  # the context steps only give the start latent
        if not count or not self.agreement.settle(self.replay.ready(length)):
            return
        train_step = self.learner.train_step  # with compile on, its first call (it compiles) is a phase
        for i in range(count):
            batch, ids, data = self.feed.next(more=i + 1 < count)  # the next batch is sampled during this update
            on_device = () if data is None else (data,)  # None on a CPU: train_step copies the batch
            try:
                metrics, latents = (self.first_calls("first update", train_step, batch, *on_device)
                                    if self.agent.compiled else train_step(batch, *on_device))  # models.Update
            except ValueError as e:  # torch.distributions refusing the NaN parameters of non-finite weights
                self.raise_non_finite(e, f"at update {self.counters.updates + 1}")
                raise
            context.write_back(self.feed, ids, latents)  # also into the batch sampled ahead
            self.counters.updates += 1
            if phase is not None:
                phase.update(i + 1)
            self.run_log.record(metrics)

    # -- logging, evaluating, saving ------------------------------------------------------------------

    def log(self):
        self.run_log.check_losses()
        self.count()
        perf = {f"{name}_busy" if name in ("learner", "env") else name: value
                for name, value in self.stopwatch.fractions().items()}
        if self.actor is not None:
            perf["policy_lag"] = self.counters.updates - self.synced
        self.run_log.log(perf)

    def evaluate(self):
        try:
            mean_return = self.evaluation.run(self.run_log.logger)
        except ValueError as e:  # as in collect
            self.raise_non_finite(e, f"in an evaluation at frame {self.frames}")
            raise
        if mean_return is not None:
            self.progress.update(self.frames, eval_return=mean_return)

    def save(self):
        self.run_log.check_losses()
        # Between two steps of the collector thread: counters, schedules and episodes on disk agree.
        with self.actor.step_lock if self.actor is not None else contextlib.nullcontext():
            self.count()
            if self.collector is not None:  # chunks of running episodes too: what a kill -9 would leave
                self.counters.stored_steps = storage.stored_steps(self.traindir)
            state = self.checkpoints.state()
        self.checkpoints.write(state)
        self.agreement.saved()

    def save_on_interrupt(self):
        if self.checkpoints.saved_at == (self.frames, self.counters.updates):  # a stop the ranks agreed on saved
            return
        if self.ranks.world_size > 1:
            # A second signal: saving gathers from every rank, and each stopped at its own point.
            print(f"Not saved: a second signal stops every rank at once ({self.checkpoints.kept()}).",
                  file=sys.stderr, flush=True)
            return
        try:
            self.save()
        except (storage.NonFiniteError, storage.WriteError) as e:
            print(f"error: {e}", file=sys.stderr, flush=True)

    def stop_if_asked(self):
        """Under torchrun: once the ranks agreed on a stop (Agreement), save together and end as the
        signal would (Interrupted: exit 143, KeyboardInterrupt: 130)."""
        if self.agreement.stop_code:
            self.save()
            raise self.agreement.stops.exception(self.agreement.stop_code)


def prefill_and_pretrain(trainer):
    """Before the loop: the prefill (`PREFILLS[prefill_policy]`), then `pretrain` updates; the
    prefill's steps count as paid for, so that training starts at the train ratio."""
    config = trainer.config
    if trainer.collector is not None:
        PREFILLS[config.prefill_policy](trainer)
    if config.pretrain:
        with logs.Phase("pretrain", config.pretrain, "update", trainer.progress.interactive) as phase:
            trainer.update(config.pretrain, phase)
    trainer.schedules["train"].updates = trainer.schedules["train"].owed(trainer.counters.policy_steps)


def random_prefill(trainer):
    """`prefill` frames of uniform random actions, with zero latents stored (the paper's v1 code)."""
    config = trainer.config
    uniform = exploration.Random(config, trainer.train_envs[0].act_space)  # its actor ignores the input

    def random_policy(obs, state):
        return uniform.actor(torch.zeros(len(obs["is_first"]), 1)).sample().numpy(), None

    if trainer.frames < config.prefill:
        with logs.Phase("prefill", config.prefill, "frame", trainer.progress.interactive) as phase:
            while trainer.frames < config.prefill:
                trainer.collect(random_policy)
                phase.update(min(trainer.frames, config.prefill))
                trainer.agreement.settle(True)  # no updates in the prefill: its steps are the boundary
                trainer.stop_if_asked()


def agent_prefill(trainer):
    """The official 2024 code's start: the untrained agent acts from the first step with its training
    policy (its latents stored for the replay context) until the replay holds one batch of steps
    (batch_size x batch_length, reset steps included, as the official `len(replay)` counts them) and
    `prefill` frames have passed; the official code then trains once (recipe2024: pretrain 1) and
    from there at the train ratio (embodied/run/train.py, elements.when.Ratio)."""
    config = trainer.config
    batch = tools.replayed_per_update(config)

    def short():  # on every rank alike: under torchrun each holds its own replay
        return bool(trainer.ranks.max(int(len(trainer.replay) < batch or trainer.frames < config.prefill)))

    if short():
        with logs.Phase("prefill", batch, "replay step", trainer.progress.interactive) as phase:
            while short():
                trainer.collect(trainer.policy)
                phase.update(min(len(trainer.replay), batch))
                trainer.agreement.settle(True)
                trainer.stop_if_asked()


PREFILLS = {"random": random_prefill, "agent": agent_prefill}  # by config.prefill_policy


class Interrupted(KeyboardInterrupt):
    """SIGTERM (what cluster schedulers send before a kill), handled like Ctrl-C."""


def raise_interrupted(signum, frame):
    raise Interrupted()



# ==================================================================================================
# --eval_only
# ==================================================================================================


def evaluate_checkpoint(config, agent, logdir, eval_envs):
    """--eval_only: load latest.pt, run eval_episode_num episodes, write only into logdir/eval_only/
    (logs.write_eval_only)."""
    state, path, notes = storage.load_checkpoint_or_previous(logdir / "latest.pt", config.device, ("agent", "counters"))
    for note in notes:
        print(f"WARNING: {note}", flush=True)
    storage.check_format(state, path)
    storage.check_fits(agent, state["agent"], path)
    agent.load_state_dict(state["agent"])
    episodes = parallel.run_episodes(agent, eval_envs, config.eval_episode_num, None)
    frame = state["counters"]["policy_steps"] * config.action_repeat
    return logs.write_eval_only(logdir / "eval_only", episodes, frame, envs.parse_tasks(config.task))


if __name__ == "__main__":
    main()
