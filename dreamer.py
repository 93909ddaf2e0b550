"""DreamerV3 training script: the one entry point.

    python3 dreamer.py --configs dmc_vision --task dmc_walker_walk --logdir ./logdir/walker

Reading order: configuration (parse), the agent (Dreamer), experience collection (Collector),
evaluation, then `main`, the training loop itself. Rerunning the same command resumes.
"""

import argparse
import copy
import difflib
import functools
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
    "opt": ("adam", "adamw"),
    "initial": ("learned", "zeros"),
    "dyn_mean_act": ("none", "tanh5"),
    "dyn_std_act": ("softplus", "abs", "sigmoid", "sigmoid2"),
    "imag_gradient": ("dynamics", "reinforce", "both"),
    "expl_behavior": ("greedy", "random", "plan2explore"),
    "disag_target": ("stoch", "deter", "embed", "feat"),
    "actor.dist": ("normal", "onehot"),
    "critic.dist": ("symlog_disc", "symlog_mse"),
    "reward_head.dist": ("symlog_disc", "symlog_mse"),
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
        if config.expl_behavior == "greedy":
            self.expl_behavior = None
        elif config.expl_behavior == "random":
            self.expl_behavior = exploration.Random(config, act_space)
        else:
            self.expl_behavior = exploration.Plan2Explore(config, self.wm, act_space)

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
        post, embed, metrics = self.wm.train_step(data)
        start = {k: v.reshape(-1, *v.shape[2:]) for k, v in post.items()}  # (B*T, ...)
        start_cont = data["cont"].reshape(-1)
        metrics.update(self.task_behavior.train_step(start, start_cont))
        if self.expl_behavior is not None:
            metrics.update(self.expl_behavior.train_step(start, start_cont, post, embed, data))
        return metrics

    def optimizer_state(self):
        state = {"model": self.wm.optimizer.state_dict(), "task": self.task_behavior.optimizer_state()}
        if isinstance(self.expl_behavior, exploration.Plan2Explore):
            state["expl"] = {"ensemble": self.expl_behavior.optimizer.state_dict(),
                             "behavior": self.expl_behavior.behavior.optimizer_state()}
        return state

    def load_optimizer_state(self, state):
        self.wm.optimizer.load_state_dict(state["model"])
        self.task_behavior.load_optimizer_state(state["task"])
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

    def __init__(self, env_list, replay, directory, on_episode):
        self.envs, self.replay, self.directory, self.on_episode = env_list, replay, directory, on_episode
        self.obs = [None] * len(env_list)
        self.episodes = [[] for _ in env_list]
        self.state = None
        self.dropped = 0  # episodes lost to environment workers that died
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
        self.on_episode(episode)

    def abandon(self):
        """Forget unfinished episodes, so the next step starts every environment afresh."""
        self.obs = [None] * len(self.envs)
        self.episodes = [[] for _ in self.envs]
        self.state = None


def episode_stats(episode):
    return {"return": float(episode["reward"].sum()), "length": len(episode["reward"]) - 1}


def evaluate(agent, eval_envs, config, logger, directory, eval_replay):
    """Run `eval_episode_num` episodes with the task policy's mode; log returns and a video."""
    finished = []

    def on_episode(episode):
        if len(finished) < config.eval_episode_num:
            finished.append(episode)
            if eval_replay is not None:
                eval_replay.add_episode({k: v for k, v in episode.items() if not k.startswith("log_")},
                                        len(finished) % len(eval_replay.streams))

    collector = Collector(eval_envs, None, directory, on_episode)
    policy = functools.partial(agent.policy, mode="eval")
    while len(finished) < config.eval_episode_num:
        collector.step(policy)
    stats = [episode_stats(e) for e in finished]
    returns = [s["return"] for s in stats]
    logger.scalar("eval/return", float(np.mean(returns)))
    logger.scalar("eval/return_std", float(np.std(returns)))
    logger.scalar("eval/length", float(np.mean([s["length"] for s in stats])))
    logger.scalar("eval/episodes", len(finished))
    for key, value in envs.episode_metrics(config.task, finished).items():
        logger.scalar(f"eval/{key}", value)
    if config.video_pred_log and "image" in finished[0]:
        logger.video("eval/policy", finished[0]["image"][None])
    return returns


