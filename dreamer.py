"""DreamerV3 training script: the one entry point.

    python3 dreamer.py --configs dmc_vision --task dmc_walker_walk --logdir ./logdir/walker

Reading order: configuration (parse), the agent (Dreamer), experience collection (Collector),
evaluation, then `main`, the training loop itself. Rerunning the same command resumes.
"""

import argparse
import copy
import ctypes
import datetime
import difflib
import functools
import io
import json
import os
import pathlib
import random
import sys
import time

import numpy as np
import torch
from torch import nn

import envs
import exploration
import models
import networks
import parallel
import tools

CONFIG_FILE = pathlib.Path(__file__).parent / "configs.yaml"

# Keys whose value must be one of a few names, checked before anything is created.
CHOICES = {
    "precision": (16, 32),
    "act": tuple(networks.ACTIVATIONS),
    "opt": tuple(models.OPTIMIZERS),
    "initial": ("learned", "zeros"),
    "norm": networks.NORMS,
    "encoder.norm": networks.NORMS,
    "decoder.norm": networks.NORMS,
    "winit": networks.WINITS,
    "dyn_cell": ("gru", "blockgru"),
    "update": tuple(models.UPDATES),
    "encoder.cnn": ("strided", "pooled"),
    "decoder.cnn": ("transposed", "upsample"),
    "dyn_mean_act": ("none", "tanh5"),
    "dyn_std_act": ("softplus", "abs", "sigmoid", "sigmoid2"),
    "imag_gradient": ("dynamics", "reinforce", "both"),
    "expl_behavior": ("greedy", "random", "plan2explore"),
    "disag_target": ("stoch", "deter", "embed", "feat"),
    "actor.dist": ("normal", "onehot"),
    "critic.dist": models.VALUE_DISTS,
    "reward_head.dist": models.VALUE_DISTS,
    "decoder.image_dist": ("mse",),
    "decoder.vector_dist": ("symlog_mse", "mse"),
    "lives": ("unused", "discount", "reset"),
    "resize": ("opencv", "pillow"),
    "actions": ("all", "needed"),
    "env_failure": ("restart", "stop"),
}

# ==================================================================================================
# Configuration
# ==================================================================================================


class Config:
    """Nested attribute access over a dict of settings (`config.actor.lr`)."""

    def __init__(self, mapping):
        for key, value in mapping.items():
            setattr(self, key, Config(value) if isinstance(value, dict) else value)

    def to_dict(self):
        return {k: v.to_dict() if isinstance(v, Config) else v for k, v in vars(self).items()}

    def __repr__(self):
        return f"Config({self.to_dict()})"


class ConfigError(ValueError):
    """A user mistake on the command line or in a preset: reported in one line, exit status 2."""


def load_presets(path=CONFIG_FILE):
    from ruamel.yaml import YAML

    return YAML(typ="safe", pure=True).load(pathlib.Path(path).read_text())


def merge(base, update):
    """Recursive merge: nested groups merge key by key, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def flatten(mapping, prefix=""):
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def parse_bool(text):
    lookup = {"true": True, "1": True, "false": False, "0": False}
    if text.lower() not in lookup:
        raise ValueError("expected True/False/true/false/1/0")
    return lookup[text.lower()]


def parse_number(text, like):
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number") from None
    if isinstance(like, int) and value.is_integer() and "." not in text and "e-" not in text.lower():
        return int(value)
    return value


def parse_value(text, default):
    """Convert a command-line string to the type of the key's current value."""
    if isinstance(default, bool):
        return parse_bool(text)
    if isinstance(default, (int, float)):
        return parse_number(text, default)
    if isinstance(default, list):
        items = [item for item in text.split(",") if item != ""]
        like = default[0] if default else ""
        return [parse_value(item, like) for item in items]
    return text


def closest(name, valid):
    match = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    return ", ".join(match) if match else "none close"


