"""DreamerV3 training script: the one entry point.

    python3 dreamer.py --configs dmc_vision --task dmc_walker_walk --logdir ./logdir/walker

It reads top to bottom in the order a run goes: `main` parses and checks the command line
(`setup`), takes the logdir's lock, sizes the resources (resources.Resources), builds the
environments (parallel.make_envs), settles every `auto` value (compilation.resolve_auto), builds the
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

import contextlib
import functools
import os
import pathlib
import signal
import sys
import time
import traceback

import torch
from torch import nn

import collection
import compilation
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
    previous_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        try:
            config, logdir, device_note, changed = setup(argv)
        except (tools.ConfigError, envs.TaskError) as e:  # a user mistake; any other error keeps its traceback
            cfg.fail(str(e))
        ranks = launch.processes(config.device)
        try:
            return run_processes(config, logdir, device_note, changed, ranks)
        except (tools.ConfigError, storage.CheckpointError, storage.LogdirBusy) as e:
            # Raised before a run is built (the lock, a finished run's check, --eval_only's load): nothing to undo.
            cfg.fail(str(e).strip().splitlines()[-1])
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
    finally:  # also the handlers a stop left in place (launch.Stops)
        for sig, handler in previous_handlers.items():
            if handler is not None:  # None: installed outside Python, nothing this process can put back
                signal.signal(sig, handler)


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
    """Build the run on this process (one of `ranks`) and train: one seed, or --seeds N (the seeds
    seed .. seed + N - 1, each a run of its own in <logdir>/seed<k>, trained together by one
    batched update: seeds.py). The config is settled here, once: the device of this rank,
    --envs/--parallel auto (Resources, measured once for every seed), the actor and compile auto
    from the action space and device (compilation.resolve_auto). It is printed and saved, and read-only
    after. A rerun resumes every seed; one that finished its --steps waits for the others."""
    config = config.replace(device=ranks.device(config.device))
    if config.seeds > 1 and config.compile == "auto":  # the batched update runs eager (seeds.check)
        config = config.replace(compile=False)
    if not ranks.is_main:  # the main process alone prints progress; errors still reach stderr
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    torch.set_float32_matmul_precision("high")
    launch.keep_freed_memory()
    dirs = [logdir] if config.seeds == 1 else [logdir / f"seed{k}" for k in range(config.seeds)]
    # One run per logdir, held until this process ends, taken before anything in it is read or
    # cleaned (a second run must not recover the first one's checkpoint in flight). Under torchrun
    # the main process holds it for all; --eval_only only reads, so it may run beside training.
    locks = [storage.LogdirLock(own) for own in dirs] if ranks.is_main and not config.eval_only else []
    ranks.barrier()  # the others start only once the main process has the logdir
    finished = [] if config.eval_only else [storage.finished_frames(own / "latest.pt", config.steps,
                                                                    config.action_repeat) for own in dirs]
    if finished and all(finished):  # before any environment worker starts
        for own, frames in zip(dirs, finished):
            print(f"Run finished: {own} completed {frames} frames of --steps {config.steps}; nothing to do (a "
                  "larger --steps continues it)", flush=True)
        return None
    runs, sizing = [], None
    try:
        try:
            for k, own_dir in enumerate(dirs):
                own = config if config.seeds == 1 else config.replace(seed=config.seed + k, logdir=str(own_dir))
                if k == 0 and config.seeds > 1 and (own_dir / "config.yaml").exists():
                    changed = cfg.compare_saved_config(own, own_dir / "config.yaml")
                launch.seed_everything(own.seed + 1000 * ranks.rank, own.deterministic_run)
                if sizing is None:  # --envs and --parallel auto: measured once, for every seed
                    sizing = resources.Resources(own, own_dir, Dreamer)
                    settled = sizing.settle()
                own = own.replace(envs=settled.envs, parallel=settled.parallel)
                runs.append(build_seed(own, own_dir, sizing, ranks))
        except (tools.ConfigError, envs.TaskError, ImportError, parallel.WorkerError, storage.CheckpointError,
                storage.LogdirBusy) as e:
            # A user mistake, or a suite whose package is missing: its last line says what to do.
            for run in runs:
                run.close()
            for lock in locks:
                lock.abandon()  # a logdir this start created is removed again: nothing half-written
            cfg.fail(str(e).strip().splitlines()[-1])
        first = runs[0]
        if config.eval_only:
            return evaluate_checkpoint(first.config, first.agent, logdir, first.eval_envs)
        if all(run.trainer.done for run in runs):  # a finish the check above could not read (a kill mid-save)
            for run in runs:
                print(f"Run finished: {run.trainer.logdir} completed {run.trainer.frames} frames of --steps "
                      f"{config.steps}; nothing to do (a larger --steps continues it)", flush=True)
            return None
        report_start(runs, sizing, device_note, changed, ranks)
        started = time.time()
        if len(runs) == 1:
            runs[0].trainer.train()
        else:
            generators = [run.generator for run in runs]
            batched = seeds.BatchedUpdate([run.agent for run in runs], generators)
            for k, run in enumerate(runs):
                run.trainer.learner = seeds.SeedLearner(batched, k)
            seeds.train_together([run.trainer for run in runs], generators, batched, [run.envs for run in runs])
        if ranks.is_main:
            ends = [(run.trainer.frames, run.trainer.final_return, run.trainer.logdir) for run in runs]
            print(logs.closing_line(ends, logdir, time.time() - started), flush=True)
    finally:
        for run in runs:  # those no seed's thread closed
            run.close()


class SeedRun:
    """One seed's run as `build_seed` made it: its settled config, environments (`envs`, closed by
    close(), or by its thread under --seeds: a rendering context is bound to it), agent, random
    stream under --seeds (`generator`) and Trainer."""

    def __init__(self, config, train_envs, eval_envs, agent, generator, trainer, resolved, spec):
        self.config, self.train_envs, self.eval_envs, self.agent = config, train_envs, eval_envs, agent
        self.envs = train_envs + eval_envs
        self.generator, self.trainer, self.resolved, self.spec = generator, trainer, resolved, spec

    def close(self):
        while self.envs:
            self.envs.pop().close()


def build_seed(config, logdir, sizing, ranks):
    """A seed's environments (as many and where `sizing`, resources.Resources, settled), agent and
    Trainer in `logdir`: the last `auto` keys settled from the action space,
    the memory checked before the agent is allocated; resuming, its checkpoint loaded."""
    train_envs, eval_envs = [], []
    try:
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
        config, resolved = compilation.resolve_auto(config, env.act_space, env.obs_space)  # the last 'auto' keys
        check_memory(config, env.obs_space, env.act_space)
        agent = Dreamer(env.obs_space, env.act_space, config).to(config.device)
        agent.distribute(ranks)  # resuming, every rank loads the same checkpoint after this
        spec = {**storage.episode_spec(env.obs_space, env.act_space), **agent.context.spec}
        if config.eval_only:
            return SeedRun(config, train_envs, eval_envs, agent, None, None, resolved, spec)
        generator = seeds.seed_generator(config.device) if config.seeds > 1 else None  # where this seed draws on from
        with distributions.generator(generator) if generator is not None else contextlib.nullcontext():
            trainer = Trainer(config, agent, logdir, train_envs, eval_envs, ranks)  # a resumed seed's random state
    except BaseException:
        for env in train_envs + eval_envs:
            env.close()
        raise
    return SeedRun(config, train_envs, eval_envs, agent, generator, trainer, resolved, spec)


def report_start(runs, sizing, device_note, changed, ranks):
    """The start-up summary (config.summary), then what the sizing, the resume and the config's keys
    have to say; each seed's config is saved in its logdir (main process)."""
    first = runs[0]
    trainer = first.trainer
    print(cfg.summary(first.config, first.agent, device_note, trainer.frames if trainer.resumed else None, ranks,
                      sizing.weights(), first.resolved, first.spec), flush=True)
    lines = [*sizing.lines, seeds.cost_line(first.agent, first.config, first.spec)] if len(runs) > 1 else sizing.lines
    for line in lines:
        print(line, flush=True)
    for k, run in enumerate(runs):
        for line in run.trainer.notes:
            print(f"seed{k}: {line}" if len(runs) > 1 else line, flush=True)
    for line in changed:
        print(f"warning: differs from the saved config: {line}", flush=True)
    for line in models.ignored_keys(first.config):  # keys the update mode reads nowhere
        print(f"warning: {line}", flush=True)
    if ranks.is_main:
        for run in runs:
            if not run.trainer.done:
                cfg.save_config(run.config, run.trainer.logdir / "config.yaml")
        sizing.save()


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
        config, self.resolved = compilation.resolve_auto(config, act_space, obs_space)
        self.config = config
        self.act_size = act_space.shape[0]
        self.wm = models.WorldModel(obs_space, act_space, config)
        self.task_behavior = models.ActorCritic(config, self.wm, act_space, self.extrinsic_reward)
        self.context = models.ReplayContext(config)
        self.expl_behavior = exploration.make_behavior(config, self.wm, act_space)
        # The whole update of every learner: self.update.train_step(batch) (models.Update).
        self.update = models.Update(config, self.wm, self.task_behavior, self.context, self.expl_behavior)
        compiler = compilation.COMPILERS[config.compile]
        self.compiled = compiler(self, networks.COMPILED + exploration.COMPILED) if compiler else []

    def regions(self):
        """What compile 'update' compiles whole (compilation.compile_update): (owner, method name) of the
        update strategy's regions (its losses, optimizer steps and slow critic), the exploration's,
        and the policy step."""
        regions = [*self.update.regions(), (self, "act")]
        if isinstance(self.expl_behavior, exploration.Plan2Explore):
            regions += self.expl_behavior.regions()
        return regions

    def extrinsic_reward(self, feat, action):  # models.ActorCritic's reward_fn: (reward, metrics)
        return self.wm.heads["reward"](feat).mean(), {}

    @torch.no_grad()
    def policy(self, obs, state, mode="train"):
        """obs: dict of (N, ...) arrays; state: (latent, action, stored) or None; mode: train, explore
        or eval.

        Returns actions (N, A) as numpy and the new state, whose `stored` holds the latents to store
        with the steps acted on (models.ReplayContext.entries) as numpy arrays. The observations go to
        the device in one copy that does not wait (storage.to_device) and the action and latents come
        back in one (storage.to_host): one wait for the device per step, not one per key.
        """
        obs = storage.to_device({k: v for k, v in obs.items() if not k.startswith("log_")},
                                 self.wm.rssm.img_stats.weight.device)
        if state is None:
            n = len(obs["is_first"])
            latent = self.wm.rssm.initial(n)
            action = torch.zeros(n, self.act_size, device=obs["is_first"].device)
        else:
            latent, action, _ = state
        latent, action = self.act(obs, latent, action, mode)
        prefix = models.ReplayContext.PREFIX
        host = storage.to_host({"action": action, **{k: latent[k[len(prefix):]] for k in self.context.spec}})
        return host.pop("action"), (latent, action, host)

    def act(self, obs, latent, action, mode):
        """The policy step on the device, from the raw observations to the action, so that compile
        'update' captures all of it, preprocessing and encoder included: obs (dict of (N, ...) tensors
        on the device, as the environments give them), the last latent and action (N, A) -> the new
        latent and the action to take."""
        data = self.wm.preprocess(obs)
        embed = self.wm.encoder(data)
        sample = not (mode == "eval" and self.config.eval_state_mean)
        latent = self.wm.rssm.obs_step(latent, action, embed, data["is_first"], sample)
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
        # Policy steps in the training episode files when last saved, and those of running episodes
        # that their files will hold (parallel.Collector.unstored): a resume counts each step once.
        self.stored_steps = 0
        self.completed = 0  # the --steps the run ended at (its last evaluation, log and save done); 0: not yet