# ==================================================================================================
# Training loop
# ==================================================================================================


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve_device(config):
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"CUDA is not available; using the CPU instead of {config.device}.")
        config.device = "cpu"
    try:
        torch.device(config.device)
    except RuntimeError:
        fail(f"Invalid value '{config.device}' for --device; valid: cpu, cuda, cuda:<index>")


def seed_everything(seed, deterministic):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


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


class Counters:
    """Progress of a run; everything here is saved in the checkpoint."""

    def __init__(self):
        self.policy_steps = 0
        self.updates = 0
        self.episodes = 0

    def frames(self, action_repeat):
        return self.policy_steps * action_repeat


def checkpoint_state(agent, counters, schedules, replay):
    return {
        "agent": agent.state_dict(),
        "optimizers": agent.optimizer_state(),
        "counters": vars(counters),
        "schedules": {name: s.last if isinstance(s, tools.Every) else s.updates for name, s in schedules.items()},
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                "replay": replay.rng.bit_generator.state if replay is not None else None},
    }


def restore(state, agent, counters, schedules, replay):
    agent.load_state_dict(state["agent"])
    agent.load_optimizer_state(state["optimizers"])
    vars(counters).update(state["counters"])
    for name, value in state["schedules"].items():
        if isinstance(schedules[name], tools.Every):
            schedules[name].last = value
        else:
            schedules[name].updates = value
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    if replay is not None and state["rng"]["replay"] is not None:
        replay.rng.bit_generator.state = state["rng"]["replay"]


def main(argv=None):
    try:
        config = parse(sys.argv[1:] if argv is None else argv)
        if not config.logdir:
            raise ConfigError("Missing --logdir: give the folder for this run, e.g. --logdir ./logdir/walker")
        envs.check_task(config.task)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    resolve_device(config)
    logdir = pathlib.Path(config.logdir).expanduser()
    traindir = pathlib.Path(config.traindir or logdir / "train_eps")
    evaldir = pathlib.Path(config.evaldir or logdir / "eval_eps")
    seed_everything(config.seed, config.deterministic_run)
    torch.set_float32_matmul_precision("high")

    offline = bool(config.offline_traindir)
    train_envs = [] if offline else make_envs(config, "train", config.envs)
    eval_count = min(config.envs, config.eval_episode_num)
    eval_envs = make_envs(config, "eval", eval_count) if eval_count else []
    try:
        some_env = (train_envs or eval_envs)[0]
    except IndexError:
        fail("Offline training needs evaluation environments to know the spaces; set --eval_episode_num > 0")
    try:
        check_spaces(config, some_env.act_space)
        agent = Dreamer(some_env.obs_space, some_env.act_space, config).to(config.device)
    except ValueError as e:
        for env in train_envs + eval_envs:
            env.close()
        fail(str(e))
    logdir.mkdir(parents=True, exist_ok=True)
    try:
        run(config, agent, logdir, traindir, evaldir, train_envs, eval_envs)
    finally:
        for env in train_envs + eval_envs:
            env.close()