def parse(argv, presets=None):
    """Command line -> Config: defaults, then --configs presets in order, then --key value flags."""
    presets = presets if presets is not None else load_presets()
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--configs", nargs="+", default=[])
    args, rest = parser.parse_known_args(argv)
    config = presets["defaults"]
    for name in args.configs:
        if name not in presets:
            raise ConfigError(f"Unknown preset '{name}' (closest: {closest(name, list(presets))}); "
                              f"valid: {', '.join(presets)}")
        config = merge(config, presets[name])
    flat = flatten(config)
    overrides, i = {}, 0
    while i < len(rest):
        flag = rest[i]
        if not flag.startswith("--"):
            raise ConfigError(f"Unexpected argument '{flag}'; flags look like --key value")
        key = flag[2:]
        value = None
        if "=" in key:
            key, value = key.split("=", 1)
        if key not in flat:
            valid = [f"--{k}" for k in flat]
            raise ConfigError(f"Unknown config key '--{key}' (closest: {closest('--' + key, valid)})")
        if value is None:
            takes_value = i + 1 < len(rest) and not rest[i + 1].startswith("--")
            if isinstance(flat[key], bool) and not takes_value:
                value = "true"
            elif not takes_value:
                raise ConfigError(f"Missing value for --{key}")
            else:
                value, i = rest[i + 1], i + 1
        try:
            overrides[key] = parse_value(value, flat[key])
        except ValueError as e:
            raise ConfigError(f"Invalid value '{value}' for --{key}: {e}") from None
        i += 1
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    check_choices(flatten(config))
    return Config(normalise(config))


def check_choices(flat):
    for key, valid in CHOICES.items():
        if key in flat and flat[key] not in valid:
            raise ConfigError(f"Invalid value '{flat[key]}' for --{key}; valid: {', '.join(map(str, valid))}")


def normalise(config):
    """Counts written as 1e6 in YAML become integers."""
    config = copy.deepcopy(config)
    for key in ("steps", "eval_every", "eval_episode_num", "log_every", "prefill", "dataset_size",
                "time_limit", "envs", "action_repeat", "expl_until", "pretrain", "batch_size", "batch_length"):
        if isinstance(config.get(key), float):
            if not config[key].is_integer():
                raise ConfigError(f"Invalid value '{config[key]}' for --{key}: expected a whole number")
            config[key] = int(config[key])
    return config


# ==================================================================================================
# The agent
# ==================================================================================================


class Dreamer(nn.Module):
    """World model, task actor-critic and exploration behaviour: acts in batches and learns."""

    def __init__(self, obs_space, act_space, config):
        super().__init__()
        self.config = config
        self.act_size = act_space.shape[0]
        self.wm = models.WorldModel(obs_space, act_space, config)
        self.task_behavior = models.ActorCritic(config, self.wm, act_space, self.extrinsic_reward)
        if config.update not in models.UPDATES:
            raise ValueError(f"Unknown update '{config.update}'; valid: {', '.join(models.UPDATES)}")
        self.updater = models.UPDATES[config.update](config, self.wm, self.task_behavior)
        if config.expl_behavior == "greedy":
            self.expl_behavior = None
        elif config.expl_behavior == "random":
            self.expl_behavior = exploration.Random(config, act_space)
        else:
            self.expl_behavior = exploration.Plan2Explore(config, self.wm, act_space)
        self.compiled = self.compile_steps() if config.compile else []

    def compile_steps(self):
        """Compile the functions that do the work of every update and every policy step: the RSSM
        transitions (run once per time step) and the MLP/CNN bodies of every network."""
        # The actor's backward pass keeps the graph (retain_graph) for the critic's loss, which
        # compiled backward functions allow only without donated buffers.
        torch._functorch.config.donated_buffer = False
        # One MLP.forward serves every MLP, each seen with and without gradients and with its own
        # input shapes: about twenty variants, beyond dynamo's default limit of 8 per function
        # (past which the rest would silently run eagerly).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        rssm = self.wm.rssm
        rssm.img_step = networks.Compiled(rssm.img_step, "rssm.img_step")
        rssm.obs_step = networks.Compiled(rssm.obs_step, "rssm.obs_step")
        compiled = [rssm.img_step, rssm.obs_step]
        for name, module in self.named_modules():
            # The critic's single forward pass is backpropagated twice, once into its input (the
            # actor's loss) and once into its weights (its own loss). Eager autograd computes only
            # what each pass needs; a compiled backward would compute both every time.
            if name.endswith(".critic.mlp"):  # not slow_critic.mlp: that one only runs forward
                continue
            if isinstance(module, (networks.MLP, networks.ConvEncoder, networks.ConvDecoder)):
                module.forward = networks.Compiled(module.forward, name)
                compiled.append(module.forward)
        return compiled

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
        sample = not (mode == "eval" and self.config.eval_state_mean)
        latent, _ = self.wm.rssm.obs_step(latent, action, embed, data["is_first"], sample)
        feat = self.wm.rssm.get_feat(latent)
        if mode == "eval":
            action = self.task_behavior.actor(feat).mode()
        elif mode == "explore" and self.expl_behavior is not None:
            action = self.expl_behavior.actor(feat).sample()
        else:
            action = self.task_behavior.actor(feat).sample()
        return action.cpu().numpy(), (latent, action)

    def train_step(self, batch):
        """One update of every learner on a replayed batch (B, T, ...); returns tensor metrics."""
        data = self.wm.preprocess(batch)
        post, embed, metrics = self.updater.train_step(data)  # world model and task actor-critic
        start = {k: v.reshape(-1, *v.shape[2:]) for k, v in post.items()}  # (B*T, ...)
        start_cont = data["cont"].reshape(-1)
        if self.expl_behavior is not None:
            metrics.update(self.expl_behavior.train_step(start, start_cont, post, embed, data))
        return metrics

    def optimizer_state(self):
        state = {"model": self.wm.optimizer.state_dict(), "task": self.task_behavior.optimizer_state()}
        if self.updater.optimizer is not None:
            state["update"] = self.updater.optimizer.state_dict()
        if isinstance(self.expl_behavior, exploration.Plan2Explore):
            state["expl"] = {"ensemble": self.expl_behavior.optimizer.state_dict(),
                             "behavior": self.expl_behavior.behavior.optimizer_state()}
        return state

    def load_optimizer_state(self, state):
        self.wm.optimizer.load_state_dict(state["model"])
        self.task_behavior.load_optimizer_state(state["task"])
        if self.updater.optimizer is not None:
            self.updater.optimizer.load_state_dict(state["update"])
        if "expl" in state:
            self.expl_behavior.optimizer.load_state_dict(state["expl"]["ensemble"])
            self.expl_behavior.behavior.load_optimizer_state(state["expl"]["behavior"])