class Trainer:
    """Owns a run's counters and schedules; `train()` is the loop, in the order it runs. Its stored
    episodes and checkpoint (`resume`), collection (collection.Collection), logs (logs.RunLog) and
    evaluation (logs.Evaluation) are components of their own. Under torchrun every process runs this
    loop in lockstep with its own environments, replay and episode folder (rank k > 0:
    train_eps/rank<k>), with the same counters and schedules; the main process alone logs, evaluates
    and writes the checkpoint, which holds every rank's random state."""

    def __init__(self, config, agent, logdir, train_envs, eval_envs, ranks=None):
        self.config, self.agent, self.logdir = config, agent, logdir
        # What takes the updates: the agent's own (models.Update), or its seed's share of one
        # batched update of several seeds (seeds.SeedLearner, set by run_processes).
        self.learner, self.ranks, self.train_envs = agent.update, ranks or launch.SingleProcess(), train_envs
        self.counters, self.schedules = Counters(), schedules(config)
        stored, self.checkpoints, self.resumed, self.notes = resume(config, agent, logdir, self.ranks, self.counters,
                                                                     self.schedules, train_envs or eval_envs)
        self.stored, self.replay = stored, stored.replay  # stored episodes: their folders and replays
        self.collection = collection.Collection(config, train_envs, self.replay, stored.traindir, agent.context,
                                                self.counters)
        # Checkpoints on the save_every clock, and stops at the next safe point (under torchrun agreed at
        # the update boundary).
        stops = launch.Stops({signal.SIGTERM: Interrupted, signal.SIGINT: KeyboardInterrupt})
        self.agreement = launch.Agreement(self.ranks, tools.Clock(config.save_every), stops)
        waits = ("learner_wait", "env_wait") if config.asynchronous else ()
        self.stopwatch = tools.Stopwatch(("learner", "env", *waits))
        self.run_log, self.evaluation = reporting(config, agent, logdir, self.ranks, self.counters, stored,
                                                  self.collection.collector, self.checkpoints.kept, eval_envs)
        self.first_calls = logs.FirstCalls("compile warm-up", lambda: self.progress.interactive)
        self.final_return = None  # the last evaluation's mean return

    frames = property(lambda self: self.counters.policy_steps * self.config.action_repeat)
    progress = property(lambda self: self.run_log.progress)

    @property
    def done(self):
        """A resumed run that completed its --steps (`completed`, so that a checkpoint of a smaller --steps
        is not taken as the end of this one): a rerun has nothing to do, a larger --steps continues it."""
        return self.resumed and self.counters.completed >= self.config.steps and self.frames >= self.config.steps

    @functools.cached_property
    def feed(self):
        """The learner's replay batches (storage.Prefetcher), made at the first update."""
        c = self.config
        return storage.Prefetcher(self.replay, c.batch_size, c.batch_length + self.agent.context.steps, c.device)

    def train(self):
        """Prefill and pretrain; then, until `steps` frames: count what was collected, evaluate, log and
        save when due (`maintain`), collect, train by the ratio; then the end's evaluation, log and save.
        Synchronous, the learner collects and trains in turn; asynchronous, a collector thread collects
        (`train_asynchronously`)."""
        self.run_log.open()
        ended = False
        try:
            with self.agreement.stops:  # a signal becomes a request, acted on at the next safe point
                if not self.resumed or not self.counters.updates:  # a stop in the prefill resumes it
                    prefill_and_pretrain(self)
                if self.config.asynchronous:
                    train_asynchronously(self)
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
                if self.evaluation.enabled:
                    self.evaluate()
                self.log()
                self.collection.stop()
                self.counters.completed = self.config.steps
                self.save()
            ended = True
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the progress; any other error keeps the last save
            self.collection.stop()  # the collector stops first, so that the checkpoint is taken between two steps
            save_on_interrupt(self)
            raise
        except storage.WriteError as e:  # a full disk or a read-only logdir: one line, and what is kept
            raise storage.WriteError(e.path, e, self.checkpoints.kept()) from None
        finally:
            self.collection.stop()  # after any other error too: no thread outlives the run
            self.run_log.close(quiet=not ended)  # the error that ends the run is raised once

    def maintain(self):
        """Between two steps, the loop's safe point: count what was collected, evaluate, log and save
        when due; stop when asked."""
        self.count()
        evaluated = self.evaluation.enabled and self.schedules["eval"](self.frames)
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

    def policy(self, obs, state):  # the learner's training policy (compiling, its first call is a phase)
        mode = policy_mode(self.config, self.frames)
        return self.announce_compilation("first policy step", self.agent.policy, obs, state, mode)

    def announce_compilation(self, name, fn, *args):
        """fn(*args); with compile on, the first call of each kind (it compiles) is a phase of its own."""
        return self.first_calls(name, fn, *args) if self.agent.compiled else fn(*args)

    def collect(self, policy):
        try:
            self.collection.step(policy)
        except ValueError as e:  # parallel.NonFiniteStep, or torch.distributions refusing NaN parameters
            self.raise_non_finite(e, f"in the policy step at frame {self.frames}")
            raise

    def count(self):
        self.collection.count(self.run_log.add_episode)

    def update(self, count, phase=None):
        context = self.agent.context  # every rank updates or none does: the updates average gradients over all
        if not count or not self.agreement.settle(self.replay.ready(self.config.batch_length + context.steps)):
            return
        train_step = self.learner.train_step  # with compile on, its first call (it compiles) is a phase
        for i in range(count):
            batch, ids, data = self.feed.next(more=i + 1 < count)  # the next batch is sampled during this update
            on_device = () if data is None else (data,)  # None on a CPU: train_step copies the batch
            try:
                metrics, latents = self.announce_compilation("first update", train_step, batch, *on_device)
            except ValueError as e:  # torch.distributions refusing the NaN parameters of non-finite weights
                self.raise_non_finite(e, f"at update {self.counters.updates + 1}")
                raise
            context.write_back(self.feed, ids, latents)  # also into the batch sampled ahead
            self.counters.updates += 1
            if phase is not None:
                phase.update(i + 1)
            self.run_log.record(metrics)

    def log(self):
        self.run_log.check_losses()
        self.count()
        lag = self.counters.updates - self.collection.synced if self.collection.thread is not None else None
        self.run_log.log(self.stopwatch.fractions(), lag)

    def evaluate(self):
        try:
            mean_return = self.evaluation.run(self.run_log)
        except ValueError as e:  # as in collect
            self.raise_non_finite(e, f"in an evaluation at frame {self.frames}")
            raise
        if mean_return is not None:
            self.final_return = mean_return  # the closing line's (logs.closing_line)
            self.progress.update(self.frames, eval_return=mean_return)

    def save(self):
        self.run_log.check_losses()
        with self.collection.between_steps():  # counters, schedules and episodes on disk agree
            self.count()
            self.agent.context.flush()  # the last update's write-back, which a resumed run would not find
            if self.collection.collector is not None:
                self.counters.stored_steps = self.collection.stored_steps()
            state = self.checkpoints.state()
        self.checkpoints.write(state)
        self.agreement.saved()

    def stop_if_asked(self):
        """At a safe point: once a stop was asked for (under torchrun: agreed, Agreement), save and end as
        the signal would (Interrupted: exit 143, KeyboardInterrupt: 130)."""
        if self.agreement.stop_code:
            self.save()
            raise self.agreement.stops.exception(self.agreement.stop_code)

    def raise_non_finite(self, error, where):
        raise_non_finite(self.agent, error, where, self.counters.updates, self.checkpoints.kept())


