"""Environment suites. `make_env` builds one wrapped environment of a task in `config.task`.

Every environment here speaks the same small protocol, which `parallel.py` relies on:
  obs_space: dict of gymnasium Box spaces, including is_first, is_last and is_terminal
  act_space: a Box; discrete actions are one-hot vectors (`act_space.discrete` is True)
  reset() -> obs dict;  step(action) -> (obs dict, reward, done, info)
Suites are imported only when used, so a missing optional package never breaks another suite.

`config.task` may name several tasks, comma-separated (README, Several tasks in one run):
`parse_tasks` splits it, `assign_tasks` spreads environments over the tasks and `common_spaces`
settles the spaces every task's environment presents (wrappers.TaskEnv).
"""

import ctypes.util
import importlib
import os
import sys

import gymnasium
import numpy as np

from envs import wrappers  # noqa: F401 - envs.wrappers.TaskEnv for parallel.make_envs
from envs.wrappers import TaskError

# suite prefix -> module in this package that defines `make(task, config, mode, index)`.
SUITES = {
    "dmc": "envs.dmc",
    "atari": "envs.atari",
    "crafter": "envs.crafter",
    "memorymaze": "envs.memorymaze",
    "minecraft": "envs.minecraft",
    "dmlab": "envs.dmlab",
    "gym": "envs.gym",
    "steering": "envs.steering",  # a tiny task for the learning check (benchmarks/learns.py)
}


def split_task(task):
    """'dmc_walker_walk' -> ('dmc', 'walker_walk'); raises TaskError for an unknown suite."""
    suite, _, name = task.partition("_")
    if suite not in SUITES or not name:
        raise TaskError(f"Unknown suite in task '{task}'; valid suites: "
                         + ", ".join(f"{s}_<name>" for s in SUITES))
    return suite, name


def suite_module(task):
    suite, name = split_task(task)
    return importlib.import_module(SUITES[suite]), name


def check_task(task):
    """Raise TaskError naming the task and close valid names when the suite knows it is invalid,
    or MUJOCO_GL when the suite's import would fail on it (check_rendering)."""
    split_task(task)
    check_rendering([task])
    module, name = suite_module(task)
    if hasattr(module, "check"):
        module.check(name)


# MUJOCO_GL's back ends (dm_control._render.constants; each name also has aliases there), with the
# shared library each loads and the package that provides it on Debian/Ubuntu.
RENDERERS = {"egl": ("EGL", "libegl1"), "osmesa": ("OSMesa", "libosmesa6"), "glfw": ("glfw", "libglfw3")}
RENDERER_ALIASES = {"on": "glfw", "enable": "glfw", "enabled": "glfw", "true": "glfw", "1": "glfw", "": "glfw",
                    "off": None, "disable": None, "disabled": None, "false": None, "0": None}
MUJOCO_SUITES = ("dmc", "memorymaze")  # the suites whose environments render through MuJoCo


def check_rendering(tasks, environ=None, find_library=ctypes.util.find_library):
    """A MUJOCO_GL the user set, checked before anything is written when a task renders through
    MuJoCo: dm_control raises on an unknown value, and on a back end whose library is missing
    fails deep in its renderer. An unset MUJOCO_GL is left to wrappers.headless_rendering."""
    environ = os.environ if environ is None else environ
    value = environ.get("MUJOCO_GL")
    if value is None or not any(split_task(task)[0] in MUJOCO_SUITES for task in tasks):
        return
    name = RENDERER_ALIASES.get(value.lower(), value.lower())
    if name is None:  # rendering off: a run without images still works
        return
    if name not in RENDERERS:
        raise TaskError(f"Invalid value '{value}' for the environment variable MUJOCO_GL; valid: egl (headless, "
                        "libegl1), osmesa (software, libosmesa6), glfw (a display); unset, it is egl")
    library, package = RENDERERS[name]
    if name == "glfw" and sys.platform.startswith("linux") and not (environ.get("DISPLAY")
                                                                    or environ.get("WAYLAND_DISPLAY")):
        raise TaskError("MUJOCO_GL=glfw needs a display, but DISPLAY is not set; use MUJOCO_GL=egl (headless) "
                        "or osmesa")
    if name != "glfw" and sys.platform.startswith("linux") and find_library(library) is None:
        raise TaskError(f"MUJOCO_GL={value} needs lib{library}, which is not installed: apt-get install {package} "
                        f"(or use MUJOCO_GL={'osmesa' if name == 'egl' else 'egl'})")


def episode_metrics(task, episodes):
    """Suite-specific scalars (achievements, scores) over finished episodes, by the suite's own
    `episode_metrics(episodes) -> {name: value}`; empty for suites that report nothing extra."""
    module, _ = suite_module(task)
    if not episodes or not hasattr(module, "episode_metrics"):
        return {}
    return module.episode_metrics(episodes)


def make_env(config, mode, index, task=None):
    """One environment of `task` (default: `config.task`, a single task) for `mode` ('train' or
    'eval') with its own seed.

    Train environments get seeds seed+index and eval environments seed+10000+index, so that no
    two environments of a run ever share a seed.
    """
    module, name = suite_module(task or config.task)
    seed = config.seed + index + (10000 if mode == "eval" else 0)
    return module.make(name, config, mode, seed)



# ==================================================================================================
# Several tasks in one run
# ==================================================================================================


