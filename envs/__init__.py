"""Environment suites. `make_env` builds one wrapped environment from `config.task`.

Every environment here speaks the same small protocol, which `parallel.py` relies on:
  obs_space: dict of gymnasium Box spaces, including is_first, is_last and is_terminal
  act_space: a Box; discrete actions are one-hot vectors (`act_space.discrete` is True)
  reset() -> obs dict;  step(action) -> (obs dict, reward, done, info)
Suites are imported only when used, so a missing optional package never breaks another suite.
"""

import importlib

# suite prefix -> module in this package that defines `make(task, config, mode, index)`.
SUITES = {
    "dmc": "envs.dmc",
    "atari": "envs.atari",
    "crafter": "envs.crafter",
    "memorymaze": "envs.memorymaze",
    "minecraft": "envs.minecraft",
    "dmlab": "envs.dmlab",
    "gym": "envs.gym",
}


def split_task(task):
    """'dmc_walker_walk' -> ('dmc', 'walker_walk'); raises ValueError for an unknown suite."""
    suite, _, name = task.partition("_")
    if suite not in SUITES or not name:
        raise ValueError(f"Unknown suite in task '{task}'; valid suites: "
                         + ", ".join(f"{s}_<name>" for s in SUITES))
    return suite, name


def suite_module(task):
    suite, name = split_task(task)
    return importlib.import_module(SUITES[suite]), name


def check_task(task):
    """Raise ValueError naming the task and close valid names when the suite knows it is invalid."""
    module, name = suite_module(task)
    if hasattr(module, "check"):
        module.check(name)


def episode_metrics(task, episodes):
    """Suite-specific scalars (achievements, scores) over finished episodes, by the suite's own
    `episode_metrics(episodes) -> {name: value}`; empty for suites that report nothing extra."""
    module, _ = suite_module(task)
    if not episodes or not hasattr(module, "episode_metrics"):
        return {}
    return module.episode_metrics(episodes)


def make_env(config, mode, index):
    """One environment for `mode` ('train' or 'eval') with its own seed.

    Train environments get seeds seed+index and eval environments seed+10000+index, so that no
    two environments of a run ever share a seed.
    """
    module, name = suite_module(config.task)
    seed = config.seed + index + (10000 if mode == "eval" else 0)
    return module.make(name, config, mode, seed)