def resume(config, agent, logdir, ranks, counters, schedules, env_list):
    """The run's stored episodes (storage.StoredEpisodes: its replays; they fit the spaces of
    env_list's first, or are taken on trust without one) and its checkpoint (storage.Checkpoints),
    resumed from where there is one into `counters` and `schedules`. Returns (stored episodes,
    checkpoints, whether it resumed, lines for the start-up summary)."""
    stored = storage.StoredEpisodes(config, logdir, ranks.rank, (env_list or [None])[0], agent.context.spec)
    length = config.batch_length + agent.context.steps
    if config.offline_traindir and not stored.replay.ready(length):  # it would finish with no update
        raise tools.ConfigError(f"Invalid value '{config.offline_traindir}' for --offline_traindir: its episodes "
                                f"hold no sequence of {length} steps to train on ({stored.note[10:]})")
    checkpoints = storage.Checkpoints(logdir / "latest.pt", config, agent, counters, schedules, stored.replay, ranks)
    resumed, notes = checkpoints.resume(None if config.offline_traindir else stored.traindir)
    # Every rank counts the frames of the rank that stored the most (they differ only after a
    # kill -9), so that all run the same number of iterations.
    counters.policy_steps = ranks.max(counters.policy_steps)
    return stored, checkpoints, resumed, [*stored.recovered, stored.note, *notes]