def run(config, agent, logdir, traindir, evaldir, train_envs, eval_envs):
    checkpoint = logdir / "latest.pt"
    replay = tools.Replay(config.dataset_size, max(1, config.envs), config.seed)
    source = pathlib.Path(config.offline_traindir) if config.offline_traindir else traindir
    loaded_steps = 0
    for i, episode in enumerate(tools.load_episodes(source, config.dataset_size)):
        replay.add_episode({k: v for k, v in episode.items() if not k.startswith("log_")}, i % len(replay.streams))
        loaded_steps += len(episode["reward"]) - 1
    eval_replay = tools.Replay(100 * config.batch_length, 1, config.seed + 1)
    for episode in tools.load_episodes(config.offline_evaldir or evaldir, 100 * config.batch_length):
        eval_replay.add_episode({k: v for k, v in episode.items() if not k.startswith("log_")})

    counters = Counters()
    batch_steps = config.batch_size * config.batch_length
    schedules = {"train": tools.Ratio(config.train_ratio, batch_steps), "log": tools.Every(config.log_every),
                 "eval": tools.Every(config.eval_every)}
    resumed = checkpoint.exists()
    if not resumed:  # episodes left by a run killed before its first checkpoint still count
        counters.policy_steps = 0 if config.offline_traindir else loaded_steps
    if resumed:
        restore(tools.load_checkpoint(checkpoint, config.device), agent, counters, schedules, replay)
        print(f"Resuming from {checkpoint} at frame {counters.frames(config.action_repeat)}.")
    logger = tools.Logger(logdir, counters.frames(config.action_repeat))

    recent_episodes = []

    def on_train_episode(episode):
        counters.episodes += 1
        recent_episodes.append(episode)
        stats = episode_stats(episode)
        logger.scalar("train/return", stats["return"])
        logger.scalar("train/length", stats["length"])

    collector = Collector(train_envs, replay, traindir, on_train_episode) if train_envs else None
    frames = lambda: counters.frames(config.action_repeat)  # noqa: E731

    def collect(policy):
        if collector is None:  # offline: time advances as if the agent were collecting
            counters.policy_steps += max(1, config.envs)
        else:
            counters.policy_steps += collector.step(policy)

    # Prefill with uniform random actions, then pretrain, unless the replay already holds enough.
    random_behavior = exploration.Random(config, (train_envs or eval_envs)[0].act_space)

    def random_policy(obs, state):
        n = len(obs["is_first"])
        return random_behavior.actor(torch.zeros(n, 1)).sample().numpy(), None

    while collector is not None and frames() < config.prefill and not resumed:
        collect(random_policy)
    if not resumed:
        print(f"Prefilled {len(replay)} steps; pretraining {config.pretrain} updates.")
    metrics_acc = {}
    last_log = (time.time(), frames(), counters.updates)

    def train(count):
        for _ in range(count):
            if not replay.ready(config.batch_length):
                return
            metrics = agent.train_step(replay.sample(config.batch_size, config.batch_length))
            counters.updates += 1
            for key, value in metrics.items():
                metrics_acc.setdefault(key, []).append(value)

    if not resumed:
        train(config.pretrain)
        schedules["train"].updates = int(counters.policy_steps / schedules["train"].steps_per_update)

    def policy(obs, state):
        explore = config.expl_behavior != "greedy" and (not config.expl_until or frames() < config.expl_until)
        return agent.policy(obs, state, "explore" if explore else "train")

    def log():
        nonlocal last_log
        now, step = time.time(), frames()
        for key, values in metrics_acc.items():
            logger.scalar(metric_name(key), torch.stack(values).float().mean())
        metrics_acc.clear()
        seconds = max(now - last_log[0], 1e-9)
        logger.scalar("perf/fps", (step - last_log[1]) / seconds)
        logger.scalar("perf/updates_per_s", (counters.updates - last_log[2]) / seconds)
        logger.scalar("perf/updates", counters.updates)
        logger.scalar("perf/replay_steps", len(replay))
        logger.scalar("train/episodes", counters.episodes)
        if collector is not None:
            logger.scalar("train/dropped_episodes", collector.dropped)
        for key, value in envs.episode_metrics(config.task, recent_episodes).items():
            logger.scalar(f"train/{key}", value)
        recent_episodes.clear()
        if config.video_pred_log and agent.wm.heads["decoder"].cnn_shapes and replay.ready(config.batch_length):
            batch = agent.wm.preprocess(replay.sample(6, config.batch_length))
            logger.video("train/openl", agent.wm.video_pred(batch))
        values = logger.write(step)
        shown = {k: v for k, v in values.items() if k in ("train/return", "eval/return", "perf/fps")}
        print(f"[{step}] " + " ".join(f"{k} {v:.1f}" for k, v in shown.items()), flush=True)
        last_log = (now, step, counters.updates)

    def save():
        tools.save_checkpoint(checkpoint, checkpoint_state(agent, counters, schedules, replay))

    try:
        while frames() < config.steps:
            if eval_envs and schedules["eval"](frames()):
                evaluate(agent, eval_envs, config, logger, evaldir, eval_replay)
                if config.video_pred_log and agent.wm.heads["decoder"].cnn_shapes \
                        and eval_replay.ready(config.batch_length):
                    batch = agent.wm.preprocess(eval_replay.sample(6, config.batch_length))
                    logger.video("eval/openl", agent.wm.video_pred(batch))
                save()
            collect(policy)
            train(schedules["train"](counters.policy_steps))
            if schedules["log"](frames()):
                log()
        if eval_envs:
            evaluate(agent, eval_envs, config, logger, evaldir, eval_replay)
        log()
    finally:
        save()
        logger.close()


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