# ==================================================================================================
# Experience collection
# ==================================================================================================


class Collector:
    """Steps a list of environments together under one batched policy and records every step.

    Each environment's steps go to its own replay stream; finished episodes are written to
    `directory` and their return and length reported to `on_episode`.
    """

    def __init__(self, env_list, replay, directory, on_episode, action_repeat=1):
        self.envs, self.replay, self.directory, self.on_episode = env_list, replay, directory, on_episode
        self.action_repeat = action_repeat
        self.obs = [None] * len(env_list)
        self.episodes = [[] for _ in env_list]
        self.state = None
        self.dropped = 0  # episodes lost to environment workers that died
        # Per environment: policy steps, finished episodes, last return; steps at the last status().
        self.env_steps = [0] * len(env_list)
        self.env_episodes = [0] * len(env_list)
        self.env_returns = [float("nan")] * len(env_list)
        self.status_mark = (time.time(), [0] * len(env_list))
        act_space = env_list[0].act_space
        self.zero_action = np.zeros(act_space.shape, np.float32)

    def _record(self, index, obs, action, reward):
        step = {k: np.asarray(v) for k, v in obs.items()}
        step["action"] = np.asarray(action, np.float32)
        step["reward"] = np.float32(reward)
        self.episodes[index].append(step)
        if self.replay is not None:
            self.replay.add({k: v for k, v in step.items() if not k.startswith("log_")}, index)

    def _reset(self, indices):
        futures = [(i, self.envs[i].reset()) for i in indices]
        for i, future in futures:
            self.obs[i] = future()
            self._record(i, self.obs[i], self.zero_action, 0.0)

    def step(self, policy):
        """One policy step in every environment; returns the number of policy steps taken."""
        self._reset([i for i, obs in enumerate(self.obs) if obs is None])
        batch = {k: np.stack([obs[k] for obs in self.obs]) for k in self.obs[0] if not k.startswith("log_")}
        actions, self.state = policy(batch, self.state)
        futures = [env.step(action) for env, action in zip(self.envs, actions)]  # all step at once
        done_indices = []
        for i, (future, action) in enumerate(zip(futures, actions)):
            obs, reward, done, info = future()
            self.obs[i] = obs
            if info.get("restarted"):  # the worker died and came back with a fresh episode
                self.dropped += 1
                self.episodes[i] = []
                self._record(i, obs, self.zero_action, 0.0)
                continue
            self._record(i, obs, action, reward)
            self.env_steps[i] += 1
            if done:
                self._finish(i)
                done_indices.append(i)
        for i in done_indices:
            self.obs[i] = None
        return len(self.envs)

    def _finish(self, index):
        steps = self.episodes[index]
        episode = {k: np.stack([s[k] for s in steps]) for k in steps[0]}
        if self.directory is not None:
            tools.save_episode(self.directory, episode)
        self.episodes[index] = []
        self.env_episodes[index] += 1
        self.env_returns[index] = float(episode["reward"].sum())
        self.on_episode(episode)

    def status(self):
        """Per-environment steps, episodes, last return and frames per second since the last call."""
        now, (then, marks) = time.time(), self.status_mark
        seconds = max(now - then, 1e-9)
        rows = [{"steps": steps, "episodes": episodes, "last_return": ret,
                 "fps": (steps - mark) * self.action_repeat / seconds}
                for steps, episodes, ret, mark in zip(self.env_steps, self.env_episodes, self.env_returns, marks)]
        self.status_mark = (now, list(self.env_steps))
        return rows


