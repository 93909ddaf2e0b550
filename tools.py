"""Leaf utilities that the rest of the project builds on, in three sections (in this order):

1. Tensors: whether a nest of tensors is finite (the checkpoint's and the training loop's check).
2. Schedules: the counters that decide when to train, log and evaluate, the train-ratio arithmetic,
   the checkpoint clock, the asynchronous loop's samples-per-insert rate limiter and a stopwatch.
3. Configuration: the read-only Config (here, a leaf, because spawned environment workers unpickle
   it), the error a user's mistake raises, and the helpers the modules below config.py read
   (config.py holds the schema, the parser and the checks).

The heads' distributions are in distributions.py; atomic file writes, episode and checkpoint files
and the replay in storage.py; processes, devices and random state in launch.py; logging and progress
in logs.py. Nothing here imports another module of the project or knows about the world model or the
environments.
"""

import copy
import re
import threading
import time

import torch

# ==================================================================================================
# 1. Tensors
# ==================================================================================================


def tensors(tree):
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors(value)


def finite_flags(tree):
    """{device: a 0-dim bool tensor on it}: whether every floating-point tensor of `tree` on that
    device is finite. Per device, since a tree can hold both (a CUDA run's checkpoint holds the
    weights on the GPU and the counters and random states on the host), and with no sync."""
    flags = {}
    for t in tensors(tree):
        if t.is_floating_point():
            flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    return {device: torch.stack(found).all() for device, found in flags.items()}


def all_finite(tree):
    """Whether every floating-point tensor in `tree` is finite (one device sync per device)."""
    return all(bool(flag) for flag in finite_flags(tree).values())


# ==================================================================================================
# 2. Schedules
# ==================================================================================================