def parse_tasks(text):
    """'dmc_walker_walk,dmc_cheetah_run' -> ['dmc_walker_walk', 'dmc_cheetah_run']; one task is a
    list of one. Raises TaskError for an empty entry or a task named twice."""
    tasks = [task.strip() for task in str(text).split(",")]
    if not all(tasks):
        raise TaskError(f"Invalid value '{text}' for --task: an empty task name; give tasks separated by "
                         "commas, e.g. dmc_walker_walk,dmc_cheetah_run")
    twice = sorted({task for task in tasks if tasks.count(task) > 1})
    if twice:
        raise TaskError(f"Invalid value '{text}' for --task: {', '.join(twice)} named more than once; "
                         "give each task once (--envs sets how many environments run)")
    return tasks


def assign_tasks(tasks, count, weights=None):
    """The task index of each of `count` environments: round-robin over `tasks` by default.

    With `weights` (one positive number per task, e.g. its cost per step) each task gets a share of
    the environments proportional to its weight, by largest remainder, and at least one; the
    environments are then dealt out in turns, so every prefix of the list mixes the tasks.
    """
    n = len(tasks)
    if count < n:
        raise TaskError(f"{count} environments cannot run {n} tasks; give --envs {n} or more")
    if weights is None:
        return [i % n for i in range(count)]
    weights = np.asarray(weights, np.float64)
    if weights.shape != (n,) or not (weights > 0).all():
        raise TaskError(f"expected {n} positive task weights, got {list(weights)}")
    share = 1 + weights / weights.sum() * (count - n)  # one each, the rest by weight
    counts = np.floor(share).astype(int)
    for i in np.argsort(-(share - counts), kind="stable")[:count - counts.sum()]:
        counts[i] += 1
    order, left = [], counts.copy()
    while left.any():
        for i in range(n):
            if left[i]:
                order.append(i)
                left[i] -= 1
    return order


def task_assignment(tasks, mode, count, weights=None):
    """The task index of each environment: `count` training environments spread over `tasks`
    (assign_tasks, round-robin unless `weights`), or `count` evaluation ones of each task."""
    if mode == "train":
        return assign_tasks(tasks, count, weights)
    return [task for task in range(len(tasks)) for _ in range(count)]


def noop_action(task):
    """Index of the suite's no-op action (the one padded discrete actions map to), None if it has none."""
    module, _ = suite_module(task)
    return getattr(module, "NOOP_ACTION", None)


def common_spaces(tasks, obs_spaces, act_spaces, used, noops=None):
    """The observation and action space that every task's environment presents in one run.

    obs_spaces, act_spaces: one per task, as the (wrapped) environments report them; used: the
    observation keys the model reads. A key the model reads must exist in every task with the same
    shape and dtype; a key it does not read is kept only where every task has it alike (else it is
    dropped: it would only break the common episode format). Actions: all discrete or all continuous;
    the widest space wins, and bounds of shared dimensions are the union of the tasks' bounds. A
    discrete task with fewer actions needs a no-op (`noops`, one index or None per task) that its
    padded actions map to.
    Raises TaskError naming the keys and tasks that do not fit.
    """
    discrete = [bool(getattr(space, "discrete", False)) for space in act_spaces]
    if any(discrete) and not all(discrete):
        kind = lambda d: ", ".join(t for t, x in zip(tasks, discrete) if x == d)  # noqa: E731
        raise TaskError(f"Tasks mix discrete actions ({kind(True)}) and continuous actions ({kind(False)}); "
                         "one run can only mix tasks of one kind")
    obs_space = {}
    for key in sorted(set().union(*obs_spaces)):
        if key.startswith("log_"):  # suite metrics, per task: never part of the common format
            continue
        have = [task for task, space in zip(tasks, obs_spaces) if key in space]
        alike = len({(tuple(space[key].shape), np.dtype(space[key].dtype)) for space in obs_spaces if key in space})
        if key in used and len(have) < len(tasks):
            lack = [task for task in tasks if task not in have]
            raise TaskError(f"Observation key '{key}' is read by the model but only {', '.join(have)} "
                             f"{'has' if len(have) == 1 else 'have'} it, not {', '.join(lack)}; every task "
                             "must have the keys the encoder and decoder read (--encoder.mlp_keys, "
                             "--encoder.cnn_keys, and the decoder's)")
        if key in used and alike > 1:
            shapes = ", ".join(f"{task} {tuple(space[key].shape)} {np.dtype(space[key].dtype)}"
                               for task, space in zip(tasks, obs_spaces))
            raise TaskError(f"Observation key '{key}' differs between tasks ({shapes}); every task must "
                             "observe the keys the model reads with the same shape (e.g. the same --size)")
        if len(have) == len(tasks) and alike == 1:
            obs_space[key] = obs_spaces[0][key]
    width = max(space.shape[0] for space in act_spaces)
    if all(discrete):
        for task, space, noop in zip(tasks, act_spaces, noops or [None] * len(tasks)):
            if space.shape[0] < width and noop is None:
                raise TaskError(f"Task {task} has {space.shape[0]} actions and cannot be padded to {width}: its "
                                 "suite has no no-op action to map the extra ones to; mix only tasks with as many "
                                 "actions, or suites with a no-op (atari, crafter, memorymaze, minecraft)")
        return obs_space, act_spaces[int(np.argmax([s.shape[0] for s in act_spaces]))]
    low, high = np.full(width, np.inf, np.float32), np.full(width, -np.inf, np.float32)  # the widest covers all
    for space in act_spaces:
        size = space.shape[0]
        low[:size] = np.minimum(low[:size], space.low)
        high[:size] = np.maximum(high[:size], space.high)
    return obs_space, gymnasium.spaces.Box(low, high, dtype=np.float32)
