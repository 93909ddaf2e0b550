"""Shared by the suites: action normalisation, one-hot actions, time limit, spaces, quiet imports."""

import contextlib
import importlib
import io
import os
import sys

import gymnasium
import numpy as np


class TaskError(ValueError):
    """A task, its settings or its spaces that a run cannot use: a user mistake, said in one line
    (dreamer.py prints it and exits 2). Any other error of a suite keeps its traceback."""


def import_quietly(names, install_hint):
    """Import optional packages that import gym 0.26, whose import prints a notice urging an upgrade
    to Gymnasium that would only mislead here; a missing package raises ImportError(install_hint)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return [importlib.import_module(name) for name in names]
    except ImportError as e:
        raise ImportError(install_hint) from e


class Wrapper:
    """Forwards everything it does not override to the wrapped environment."""

    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.env, name)


class NormalizeActions(Wrapper):
    """The agent acts in [-1, 1] on every bounded dimension; actions are clipped, then rescaled."""

    def __init__(self, env):
        super().__init__(env)
        space = env.act_space
        self.mask = np.isfinite(space.low) & np.isfinite(space.high)
        self.low = np.where(self.mask, space.low, -1)
        self.high = np.where(self.mask, space.high, 1)
        low = np.where(self.mask, -np.ones_like(self.low), self.low)
        high = np.where(self.mask, np.ones_like(self.high), self.high)
        self.act_space = gymnasium.spaces.Box(low.astype(np.float32), high.astype(np.float32), dtype=np.float32)

    def step(self, action):
        action = np.clip(action, -1, 1)
        original = (action + 1) / 2 * (self.high - self.low) + self.low
        return self.env.step(np.where(self.mask, original, action))


class OneHotSpace(gymnasium.spaces.Box):
    """A Box of one-hot vectors, marked discrete so the agent picks a categorical actor."""

    discrete = True

    def __init__(self, n):
        super().__init__(0.0, 1.0, (n,), dtype=np.float32)

    def sample(self, mask=None, probability=None):
        action = np.zeros(self.shape, np.float32)
        action[self.np_random.integers(0, self.shape[0])] = 1.0
        return action


class OneHotAction(Wrapper):
    """Discrete(n) action space exposed as one-hot vectors of size n."""

    def __init__(self, env):
        super().__init__(env)
        self.n = int(env.act_space.n)
        self.act_space = OneHotSpace(self.n)

    def step(self, action):
        action = np.asarray(action)
        index = int(np.argmax(action))
        if not np.allclose(action.sum(), 1.0) or action[index] != 1.0:
            raise ValueError(f"Expected a one-hot action of size {self.n}, got {action}")
        return self.env.step(index)


class TimeLimit(Wrapper):
    """Ends an episode after `duration` policy steps as a truncation: is_last, not is_terminal."""

    def __init__(self, env, duration):
        super().__init__(env)
        self.duration = duration
        self.step_count = None

    def reset(self):
        self.step_count = 0
        return self.env.reset()

    def step(self, action):
        if self.step_count is None:
            raise RuntimeError("Call reset() before step().")
        obs, reward, done, info = self.env.step(action)
        self.step_count += 1
        if self.duration and self.step_count >= self.duration and not done:
            obs = dict(obs, is_last=True)
            done = True
        if done:
            self.step_count = None
        return obs, reward, done, info


def flag_spaces():
    """Spaces of the is_first / is_last / is_terminal flags every observation carries."""
    return {k: gymnasium.spaces.Box(0, 1, (), dtype=bool) for k in ("is_first", "is_last", "is_terminal")}


def image_obs_space(size, grayscale=False):
    """Spaces of an environment that observes one uint8 image: (H, W, 1 or 3) plus the flags."""
    shape = tuple(size) + (1 if grayscale else 3,)
    return {"image": gymnasium.spaces.Box(0, 255, shape, dtype=np.uint8), **flag_spaces()}


def wrap(env, config):
    """The wrappers every suite applies: actions in [-1, 1] or one-hot, and the time limit.

    `time_limit` counts environment frames, like every other duration in the config.
    """
    if hasattr(env.act_space, "n"):
        env = OneHotAction(env)
    else:
        env = NormalizeActions(env)
    return TimeLimit(env, int(config.time_limit // config.action_repeat) if config.time_limit else 0)


class TaskEnv(Wrapper):
    """One task's environment in a run of several (envs.common_spaces): it presents the run's
    common observation and action spaces and records which task it runs (`task_index`).

    The agent acts in the widest action space. A continuous environment executes the leading
    dimensions of the action that are its own and ignores the rest; a discrete one executes its own
    actions, and the padded ones (index >= its own count) as its suite's no-op action `noop`. Only
    the action is changed on the way in, so this also wraps the handles of parallel.py, whose step
    returns a callable; the Collector drops the observation keys not in the common space
    (`dropped_keys`).
    """

    def __init__(self, env, task_index, obs_space, act_space, noop=None):
        super().__init__(env)
        self.task_index, self.obs_space, self.act_space = task_index, obs_space, act_space
        self.dropped_keys = frozenset(k for k in env.obs_space if k not in obs_space and not k.startswith("log_"))
        own = env.act_space
        self.size = own.shape[0]
        self.discrete = bool(getattr(own, "discrete", False))
        self.noop = noop  # envs.common_spaces makes sure a padded discrete task has one

    def step(self, action):
        action = np.asarray(action, np.float32)
        if not self.discrete:
            return self.env.step(action[:self.size])
        index = int(np.argmax(action))
        own = np.zeros(self.size, np.float32)
        own[index if index < self.size else self.noop] = 1.0
        return self.env.step(own)


def headless_rendering():
    """MuJoCo renders with EGL (no display needed) on Linux unless the user chose a back end
    (MUJOCO_GL); elsewhere, e.g. on macOS where EGL does not exist, MuJoCo's own default (glfw) stays."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("MUJOCO_GL", "egl")
