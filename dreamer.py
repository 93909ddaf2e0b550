"""DreamerV3 training script: the one entry point.

    python3 dreamer.py --configs dmc_vision --task dmc_walker_walk --logdir ./logdir/walker

Reading order: configuration (CHOICES, RANGES, parse), the agent (Dreamer), experience collection
(Collector), run set-up (devices, seeds, environments, `Resources` for --envs/--parallel auto,
saved config, start-up summary), then the training run: `Trainer` (replay, counters, schedules,
`train()`) with its `Checkpoints` and its `RunLog` (logs, evaluation), and the loop that drives it
(`SyncLoop` or `AsyncLoop`); then evaluation episodes, and the entry points `main`, `run` and
`run_processes` (torchrun). Rerunning the same command resumes.
"""

import argparse
import collections
import contextlib
import copy
import ctypes
import datetime
import difflib
import functools
import io
import itertools
import json
import os
import pathlib
import random
import re
import signal
import sys
import tempfile
import threading
import time
import traceback

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
    "precision": models.PRECISIONS,
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
    "compile": ("auto", True, False),
    "imag_gradient": ("auto", "dynamics", "reinforce", "both"),
    "expl_behavior": ("greedy", "random", "plan2explore"),
    "disag_target": ("stoch", "deter", "embed", "feat"),
    "actor.dist": ("auto", "normal", "onehot"),
    "critic.dist": models.VALUE_DISTS,
    "reward_head.dist": models.VALUE_DISTS,
    "decoder.image_dist": ("mse",),
    "decoder.vector_dist": ("symlog_mse", "mse"),
    "lives": ("unused", "discount", "reset"),
    "resize": ("opencv", "pillow"),
    "actions": ("all", "needed"),
    "env_failure": ("restart", "stop"),
    "parallel": ("auto", True, False),
}


def valid_regex(text):
    try:
        re.compile(text)
    except (re.error, TypeError):
        return False
    return True


def offline(flat):
    """Offline training and --eval_only collect nothing, so they may run with --envs 0."""
    return bool(flat.get("offline_traindir")) or bool(flat.get("eval_only"))