def schedules(config):
    """The Trainer's schedules: the train ratio (asynchronous: a limiter between the collector thread
    and the learner, tools.SamplesPerInsert), the log and the evaluation."""
    per_update = tools.replayed_per_update(config)
    train = (tools.SamplesPerInsert(config.train_ratio, per_update, config.ratio_tolerance) if config.asynchronous
             else tools.Ratio(config.train_ratio, per_update))
    return {"train": train, "log": tools.Every(config.log_every), "eval": tools.Every(config.eval_every)}


def reporting(config, agent, logdir, ranks, counters, stored, collector, kept, eval_envs):
    """The run's log (logs.RunLog) and evaluation (logs.Evaluation, on `eval_envs` into the stored
    evaluation episodes), with the open-loop prediction videos where they are made: on the main
    process alone, with an image decoder."""
    films = ranks.is_main and config.video_pred_log and agent.wm.heads["decoder"].cnn_shapes
    predict = (lambda data: agent.wm.video_pred(agent.wm.preprocess(data))) if films else None
    run_log = logs.RunLog(config, logdir, counters, ranks, envs.parse_tasks(config.task), stored.replay, collector,
                          kept, predict)
    run_episodes = (functools.partial(parallel.run_episodes, agent, eval_envs, config.eval_episode_num,
                                      stored.evaldir) if eval_envs else None)
    return run_log, logs.Evaluation(config, run_episodes, stored.eval_replay, ranks.is_main, predict)