def episode_stats(episode):
    return {"return": float(episode["reward"].sum()), "length": len(episode["reward"]) - 1}


# ==================================================================================================
# Training loop
# ==================================================================================================


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve_device(config):
    """Fall back to the CPU where CUDA is absent; returns the reason, for the start-up summary."""
    try:
        device = torch.device(config.device)
    except RuntimeError:
        raise ConfigError(f"Invalid value '{config.device}' for --device; valid: cpu, cuda, cuda:<index>") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        config.device = "cpu"
        return "CUDA is not available"
    return None


def seed_everything(seed, deterministic):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses otherwise
        torch.use_deterministic_algorithms(True)


def keep_freed_memory():
    """Have glibc keep freed memory for reuse instead of returning it to the OS.

    By default glibc serves every block over 32 MB with a fresh mmap and unmaps it when freed, so
    each of the update's large activations is paid again in page faults: 4-10% of a CPU update in
    benchmarks/train_speed.py (--no_malloc_tuning), a quarter of the CNN's forward and backward.
    Returns whether the setting took effect (False off glibc, e.g. on macOS).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def make_envs(config, mode, count):
    ctors = [functools.partial(envs.make_env, config, mode, i) for i in range(count)]
    if config.parallel:
        return [parallel.Parallel(ctor, i, restart=config.env_failure == "restart") for i, ctor in enumerate(ctors)]
    return [parallel.Damy(ctor, i) for i, ctor in enumerate(ctors)]


def check_spaces(config, act_space):
    discrete = getattr(act_space, "discrete", False)
    if discrete and config.actor.dist != "onehot":
        raise ConfigError(f"Task '{config.task}' has discrete actions; use --actor.dist onehot "
                          "(as the atari100k, crafter and memorymaze presets do)")
    if not discrete and config.actor.dist == "onehot":
        raise ConfigError(f"Task '{config.task}' has continuous actions; use --actor.dist normal")


# Keys that may differ between a run and its resumption without a warning.
BUDGET_KEYS = ("steps", "eval_every", "log_every", "eval_episode_num", "eval_only", "device", "logdir",
               "parallel", "env_failure", "compile", "video_pred_log")


def compare_saved_config(config, path):
    """Warnings for keys that differ from the run's saved config; a different task is an error."""
    from ruamel.yaml import YAML

    saved = flatten(YAML(typ="safe", pure=True).load(path.read_text()))
    current = flatten(config.to_dict())
    if saved.get("task") != current["task"]:
        raise ConfigError(f"--task {current['task']} differs from this run's task '{saved.get('task')}' "
                          f"(saved in {path}); use another --logdir for another task")
    return [f"{key}: {saved.get(key)!r} -> {value!r}" for key, value in current.items()
            if key not in BUDGET_KEYS and saved.get(key) != value]


