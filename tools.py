"""Leaf utilities that the rest of the project builds on, in three sections (in this order):

1. Tensors: whether a nest of tensors is finite (the checkpoint's and the training loop's check).
2. Schedules: the counters that decide when to train, log and evaluate, the train-ratio arithmetic,
   the checkpoint clock, the asynchronous loop's samples-per-insert rate limiter and a stopwatch.
3. Configuration: the read-only Config, presets, command-line parsing and checks, the saved config
   compared with the run's.

The heads' distributions are in distributions.py; atomic file writes, episode and checkpoint files
and the replay in storage.py; processes, devices and random state in launch.py; logging and progress
in logs.py. Nothing here imports another module of the project or knows about the world model or the
environments.
"""

import argparse
import contextlib
import copy
import difflib
import math
import pathlib
import re
import threading
import time

import numpy as np
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


def all_finite(tree):
    """Whether every floating-point tensor in `tree` is finite (one device sync in all)."""
    flags = [torch.isfinite(t).all() for t in tensors(tree) if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


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
        self.updates = state["updates"] if isinstance(state, dict) else state  # older checkpoints: the int


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


CONFIG_FILE = pathlib.Path(__file__).parent / "configs.yaml"


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


def at_least(low):
    """A RANGES predicate (value, flat config) -> whether value >= low."""
    return lambda v, flat: v >= low


def positive(v, flat):
    """A RANGES predicate: value > 0."""
    return v > 0


def fraction(v, flat):
    """A RANGES predicate: value in [0, 1]."""
    return 0 <= v <= 1


def valid_regex(text):
    try:
        re.compile(text)
    except (re.error, TypeError):
        return False
    return True


def select_keys(obs_space, cnn_pattern, mlp_pattern):
    """Image keys (rank 3) matching cnn_pattern and vector keys (rank <= 1) matching mlp_pattern."""
    skip = ("is_first", "is_last", "is_terminal", "reward")
    shapes = {k: v.shape for k, v in obs_space.items() if k not in skip and not k.startswith("log_")}
    cnn = {k: s for k, s in shapes.items() if len(s) == 3 and re.match(cnn_pattern, k)}
    mlp = {k: s for k, s in shapes.items() if len(s) in (0, 1) and re.match(mlp_pattern, k)}
    return cnn, mlp


def parse_bool(text):
    lookup = {"true": True, "1": True, "false": False, "0": False}
    if text.lower() not in lookup:
        raise ValueError("expected True/False/true/false/1/0")
    return lookup[text.lower()]


# The largest magnitude a float key may take: every value ends up in float32 arithmetic, where a
# larger one is inf (and inf or NaN make no sense for any key).
FLOAT32_MAX = float(np.finfo(np.float32).max)


def parse_number(text, like):
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number") from None
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ValueError(f"expected a finite number (at most {FLOAT32_MAX:.3g} in magnitude: float32 holds no more)")
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


def parse_choice(text, valid):
    """The one of `valid` that `text` names (True/False also as true/false/1/0)."""
    for option in valid:
        if isinstance(option, bool):
            with contextlib.suppress(ValueError):
                if parse_bool(text) is option:
                    return option
        elif str(option) == text:
            return option
    raise ValueError(f"valid: {', '.join(map(str, valid))}")


def parse_count_or_auto(text):
    if text == "auto":
        return text
    try:
        return parse_number(text, 1)
    except ValueError:
        raise ValueError("expected a whole number or auto") from None


def closest(name, valid):
    match = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    return ", ".join(match) if match else "none close"


def parse(argv, choices, ranges, counts=(), presets=None):
    """Command line -> Config: defaults, then --configs presets in order, then --key value flags.

    choices: {key: valid values} (a key that takes True/False may stand alone as a flag);
    ranges: {key: (predicate(value, flat config), what is valid)}; counts: keys that take a whole
    number or 'auto'. Every value is checked here, once."""
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
            if (isinstance(flat[key], bool) or True in choices.get(key, ())) and not takes_value:
                value = "true"
            elif not takes_value:
                raise ConfigError(f"Missing value for --{key}")
            else:
                value, i = rest[i + 1], i + 1
        try:
            if key in choices:
                overrides[key] = parse_choice(value, choices[key])
            elif key in counts:
                overrides[key] = parse_count_or_auto(value)
            else:
                overrides[key] = parse_value(value, flat[key])
        except ValueError as e:
            raise ConfigError(f"Invalid value '{value}' for --{key}{'; ' if key in choices else ': '}{e}") from None
        i += 1
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    check_choices(flatten(config), choices)
    config = normalise(config)
    check_ranges(flatten(config), ranges)
    return Config(config)


def check_choices(flat, choices):
    for key, valid in choices.items():
        if key in flat and flat[key] not in valid:
            raise ConfigError(f"Invalid value '{flat[key]}' for --{key}; valid: {', '.join(map(str, valid))}")


def check_ranges(flat, ranges):
    for key, (valid, description) in ranges.items():
        if key in flat and not valid(flat[key], flat):
            value = ",".join(map(str, flat[key])) if isinstance(flat[key], list) else flat[key]
            raise ConfigError(f"Invalid value '{value}' for --{key}; valid: {description}")


# Counts that YAML may write as 1e6: they become integers.
WHOLE_NUMBERS = ("steps", "eval_every", "eval_episode_num", "log_every", "prefill", "dataset_size", "time_limit",
                 "envs", "action_repeat", "expl_until", "pretrain", "batch_size", "batch_length", "replay_context",
                 "actor_sync_every")


def normalise(config):
    """Counts written as 1e6 in YAML become integers."""
    config = copy.deepcopy(config)
    for key in WHOLE_NUMBERS:
        if isinstance(config.get(key), float):
            if not config[key].is_integer():
                raise ConfigError(f"Invalid value '{config[key]}' for --{key}: expected a whole number")
            config[key] = int(config[key])
    return config


def compare_saved_config(config, path, free_keys=()):
    """Warnings for keys that differ from the run's saved config (but `free_keys`, which may
    differ between a run and its resumption); a different task is an error."""
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
            if key not in free_keys and value != "auto" and saved.get(key) != value]