class Every:
    """True once each time `step` passes a multiple of `every` (never when every <= 0)."""

    def __init__(self, every, last=None):
        self.every = every
        self.last = last

    def __call__(self, step):
        if not self.every or self.every <= 0:
            return False
        if self.last is None:
            self.last = step
            return True
        if step >= self.last + self.every:
            self.last += self.every * ((step - self.last) // self.every)
            return True
        return False


class Clock:
    """Wall-clock schedule: due once `seconds` have passed since it started or was last `reset()`
    (never when seconds <= 0). The checkpoint clock (save_every); `now` is replaceable for tests."""

    def __init__(self, seconds, now=time.monotonic):
        self.seconds, self.now = seconds, now
        self.last = now()

    def __call__(self):
        return bool(self.seconds) and self.seconds > 0 and self.now() - self.last >= self.seconds

    def reset(self):
        self.last = self.now()


def replayed_per_update(config):
    """Replayed steps one update trains on, as the train ratio counts them: batch_size sequences of
    batch_length steps (the replay context's steps only give the start latent)."""
    return config.batch_size * config.batch_length


def updates_owed(steps, ratio, replayed_per_update):
    """Updates (a float) that the train ratio owes for `steps` policy steps: the one place of the
    train-ratio arithmetic (Ratio, SamplesPerInsert, total_updates, parallel's sizing). Multiplied
    first, so that exact ratios stay exact."""
    return steps * ratio / replayed_per_update


class Ratio:
    """Number of updates owed so that updates * replayed_per_update / steps == ratio."""

    def __init__(self, ratio, replayed_per_update):
        self.ratio, self.replayed_per_update = ratio, replayed_per_update
        self.steps_per_update = replayed_per_update / ratio
        self.updates = 0

    def owed(self, steps):
        """Whole updates owed in total after `steps` steps."""
        return int(updates_owed(steps, self.ratio, self.replayed_per_update))

    def __call__(self, steps):
        due = self.owed(steps) - self.updates
        due = max(0, due)
        self.updates += due
        return due

    def state_dict(self):
        return {"updates": self.updates}

    def load_state_dict(self, state):
        self.updates = state["updates"]


class SamplesPerInsert:
    """Rate limiter between an actor inserting policy steps and a learner making updates.

    Holds the credited `updates` within `tolerance` updates of those the train ratio owes for the
    `inserts` so far, `owed = inserts * ratio / replayed_per_update`: the learner waits while one
    more update would put it more than `tolerance` ahead, the actor while the learner is more than
    `tolerance` behind. An insert of n steps adds n * ratio / replayed_per_update to the owed
    updates, so the learner lags by at most `tolerance` plus one insert. After `finish()` (no more
    inserts) the learner may make the updates still owed, as the synchronous loop would, and no more.

    Thread-safe; `wait_*` return False on timeout or after `close()`.
    """

    def __init__(self, ratio, replayed_per_update, tolerance, lock=None):
        if tolerance < 1:  # below one update the two sides can wait on each other for ever
            raise ValueError(f"tolerance must be at least 1 update, got {tolerance}")
        self.ratio, self.replayed_per_update, self.tolerance = ratio, replayed_per_update, tolerance
        self.inserts, self.updates = 0, 0
        self.finished = self.closed = False
        self.condition = threading.Condition(lock or threading.RLock())

    def owed(self, inserts):
        """Whole updates owed after `inserts` steps (as `Ratio.owed`)."""
        return int(updates_owed(inserts, self.ratio, self.replayed_per_update))

    def can_sample(self):
        if self.finished:
            return self.updates + 1 <= self.owed(self.inserts)
        return self.updates + 1 <= updates_owed(self.inserts, self.ratio, self.replayed_per_update) + self.tolerance

    def can_insert(self):
        return updates_owed(self.inserts, self.ratio, self.replayed_per_update) - self.updates <= self.tolerance

    def wait_sample(self, timeout=None):
        return self._wait(self.can_sample, timeout)

    def wait_insert(self, timeout=None):
        return self._wait(self.can_insert, timeout)

    def _wait(self, allowed, timeout):
        with self.condition:
            return bool(self.condition.wait_for(lambda: self.closed or allowed(), timeout)) and not self.closed

    def sampled(self, count=1):
        with self.condition:
            self.updates += count
            self.condition.notify_all()

    def inserted(self, count):
        with self.condition:
            self.inserts += count
            self.condition.notify_all()

    def finish(self):
        with self.condition:
            self.finished = True
            self.condition.notify_all()

    def close(self):
        with self.condition:
            self.closed = True
            self.condition.notify_all()

    def state_dict(self):
        with self.condition:
            return {"updates": self.updates, "inserts": self.inserts}

    def load_state_dict(self, state):
        state = state if isinstance(state, dict) else {"updates": state}
        with self.condition:
            self.updates = state["updates"]
            self.inserts = state.get("inserts", self.inserts)


class Stopwatch:
    """Seconds spent in each named activity, from any thread (one thread per name), and the
    fraction of wall-clock time each took since the last `fractions()`."""

    def __init__(self, names):
        self.seconds = {name: 0.0 for name in names}
        self.mark = (time.perf_counter(), dict(self.seconds))

    def time(self, name):
        return _Timed(self.seconds, name)

    def fractions(self):
        """{name: fraction of wall-clock time} since the last call."""
        now, (then, before) = time.perf_counter(), self.mark
        totals = dict(self.seconds)
        self.mark = (now, totals)
        return {name: (value - before[name]) / max(now - then, 1e-9) for name, value in totals.items()}


class _Timed:
    def __init__(self, seconds, name):
        self.seconds, self.name = seconds, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds[self.name] += time.perf_counter() - self.start


def prefill_frames(config):
    """Frames the prefill lasts: `prefill`; with prefill_policy agent at least one batch of replay steps
    (a few frames fewer where reset steps, which the replay holds too, fill part of it)."""
    if config.prefill_policy == "agent":
        return max(config.prefill, replayed_per_update(config) * config.action_repeat)
    return config.prefill


def total_updates(config):
    """Updates a run makes from its start to `steps` frames: the pretraining, then train_ratio replayed
    steps per policy step after the prefill (Trainer.train: the prefill's steps count as paid for)."""
    policy_steps = max(0, config.steps - prefill_frames(config)) / config.action_repeat
    return config.pretrain + int(updates_owed(policy_steps, config.train_ratio, replayed_per_update(config)))


# ==================================================================================================
# 3. Configuration
# ==================================================================================================


class Config:
    """Read-only nested settings (`config.actor.lr`). A run settles its config once at start-up
    (every `auto` resolved, through `replace`, which returns a new Config) and then never assigns
    to it: an assignment raises, so that no part of the run sees a value another part changed."""

    def __init__(self, mapping):
        for key, value in mapping.items():
            object.__setattr__(self, key, Config(value) if isinstance(value, dict) else value)

    def __setattr__(self, key, value):
        raise AttributeError(f"the config is read-only once settled: cannot set '{key}' (use config.replace)")

    def __delattr__(self, key):
        raise AttributeError(f"the config is read-only once settled: cannot delete '{key}'")

    def replace(self, changes=None, **more):
        """A new Config with `changes` ({dotted key: value}, or keyword arguments) applied."""
        tree = self.to_dict()
        for key, value in {**(changes or {}), **more}.items():
            node = tree
            *parents, leaf = key.split(".")
            for parent in parents:
                node = node[parent]
            if leaf not in node:
                raise KeyError(f"no config key '{key}'")
            node[leaf] = value
        return Config(tree)

    def to_dict(self):
        return {k: v.to_dict() if isinstance(v, Config) else copy.deepcopy(v) for k, v in vars(self).items()}

    def __repr__(self):
        return f"Config({self.to_dict()})"


class ConfigError(ValueError):
    """A user mistake on the command line or in a preset: reported in one line, exit status 2."""


def flatten(mapping, prefix=""):
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def select_keys(obs_space, cnn_pattern, mlp_pattern):
    """Image keys (rank 3) matching cnn_pattern and vector keys (rank <= 1) matching mlp_pattern."""
    skip = ("is_first", "is_last", "is_terminal", "reward")
    shapes = {k: v.shape for k, v in obs_space.items() if k not in skip and not k.startswith("log_")}
    cnn = {k: s for k, s in shapes.items() if len(s) == 3 and re.match(cnn_pattern, k)}
    mlp = {k: s for k, s in shapes.items() if len(s) in (0, 1) and re.match(mlp_pattern, k)}
    return cnn, mlp