def save_config(config, path):
    from ruamel.yaml import YAML

    buffer = io.StringIO()
    YAML(typ="safe", pure=True).dump(config.to_dict(), buffer)
    tools.atomic_write_bytes(path, buffer.getvalue().encode())


def compile_note(config):
    if not config.compile:
        return "off"
    if torch.device(config.device).type == "cpu":  # README, Performance: measured 0-14% slower there
        return "on (on a CPU it measured no faster than eager and adds a warm-up; --compile False turns it off)"
    return "on (the first updates include compilation)"


def summary(config, agent, device_note, resumed_step):
    """The start-up summary: what runs where, what differs from defaults, how big the model is."""
    defaults = flatten(load_presets()["defaults"])
    changed = {k: v for k, v in flatten(config.to_dict()).items() if defaults.get(k) != v}
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    params = {"world model": count(agent.wm), "actor": count(agent.task_behavior.actor),
              "critic": count(agent.task_behavior.critic)}
    if agent.expl_behavior is not None:
        params["exploration"] = count(agent.expl_behavior)
    lines = [
        f"Task: {config.task}",
        f"Device: {config.device}" + (f" ({device_note}; using the CPU)" if device_note else ""),
        "Compile: " + compile_note(config),
        f"Environments: {config.envs} ({'parallel processes' if config.parallel else 'in-process'})",
        f"Logdir: {config.logdir}",
        "Run: " + (f"resumed from frame {resumed_step}" if resumed_step is not None else "new"),
        "Parameters: " + ", ".join(f"{k} {v:,}" for k, v in params.items()),
        "Changed from defaults: " + (", ".join(f"{k}={v}" for k, v in changed.items()) or "none"),
    ]
    return "\n".join(lines)


class Counters:
    """Progress of a run; everything here is saved in the checkpoint."""

    def __init__(self):
        self.policy_steps = 0
        self.updates = 0
        self.episodes = 0


class Progress:
    """One updating line (tqdm) in a terminal; a plain line at every log when stdout is a file."""

    def __init__(self, total, initial, interactive=None):
        from tqdm import tqdm

        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self.total = total
        self.bar = tqdm(total=total, initial=initial, unit="frame", dynamic_ncols=True, disable=not self.interactive)
        self.stats = {}

    def update(self, frames, **stats):
        self.stats.update({k: v for k, v in stats.items() if v is not None})
        if self.interactive:
            self.bar.update(frames - self.bar.n)
            self.bar.set_postfix({k: f"{v:.1f}" for k, v in self.stats.items()}, refresh=False)

    def line(self, frames):
        """The plain progress line: frames, rates, last returns and ETA."""
        fps = self.stats.get("fps", 0.0)
        eta = datetime.timedelta(seconds=int((self.total - frames) / fps)) if fps > 0 else "?"
        parts = [f"frames {frames}/{self.total} ({100 * frames / max(self.total, 1):.1f}%)"]
        parts += [f"{k} {v:.1f}" for k, v in self.stats.items()]
        return " | ".join(parts + [f"ETA {eta}"])

    def log(self, frames):
        if not self.interactive:
            print(self.line(frames), flush=True)

    def close(self):
        self.bar.close()