def raise_non_finite(agent, error, where, updates, kept):
    """The NonFiniteError line for a ValueError raised `where` (the update or the policy step): one
    that non-finite weights caused names their learners, a non-finite environment step says which
    (parallel.NonFiniteStep). Returns for any other ValueError: a bug, which keeps its traceback."""
    learners = {"world model": agent.wm, "actor": agent.task_behavior.actor, "critic": agent.task_behavior.critic}
    if agent.expl_behavior is not None:
        learners["exploration"] = agent.expl_behavior
    bad = [name for name, module in learners.items() if not tools.all_finite(list(module.parameters()))]
    if bad:
        raise storage.NonFiniteError(f"non-finite {' and '.join(bad)} weights {where} (after update {updates}); the "
                                     f"run stops without saving ({kept})") from None
    if isinstance(error, parallel.NonFiniteStep):
        raise storage.NonFiniteError(f"{error} {where}; the run stops without saving ({kept})") from None


def policy_mode(config, frames):
    """The training policy's mode at `frames`: exploring until expl_until."""
    explore = config.expl_behavior != "greedy" and (not config.expl_until or frames < config.expl_until)
    return "explore" if explore else "train"


def train_asynchronously(trainer):
    """The loop of an asynchronous run: the learner trains in this thread while a collector thread
    (collection.Collection.start) steps every environment under one batched call of a copy of the
    policy, refreshed every `actor_sync_every` updates. The limiter (tools.SamplesPerInsert) holds
    the train ratio within `ratio_tolerance` updates: the learner waits when it runs ahead, the
    collector when the learner falls behind. The collector thread uses one torch thread; the learner
    keeps its own (README, Going faster)."""
    config, limiter, collecting = trainer.config, trainer.schedules["train"], trainer.collection
    env = trainer.train_envs[0]
    limiter.load_state_dict({"updates": limiter.updates, "inserts": trainer.counters.policy_steps})
    actor = Dreamer(env.obs_space, env.act_space, config.replace(compile=False))  # never compiled
    collecting.start(actor.to(config.device).requires_grad_(False), functools.partial(policy_mode, config), limiter,
                     trainer.stopwatch)
    collecting.sync(trainer.agent, trainer.counters.updates)
    print(f"Asynchronous: learner on {config.device} with {torch.get_num_threads()} torch threads, actor thread "
          f"with 1, {len(trainer.train_envs)} environments; weights synced every {config.actor_sync_every} "
          "updates", flush=True)
    collecting.thread.start()
    while not (collecting.thread.done.is_set() and not limiter.can_sample()):
        trainer.maintain()
        raise_actor_error(trainer)
        with trainer.stopwatch.time("learner_wait"):
            if not limiter.wait_sample(timeout=0.05):
                continue
        with trainer.stopwatch.time("learner"):
            trainer.update(1)
        limiter.sampled()
        if trainer.counters.updates - collecting.synced >= config.actor_sync_every:
            collecting.sync(trainer.agent, trainer.counters.updates)
    trainer.count()  # the steps handed over since the last maintain
    raise_actor_error(trainer)