def config_reference(path=CONFIG_FILE):
    """Every key of `defaults` in configs.yaml with its default as written and its comment (the
    comment lines below a key continue it): [(dotted key, default, comment)], in file order. The
    file is the reference; `python3 dreamer.py --help` prints this, so the two cannot drift."""
    rows, parents, inside = [], [], False
    for line in pathlib.Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):  # a top-level entry: defaults or a preset
            inside = line.startswith("defaults:")
            parents = []
            continue
        if not inside:
            continue
        indent = len(line) - len(line.lstrip())
        text, _, comment = line.strip().partition("#") if line.strip().startswith("#") else _split_comment(line)
        if line.strip().startswith("#"):
            if rows and indent > 2 and rows[-1][2] and not line.strip().startswith("# ---"):
                rows[-1] = (rows[-1][0], rows[-1][1], rows[-1][2] + " " + line.strip()[1:].strip())
            continue
        key, _, value = text.partition(":")
        depth = indent // 2 - 1  # defaults' own keys are indented by 2
        parents = parents[:depth]
        if not value.strip():  # a group: its keys follow, indented
            parents.append(key.strip())
            continue
        rows.append((".".join([*parents, key.strip()]), value.strip(), comment.strip()))
    return rows


def config_help(topic=None):
    """The lines of `--help [TOPIC]`: every key with its default and comment (config_reference),
    those starting with TOPIC (a group or key prefix) when given; an unknown TOPIC is a ConfigError."""
    rows = config_reference()
    if topic is not None:
        rows = [row for row in rows if row[0].startswith(topic)]
        if not rows:
            groups = sorted({key.split(".")[0] for key, _, _ in config_reference() if "." in key})
            raise ConfigError(f"No config key starts with '{topic}'; groups: {', '.join(groups)} "
                              "(or any key prefix, e.g. dyn_)")
    width = max(len(f"--{key} {default}") for key, default, _ in rows) + 2
    return [f"  {f'--{key} {default}':<{width}}{comment}" for key, default, comment in rows]


def _split_comment(line):
    """'key: value  # comment' -> ('key: value', '#', 'comment'); a '#' inside quotes is text."""
    quote = None
    for i, char in enumerate(line):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (i == 0 or line[i - 1] == " "):
            return line[:i].strip(), "#", line[i + 1:]
    return line.strip(), "", ""