# Numeric ranges (and patterns), checked at start-up like CHOICES: key -> (predicate(value, flat
# config), what is valid). A key absent from a config is not checked.
_at_least = lambda low: (lambda v, flat: v >= low)  # noqa: E731
_positive = lambda v, flat: v > 0  # noqa: E731
_fraction = lambda v, flat: 0 <= v <= 1  # noqa: E731
RANGES = {
    "steps": (_at_least(0), "a whole number >= 0"),
    "envs": (lambda v, flat: v == "auto" or (isinstance(v, int) and v >= (0 if offline(flat) else 1)),
             "auto or a whole number >= 1 (0 only with --offline_traindir or --eval_only)"),
    "action_repeat": (_at_least(1), "a whole number >= 1"),
    "size": (lambda v, flat: len(v) == 2 and all(isinstance(x, int) and x >= 1 for x in v),
             "two whole numbers >= 1, e.g. 64,64"),
    "time_limit": (_at_least(0), "a whole number >= 0 (0 for none)"),
    "prefill": (_at_least(0), "a whole number >= 0"),
    "pretrain": (_at_least(0), "a whole number >= 0"),
    "eval_every": (_at_least(0), "a whole number >= 0"),
    "eval_episode_num": (_at_least(0), "a whole number >= 0"),
    "log_every": (_at_least(0), "a whole number >= 0"),
    "expl_until": (_at_least(0), "a whole number >= 0"),
    "noops": (_at_least(0), "a whole number >= 0"),
    "dataset_size": (_at_least(1), "a whole number >= 1"),
    "batch_size": (_at_least(1), "a whole number >= 1"),
    "batch_length": (_at_least(1), "a whole number >= 1"),
    "replay_context": (_at_least(0), "a whole number >= 0 (0 for none)"),
    "train_ratio": (_positive, "a number > 0"),
    # Below one update of tolerance the learner and the actor can wait on each other for ever.
    "ratio_tolerance": (_at_least(1), "a number >= 1 (updates)"),
    "actor_sync_every": (_at_least(1), "a whole number >= 1"),
    "asynchronous": (lambda v, flat: not (v and flat.get("offline_traindir") and not flat.get("eval_only")),
                     "False with --offline_traindir (no environments for an actor to act in)"),
    "model_lr": (_positive, "a number > 0"),
    "opt_eps": (_positive, "a number > 0"),
    "actor.lr": (_positive, "a number > 0"),
    "actor.eps": (_positive, "a number > 0"),
    "critic.lr": (_positive, "a number > 0"),
    "critic.eps": (_positive, "a number > 0"),
    "weight_decay": (_at_least(0), "a number >= 0"),
    "grad_clip": (_at_least(0), "a number >= 0 (0 for none)"),
    "actor.grad_clip": (_at_least(0), "a number >= 0 (0 for none)"),
    "critic.grad_clip": (_at_least(0), "a number >= 0 (0 for none)"),
    "agc": (_at_least(0), "a number >= 0 (0 for none)"),
    "warmup": (_at_least(0), "a whole number >= 0"),
    "critic.repval": (_at_least(0), "a number >= 0"),
    "dyn_img_layers": (_at_least(1), "a whole number >= 1"),
    "dyn_blocks": (lambda v, flat: v >= 1 and (flat.get("dyn_cell") != "blockgru" or flat.get("dyn_deter", v) % v == 0),
                   "a whole number >= 1 that divides --dyn_deter"),
    "discount": (lambda v, flat: 0 < v <= 1, "a number in (0, 1]"),
    "discount_lambda": (_fraction, "a number in [0, 1]"),
    "imag_horizon": (_at_least(1), "a whole number >= 1"),
    "imag_gradient_mix": (_fraction, "a number in [0, 1]"),
    "unimix_ratio": (lambda v, flat: 0 <= v < 1, "a number in [0, 1)"),
    "actor.unimix_ratio": (lambda v, flat: 0 <= v < 1, "a number in [0, 1)"),
    "kl_free": (_at_least(0), "a number >= 0"),
    "dyn_scale": (_at_least(0), "a number >= 0"),
    "rep_scale": (_at_least(0), "a number >= 0"),
    "dyn_hidden": (_at_least(1), "a whole number >= 1"),
    "dyn_deter": (_at_least(1), "a whole number >= 1"),
    "dyn_stoch": (_at_least(1), "a whole number >= 1"),
    "dyn_discrete": (_at_least(0), "a whole number >= 0 (0 for Gaussian latents)"),
    "dyn_rec_depth": (_at_least(1), "a whole number >= 1"),
    "units": (_at_least(1), "a whole number >= 1"),
    "critic.slow_target_update": (_at_least(1), "a whole number >= 1"),
    "critic.slow_target_fraction": (lambda v, flat: 0 < v <= 1, "a number in (0, 1]"),
    "actor.min_std": (_positive, "a number > 0"),
    "actor.absmax": (_at_least(0), "a number >= 0 (0 for unbounded samples)"),
    "actor.max_std": (lambda v, flat: v >= flat.get("actor.min_std", 0), "a number >= --actor.min_std"),
    "dyn_min_std": (_at_least(0), "a number >= 0"),
    "actor.entropy": (_at_least(0), "a number >= 0"),
    "reward_head.loss_scale": (_at_least(0), "a number >= 0"),
    "cont_head.loss_scale": (_at_least(0), "a number >= 0"),
    "encoder.cnn_depth": (_at_least(1), "a whole number >= 1"),
    "decoder.cnn_depth": (_at_least(1), "a whole number >= 1"),
    "encoder.minres": (_at_least(1), "a whole number >= 1"),
    "decoder.minres": (_at_least(1), "a whole number >= 1"),
    "encoder.mlp_units": (_at_least(1), "a whole number >= 1"),
    "decoder.mlp_units": (_at_least(1), "a whole number >= 1"),
    "disag_models": (_at_least(1), "a whole number >= 1"),
    "disag_units": (_at_least(1), "a whole number >= 1"),
    "disag_offset": (_at_least(0), "a whole number >= 0"),
    "encoder.mlp_keys": (lambda v, flat: valid_regex(v), "a regular expression"),
    "encoder.cnn_keys": (lambda v, flat: valid_regex(v), "a regular expression"),
    "decoder.mlp_keys": (lambda v, flat: valid_regex(v), "a regular expression"),
    "decoder.cnn_keys": (lambda v, flat: valid_regex(v), "a regular expression"),
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


# Keys that take True/False or 'auto' (compile: settled by resolve_auto once the device is known;
# parallel: by Resources, from measurement), and a count or 'auto' (envs: by Resources).
BOOL_OR_AUTO = ("compile", "parallel")
INT_OR_AUTO = ("envs",)
NUMBER_OR_NAME = ("precision",)  # 32 | 16 | bf16: a name stays text, for check_choices to judge


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


def parse_count_or_auto(text):
    try:
        return parse_number(text, 1)
    except ValueError:
        raise ValueError("expected a whole number or auto") from None


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
            if (isinstance(flat[key], bool) or key in BOOL_OR_AUTO) and not takes_value:
                value = "true"
            elif not takes_value:
                raise ConfigError(f"Missing value for --{key}")
            else:
                value, i = rest[i + 1], i + 1
        try:
            if key in BOOL_OR_AUTO:
                overrides[key] = "auto" if value == "auto" else parse_bool(value)
            elif key in INT_OR_AUTO:
                overrides[key] = "auto" if value == "auto" else parse_count_or_auto(value)
            elif key in NUMBER_OR_NAME and not value.replace(".", "", 1).isdigit():
                overrides[key] = value
            else:
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
    config = normalise(config)
    check_ranges(flatten(config))
    return Config(config)


def check_choices(flat):
    for key, valid in CHOICES.items():
        if key in flat and flat[key] not in valid:
            raise ConfigError(f"Invalid value '{flat[key]}' for --{key}; valid: {', '.join(map(str, valid))}")


def check_ranges(flat):
    for key, (valid, description) in RANGES.items():
        if key in flat and not valid(flat[key], flat):
            value = ",".join(map(str, flat[key])) if isinstance(flat[key], list) else flat[key]
            raise ConfigError(f"Invalid value '{value}' for --{key}; valid: {description}")


def normalise(config):
    """Counts written as 1e6 in YAML become integers."""
    config = copy.deepcopy(config)
    for key in ("steps", "eval_every", "eval_episode_num", "log_every", "prefill", "dataset_size",
                "time_limit", "envs", "action_repeat", "expl_until", "pretrain", "batch_size", "batch_length",
                "replay_context", "actor_sync_every"):
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
        self.auto_notes = {}  # why an 'auto' key settled as it did, for the summary
        # settles every 'auto' key before anything is built
        self.resolved = resolve_auto(config, act_space, obs_space, self.auto_notes)
        self.config = config
        self.act_size = act_space.shape[0]
        self.wm = models.WorldModel(obs_space, act_space, config)
        self.task_behavior = models.ActorCritic(config, self.wm, act_space, self.extrinsic_reward)
        if config.update not in models.UPDATES:
            raise ValueError(f"Unknown update '{config.update}'; valid: {', '.join(models.UPDATES)}")
        self.updater = models.UPDATES[config.update](config, self.wm, self.task_behavior)
        self.context = models.ReplayContext(config)
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
            policy = self.task_behavior.actor(feat)
            action = policy.sample() if self.config.eval_sample else policy.mode()
        elif mode == "explore" and self.expl_behavior is not None:
            action = self.expl_behavior.actor(feat).sample()
        else:
            action = self.task_behavior.actor(feat).sample()
        return action.cpu().numpy(), (latent, action)

    def train_step(self, batch, data=None):
        """One update of every learner on a replayed batch (B, K + T, ...) with K replay_context
        steps; returns tensor metrics. With K > 0 the training posteriors replace the batch's
        latents of the T trained steps (models.ReplayContext.store), for the write-back. `data`:
        the same batch already on the device (tools.Prefetcher), else batch is copied there."""
        data = self.wm.preprocess(batch if data is None else data)
        latent, data = self.context.split(data)  # the stored start latent; data (B, T, ...)
        post, embed, metrics = self.updater.train_step(data, latent)  # world model and task actor-critic
        start = {k: v.reshape(-1, *v.shape[2:]) for k, v in post.items()}  # (B*T, ...)
        start_cont = data["cont"].reshape(-1)
        if self.expl_behavior is not None:
            metrics.update(self.expl_behavior.train_step(start, start_cont, post, embed, data))
        self.context.store(batch, post)
        return metrics

    def distribute(self, ranks):
        """Train as one of the processes `ranks` (tools.SingleProcess or tools.Distributed): every
        optimizer averages its gradients over them, every return normalisation takes its
        percentiles over all of them, Plan2Explore counts its ensemble's pairs over all of them,
        and all weights and buffers (the slow critic, the return EMAs) start from the main
        process's, so that they stay identical on every process."""
        for module in self.modules():
            if isinstance(module, (models.ReturnNorm, exploration.Plan2Explore)):
                module.ranks = ranks
            for value in vars(module).values():
                if isinstance(value, models.Optimizer):
                    value.ranks = ranks
        if self.updater.optimizer is not None:  # the joint optimizer lives outside the modules
            self.updater.optimizer.ranks = ranks
        ranks.broadcast_(self.state_dict().values())

    def optimizer_state(self):
        state = {"model": self.wm.optimizer.state_dict(), "task": self.task_behavior.optimizer_state()}
        if self.updater.optimizer is not None:
            state["update"] = self.updater.optimizer.state_dict()
        if isinstance(self.expl_behavior, exploration.Plan2Explore):
            state["expl"] = {"ensemble": self.expl_behavior.optimizer.state_dict(),
                             "behavior": self.expl_behavior.behavior.optimizer_state()}
        return state

    def load_optimizer_state(self, state):
        """Returns the optimizer settings of this config that replace differing saved ones."""
        changes = self.wm.optimizer.load_state_dict(state["model"])
        changes += self.task_behavior.load_optimizer_state(state["task"])
        if self.updater.optimizer is not None:
            changes += self.updater.optimizer.load_state_dict(state["update"])
        if "expl" in state:
            changes += self.expl_behavior.optimizer.load_state_dict(state["expl"]["ensemble"])
            changes += self.expl_behavior.behavior.load_optimizer_state(state["expl"]["behavior"])
        return changes


# ==================================================================================================
# Experience collection
# ==================================================================================================


class Collector:
    """Steps a list of environments together under one batched policy and records every step.

    Each environment's steps go to its own replay stream; finished episodes are written to
    `directory` and their return and length reported to `on_episode`. With a replay `context`
    (models.ReplayContext, replay_context > 0) each step also holds the latent the policy
    computed on it, filled in once the policy has seen the step (zeros until then: the last step
    of an episode keeps them).
    """

    def __init__(self, env_list, replay, directory, on_episode, action_repeat=1, context=None):
        self.envs, self.replay, self.directory, self.on_episode = env_list, replay, directory, on_episode
        self.action_repeat = action_repeat
        self.context = context if context is not None and context.spec else None
        self.newest = [None] * len(env_list)  # per environment: (step, replay id) of the step the policy sees next
        self.obs = [None] * len(env_list)
        self.episodes = [[] for _ in env_list]
        self.state = None
        self.dropped = 0  # episodes lost to environment workers that died
        # Per environment: policy steps, finished episodes, last return; steps at the last status().
        self.env_steps = [0] * len(env_list)
        self.env_episodes = [0] * len(env_list)
        self.env_returns = [float("nan")] * len(env_list)
        self.status_mark = (time.time(), [0] * len(env_list), self.step_costs())
        act_space = env_list[0].act_space
        self.zero_action = np.zeros(act_space.shape, np.float32)
        # Every step records its environment's task (index into the --task list; 0 with one task).
        # In a run of several, a task may observe keys beyond those all share (envs.common_spaces):
        # they are dropped.
        self.tasks = [getattr(env, "task_index", 0) for env in env_list]
        self.dropped_keys = [getattr(env, "dropped_keys", frozenset()) for env in env_list]

    def _observe(self, index, obs):
        drop = self.dropped_keys[index]
        self.obs[index] = {k: v for k, v in obs.items() if k not in drop} if drop else obs
        return self.obs[index]

    def _record(self, index, obs, action, reward):
        step = {k: np.asarray(v) for k, v in obs.items()}
        step["action"] = np.asarray(action, np.float32)
        step["reward"] = np.float32(reward)
        step["task"] = np.int32(self.tasks[index])
        if self.context is not None:
            step.update({k: v[0] for k, v in self.context.entries(None, 1).items()})
        self.episodes[index].append(step)
        stepid = None
        if self.replay is not None:
            stepid = self.replay.add({k: v for k, v in step.items() if not k.startswith("log_")}, index)
        self.newest[index] = (step, stepid)

    def _store_latents(self, state):
        """Attach the latents of the policy's `state` to the steps it just acted on."""
        entries = self.context.entries(state, len(self.envs))  # (N, ...) each
        for i, (step, _) in enumerate(self.newest):
            step.update({k: v[i] for k, v in entries.items()})
        if self.replay is not None:  # one step (L = 1) from each environment's newest id
            self.replay.update([stepid for _, stepid in self.newest], {k: v[:, None] for k, v in entries.items()})

    def _reset(self, indices):
        futures = [(i, self.envs[i].reset()) for i in indices]
        for i, future in futures:
            self._record(i, self._observe(i, future()), self.zero_action, 0.0)

    def step(self, policy):
        """One policy step in every environment; returns the number of policy steps taken."""
        self._reset([i for i, obs in enumerate(self.obs) if obs is None])
        batch = {k: np.stack([obs[k] for obs in self.obs]) for k in self.obs[0] if not k.startswith("log_")}
        actions, self.state = policy(batch, self.state)
        if self.context is not None:
            self._store_latents(self.state)
        # All step at once: the workers' requests go out before in-process environments step here.
        # (`in_process` of parallel.Damy / Parallel, forwarded by the wrappers; False sorts first.)
        order = sorted(range(len(self.envs)), key=lambda i: getattr(self.envs[i], "in_process", True))
        futures = {i: self.envs[i].step(actions[i]) for i in order}
        done_indices = []
        for i, action in enumerate(actions):
            obs, reward, done, info = futures[i]()
            obs = self._observe(i, obs)
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

    def step_costs(self):
        """(seconds inside env.step, steps) per environment, as counted where each one runs."""
        return [(getattr(env, "step_seconds", 0.0), getattr(env, "step_count", 0)) for env in self.envs]

    def status(self):
        """Per-environment steps, episodes, last return, frames per second and mean ms per step of the
        environment itself (step_ms; NaN without steps) since the last call."""
        now, (then, marks, costs) = time.time(), self.status_mark
        seconds = max(now - then, 1e-9)
        current = self.step_costs()
        rows = [{"steps": steps, "episodes": episodes, "last_return": ret,
                 "fps": (steps - mark) * self.action_repeat / seconds,
                 "step_ms": 1e3 * (spent - spent0) / (count - count0) if count > count0 else float("nan")}
                for steps, episodes, ret, mark, (spent, count), (spent0, count0)
                in zip(self.env_steps, self.env_episodes, self.env_returns, marks, current, costs)]
        self.status_mark = (now, list(self.env_steps), current)
        return rows


def episode_stats(episode):
    return {"return": float(episode["reward"].sum()), "length": len(episode["reward"]) - 1}


def by_task(tasks, episodes):
    """{task name: its episodes}, in the order of `tasks`, for the tasks that have any. An episode
    without a `task` key (stored before runs of several tasks existed) is of the first task."""
    groups = {}
    for episode in episodes:
        index = int(episode["task"][0]) if "task" in episode else 0
        groups.setdefault(index, []).append(episode)
    return {tasks[i]: groups[i] for i in sorted(groups)}


def log_episode_metrics(logger, prefix, tasks, episodes):
    """The suites' own scalars (envs.episode_metrics) of each task: <prefix>/<key> with one task,
    <prefix>/<task>/<key> with several."""
    for task, group in by_task(tasks, episodes).items():
        scope = f"{prefix}/{task}" if len(tasks) > 1 else prefix
        for key, value in envs.episode_metrics(task, group).items():
            logger.scalar(f"{scope}/{key}", value)


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


def task_assignment(config, mode, count, weights=None):
    """The task index of each environment: `count` training environments spread over the tasks of
    --task (envs.assign_tasks, round-robin unless `weights`), or `count` evaluation ones of each."""
    tasks = envs.parse_tasks(config.task)
    if mode == "train":
        return envs.assign_tasks(tasks, count, weights)
    return [task for task in range(len(tasks)) for _ in range(count)]


def make_envs(config, mode, count, first=0, weights=None, processes=None):
    """Environments for `mode`, as many as `task_assignment` gives (`weights`: per task, see
    envs.assign_tasks). `first`: the index (and seed offset) of the first one; under torchrun rank
    k's training environments are k * envs ... (k + 1) * envs - 1, so that no two share a seed.
    `processes`: {task: whether its environments run in worker processes} (by default
    config.parallel for all; a Resources decision may place only the expensive tasks' environments
    in workers). With several tasks every environment is wrapped to present the spaces the tasks
    share (envs.wrappers.TaskEnv)."""
    tasks = envs.parse_tasks(config.task)
    assignment = task_assignment(config, mode, count, weights)
    ctors = [functools.partial(envs.make_env, config, mode, first + i, tasks[task])
             for i, task in enumerate(assignment)]
    in_worker = [bool(config.parallel) if processes is None else processes[tasks[task]] for task in assignment]
    # The asynchronous actor steps the training environments from a thread of its own.
    own_thread = config.asynchronous and mode == "train"
    handles = [parallel.Parallel(ctor, i, restart=config.env_failure == "restart") if process
               else parallel.Damy(ctor, i, own_thread) for i, (ctor, process) in enumerate(zip(ctors, in_worker))]
    if len(tasks) == 1:
        return handles
    try:
        return wrap_tasks(config, tasks, handles, assignment)
    except BaseException:
        for env in handles:
            env.close()
        raise


def wrap_tasks(config, tasks, handles, assignment):
    """Each environment of a run of several tasks wrapped to present the spaces they share; a
    ConfigError names the keys or actions that do not fit (envs.common_spaces)."""
    one = {}  # task index -> one of its environments
    for env, task in zip(handles, assignment):
        one.setdefault(task, env)
    present = sorted(one)
    obs_spaces = [one[task].obs_space for task in present]
    used = set()  # the keys the encoder and decoder read in some task
    for space in obs_spaces:
        for part in (config.encoder, config.decoder):
            used.update(*networks.select_keys(space, part.cnn_keys, part.mlp_keys))
    noops = [envs.noop_action(tasks[task]) for task in present]
    try:
        obs_space, act_space = envs.common_spaces([tasks[task] for task in present], obs_spaces,
                                                  [one[task].act_space for task in present], used, noops)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return [envs.wrappers.TaskEnv(env, task, obs_space, act_space, envs.noop_action(tasks[task]))
            for env, task in zip(handles, assignment)]


# ==================================================================================================
# Resources: --envs auto and --parallel auto
# ==================================================================================================

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
    # The actor thread runs the policy on one torch thread (AsyncLoop.act).
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
    updates_per_step = train_ratio / (batch_size * batch_length)
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


@contextlib.contextmanager
def kept_random_state():
    """The measurement draws random numbers; the run starts from the state it would have without it."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def measure_costs(config, tasks, max_threads):
    """The costs `decide_resources` takes: each task's environment in-process and in workers
    (parallel.measure_env), and the policy and a few updates of a fresh, uncompiled agent on a
    dummy batch (thrown away afterwards; the run's random state is kept)."""
    costs = {"env_ms": {}, "worker_ms": {}, "cores": available_cores(), "max_threads": max_threads}
    extra, starts = [], []
    for task in tasks:
        measured = parallel.measure_env(functools.partial(envs.make_env, config, "train", 0, task), seed=config.seed)
        costs["env_ms"][task], costs["worker_ms"][task] = measured["step_ms"], measured["worker_ms"]
        extra.append(measured["extra_worker_ms"])
        starts.append(measured["worker_start_s"])
    costs["extra_worker_ms"], costs["worker_start_s"] = float(np.mean(extra)), max(starts)
    costs["gpu"] = torch.device(config.device).type == "cuda"
    with kept_random_state():
        agent = Dreamer(measured["obs_space"], measured["act_space"], Config({**config.to_dict(), "compile": False}))
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
            agent.train_step(batch)
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

    def __init__(self, config, logdir):
        self.config, self.path = config, logdir / self.FILE
        self.auto = [key for key in ("envs", "parallel") if getattr(config, key) == "auto"]
        self.record, self.lines = None, []

    def settings(self):
        """What the decision depends on besides the measured costs; another value re-measures."""
        config = self.config
        return {"task": config.task, "train_ratio": config.train_ratio, "batch_size": config.batch_size,
                "batch_length": config.batch_length, "asynchronous": bool(config.asynchronous),
                "device": torch.device(config.device).type, "cores": available_cores()}

    def settle(self):
        config = self.config
        if not self.auto:
            return
        if offline(vars(config)):  # nothing is collected: the evaluation's one environment, in-process
            config.envs = 1 if config.envs == "auto" else config.envs
            config.parallel = False if config.parallel == "auto" else config.parallel
            self.lines = ["Resources: auto: nothing to collect, 1 environment in-process"]
            return
        start = time.time()
        self.record = self.load()
        reused = self.record is not None
        if not reused:
            fixed_threads = torch.get_num_threads() if "OMP_NUM_THREADS" in os.environ else None
            tasks = envs.parse_tasks(config.task)  # each task of a list is measured on its own
            print(f"Resources: measuring for {', '.join(self.auto)} auto: the environment in-process and in workers, "
                  "then the policy and a few updates (about a minute at full size on a CPU)", flush=True)
            costs = measure_costs(config, tasks, torch.get_num_threads())
            decision = decide_resources(
                costs, tasks, config.train_ratio, config.batch_size, config.batch_length, config.asynchronous,
                envs=None if config.envs == "auto" else config.envs,
                parallel=None if config.parallel == "auto" else config.parallel, threads=fixed_threads,
                steps=max(1, (config.steps - config.prefill) // config.action_repeat))
            self.record = {"settings": self.settings(), "costs": costs, "decision": decision,
                           "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "measure_s": round(time.time() - start, 1)}
        decision = self.record["decision"]
        for key in self.auto:
            setattr(config, key, decision[key] is True if key == "parallel" else decision[key])
        if decision["threads"] and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(decision["threads"])
        self.lines = self.describe(reused)

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
        updates = config.train_ratio / (config.batch_size * config.batch_length)
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
            tools.atomic_write_bytes(self.path, json.dumps(self.record, indent=2).encode())


def resolve_auto(config, act_space, obs_space=None, notes=None):
    """Settle the 'auto' keys, in place: the actor's distribution and gradient from the action
    space (v1's actor_dist_disc/cont and actor_grad_disc/cont: discrete -> onehot + reinforce,
    continuous -> normal + dynamics) and compile by models.compile_choice (on CUDA; on a CPU when
    the run is long enough for the model at hand; without obs_space the model is unknown: eager).
    Explicit values stay; an actor distribution that contradicts the action space is a
    ConfigError. Returns the keys that were 'auto', for the summary; `notes` gets the reasons."""
    discrete = bool(getattr(act_space, "discrete", False))
    dist, gradient = ("onehot", "reinforce") if discrete else ("normal", "dynamics")
    resolved = []
    if config.actor.dist == "auto":
        config.actor.dist = dist
        resolved.append("actor.dist")
    if config.imag_gradient == "auto":
        config.imag_gradient = gradient
        resolved.append("imag_gradient")
    if config.actor.dist != dist:
        kind = "discrete" if discrete else "continuous"
        raise ConfigError(f"Invalid value '{config.actor.dist}' for --actor.dist: task '{config.task}' has {kind} "
                          f"actions; use --actor.dist {dist} (or auto)")
    if config.compile == "auto":
        if obs_space is None and torch.device(config.device).type != "cuda":
            config.compile, reason = False, "on a CPU without the model to estimate its gain"
        else:
            counts = models.parameter_counts(obs_space, act_space, config) if obs_space is not None else None
            config.compile, reason = models.compile_choice(config, counts)
        resolved.append("compile")
        if notes is not None:
            notes["compile"] = reason
    return resolved


# Keys that may differ between a run and its resumption without a warning.
BUDGET_KEYS = ("steps", "eval_every", "log_every", "eval_episode_num", "eval_only", "device", "logdir",
               "parallel", "env_failure", "compile", "video_pred_log", "asynchronous", "actor_sync_every",
               "ratio_tolerance")


def compare_saved_config(config, path):
    """Warnings for keys that differ from the run's saved config; a different task is an error."""
    from ruamel.yaml import YAML

    try:
        saved = YAML(typ="safe", pure=True).load(path.read_text())
    except Exception as e:  # noqa: BLE001 - any parse error: the file is unusable
        raise ConfigError(f"Cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          "fix or delete it (this run's settings are the command line)") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"Cannot read {path}: expected a mapping of config keys; fix or delete it")
    saved = flatten(saved)
    current = flatten(config.to_dict())
    if saved.get("task") != current["task"]:
        raise ConfigError(f"--task {current['task']} differs from this run's task '{saved.get('task')}' "
                          f"(saved in {path}); use another --logdir for another task")
    # 'auto' settles the same way for the same task, into the value the saved config holds.
    return [f"{key}: {saved.get(key)!r} -> {value!r}" for key, value in current.items()
            if key not in BUDGET_KEYS and value != "auto" and saved.get(key) != value]


def save_config(config, path):
    from ruamel.yaml import YAML

    buffer = io.StringIO()
    YAML(typ="safe", pure=True).dump(config.to_dict(), buffer)
    tools.atomic_write_bytes(path, buffer.getvalue().encode())


def compile_note(config, auto=False):
    """`auto`: the value was settled by resolve_auto rather than asked for; a string: the reason
    it gave (models.compile_choice)."""
    cpu = torch.device(config.device).type == "cpu"
    if isinstance(auto, str):
        flag = "--compile False turns it off" if config.compile else "--compile True compiles"
        return f"{'on' if config.compile else 'off'} (auto: {auto}; {flag})"
    if not config.compile:
        if auto and cpu:
            return "off (auto: on a CPU the run is too short to repay the warm-up; --compile True compiles)"
        return "off"
    if cpu:
        return ("on (on a CPU measured 1.1-1.3x faster per update after a warm-up of one to several minutes; "
                "--compile False turns it off)")
    return "on (the first updates include compilation)"


def actor_note(config, resolved):
    """The actor's distribution and gradient, and whether they were chosen from the action space."""
    auto = [key for key in ("actor.dist", "imag_gradient") if key in resolved]
    note = f"{config.actor.dist} distribution, {config.imag_gradient} gradient"
    return note + (f" ({' and '.join(auto)} auto: from the action space)" if auto else "")


def summary(config, agent, device_note, resumed_step, ranks=None, weights=None):
    """The start-up summary: what runs where, what differs from defaults, how big the model is.
    `weights`: the task weights the training environments were made with (Resources.weights())."""
    defaults = flatten(load_presets()["defaults"])
    changed = {k: v for k, v in flatten(config.to_dict()).items() if defaults.get(k) != v and k not in agent.resolved}
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    params = {"world model": count(agent.wm), "actor": count(agent.task_behavior.actor),
              "critic": count(agent.task_behavior.critic)}
    if agent.expl_behavior is not None:
        params["exploration"] = count(agent.expl_behavior)
    tasks = envs.parse_tasks(config.task)
    several = len(tasks) > 1 and config.envs >= len(tasks)  # offline runs of several have no assignment
    per_task = collections.Counter(task_assignment(config, "train", config.envs, weights)) if several else {}
    lines = [
        f"Task: {config.task}" + (" (training environments per task: "
                                  + ", ".join(str(per_task[i]) for i in range(len(tasks))) + "; action size "
                                  f"{agent.act_size}, the widest task's)" if per_task else ""),
        f"Device: {config.device}" + (f" ({device_note}; using the CPU)" if device_note else ""),
        "Compile: " + compile_note(config, agent.auto_notes.get("compile", "compile" in agent.resolved)),
        "Precision: " + models.precision_note(config),
        "Actor: " + actor_note(config, agent.resolved),
        f"Environments: {config.envs} ({'parallel processes' if config.parallel else 'in-process'})"
        + (" per process" if ranks is not None and ranks.world_size > 1 else ""),
        *([f"Processes: {ranks.describe()}; envs and batch_size are per process"]
          if ranks is not None and ranks.world_size > 1 else []),
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
        self.stored_steps = 0  # policy steps in the training episode files when last saved


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
            self.bar.set_postfix({k: self.format(k, v) for k, v in self.stats.items()}, refresh=False)

    @staticmethod
    def format(key, value):
        return f"{value:.0%}" if key.endswith("_busy") else f"{value:.1f}"

    def line(self, frames):
        """The plain progress line: frames, rates, last returns and ETA."""
        fps = self.stats.get("fps", 0.0)
        eta = datetime.timedelta(seconds=int((self.total - frames) / fps)) if fps > 0 else "?"
        parts = [f"frames {frames}/{self.total} ({100 * frames / max(self.total, 1):.1f}%)"]
        parts += [f"{k} {self.format(k, v)}" for k, v in self.stats.items()]
        return " | ".join(parts + [f"ETA {eta}"])

    def log(self, frames):
        if not self.interactive:
            print(self.line(frames), flush=True)

    def close(self):
        self.bar.close()


class Phase:
    """A bounded phase before training proper (prefill, pretraining, compilation): its own tqdm bar
    in a terminal; in a log file a plain line when it starts, after its first step and then every
    `every` seconds with its rate and ETA, and when it ends, so that no minute passes in silence.
    A heartbeat thread keeps the lines (and the bar's clock) coming while one step takes long, such
    as a full-size update on a loaded CPU or a compilation."""

    def __init__(self, name, total, unit, interactive, every=10.0):
        from tqdm import tqdm

        self.name, self.total, self.unit, self.interactive, self.every = name, total, unit, interactive, every
        self.done, self.start = 0, time.time()
        self.last = self.start
        self.bar = tqdm(total=total, desc=name, unit=unit, dynamic_ncols=True, leave=False, disable=not interactive)
        if not interactive:
            print(f"{name}: 0/{total} {unit}s", flush=True)
        self.stopped = threading.Event()
        if every > 0:
            threading.Thread(target=self.heartbeat, daemon=True).start()

    def heartbeat(self):
        while not self.stopped.wait(self.every):
            if self.interactive:
                self.bar.refresh()
            elif time.time() - self.last >= self.every:
                self.last = time.time()
                print(self.line(self.last), flush=True)

    def update(self, done):
        self.bar.update(done - self.done)
        self.done = done
        now = time.time()
        # The first step gives the rate (and ETA) as soon as it is known; then every `every` seconds.
        if not self.interactive and (self.last == self.start or now - self.last >= self.every):
            self.last = now
            print(self.line(now), flush=True)

    def line(self, now):
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = datetime.timedelta(seconds=int((self.total - self.done) / rate)) if rate > 0 else "?"
        percent = 100 * self.done / max(self.total, 1)
        return (f"{self.name}: {self.done}/{self.total} {self.unit}s ({percent:.0f}%) | "
                f"{rate:.2f} {self.unit}s/s | elapsed {datetime.timedelta(seconds=int(elapsed))} | ETA {eta}")

    def __enter__(self):
        return self

    def __exit__(self, error, *_):
        self.close(finished=error is None)

    def close(self, finished=True):
        self.stopped.set()
        self.bar.close()
        if not finished:  # an error is on its way up; no "done" line
            return
        seconds = time.time() - self.start
        message = f"{self.name}: done, {self.done} {self.unit}s in {seconds:.1f} s"
        if self.interactive:
            self.bar.write(message)
        else:
            print(message, flush=True)


class StoredEpisodes:
    """A run's episode folders and what is loaded from them at the start: the training replay (from
    traindir, or offline_traindir) and the evaluation replay (evaldir, or offline_evaldir, which
    eval_openl samples). Files that do not fit the run's spaces (those of `env`; without one they
    are taken on trust) are skipped with a warning and counted in `note`."""

    def __init__(self, config, logdir, rank, env, context_spec):
        self.traindir = pathlib.Path(config.traindir or logdir / "train_eps").expanduser()
        if rank:  # rank 0 keeps the single-process folder, so its runs resume alike
            self.traindir = self.traindir / f"rank{rank}"
        self.evaldir = pathlib.Path(config.evaldir or logdir / "eval_eps").expanduser()
        self.skipped = 0
        spec = tools.episode_spec(env.obs_space, env.act_space) if env is not None else None
        # Each rank samples its own batches: seeds seed + 1 + rank * 1000 for ranks > 0 (seed + 1
        # is the evaluation replay's).
        self.replay = tools.Replay(config.dataset_size, max(1, config.envs),
                                   config.seed + (1 + 1000 * rank if rank else 0))
        source = pathlib.Path(config.offline_traindir).expanduser() if config.offline_traindir else self.traindir
        # Training episodes hold the policy's latents too when the replay context wants them.
        train_spec = {**spec, **context_spec} if spec is not None else None
        loaded_steps = 0
        for i, episode in enumerate(tools.load_episodes(source, config.dataset_size, train_spec, self.skip)):
            self.replay.add_episode(strip_logs(episode), i % len(self.replay.streams))
            loaded_steps += len(episode["reward"]) - 1
        self.eval_replay = tools.Replay(100 * config.batch_length, 1, config.seed + 1)
        source = pathlib.Path(config.offline_evaldir).expanduser() if config.offline_evaldir else self.evaldir
        for episode in tools.load_episodes(source, 100 * config.batch_length, spec, self.skip):
            self.eval_replay.add_episode(strip_logs(episode))
        self.note = f"Episodes: {loaded_steps} replay steps loaded, {self.skipped} files skipped"

    def skip(self, filename, problem):
        tools.skip_warning(filename, problem)
        self.skipped += 1


class Trainer:
    """Owns a run's replay, counters and schedules; `train()` is the main loop.

    Its stored episodes (`StoredEpisodes`), checkpoint (`Checkpoints`) and logs and evaluation (`RunLog`)
    are components of their own.
    Under torchrun (`ranks` a tools.Distributed) every process runs this loop in lockstep with its
    own environments, replay and episode folder (rank k > 0: train_eps/rank<k>); the counters and
    schedules are the same on all of them, so that each makes the same updates. The main process
    alone logs, evaluates and writes the checkpoint, which holds every rank's random state.
    """

    def __init__(self, config, agent, logdir, train_envs, eval_envs, ranks=None):
        self.config, self.agent, self.logdir = config, agent, logdir
        self.ranks = ranks or tools.SingleProcess()
        self.train_envs, self.eval_envs = train_envs, eval_envs
        self.tasks = envs.parse_tasks(config.task)  # a stored step's `task` indexes this list
        self.counters = Counters()
        self.loop = LOOPS[config.asynchronous](self)
        self.schedules = {"train": self.loop.schedule,
                          "log": tools.Every(config.log_every), "eval": tools.Every(config.eval_every)}
        env = (train_envs or eval_envs or [None])[0]  # without one, stored episodes are taken on trust
        stored = StoredEpisodes(config, logdir, self.ranks.rank, env, agent.context.spec if env is not None else {})
        self.traindir, self.evaldir = stored.traindir, stored.evaldir
        self.replay, self.eval_replay = stored.replay, stored.eval_replay
        self.notes = [stored.note]  # lines for the start-up summary
        self.checkpoints = Checkpoints(self, logdir / "latest.pt")
        self.resumed = self.checkpoints.resume()
        # Every rank counts the frames of the rank that stored the most (they differ only after a
        # kill -9), so that all run the same number of iterations.
        self.counters.policy_steps = self.ranks.max(self.counters.policy_steps)
        self.finished = collections.deque()  # episodes the collector finished, not yet counted and logged
        self.prefill_behavior = exploration.Random(config, train_envs[0].act_space) if train_envs else None
        self.collector = (Collector(train_envs, self.replay, self.traindir, self.on_episode, config.action_repeat,
                                    agent.context) if train_envs else None)
        self.stopwatch = tools.Stopwatch(("learner", "env", *self.loop.waits))
        self.run_log = RunLog(self)
        self.warmed_up = set()  # names of the compiled calls made once already

    @property
    def frames(self):
        return self.counters.policy_steps * self.config.action_repeat

    @functools.cached_property
    def feed(self):
        """The learner's replay batches (tools.Prefetcher), made at the first update."""
        config = self.config
        return tools.Prefetcher(self.replay, config.batch_size, config.batch_length + self.agent.context.steps,
                                config.device)

    # -- the components' entry points, for the loops, `main` and tests ------------------------------

    checkpoint = property(lambda self: self.checkpoints.path)
    saved_frames = property(lambda self: self.checkpoints.saved_frames)
    logger = property(lambda self: self.run_log.logger)
    progress = property(lambda self: self.run_log.progress)
    metrics = property(lambda self: self.run_log.metrics)
    evaluates = property(lambda self: self.run_log.evaluates)

    def save(self):
        self.checkpoints.save()

    def restore(self, state):
        return self.checkpoints.restore(state)

    def log(self):
        self.run_log.log()

    def evaluate(self):
        self.run_log.evaluate()

    # -- acting and learning ------------------------------------------------------------------------

    def on_episode(self, episode):
        self.finished.append(episode)  # from the actor's thread in async mode: counted in the main thread

    def count_episodes(self):
        while self.finished:
            episode = self.finished.popleft()
            self.counters.episodes += 1
            self.counters.stored_steps += len(episode["reward"]) - 1
            self.run_log.add_episode(episode)

    def collect(self, policy):
        if self.collector is None:  # offline: time advances as if the agent were collecting
            self.counters.policy_steps += max(1, self.config.envs)
        else:
            self.counters.policy_steps += self.collector.step(policy)

    def policy(self, obs, state, agent=None):
        """The training policy of `agent` (the learner's by default): exploring until expl_until."""
        config = self.config
        explore = config.expl_behavior != "greedy" and (not config.expl_until or self.frames < config.expl_until)
        mode = "explore" if explore else "train"
        if agent is not None:  # the asynchronous actor's copy, never compiled
            return agent.policy(obs, state, mode)
        return self.announce_compilation("first policy step", self.agent.policy, obs, state, mode)

    def announce_compilation(self, name, fn, *args):
        """fn(*args). With compile on, the first call of each kind compiles (minutes on a CPU): it
        gets a progress bar or log lines of its own, so that the wait is not silent."""
        if not self.agent.compiled or name in self.warmed_up:
            return fn(*args)
        self.warmed_up.add(name)
        with Phase(f"compile warm-up ({name})", 1, "call", self.progress.interactive) as phase:
            out = fn(*args)
            phase.update(1)
        return out

    def random_policy(self, obs, state):
        """Uniform actions for the prefill (the Random behaviour's actor ignores its input)."""
        return self.prefill_behavior.actor(torch.zeros(len(obs["is_first"]), 1)).sample().numpy(), None

    def update(self, count, phase=None):
        config = self.config
        # Every rank updates or none does: the updates average gradients over all of them.
        context = self.agent.context
        length = config.batch_length + context.steps  # the context steps only give the start latent
        if not count or not self.ranks.all(self.replay.ready(length)):
            return
        for i in range(count):
            batch, ids, data = self.feed.next(more=i + 1 < count)  # the next batch is sampled during this update
            on_device = () if data is None else (data,)  # None on a CPU: train_step copies the batch
            metrics = self.announce_compilation("first update", self.agent.train_step, batch, *on_device)
            context.write_back(self.feed, ids, batch)  # also into the batch sampled ahead
            self.counters.updates += 1
            if phase is not None:
                phase.update(i + 1)
            self.run_log.record(metrics)

    def train(self):
        """Prefill and pretrain, then the loop (`SyncLoop` or `AsyncLoop`) until `steps` frames."""
        config = self.config
        self.run_log.open()
        try:
            if not self.resumed:
                if self.collector is not None and self.frames < config.prefill:
                    with Phase("prefill", config.prefill, "frame", self.progress.interactive) as phase:
                        while self.frames < config.prefill:
                            self.collect(self.random_policy)
                            phase.update(min(self.frames, config.prefill))
                if config.pretrain:
                    with Phase("pretrain", config.pretrain, "update", self.progress.interactive) as phase:
                        self.update(config.pretrain, phase)
                # The prefill's steps count as paid for: training starts at the train ratio.
                self.schedules["train"].updates = self.schedules["train"].owed(self.counters.policy_steps)
            self.loop.run()
            if self.evaluates:
                self.evaluate()
            self.log()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the progress; any other error keeps the last save
            self.loop.close()  # the actor stops first, so that the checkpoint is taken between two steps
            self.checkpoints.save_on_interrupt()
            raise
        else:
            self.loop.close()
            self.save()
        finally:
            self.loop.close()  # after any other error too: no thread outlives the run
            self.run_log.close()

    def maintain(self):
        """What both loops do between steps: count finished episodes, evaluate, log."""
        self.count_episodes()
        if self.evaluates and self.schedules["eval"](self.frames):
            self.evaluate()
            self.save()
        self.progress.update(self.frames)
        if self.schedules["log"](self.frames):
            self.log()


class Checkpoints:
    """A Trainer's checkpoint at `path`: resuming from it (or from previous.pt), saving it.

    A save holds the agent, optimizers, counters, schedules and the random state of every rank
    (gathered on the main process, which alone writes). Non-finite values are never saved.
    """

    def __init__(self, trainer, path):
        self.trainer, self.path = trainer, path
        self.saved_frames = None  # frame of the checkpoint on disk

    def kept(self):
        """What a refused save leaves on disk, for its error message."""
        return f"latest.pt keeps frame {self.saved_frames}" if self.saved_frames is not None else "nothing saved"

    def resume(self):
        """Load the checkpoint (or the previous one) and count every stored frame; False for a new run."""
        trainer = self.trainer
        config, counters, ranks = trainer.config, trainer.counters, trainer.ranks
        state, path, notes = tools.load_checkpoint_or_previous(self.path, config.device)
        trainer.notes += [f"WARNING: {note}" for note in notes]
        stored = 0 if config.offline_traindir else tools.stored_steps(trainer.traindir)
        if state is None:
            counters.stored_steps = stored
            # Episodes of a run killed before its first checkpoint count towards the budget.
            counters.policy_steps = stored
            if stored:
                trainer.notes.append(f"WARNING: no checkpoint in {trainer.logdir}, but {trainer.traindir} holds "
                                     f"{stored * config.action_repeat} frames of episodes: training starts from "
                                     "fresh weights and the frame count continues from them")
            return False
        check_fits(trainer.agent, state["agent"], path)
        saved_ranks = state.get("world_size", 1)
        if saved_ranks != ranks.world_size:
            raise ConfigError(f"{path} was saved by {saved_ranks} process(es) and this run has "
                              f"{ranks.world_size}: resuming with another number of processes is not "
                              f"supported (each holds its own replay); use --nproc_per_node {saved_ranks} "
                              "or another --logdir")
        changes = self.restore(state)
        self.saved_frames = trainer.frames
        if changes:
            trainer.notes.append("Optimizer settings from this config replace the saved ones: " + ", ".join(changes))
        # After a kill -9, episodes written after the checkpoint are in replay; their frames were
        # spent, so the budget counts them (an episode running at the save may count twice).
        rank = ranks.rank
        saved = state["ranks"][rank - 1]["stored_steps"] if rank else state["counters"].get("stored_steps", stored)
        extra = stored - saved
        counters.stored_steps = stored
        if extra > 0:
            counters.policy_steps += extra
            trainer.notes.append(f"Counted {extra * config.action_repeat} frames of episodes stored after the "
                                 f"checkpoint (frame {self.saved_frames})")
        return True

    def save(self):
        trainer = self.trainer
        trainer.run_log.check_losses()
        schedules, ranks = trainer.schedules, trainer.ranks
        with trainer.loop.between_steps():  # counters, schedules and episodes on disk agree
            trainer.count_episodes()
            # Every rank's own state, gathered on the main one: [rank 0, rank 1, ...].
            own = ranks.gather_object({"rng": rng_state(trainer.replay.rng),
                                       "stored_steps": trainer.counters.stored_steps})
            if not ranks.is_main:
                self.saved_frames = trainer.frames
                return
            state = {
                "agent": trainer.agent.state_dict(),
                "optimizers": trainer.agent.optimizer_state(),
                "counters": dict(vars(trainer.counters)),
                "schedules": {"train": schedules["train"].state_dict(), "log": schedules["log"].last,
                              "eval": schedules["eval"].last},
                "rng": own[0]["rng"],
                "ranks": own[1:],  # ranks 1, 2, ... of a torchrun run: their rng and stored_steps
                "world_size": ranks.world_size,
            }
        try:
            tools.save_checkpoint(self.path, state)  # refuses non-finite values
        except tools.CheckpointError:
            raise NonFiniteError(f"non-finite weights or optimizer state at update {trainer.counters.updates}; "
                                 f"the run stops without saving ({self.kept()})") from None
        self.saved_frames = trainer.frames

    def save_on_interrupt(self):
        if self.trainer.ranks.world_size > 1:
            # Saving gathers from every rank, and each stopped at its own point of the loop.
            print(f"Not saved on interrupt under torchrun ({self.kept()}).", file=sys.stderr, flush=True)
            return
        try:
            self.save()
        except NonFiniteError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)

    def restore(self, state):
        """Returns the optimizer settings of this config that replaced differing saved ones."""
        trainer = self.trainer
        trainer.agent.load_state_dict(state["agent"])
        changes = trainer.agent.load_optimizer_state(state["optimizers"])
        vars(trainer.counters).update(state["counters"])
        trainer.schedules["train"].load_state_dict(state["schedules"]["train"])
        trainer.schedules["log"].last = state["schedules"]["log"]
        trainer.schedules["eval"].last = state["schedules"]["eval"]
        rank = trainer.ranks.rank
        set_rng_state(state["ranks"][rank - 1]["rng"] if rank else state["rng"], trainer.replay.rng)
        return changes


class RunLog:
    """A Trainer's logs and evaluation: the logger and progress display, the update metrics
    averaged per log, the episodes finished since then, and the end on a non-finite loss.
    Only the main process writes logs (the others get a NullLogger) and evaluates."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.metrics = {}  # name: [value per update since the last log]
        self.recent_episodes = []
        self.logger = self.progress = None  # made by open(), at the start of training
        self.last_log = (time.time(), trainer.counters.policy_steps, trainer.counters.updates)

    def open(self):
        trainer = self.trainer
        self.logger = tools.Logger(trainer.logdir, trainer.frames) if trainer.ranks.is_main else tools.NullLogger()
        self.logger.text("config", "```\n" + json.dumps(trainer.config.to_dict(), indent=2) + "\n```",
                         trainer.frames)
        self.progress = Progress(trainer.config.steps, trainer.frames)

    def close(self):
        self.progress.close()
        self.logger.close()

    def record(self, metrics):
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append(value)

    def add_episode(self, episode):
        self.recent_episodes.append(episode)
        stats = episode_stats(episode)
        self.logger.scalar("train/return", stats["return"])
        self.logger.scalar("train/length", stats["length"])
        tasks = self.trainer.tasks
        if len(tasks) > 1:  # beside the mean over all tasks
            task = next(iter(by_task(tasks, [episode])))
            self.logger.scalar(f"train/{task}/return", stats["return"])
            self.logger.scalar(f"train/{task}/length", stats["length"])
        self.progress.update(self.trainer.frames, train_return=stats["return"])

    def log(self):
        self.check_losses()
        trainer = self.trainer
        config, counters = trainer.config, trainer.counters
        trainer.count_episodes()
        now, steps, frames = time.time(), counters.policy_steps, trainer.frames
        for key, values in self.metrics.items():
            self.logger.scalar(metric_name(key), torch.stack(values).float().mean())
        self.metrics.clear()
        seconds = max(now - self.last_log[0], 1e-9)
        fps = (steps - self.last_log[1]) * config.action_repeat / seconds
        updates_per_s = (counters.updates - self.last_log[2]) / seconds
        for key, value in (("fps", fps), ("updates_per_s", updates_per_s), ("updates", counters.updates),
                           ("replay_steps", len(trainer.replay))):
            self.logger.scalar(f"perf/{key}", value)
        if steps > self.last_log[1]:  # replayed steps per policy step since the last log
            ratio = (counters.updates - self.last_log[2]) * config.batch_size * config.batch_length
            self.logger.scalar("perf/train_ratio", ratio / (steps - self.last_log[1]))
        busy = {f"{name}_busy" if name in ("learner", "env") else name: value
                for name, value in trainer.stopwatch.fractions().items()}
        for key, value in {**busy, **trainer.loop.stats()}.items():
            self.logger.scalar(f"perf/{key}", value)
        self.logger.scalar("train/episodes", counters.episodes)
        if trainer.collector is not None:
            self.logger.scalar("train/dropped_episodes", trainer.collector.dropped)
            self.log_env_status()
        log_episode_metrics(self.logger, "train", trainer.tasks, self.recent_episodes)
        self.log_task_frames(frames)
        self.recent_episodes.clear()
        if self.films_predictions(trainer.replay):
            batch = trainer.agent.wm.preprocess(trainer.replay.sample(6, config.batch_length))
            self.logger.video("train/openl", trainer.agent.wm.video_pred(batch))
        self.logger.write(frames)
        self.progress.update(frames, fps=fps, updates_per_s=updates_per_s, learner_busy=busy["learner_busy"],
                             env_busy=busy["env_busy"])
        self.progress.log(frames)
        self.last_log = (now, steps, counters.updates)

    def log_task_frames(self, frames):
        """train/<task>/frames: each task's share of the frames, so that a run of several tasks can be
        read against single-task runs at the same frames per task (benchmarks/plot.py does). Exact:
        every environment steps once per policy step, and every rank spreads its environments alike."""
        trainer = self.trainer
        if len(trainer.tasks) < 2 or trainer.collector is None:
            return
        counts = collections.Counter(trainer.collector.tasks)
        for index, task in enumerate(trainer.tasks):
            self.logger.scalar(f"train/{task}/frames", frames * counts[index] / len(trainer.collector.tasks))

    def log_env_status(self):
        """What each environment is doing: scalars env/<i>/..., and a line per environment when
        the progress goes to a log file."""
        collector, tasks = self.trainer.collector, self.trainer.tasks
        for i, row in enumerate(collector.status()):
            for key, value in row.items():
                if np.isfinite(value):
                    self.logger.scalar(f"env/{i}/{key}", value)
            if not self.progress.interactive:
                task = f" ({tasks[collector.tasks[i]]})" if len(tasks) > 1 else ""
                print(f"  env {i}{task}: steps {row['steps']} episodes {row['episodes']} "
                      f"last return {row['last_return']:.1f} fps {row['fps']:.1f} step {row['step_ms']:.1f} ms",
                      flush=True)

    @property
    def evaluates(self):
        """Whether the run evaluates (the same on every rank; only the main one has eval_envs)."""
        trainer = self.trainer
        return trainer.config.eval_episode_num > 0 and (bool(trainer.eval_envs) or not trainer.ranks.is_main)

    def evaluate(self):
        trainer = self.trainer
        config = trainer.config
        if not trainer.eval_envs:  # another rank than the main one: it waits at the save that follows
            return
        episodes = run_episodes(trainer.agent, trainer.eval_envs, config.eval_episode_num, trainer.evaldir)
        for episode in episodes:
            trainer.eval_replay.add_episode(strip_logs(episode))
        returns = log_evaluation(self.logger, episodes, config)
        if self.films_predictions(trainer.eval_replay):
            batch = trainer.agent.wm.preprocess(trainer.eval_replay.sample(6, config.batch_length))
            self.logger.video("eval/openl", trainer.agent.wm.video_pred(batch))
        self.progress.update(trainer.frames, eval_return=float(np.mean(returns)))

    def films_predictions(self, replay):
        """Open-loop videos need an image decoder and a full sequence to show."""
        trainer = self.trainer
        config = trainer.config
        return (trainer.ranks.is_main and config.video_pred_log
                and bool(trainer.agent.wm.heads["decoder"].cnn_shapes) and replay.ready(config.batch_length))

    def check_losses(self):
        """End the run on a non-finite loss among the updates since the last log. Checked here and
        before every save, not per update: one device sync per log instead of one per update."""
        losses = {key: torch.stack(values) for key, values in self.metrics.items() if key.endswith("_loss")}
        if not losses or tools.all_finite(losses):
            return
        first = {}
        for key, values in losses.items():
            bad = (~torch.isfinite(values.float())).nonzero()
            if len(bad):
                index = int(bad[0])
                first[key] = (self.trainer.counters.updates - len(values) + index + 1, float(values[index]))
        key = min(first, key=lambda k: first[k][0])
        update, value = first[key]
        raise NonFiniteError(f"non-finite {metric_name(key)} ({value}) at update {update}; the run stops "
                             f"without saving ({self.trainer.checkpoints.kept()})")


class NonFiniteError(RuntimeError):
    """A loss or weight went NaN or infinite: the run stops without saving."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM (what cluster schedulers send before a kill), handled like Ctrl-C."""


def raise_interrupted(signum, frame):
    raise Interrupted()


def rng_state(replay_rng):
    """Every random state as tensors and plain lists, so checkpoints load with weights_only."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
            "python": [version, list(internal), gauss_next], "replay": replay_rng.bit_generator.state}


def set_rng_state(state, replay_rng):
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    replay_rng.bit_generator.state = state["replay"]


def check_fits(agent, saved, path):
    """A checkpoint whose tensors do not fit this config's model ends the run before anything loads."""
    current = agent.state_dict()
    differ = [k for k in current if k in saved and tuple(saved[k].shape) != tuple(current[k].shape)]
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if not (differ or missing or unexpected):
        return
    if differ:
        key = differ[0]
        example = f"{key} is {tuple(saved[key].shape)} there, {tuple(current[key].shape)} here"
    else:
        example = f"{(missing or unexpected)[0]} is only {'here' if missing else 'there'}"
    raise ConfigError(f"{path} does not fit this config ({len(differ)} shapes differ, {len(missing)} tensors "
                      f"missing, {len(unexpected)} unexpected; e.g. {example}): restore the size keys of the "
                      "saved config.yaml or use another --logdir")


class SyncLoop:
    """Collect one step in every environment, then make the updates the train ratio owes; repeat.

    The learner waits while the environments step and the environments while the learner trains.
    """

    waits = ()

    def __init__(self, trainer):
        self.trainer = trainer
        config = trainer.config
        self.schedule = tools.Ratio(config.train_ratio, config.batch_size * config.batch_length)

    def run(self):
        trainer = self.trainer
        while trainer.frames < trainer.config.steps:
            trainer.maintain()
            with trainer.stopwatch.time("env"):
                trainer.collect(trainer.policy)
            with trainer.stopwatch.time("learner"):
                trainer.update(self.schedule(trainer.counters.policy_steps))

    def between_steps(self):
        return contextlib.nullcontext()

    def stats(self):
        return {}

    def close(self):
        pass


class AsyncLoop:
    """The learner trains in the calling thread while an actor thread steps every environment under
    one batched call of a copy of the policy, refreshed every `actor_sync_every` updates.

    A `tools.SamplesPerInsert` limiter holds the train ratio within `ratio_tolerance` updates: the
    learner waits when it runs ahead, the actor when the learner falls behind. The actor thread uses
    one torch thread; the learner keeps its own (README, Asynchronous training).
    """

    waits = ("learner_wait", "env_wait")

    def __init__(self, trainer):
        self.trainer = trainer
        config = trainer.config
        self.schedule = tools.SamplesPerInsert(config.train_ratio, config.batch_size * config.batch_length,
                                               config.ratio_tolerance)
        self.stop, self.done = threading.Event(), threading.Event()
        self.step_lock = threading.Lock()  # held by the actor from a step until its steps are counted
        self.policy_lock = threading.Lock()  # the actor's weights change only between its policy calls
        self.thread = self.actor = self.error = None
        self.synced = None

    def run(self):
        trainer, config = self.trainer, self.trainer.config
        self.schedule.load_state_dict({"updates": self.schedule.updates, "inserts": trainer.counters.policy_steps})
        self.start_actor()
        while not (self.done.is_set() and not self.schedule.can_sample()):
            trainer.maintain()
            if self.error is not None:
                raise self.error
            with trainer.stopwatch.time("learner_wait"):
                if not self.schedule.wait_sample(timeout=0.05):
                    continue
            with trainer.stopwatch.time("learner"):
                trainer.update(1)
            self.schedule.sampled()
            if trainer.counters.updates - self.synced >= config.actor_sync_every:
                self.sync_actor()
        if self.error is not None:
            raise self.error

    def start_actor(self):
        trainer, config = self.trainer, self.trainer.config
        env = trainer.train_envs[0]
        self.actor = Dreamer(env.obs_space, env.act_space, Config({**config.to_dict(), "compile": False}))
        self.actor.to(config.device).requires_grad_(False)
        self.sync_actor()
        print(f"Asynchronous: learner on {config.device} with {torch.get_num_threads()} torch threads, actor thread "
              f"with 1, {len(trainer.train_envs)} environments; weights synced every {config.actor_sync_every} "
              "updates", flush=True)
        self.thread = threading.Thread(target=self.act, name="actor", daemon=True)
        self.thread.start()

    def act(self):
        """The actor thread: step all environments while the limiter allows, until `steps` frames."""
        trainer, config = self.trainer, self.trainer.config
        # Intra-op threads are set per thread: the policy on a few observations gets one, and the
        # learner keeps all of its own. (A first design, the learner on cores - 1 threads switched to
        # all while the actor waited, measured ~1.5x slower updates than sync on 2 cores: README.)
        torch.set_num_threads(1)
        try:
            while not self.stop.is_set() and trainer.frames < config.steps:
                with trainer.stopwatch.time("env_wait"):
                    if not self.schedule.wait_insert(timeout=0.05):
                        continue
                with self.step_lock, trainer.stopwatch.time("env"):
                    steps = trainer.collector.step(self.policy)
                    trainer.counters.policy_steps += steps
                    self.schedule.inserted(steps)
        except BaseException as e:  # noqa: BLE001 - handed to the learner's thread, raised there
            self.error = e
        finally:
            self.schedule.finish()  # the learner makes the updates still owed, then stops
            self.done.set()

    def policy(self, obs, state):
        with self.policy_lock:
            return self.trainer.policy(obs, state, self.actor)

    def sync_actor(self):
        with self.policy_lock:
            self.actor.load_state_dict(self.trainer.agent.state_dict())
        self.synced = self.trainer.counters.updates
    def between_steps(self):
        return self.step_lock

    def stats(self):
        return {"policy_lag": self.trainer.counters.updates - (self.synced or 0)}

    def close(self):
        """Stop the actor thread (Ctrl-C, an error, or the end); the environments are closed by main."""
        self.stop.set()
        self.schedule.close()
        if self.thread is not None:
            self.thread.join()


LOOPS = {False: SyncLoop, True: AsyncLoop}  # by config.asynchronous


def strip_logs(episode):
    """Replay keeps what the model trains on; `log_*` keys only feed the suite metrics."""
    return {k: v for k, v in episode.items() if not k.startswith("log_")}


def run_episodes(agent, env_list, count, directory):
    """`count` episodes of each task among `env_list`, acting in mode 'eval': the task policy's
    sample, or its mode with eval_sample False (episodes still running at the end are dropped)."""
    finished = {task: [] for task in sorted({getattr(env, "task_index", 0) for env in env_list})}
    collector = Collector(env_list, None, directory, lambda e: finished[int(e["task"][0])].append(e))
    policy = functools.partial(agent.policy, mode="eval")
    while any(len(episodes) < count for episodes in finished.values()):
        collector.step(policy)
    return [episode for episodes in finished.values() for episode in episodes[:count]]


def log_evaluation(logger, episodes, config):
    """eval/return, return_std, length and episodes over all episodes; with several tasks the same
    for each task as eval/<task>/..., and the suites' own metrics per task."""
    tasks = envs.parse_tasks(config.task)
    groups = {"eval": episodes}
    if len(tasks) > 1:
        groups.update({f"eval/{task}": group for task, group in by_task(tasks, episodes).items()})
    for scope, group in groups.items():
        returns = [episode_stats(e)["return"] for e in group]
        logger.scalar(f"{scope}/return", float(np.mean(returns)))
        logger.scalar(f"{scope}/return_std", float(np.std(returns)))
        logger.scalar(f"{scope}/length", float(np.mean([episode_stats(e)["length"] for e in group])))
        logger.scalar(f"{scope}/episodes", len(group))
    log_episode_metrics(logger, "eval", tasks, episodes)
    returns = [episode_stats(e)["return"] for e in episodes]
    if config.video_pred_log and "image" in episodes[0]:
        logger.video("eval/policy", episodes[0]["image"][None])
    return returns


def evaluate_checkpoint(config, agent, logdir, eval_envs):
    """--eval_only: load latest.pt, run eval_episode_num episodes, write only into logdir/eval_only/."""
    state, path, notes = tools.load_checkpoint_or_previous(logdir / "latest.pt", config.device)
    for note in notes:
        print(f"WARNING: {note}", flush=True)
    check_fits(agent, state["agent"], path)
    agent.load_state_dict(state["agent"])
    episodes = run_episodes(agent, eval_envs, config.eval_episode_num, None)
    returns = [episode_stats(e)["return"] for e in episodes]
    out = logdir / "eval_only"
    out.mkdir(exist_ok=True)
    result = {"frame": state["counters"]["policy_steps"] * config.action_repeat, "returns": returns,
              "mean": float(np.mean(returns)), "std": float(np.std(returns))}
    tasks = envs.parse_tasks(config.task)
    if len(tasks) > 1:
        result["tasks"] = {}
        for task, group in by_task(tasks, episodes).items():
            task_returns = [episode_stats(e)["return"] for e in group]
            result["tasks"][task] = {"returns": task_returns, "mean": float(np.mean(task_returns)),
                                     "std": float(np.std(task_returns))}
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


def usage():
    """--help: how to call the script, and the presets to start from."""
    presets = [name for name in load_presets() if name != "defaults"]
    return "\n".join([
        "usage: python3 dreamer.py [--configs PRESET ...] --logdir DIR [--KEY VALUE ...]",
        "",
        __doc__.strip().splitlines()[0],
        "",
        "Presets (merged in the order given, over `defaults`): " + ", ".join(presets),
        f"Every key of {CONFIG_FILE.name} is a flag: --task dmc_walker_walk, --actor.lr 1e-4, --size 64,64;",
        "a boolean flag alone means True. Rerunning the same command resumes the run in --logdir.",
    ])


def check_logdir(logdir):
    """The logdir must be a folder, or creatable, and writable: probed with a temporary file that
    is removed again, because permission bits say nothing for root or read-only mounts."""
    if logdir.exists() and not logdir.is_dir():
        raise ConfigError(f"Invalid value '{logdir}' for --logdir: it is a file, not a folder")
    existing = next(p for p in (logdir, *logdir.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"Invalid value '{logdir}' for --logdir: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"Invalid value '{logdir}' for --logdir: cannot write in {existing} "
                          f"({e.strerror or e})") from None


def check_tasks(config):
    """--task names one task or several, comma-separated, each known to its suite; a run of several
    needs a training environment per task. Spells config.task canonically (no spaces), as saved."""
    tasks = envs.parse_tasks(config.task)
    for task in tasks:
        envs.check_task(task)
    config.task = ",".join(tasks)
    if (len(tasks) > 1 and not offline(flatten(config.to_dict())) and isinstance(config.envs, int)
            and config.envs < len(tasks)):
        raise ConfigError(f"Invalid value '{config.envs}' for --envs: {len(tasks)} tasks need at least one "
                          f"training environment each; valid: a whole number >= {len(tasks)}")
    return tasks


def check_offline_traindir(config):
    if not config.offline_traindir:
        return
    folder = pathlib.Path(config.offline_traindir).expanduser()
    if not folder.is_dir() or not any(folder.glob("*.npz")):
        raise ConfigError(f"Invalid value '{config.offline_traindir}' for --offline_traindir: "
                          f"{'no episode files (*.npz) in it' if folder.is_dir() else 'no such folder'}")


def setup(argv):
    """Parse and check everything that can be wrong before any file is written."""
    config = parse(sys.argv[1:] if argv is None else argv)
    check_processes(config)
    if not config.logdir:
        raise ConfigError("Missing --logdir: give the folder for this run, e.g. --logdir ./logdir/walker")
    check_tasks(config)
    logdir = pathlib.Path(config.logdir).expanduser()
    check_logdir(logdir)
    check_offline_traindir(config)
    warnings_ = []
    if (logdir / "config.yaml").exists():
        warnings_ = compare_saved_config(config, logdir / "config.yaml")
    checkpoint = logdir / "latest.pt"
    if config.eval_only and not (checkpoint.exists() or tools.previous_path(checkpoint).exists()):
        raise ConfigError(f"--eval_only needs a checkpoint, but {checkpoint} does not exist")
    return config, logdir, resolve_device(config), warnings_


def main(argv=None):
    """Parse, build, train; Ctrl-C and SIGTERM save and end without a traceback."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(usage())
        return None
    previous_handler = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        return run(argv)
    except KeyboardInterrupt as e:
        name = "SIGTERM" if isinstance(e, Interrupted) else "Ctrl-C"
        print(f"Stopped by {name}; rerun the same command to resume.", file=sys.stderr, flush=True)
        sys.exit(143 if isinstance(e, Interrupted) else 130)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:
        found = tools.torchrun_rank()
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


def check_processes(config):
    """Modes not yet supported under torchrun: one line before any process group starts."""
    if tools.torchrun_rank() is None:
        return
    for key in ("eval_only", "offline_traindir", "asynchronous"):
        if getattr(config, key, None):
            raise ConfigError(f"--{key} is not supported with torchrun yet; run it as one process "
                              "(python3 dreamer.py ...)")
    for key in ("envs", "parallel"):  # every rank must collect alike: one measurement would not do for all
        if getattr(config, key, None) == "auto":
            raise ConfigError(f"--{key} auto is not supported with torchrun yet; give --{key} a value")


def run(argv):
    try:
        config, logdir, device_note, changed = setup(argv)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    ranks = tools.processes(config.device)
    try:
        return run_processes(config, logdir, device_note, changed, ranks)
    finally:
        ranks.close()


def run_processes(config, logdir, device_note, changed, ranks):
    config.device = ranks.device(config.device)
    if not ranks.is_main:  # the main process alone prints progress; errors still reach stderr
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    # One run per logdir, held until this process ends. A logdir that exists may be in use: check
    # before building anything; a new one is locked once created. --eval_only only reads, so it
    # may run beside training. Under torchrun the main process holds it for all.
    try:
        lock = tools.lock_logdir(logdir) if logdir.is_dir() and not config.eval_only and ranks.is_main else None
    except tools.LogdirBusy as e:
        fail(str(e))
    ranks.barrier()  # the others start only once the main process has the logdir
    seed_everything(config.seed + 1000 * ranks.rank, config.deterministic_run)
    torch.set_float32_matmul_precision("high")
    keep_freed_memory()
    train_envs, eval_envs = [], []
    resources = Resources(config, logdir)
    try:
        resources.settle()  # --envs auto, --parallel auto: measured (or reused) before any environment is built
        if not config.offline_traindir and not config.eval_only:
            train_envs = make_envs(config, "train", config.envs, ranks.rank * config.envs, resources.weights(),
                                   resources.processes())
        # The main process alone evaluates; with several tasks, on as many environments per task
        # as it trains on (at least one).
        per_task = max(config.envs // len(envs.parse_tasks(config.task)), 1)
        eval_count = min(per_task, config.eval_episode_num) if ranks.is_main else 0
        eval_envs = make_envs(config, "eval", eval_count) if eval_count else []
        if not train_envs and not eval_envs:
            raise ConfigError("Nothing to act in: offline training and --eval_only need --eval_episode_num > 0")
        env = (train_envs or eval_envs)[0]
        agent = Dreamer(env.obs_space, env.act_space, config).to(config.device)
        agent.distribute(ranks)  # resuming, every rank loads the same checkpoint after this
    except (ConfigError, ValueError, ImportError, parallel.WorkerError) as e:
        # A user mistake, or a suite whose package is missing: its last line says what to do.
        for env in train_envs + eval_envs:
            env.close()
        fail(str(e).strip().splitlines()[-1])
    try:
        try:
            if config.eval_only:
                return evaluate_checkpoint(config, agent, logdir, eval_envs)
            logdir.mkdir(parents=True, exist_ok=True)
            if ranks.is_main:
                lock = lock or tools.lock_logdir(logdir)  # noqa: F841 - held until this process ends
            trainer = Trainer(config, agent, logdir, train_envs, eval_envs, ranks)
        except (ConfigError, tools.CheckpointError, tools.LogdirBusy) as e:
            fail(str(e))
        print(summary(config, agent, device_note, trainer.frames if trainer.resumed else None, ranks,
                      resources.weights()), flush=True)
        for line in resources.lines:
            print(line, flush=True)
        for line in trainer.notes:
            print(line, flush=True)
        for line in changed:
            print(f"warning: differs from the saved config: {line}", flush=True)
        if ranks.is_main:
            save_config(config, logdir / "config.yaml")
            resources.save()
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