def raise_actor_error(trainer):
    """The collector thread's error, in the learner's thread; a ValueError as Trainer.collect words it."""
    error = trainer.collection.thread.error
    if isinstance(error, ValueError):  # its weights are the learner's, copied
        trainer.raise_non_finite(error, f"in the actor's policy step at frame {trainer.frames}")
    if error is not None:
        raise error


def save_on_interrupt(trainer):
    """Ctrl-C or SIGTERM that ended the loop where it was (a deadline passed, a second signal): save
    there, unless a stop at a safe point saved already."""
    if trainer.checkpoints.saved_at == (trainer.frames, trainer.counters.updates):
        return
    if trainer.ranks.world_size > 1:
        # A second signal: saving gathers from every rank, and each stopped at its own point.
        print(f"Not saved: a second signal stops every rank at once ({trainer.checkpoints.kept()}).",
              file=sys.stderr, flush=True)
        return
    try:
        trainer.save()
    except (storage.NonFiniteError, storage.WriteError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)


def prefill_and_pretrain(trainer):
    """Before the loop: the prefill (`PREFILLS[prefill_policy]`), then `pretrain` updates; the
    prefill's steps count as paid for, so that training starts at the train ratio."""
    config = trainer.config
    if trainer.collection.collector is not None:
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
    # main restores this handler as it returns. Ignored, a late copy of a signal burst (a scheduler and a
    # wrapper both signalling) finds the stop it asked for saved and the process exiting; the default
    # action, which Python's shutdown puts back for a Python handler, would kill it (exit -15 after the
    # line that said 143). Children never inherit it: main installs its own handler before starting any.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    main()