class Trainer:
    """Owns a run's replay, counters, schedules and logger; `train()` is the main loop."""

    def __init__(self, config, agent, logdir, train_envs, eval_envs):
        self.config, self.agent, self.logdir = config, agent, logdir
        self.traindir = pathlib.Path(config.traindir or logdir / "train_eps").expanduser()
        self.evaldir = pathlib.Path(config.evaldir or logdir / "eval_eps").expanduser()
        self.train_envs, self.eval_envs = train_envs, eval_envs
        self.checkpoint = logdir / "latest.pt"
        self.counters = Counters()
        self.schedules = {"train": tools.Ratio(config.train_ratio, config.batch_size * config.batch_length),
                          "log": tools.Every(config.log_every), "eval": tools.Every(config.eval_every)}
        self.replay, loaded_steps = self.load_replay()
        self.eval_replay = tools.Replay(100 * config.batch_length, 1, config.seed + 1)
        evaldir = pathlib.Path(config.offline_evaldir).expanduser() if config.offline_evaldir else self.evaldir
        for episode in tools.load_episodes(evaldir, 100 * config.batch_length):
            self.eval_replay.add_episode(strip_logs(episode))
        self.resumed = self.checkpoint.exists()
        if self.resumed:
            self.restore(tools.load_checkpoint(self.checkpoint, config.device))
        elif not config.offline_traindir:  # episodes of a run killed before its first checkpoint count
            self.counters.policy_steps = loaded_steps
        self.recent_episodes = []
        self.prefill_behavior = exploration.Random(config, train_envs[0].act_space) if train_envs else None
        self.collector = (Collector(train_envs, self.replay, self.traindir, self.on_episode, config.action_repeat)
                          if train_envs else None)
        self.metrics = {}
        self.last_log = (time.time(), self.frames, self.counters.updates)

    @property
    def frames(self):
        return self.counters.policy_steps * self.config.action_repeat

    def load_replay(self):
        config = self.config
        replay = tools.Replay(config.dataset_size, max(1, config.envs), config.seed)
        source = pathlib.Path(config.offline_traindir).expanduser() if config.offline_traindir else self.traindir
        loaded_steps = 0
        for i, episode in enumerate(tools.load_episodes(source, config.dataset_size)):
            replay.add_episode(strip_logs(episode), i % len(replay.streams))
            loaded_steps += len(episode["reward"]) - 1
        return replay, loaded_steps

    # -- acting and learning ------------------------------------------------------------------------

    def on_episode(self, episode):
        self.counters.episodes += 1
        self.recent_episodes.append(episode)
        stats = episode_stats(episode)
        self.logger.scalar("train/return", stats["return"])
        self.logger.scalar("train/length", stats["length"])
        self.progress.update(self.frames, train_return=stats["return"])

    def collect(self, policy):
        if self.collector is None:  # offline: time advances as if the agent were collecting
            self.counters.policy_steps += max(1, self.config.envs)
        else:
            self.counters.policy_steps += self.collector.step(policy)

    def policy(self, obs, state):
        config = self.config
        explore = config.expl_behavior != "greedy" and (not config.expl_until or self.frames < config.expl_until)
        return self.agent.policy(obs, state, "explore" if explore else "train")

    def random_policy(self, obs, state):
        """Uniform actions for the prefill (the Random behaviour's actor ignores its input)."""
        return self.prefill_behavior.actor(torch.zeros(len(obs["is_first"]), 1)).sample().numpy(), None

    def update(self, count):
        config = self.config
        for _ in range(count):
            if not self.replay.ready(config.batch_length):
                return
            metrics = self.agent.train_step(self.replay.sample(config.batch_size, config.batch_length))
            self.counters.updates += 1
            for key, value in metrics.items():
                self.metrics.setdefault(key, []).append(value)

    def train(self):
        """Prefill, pretrain, then alternate collecting and updating until `steps` frames."""
        config = self.config
        self.logger = tools.Logger(self.logdir, self.frames)
        self.logger.writer.add_text("config", "```\n" + json.dumps(config.to_dict(), indent=2) + "\n```", self.frames)
        self.progress = Progress(config.steps, self.frames)
        try:
            if not self.resumed:
                while self.collector is not None and self.frames < config.prefill:
                    self.collect(self.random_policy)
                self.update(config.pretrain)
                self.schedules["train"].updates = self.schedules["train"].owed(self.counters.policy_steps)
            while self.frames < config.steps:
                if self.eval_envs and self.schedules["eval"](self.frames):
                    self.evaluate()
                    self.save()
                self.collect(self.policy)
                self.update(self.schedules["train"](self.counters.policy_steps))
                self.progress.update(self.frames)
                if self.schedules["log"](self.frames):
                    self.log()
            if self.eval_envs:
                self.evaluate()
            self.log()
        finally:
            self.save()
            self.progress.close()
            self.logger.close()

    # -- logging, evaluation, checkpoints -----------------------------------------------------------

    def log(self):
        config, counters = self.config, self.counters
        now, frames = time.time(), self.frames
        for key, values in self.metrics.items():
            self.logger.scalar(metric_name(key), torch.stack(values).float().mean())
        self.metrics.clear()
        seconds = max(now - self.last_log[0], 1e-9)
        fps = (frames - self.last_log[1]) / seconds
        updates_per_s = (counters.updates - self.last_log[2]) / seconds
        for key, value in (("fps", fps), ("updates_per_s", updates_per_s), ("updates", counters.updates),
                           ("replay_steps", len(self.replay))):
            self.logger.scalar(f"perf/{key}", value)
        self.logger.scalar("train/episodes", counters.episodes)
        if self.collector is not None:
            self.logger.scalar("train/dropped_episodes", self.collector.dropped)
            self.log_env_status()
        for key, value in envs.episode_metrics(config.task, self.recent_episodes).items():
            self.logger.scalar(f"train/{key}", value)
        self.recent_episodes.clear()
        if self.films_predictions(self.replay):
            batch = self.agent.wm.preprocess(self.replay.sample(6, config.batch_length))
            self.logger.video("train/openl", self.agent.wm.video_pred(batch))
        self.logger.write(frames)
        self.progress.update(frames, fps=fps, updates_per_s=updates_per_s)
        self.progress.log(frames)
        self.last_log = (now, frames, counters.updates)

    def log_env_status(self):
        """What each environment is doing: scalars env/<i>/..., and a line per environment when
        the progress goes to a log file."""
        for i, row in enumerate(self.collector.status()):
            for key, value in row.items():
                if np.isfinite(value):
                    self.logger.scalar(f"env/{i}/{key}", value)
            if not self.progress.interactive:
                print(f"  env {i}: steps {row['steps']} episodes {row['episodes']} "
                      f"last return {row['last_return']:.1f} fps {row['fps']:.1f}", flush=True)

    def evaluate(self):
        config = self.config
        episodes = run_episodes(self.agent, self.eval_envs, config.eval_episode_num, self.evaldir)
        for episode in episodes:
            self.eval_replay.add_episode(strip_logs(episode))
        returns = log_evaluation(self.logger, episodes, config)
        if self.films_predictions(self.eval_replay):
            batch = self.agent.wm.preprocess(self.eval_replay.sample(6, config.batch_length))
            self.logger.video("eval/openl", self.agent.wm.video_pred(batch))
        self.progress.update(self.frames, eval_return=float(np.mean(returns)))

    def films_predictions(self, replay):
        """Open-loop videos need an image decoder and a full sequence to show."""
        config = self.config
        return (config.video_pred_log and bool(self.agent.wm.heads["decoder"].cnn_shapes)
                and replay.ready(config.batch_length))

    def save(self):
        schedules = self.schedules
        tools.save_checkpoint(self.checkpoint, {
            "agent": self.agent.state_dict(),
            "optimizers": self.agent.optimizer_state(),
            "counters": dict(vars(self.counters)),
            "schedules": {"train": schedules["train"].updates, "log": schedules["log"].last,
                          "eval": schedules["eval"].last},
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "replay": self.replay.rng.bit_generator.state},
        })

    def restore(self, state):
        self.agent.load_state_dict(state["agent"])
        self.agent.load_optimizer_state(state["optimizers"])
        vars(self.counters).update(state["counters"])
        self.schedules["train"].updates = state["schedules"]["train"]
        self.schedules["log"].last = state["schedules"]["log"]
        self.schedules["eval"].last = state["schedules"]["eval"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        self.replay.rng.bit_generator.state = state["rng"]["replay"]


def strip_logs(episode):
    """Replay keeps what the model trains on; `log_*` keys only feed the suite metrics."""
    return {k: v for k, v in episode.items() if not k.startswith("log_")}


def run_episodes(agent, env_list, count, directory):
    """`count` episodes with the task policy's mode (episodes still running at the end are dropped)."""
    finished = []
    collector = Collector(env_list, None, directory, finished.append)
    policy = functools.partial(agent.policy, mode="eval")
    while len(finished) < count:
        collector.step(policy)
    return finished[:count]


def log_evaluation(logger, episodes, config):
    returns = [episode_stats(e)["return"] for e in episodes]
    logger.scalar("eval/return", float(np.mean(returns)))
    logger.scalar("eval/return_std", float(np.std(returns)))
    logger.scalar("eval/length", float(np.mean([episode_stats(e)["length"] for e in episodes])))
    logger.scalar("eval/episodes", len(episodes))
    for key, value in envs.episode_metrics(config.task, episodes).items():
        logger.scalar(f"eval/{key}", value)
    if config.video_pred_log and "image" in episodes[0]:
        logger.video("eval/policy", episodes[0]["image"][None])
    return returns


def evaluate_checkpoint(config, agent, logdir, eval_envs):
    """--eval_only: load latest.pt, run eval_episode_num episodes, write only into logdir/eval_only/."""
    state = tools.load_checkpoint(logdir / "latest.pt", config.device)
    agent.load_state_dict(state["agent"])
    episodes = run_episodes(agent, eval_envs, config.eval_episode_num, None)
    returns = [episode_stats(e)["return"] for e in episodes]
    out = logdir / "eval_only"
    out.mkdir(exist_ok=True)
    result = {"frame": state["counters"]["policy_steps"] * config.action_repeat, "returns": returns,
              "mean": float(np.mean(returns)), "std": float(np.std(returns))}
    tools.atomic_write_bytes(out / "returns.json", json.dumps(result, indent=2).encode())
    if "image" in episodes[0]:
        write_mp4(out / "episode.mp4", episodes[0]["image"])
    print(f"Evaluated {len(returns)} episodes at frame {result['frame']}: "
          f"return {result['mean']:.1f} ± {result['std']:.1f}; wrote {out}")
    return result


def write_mp4(path, frames, fps=30):
    import imageio.v2 as imageio

    tmp = path.with_name(f".{path.stem}.tmp.mp4")
    imageio.mimwrite(tmp, list(frames), fps=fps, format="FFMPEG", macro_block_size=1)
    os.replace(tmp, path)


def setup(argv):
    """Parse and check everything that can be wrong before any file is written."""
    config = parse(sys.argv[1:] if argv is None else argv)
    if not config.logdir:
        raise ConfigError("Missing --logdir: give the folder for this run, e.g. --logdir ./logdir/walker")
    envs.check_task(config.task)
    logdir = pathlib.Path(config.logdir).expanduser()
    warnings_ = []
    if (logdir / "config.yaml").exists():
        warnings_ = compare_saved_config(config, logdir / "config.yaml")
    if config.eval_only and not (logdir / "latest.pt").exists():
        raise ConfigError(f"--eval_only needs a checkpoint, but {logdir / 'latest.pt'} does not exist")
    return config, logdir, resolve_device(config), warnings_


def main(argv=None):
    try:
        config, logdir, device_note, changed = setup(argv)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    seed_everything(config.seed, config.deterministic_run)
    torch.set_float32_matmul_precision("high")
    keep_freed_memory()
    train_envs, eval_envs = [], []
    try:
        if not config.offline_traindir and not config.eval_only:
            train_envs = make_envs(config, "train", config.envs)
        eval_count = min(max(config.envs, 1), config.eval_episode_num)
        eval_envs = make_envs(config, "eval", eval_count) if eval_count else []
        if not train_envs and not eval_envs:
            raise ConfigError("Nothing to act in: offline training and --eval_only need --eval_episode_num > 0")
        env = (train_envs or eval_envs)[0]
        check_spaces(config, env.act_space)
        agent = Dreamer(env.obs_space, env.act_space, config).to(config.device)
    except (ConfigError, ValueError, ImportError, parallel.WorkerError) as e:
        # A user mistake, or a suite whose package is missing: its last line says what to do.
        for env in train_envs + eval_envs:
            env.close()
        fail(str(e).strip().splitlines()[-1])
    try:
        if config.eval_only:
            return evaluate_checkpoint(config, agent, logdir, eval_envs)
        logdir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(config, agent, logdir, train_envs, eval_envs)
        print(summary(config, agent, device_note, trainer.frames if trainer.resumed else None), flush=True)
        for line in changed:
            print(f"warning: differs from the saved config: {line}", flush=True)
        save_config(config, logdir / "config.yaml")
        trainer.train()
    finally:
        for env in train_envs + eval_envs:
            env.close()


ACTOR_METRICS = ("return_scale", "advantage", "imag_reward", "imag_return")


def metric_name(key):
    """Group metrics in TensorBoard: expl/, actor/, critic/ or world_model/."""
    if key.startswith("expl_"):
        return f"expl/{key[5:]}"
    if key.startswith("actor") or key in ACTOR_METRICS:
        return f"actor/{key}"
    if key.startswith("critic") or key == "imag_value":
        return f"critic/{key}"
    return f"world_model/{key}"


if __name__ == "__main__":
    main()
