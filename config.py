"""The run's configuration: one schema of its keys, the command-line parser and --help that read it,
the argument checks before anything is written, and the start-up summary's tables.

SCHEMA holds a row for every key that takes more than its default's type: its choices (a module's
own dispatch table where one dispatches on the key, so that the two cannot drift), its range, whether
it is a whole number or takes 'auto', may change on resume, or sets a network's width. parse checks
every value against it once; the modules that read a value take it on trust. This module imports
the modules whose tables it names; none of them imports it (ConfigError, which they raise, is in
tools.py, the leaf).
"""

import argparse
import collections
import contextlib
import copy
import difflib
import io
import math
import os
import pathlib
import re
import sys
import tempfile
import typing

import numpy as np
import torch

import compilation
import envs
import exploration
import launch
import models
import networks
import optim
import precision
import storage
import tools

CONFIG_FILE = pathlib.Path(__file__).parent / "configs.yaml"


class Presets(dict):
    """configs.yaml as loaded: {preset name: its keys} with `defaults` first, and where each key is
    written, `lines[(preset, dotted key)]` (1-based), so that a bad value names its line."""

    def __init__(self, presets, lines, path):
        super().__init__(presets)
        self.lines, self.path = lines, pathlib.Path(path)

    def where(self, name, key=None):
        """'configs.yaml:LINE' of a preset or one of its keys (the preset's own line when the key's is unknown)."""
        line = self.lines.get((name, key)) or self.lines.get((name, None), 1)
        return f"{self.path.name}:{line}"


def load_presets(path=None):
    """The one reader of configs.yaml. Every YAML or schema mistake in it is a ConfigError of one
    line, 'configs.yaml:LINE: what is wrong', before anything is written: a preset is a mapping of
    keys that `defaults` declares, each of its default's type and, where SCHEMA lists choices, one of
    them; `defaults` holds every SCHEMA key and passes every check (parse checks the stacked presets)."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    path = pathlib.Path(CONFIG_FILE if path is None else path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise tools.ConfigError(f"{path.name}: not found at {path}; restore it (git checkout {path.name})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise tools.ConfigError(f"{path.name}: cannot read {path} ({getattr(e, 'strerror', None) or e})") from None
    yaml = YAML(typ="safe", pure=True)
    try:
        root = yaml.compose(text)  # the nodes know their lines; built into values once
        presets = yaml.constructor.construct_document(root) if root is not None else None
    except MarkedYAMLError as e:
        raise tools.ConfigError(yaml_error(path.name, e)) from None
    except YAMLError as e:
        raise tools.ConfigError(f"{path.name}: {str(e).splitlines()[0]}") from None
    if presets is None:
        raise tools.ConfigError(f"{path.name}:1: the file is empty; it needs `defaults:` and the presets "
                                f"(restore it: git checkout {path.name})")
    if not isinstance(presets, dict):
        raise tools.ConfigError(f"{path.name}:1: expected a mapping of presets (defaults:, debug:, ...), "
                                f"got {type(presets).__name__}")
    loaded = Presets(presets, key_lines(root), path)
    if "defaults" not in presets:
        raise tools.ConfigError(f"{path.name}:1: no `defaults:` mapping; every preset is merged over it")
    for name, preset in presets.items():
        if not isinstance(preset, dict):
            raise tools.ConfigError(f"{loaded.where(name)}: preset '{name}' is not a mapping of keys "
                                    f"(got {preset!r}); write it as `{name}:` with indented `key: value` lines")
    check_defaults(loaded)
    for name in presets:
        if name != "defaults":
            check_preset(loaded, name)
    return loaded


def yaml_error(name, error):
    """A YAML syntax error as 'configs.yaml:LINE: what, how to fix'."""
    problem = error.problem or str(error).splitlines()[0]
    mark = error.problem_mark
    if "\\t" in problem:  # ruamel writes the tab it found as '\\t'
        return f"{name}:{mark.line + 1}: a tab in the indentation; indent with spaces"
    if "could not find expected ':'" in problem and error.context_mark is not None:
        return (f"{name}:{error.context_mark.line + 1}: a key without ': ' (a colon and a space), "
                "e.g. `batch_size: 16`")
    if "duplicate key" in problem:
        key = problem.split('"')[1] if '"' in problem else "?"
        return f"{name}:{mark.line + 1}: duplicate key '{key}' (each key once per preset)"
    return f"{name}:{mark.line + 1}: {problem}" + (f" ({error.context})" if error.context else "")


def key_lines(node, prefix=(), lines=None):
    """{(preset, dotted key): line} of every key under the YAML node tree's top-level mapping;
    (preset, None) is the preset's own line."""
    lines = {} if lines is None else lines
    if not hasattr(node, "value") or not isinstance(node.value, list):
        return lines
    for item in node.value:
        if not isinstance(item, tuple):
            continue
        key, value = item
        path = (*prefix, str(key.value))
        if not prefix:
            lines[(path[0], None)] = key.start_mark.line + 1
        else:
            lines[(path[0], ".".join(path[1:]))] = key.start_mark.line + 1
        key_lines(value, path, lines)
    return lines


def check_defaults(presets):
    """`defaults` declares every key and is a valid run by itself: every SCHEMA key present (a file
    cut short lacks the last ones), every value valid."""
    flat = tools.flatten(presets["defaults"])
    missing = [key for key in SCHEMA if key not in flat]
    if missing:
        last = max((line for (name, _), line in presets.lines.items() if name == "defaults"), default=1)
        raise tools.ConfigError(f"{presets.path.name}:{last}: defaults lacks '{missing[0]}'"
                                + (f" and {len(missing) - 1} more keys" if len(missing) > 1 else "")
                                + f" (cut short?); every key needs a default (restore: git checkout "
                                  f"{presets.path.name})")
    try:
        check_choices(flat)
        check_ranges(tools.flatten(normalise(presets["defaults"])))
    except InvalidValue as e:
        raise tools.ConfigError(f"{presets.where('defaults', e.key)}: {e}") from None


def check_preset(presets, name):
    """Every key of a preset is a key of `defaults`, of its default's type, and one of its choices."""
    defaults = tools.flatten(presets["defaults"])
    for key, value in tools.flatten(presets[name]).items():
        where = presets.where(name, key)
        if key not in defaults:
            if any(k.startswith(key + ".") for k in defaults):
                raise tools.ConfigError(f"{where}: '{key}' in preset '{name}' is a group; give its keys "
                                        f"({', '.join(k for k in defaults if k.startswith(key + '.'))[:80]}...)")
            raise tools.ConfigError(f"{where}: unknown key '{key}' in preset '{name}' "
                                    f"(closest valid: {closest(key, list(defaults))})")
        row = SCHEMA.get(key, Key())
        if row.choices:
            if value not in row.choices:
                raise tools.ConfigError(f"{where}: invalid value '{value}' for '{key}' in preset '{name}'; "
                                        f"valid: {', '.join(map(str, row.choices))}")
            continue
        expected = expected_type(defaults[key], row)
        if expected and not expected[0](value):
            raise tools.ConfigError(f"{where}: invalid value {value!r} for '{key}' in preset '{name}': "
                                    f"expected {expected[1]} (its default is {defaults[key]!r})")


def expected_type(default, row=None):
    """(test, description) of the values a key with this default takes; None for any (a null default)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if row is not None and row.auto:
        return (lambda v: v == "auto" or number(v), "auto or a number")
    if isinstance(default, bool):
        return (lambda v: isinstance(v, bool), "True or False")
    if number(default):
        return (number, "a number")
    if isinstance(default, list):
        return (lambda v: isinstance(v, list), "a list, e.g. [64, 64]")
    if isinstance(default, str):  # some text keys also take a number (actor.std)
        return (lambda v: isinstance(v, str) or number(v), "text")
    return None


def merge(base, update):
    """Recursive merge: nested groups merge key by key, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def at_least(low):
    """A range predicate (value, flat config) -> whether value >= low."""
    return lambda v, flat: v >= low


def positive(v, flat):
    """A range predicate: value > 0."""
    return v > 0


def fraction(v, flat):
    """A range predicate: value in [0, 1]."""
    return 0 <= v <= 1


def valid_regex(text):
    try:
        re.compile(text)
    except (re.error, TypeError):
        return False
    return True


class Key(typing.NamedTuple):
    """A row of SCHEMA: what a key takes beyond the type of its default."""

    choices: tuple = ()  # the valid values, in the order errors list them
    range: tuple = None  # (predicate(value, flat config), what is valid): checked after the choices
    whole: bool = False  # a whole number: 1e6 in YAML becomes an integer, 1.5 is refused
    auto: bool = False  # a whole number or 'auto' (settled by resources.Resources)
    free: bool = False  # may differ between a run and its resumption without a warning
    size: bool = False  # sets the width of a network (named when the model does not fit, dreamer.check_memory)


def offline(flat):
    """Offline training and --eval_only collect nothing, so they may run with --envs 0."""
    return bool(flat.get("offline_traindir")) or bool(flat.get("eval_only"))


def learning_rate(v, flat):
    """Every optimizer is adaptive (optim.OPTIMIZERS), so an update moves each weight by about the
    learning rate: above 1 the weights overflow within a few updates."""
    return 0 < v <= 1


def plan2explore_offset(v, flat):
    """The ensemble predicts the step `v` ahead within a replayed sequence; read by Plan2Explore only."""
    return v >= 0 and (flat.get("expl_behavior") != "plan2explore" or v < flat.get("batch_length", v + 1))


WHOLE = "a whole number >= {}"
REGEX = (lambda v, flat: valid_regex(v), "a regular expression")
LR = (learning_rate, "a number in (0, 1] (a step size of adaptive optimizers)")
UNIMIX = (lambda v, flat: 0 <= v < 1, "a number in [0, 1)")

# Checked in this order (the first invalid value is the error): the networks' keys, the update's,
# exploration's, the suites', the environments' and the run's own, each group as its reader lists them.
SCHEMA = {
    # networks.py
    "act": Key(choices=tuple(networks.ACTIVATIONS)),
    "encoder.act": Key(choices=tuple(networks.ACTIVATIONS)),
    "decoder.act": Key(choices=tuple(networks.ACTIVATIONS)),
    "norm": Key(choices=networks.NORMS),
    "encoder.norm": Key(choices=networks.NORMS),
    "decoder.norm": Key(choices=networks.NORMS),
    "winit": Key(choices=networks.WINITS),
    "initial": Key(choices=("learned", "zeros")),
    "dyn_cell": Key(choices=("gru", "blockgru")),
    "dyn_mean_act": Key(choices=networks.MEAN_ACTS),
    "dyn_std_act": Key(choices=tuple(networks.STD_ACTS)),
    "encoder.cnn": Key(choices=tuple(networks.IMAGE_ENCODERS)),
    "decoder.cnn": Key(choices=("transposed", "upsample")),
    "decoder.vector_dist": Key(choices=tuple(networks.VECTOR_DISTS)),
    "actor.dist": Key(choices=("auto", *networks.ACTOR_DISTS)),  # auto: settled by compilation.resolve_auto
    "dyn_img_layers": Key(range=(at_least(1), WHOLE.format(1))),
    "dyn_blocks": Key(range=(lambda v, flat: v >= 1 and (flat.get("dyn_cell") != "blockgru"
                                                         or flat.get("dyn_deter", v) % v == 0),
                             "a whole number >= 1 that divides --dyn_deter")),
    "unimix_ratio": Key(range=UNIMIX),
    "actor.unimix_ratio": Key(range=UNIMIX),
    "dyn_hidden": Key(range=(at_least(1), WHOLE.format(1)), size=True),
    "dyn_deter": Key(range=(at_least(1), WHOLE.format(1)), size=True),
    "dyn_stoch": Key(range=(at_least(1), WHOLE.format(1)), size=True),
    "dyn_discrete": Key(range=(at_least(0), "a whole number >= 0 (0 for Gaussian latents)"), size=True),
    "dyn_rec_depth": Key(range=(at_least(1), WHOLE.format(1))),
    "units": Key(range=(at_least(1), WHOLE.format(1)), size=True),
    "actor.min_std": Key(range=(positive, "a number > 0")),
    "actor.absmax": Key(range=(at_least(0), "a number >= 0 (0 for unbounded samples)")),
    "actor.max_std": Key(range=(lambda v, flat: v >= flat.get("actor.min_std", 0), "a number >= --actor.min_std")),
    "dyn_min_std": Key(range=(at_least(0), "a number >= 0")),
    "encoder.cnn_depth": Key(range=(at_least(1), WHOLE.format(1)), size=True),
    "decoder.cnn_depth": Key(range=(at_least(1), WHOLE.format(1)), size=True),
    "encoder.minres": Key(range=(at_least(1), WHOLE.format(1))),
    "decoder.minres": Key(range=(at_least(1), WHOLE.format(1))),
    "encoder.mlp_units": Key(range=(at_least(1), WHOLE.format(1)), size=True),
    "decoder.mlp_units": Key(range=(at_least(1), WHOLE.format(1)), size=True),
    "encoder.mlp_keys": Key(range=REGEX),
    "encoder.cnn_keys": Key(range=REGEX),
    "decoder.mlp_keys": Key(range=REGEX),
    "decoder.cnn_keys": Key(range=REGEX),
    # models.py; compiling computes the same update, so compile may change on resume
    "precision": Key(choices=precision.PRECISIONS),
    "opt": Key(choices=tuple(optim.OPTIMIZERS)),
    "update": Key(choices=tuple(models.UPDATES)),
    "compile": Key(choices=("auto", *compilation.COMPILERS), free=True),
    "imag_gradient": Key(choices=("auto", "dynamics", "reinforce", "both")),
    "critic.dist": Key(choices=networks.Head.VALUE_DISTS),
    "reward_head.dist": Key(choices=networks.Head.VALUE_DISTS),
    "replay_context": Key(range=(at_least(0), "a whole number >= 0 (0 for none)"), whole=True),
    "model_lr": Key(range=LR),
    "opt_eps": Key(range=(positive, "a number > 0")),
    "actor.lr": Key(range=LR),
    "actor.eps": Key(range=(positive, "a number > 0")),
    "critic.lr": Key(range=LR),
    "critic.eps": Key(range=(positive, "a number > 0")),
    "weight_decay": Key(range=(at_least(0), "a number >= 0")),
    "grad_clip": Key(range=(at_least(0), "a number >= 0 (0 for none)")),
    "actor.grad_clip": Key(range=(at_least(0), "a number >= 0 (0 for none)")),
    "critic.grad_clip": Key(range=(at_least(0), "a number >= 0 (0 for none)")),
    "agc": Key(range=(at_least(0), "a number >= 0 (0 for none)")),
    "warmup": Key(range=(at_least(0), WHOLE.format(0))),
    "critic.repval": Key(range=(at_least(0), "a number >= 0")),
    "discount": Key(range=(lambda v, flat: 0 < v <= 1, "a number in (0, 1]")),
    "discount_lambda": Key(range=(fraction, "a number in [0, 1]")),
    "imag_horizon": Key(range=(at_least(1), WHOLE.format(1))),
    "imag_gradient_mix": Key(range=(fraction, "a number in [0, 1]")),
    "kl_free": Key(range=(at_least(0), "a number >= 0")),
    "dyn_scale": Key(range=(at_least(0), "a number >= 0")),
    "rep_scale": Key(range=(at_least(0), "a number >= 0")),
    "critic.slow_target_update": Key(range=(at_least(1), WHOLE.format(1))),
    "critic.slow_target_fraction": Key(range=(lambda v, flat: 0 < v <= 1, "a number in (0, 1]")),
    "actor.entropy": Key(range=(at_least(0), "a number >= 0")),
    "reward_head.loss_scale": Key(range=(at_least(0), "a number >= 0")),
    "cont_head.loss_scale": Key(range=(at_least(0), "a number >= 0")),
    # exploration.py
    "expl_behavior": Key(choices=tuple(exploration.BEHAVIORS)),
    "disag_target": Key(choices=exploration.Plan2Explore.TARGETS),
    "expl_until": Key(range=(at_least(0), WHOLE.format(0)), whole=True),
    # the variance across members is unbiased over K - 1 of them (exploration.Plan2Explore.disagreement)
    "disag_models": Key(range=(at_least(2), "a whole number >= 2 (disagreement needs two members or more)")),
    "disag_units": Key(range=(at_least(1), WHOLE.format(1)), size=True),
    "disag_offset": Key(range=(plan2explore_offset, "a whole number >= 0, below --batch_length with plan2explore")),
    # envs/: atari's
    "lives": Key(choices=("unused", "discount", "reset")),
    "resize": Key(choices=("opencv", "pillow")),
    "actions": Key(choices=("all", "needed")),
    # parallel.py: where and how the environments run, not what they are, may change on resume
    "env_failure": Key(choices=("restart", "stop"), free=True),
    "parallel": Key(choices=("auto", True, False), free=True),  # auto: settled by resources.Resources
    # logs.py: where the metrics go, not what they are, may change on resume
    "logger": Key(free=True),
    "wandb.project": Key(free=True),
    "wandb.entity": Key(free=True),
    "wandb.group": Key(free=True),
    "wandb.name": Key(free=True),
    "wandb.tags": Key(free=True),
    # the run's own (dreamer.py): its budget, schedules, device, replay and loops
    "prefill_policy": Key(choices=("random", "agent")),  # dreamer.PREFILLS, which this module cannot import
    "steps": Key(range=(at_least(0), WHOLE.format(0)), whole=True, free=True),
    "seed": Key(range=(lambda v, flat: isinstance(v, int) and 0 <= v < 2**31, "a whole number in [0, 2^31)")),
    # seeds.py: more seeds on a rerun add runs, fewer leave the others' folders as they are
    "seeds": Key(range=(at_least(1), "a whole number >= 1 (the seeds seed .. seed + seeds - 1, in one process)"),
                 whole=True, free=True),
    "envs": Key(range=(lambda v, flat: v == "auto" or (isinstance(v, int) and v >= (0 if offline(flat) else 1)),
                       "auto or a whole number >= 1 (0 only with --offline_traindir or --eval_only)"),
                whole=True, auto=True),
    "action_repeat": Key(range=(at_least(1), WHOLE.format(1)), whole=True),
    "size": Key(range=(lambda v, flat: len(v) == 2 and all(isinstance(x, int) and x >= 1 for x in v),
                       "two whole numbers >= 1, e.g. 64,64")),
    "time_limit": Key(range=(at_least(0), "a whole number >= 0 (0 for none)"), whole=True),
    "prefill": Key(range=(at_least(0), WHOLE.format(0)), whole=True),
    "pretrain": Key(range=(at_least(0), WHOLE.format(0)), whole=True),
    "eval_every": Key(range=(at_least(0), WHOLE.format(0)), whole=True, free=True),
    # parallel.py reads env_timeout; here, it keeps its place in the order of the checks
    "env_timeout": Key(range=(positive, "a number > 0 (seconds)"), free=True),
    "save_every": Key(range=(at_least(0), "a number >= 0 (seconds; 0 for only at evaluations and the end)"),
                      free=True),
    "chunk_size": Key(range=(lambda v, flat: isinstance(v, int) and v >= 0,
                             "a whole number >= 0 (0 for whole episodes only)"), free=True),
    "eval_episode_num": Key(range=(at_least(0), WHOLE.format(0)), whole=True, free=True),
    "log_every": Key(range=(at_least(0), WHOLE.format(0)), whole=True, free=True),
    "noops": Key(range=(at_least(0), WHOLE.format(0))),
    "dataset_size": Key(range=(at_least(1), WHOLE.format(1)), whole=True),
    "batch_size": Key(range=(at_least(1), WHOLE.format(1)), whole=True),
    "batch_length": Key(range=(at_least(1), WHOLE.format(1)), whole=True),
    "train_ratio": Key(range=(positive, "a number > 0")),
    # Below one update of tolerance the learner and the actor can wait on each other for ever.
    "ratio_tolerance": Key(range=(at_least(1), "a number >= 1 (updates)"), free=True),
    "actor_sync_every": Key(range=(at_least(1), WHOLE.format(1)), whole=True, free=True),
    "asynchronous": Key(range=(lambda v, flat: not (v and flat.get("offline_traindir") and not flat.get("eval_only")),
                               "False with --offline_traindir (no environments for an actor to act in)"), free=True),
    "eval_only": Key(free=True),
    "device": Key(free=True),
    "logdir": Key(free=True),
    "replay_device": Key(free=True),
    "video_pred_log": Key(free=True),
}


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


def parse(argv, presets=None):
    """Command line -> the run's Config: defaults, then --configs presets in order, then --key value
    flags. Every value is checked here, once, against SCHEMA (a key whose choices include True may
    stand alone as a flag)."""
    presets = presets if presets is not None else load_presets()
    parser = argparse.ArgumentParser(add_help=False)
    # --configs a b --configs c stacks a, b, c: presets are merged in the order given, wherever given.
    parser.add_argument("--configs", nargs="+", action="extend", default=[])
    args, rest = parser.parse_known_args(argv)
    config = presets["defaults"]
    for name in args.configs:
        if name not in presets:
            raise tools.ConfigError(f"Unknown preset '{name}' (closest: {closest(name, list(presets))}); "
                                    f"valid: {', '.join(presets)}")
        config = merge(config, presets[name])
    flat = tools.flatten(config)
    overrides, i = {}, 0
    while i < len(rest):
        flag = rest[i]
        if not flag.startswith("--"):
            raise tools.ConfigError(f"Unexpected argument '{flag}'; flags look like --key value")
        key = flag[2:]
        value = None
        if "=" in key:
            key, value = key.split("=", 1)
        if key not in flat:
            valid = [f"--{k}" for k in flat]
            raise tools.ConfigError(f"Unknown config key '--{key}' (closest: {closest('--' + key, valid)})")
        row = SCHEMA.get(key, Key())
        if value is None:
            takes_value = i + 1 < len(rest) and not rest[i + 1].startswith("--")
            if (isinstance(flat[key], bool) or True in row.choices) and not takes_value:
                value = "true"
            elif not takes_value:
                raise tools.ConfigError(f"Missing value for --{key}")
            else:
                value, i = rest[i + 1], i + 1
        try:
            if row.choices:
                overrides[key] = parse_choice(value, row.choices)
            elif row.auto:
                overrides[key] = parse_count_or_auto(value)
            else:
                overrides[key] = parse_value(value, flat[key])
        except ValueError as e:
            raise tools.ConfigError(f"Invalid value '{value}' for --{key}{'; ' if row.choices else ': '}{e}") from None
        i += 1
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    try:
        check_choices(tools.flatten(config))
        config = normalise(config)
        check_ranges(tools.flatten(config))
    except InvalidValue as e:
        # A value from configs.yaml, not the command line: name the line of the last preset that set it.
        setters = [name for name in ["defaults", *args.configs] if e.key in tools.flatten(presets[name])]
        if e.key in overrides or not setters or not isinstance(presets, Presets):
            raise
        setter = "defaults" if setters[-1] == "defaults" else f"preset '{setters[-1]}'"
        raise tools.ConfigError(f"{presets.where(setters[-1], e.key)}: {e} (set by {setter})") from None
    return tools.Config(config)


class InvalidValue(tools.ConfigError):
    """A value SCHEMA refuses, with its key (parse names the configs.yaml line that set it)."""

    def __init__(self, message, key):
        super().__init__(message)
        self.key = key


def check_choices(flat):
    for key, valid in ((key, row.choices) for key, row in SCHEMA.items() if row.choices):
        if key in flat and flat[key] not in valid:
            raise InvalidValue(f"Invalid value '{flat[key]}' for --{key}; valid: {', '.join(map(str, valid))}", key)


def check_ranges(flat):
    for key, (valid, description) in ((key, row.range) for key, row in SCHEMA.items() if row.range):
        if key not in flat:
            continue
        try:
            ok = valid(flat[key], flat)
        except TypeError:  # text where a number belongs (discount: high in configs.yaml)
            ok = False
        if not ok:
            value = ",".join(map(str, flat[key])) if isinstance(flat[key], list) else flat[key]
            raise InvalidValue(f"Invalid value '{value}' for --{key}; valid: {description}", key)


# The largest count a run takes: frames, steps and sizes are int64 in numpy and torch and pass through
# float64 rates, which hold whole numbers exactly up to 2^53; --steps 1e30 is refused at start.
LARGEST_COUNT = 2**53


def normalise(config):
    """Counts written as 1e6 in YAML become integers, each at most LARGEST_COUNT."""
    config = copy.deepcopy(config)
    for key in (key for key, row in SCHEMA.items() if row.whole):
        value = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, float):
            if not value.is_integer():
                raise InvalidValue(f"Invalid value '{value}' for --{key}: expected a whole number", key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if abs(value) > LARGEST_COUNT:
                raise InvalidValue(f"Invalid value '{value:.3g}' for --{key}: at most 2^53 "
                                   f"({LARGEST_COUNT:.3g}; a 64-bit counter and float64 rates hold no more)", key)
            if "." not in key:
                config[key] = int(value)
    return config


def compare_saved_config(config, path):
    """Warnings for keys that differ from the run's saved config (but those SCHEMA marks free, which
    may differ between a run and its resumption); a different task is an error."""
    from ruamel.yaml import YAML

    try:
        saved = YAML(typ="safe", pure=True).load(path.read_text())
    except Exception as e:  # noqa: BLE001 - any parse error: the file is unusable
        raise tools.ConfigError(f"Cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                                "fix or delete it (this run's settings are the command line)") from None
    if not isinstance(saved, dict):
        raise tools.ConfigError(f"Cannot read {path}: expected a mapping of config keys; fix or delete it")
    saved = tools.flatten(saved)
    current = tools.flatten(config.to_dict())
    if saved.get("task") != current["task"]:
        raise tools.ConfigError(f"--task {current['task']} differs from this run's task '{saved.get('task')}' "
                                f"(saved in {path}); use another --logdir for another task")
    # 'auto' settles the same way for the same task, into the value the saved config holds.
    return [f"{key}: {saved.get(key)!r} -> {value!r}" for key, value in current.items()
            if not SCHEMA.get(key, Key()).free and value != "auto" and saved.get(key) != value]


def config_reference(path=None, sections=False):
    """Every key of `defaults` in configs.yaml with its default as written and its comment (the
    comment lines below a key continue it): [(dotted key, default, comment)], in file order. The
    file is the reference; `python3 dreamer.py --help` prints this, so the two cannot drift. With
    `sections`, each row ends with its section's heading (the `# --- run ---` lines)."""
    rows, parents, inside, section = [], [], False, ""
    for line in pathlib.Path(CONFIG_FILE if path is None else path).read_text().splitlines():
        heading = re.fullmatch(r"  # --- (.+) ---", line)
        if inside and heading:
            section = heading.group(1)
            continue
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
                rows[-1] = (*rows[-1][:2], rows[-1][2] + " " + line.strip()[1:].strip(), *rows[-1][3:])
            continue
        key, _, value = text.partition(":")
        depth = indent // 2 - 1  # defaults' own keys are indented by 2
        parents = parents[:depth]
        if not value.strip():  # a group: its keys follow, indented
            parents.append(key.strip())
            continue
        rows.append((".".join([*parents, key.strip()]), value.strip(), comment.strip(), section))
    return rows if sections else [row[:3] for row in rows]


def config_help(topic=None):
    """The lines of `--help [TOPIC]`: every key with its default and comment (config_reference),
    those starting with TOPIC (a group or key prefix) when given; an unknown TOPIC is a ConfigError."""
    rows = config_reference(sections=True)
    if topic is not None:
        rows = [row for row in rows if row[0].startswith(topic)]
        if not rows:
            groups = sorted({key.split(".")[0] for key, _, _ in config_reference() if "." in key})
            raise tools.ConfigError(f"No config key starts with '{topic}' and no preset is called so; groups: "
                                    f"{', '.join(groups)} (or any key prefix, e.g. dyn_, or a preset, e.g. debug)")
    width = max(len(f"--{key} {default}") for key, default, _, _ in rows) + 2
    lines, section = [], None
    for key, default, comment, heading in rows:
        if topic is None and heading != section:  # configs.yaml's sections, as headings of the full list
            lines += [*([""] if lines else []), f"{heading}:"]
            section = heading
        lines.append(f"  {f'--{key} {default}':<{width}}{comment}")
    return lines


def preset_help(name, presets=None):
    """The lines of `--help PRESET`: every key the preset sets, its value and the default it replaces."""
    presets = load_presets() if presets is None else presets
    defaults = tools.flatten(presets["defaults"])
    rows = [(f"--{key} {format_value(value)}", f"(default {format_value(defaults.get(key))})")
            for key, value in tools.flatten(presets[name]).items()]
    width = max((len(flag) for flag, _ in rows), default=0) + 2
    return [f"Preset {name} ({presets.where(name)}) sets {len(rows)} keys over defaults:",
            *[f"  {flag:<{width}}{note}" for flag, note in rows]]


def format_value(value):
    """A value as a flag takes it: lists comma-separated."""
    if isinstance(value, list):
        return ",".join(map(format_value, value))
    return str(int(value)) if isinstance(value, float) and value.is_integer() and abs(value) >= 1e3 else str(value)


def _split_comment(line):
    """'key: value  # comment' -> ('key: value', '#', 'comment'); a '#' inside quotes is text."""
    quote = None
    for i, char in enumerate(line):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (i == 0 or line[i - 1] == " "):
            return line[:i].strip(), "#", line[i + 1:]
    return line.strip(), "", ""


def print_config(argv):
    """--print_config: the settled config as YAML (presets stacked, overrides applied, the task
    spelled canonically, --device auto and, on CUDA, --compile auto settled), from the same checks
    as a run's start; it builds nothing and writes nothing. The keys still 'auto' settle from what
    only the built run knows (the action space, measured costs, the model's size), as listed."""
    from ruamel.yaml import YAML

    config = check_tasks(parse(argv))
    check_text(config)
    config, device_note = launch.resolve_device(config)
    if config.compile == "auto" and torch.device(config.device).type == "cuda":
        config = config.replace(compile=compilation.compile_choice(config, None)[0])
    buffer, yaml = io.StringIO(), YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    yaml.dump(config.to_dict(), buffer)
    left = [key for key, value in tools.flatten(config.to_dict()).items() if value == "auto"]
    header = [f"# The settled config of: python3 dreamer.py {' '.join(argv)}".rstrip()]
    if device_note:
        header.append(f"# device: {config.device} ({device_note})")
    if left:
        header.append(f"# still auto, settled when the run is built: {', '.join(left)}")
    return "\n".join(header) + "\n" + buffer.getvalue().rstrip("\n")


def save_config(config, path):
    """The run's config as the logdir's config.yaml, atomically (compare_saved_config reads it back)."""
    from ruamel.yaml import YAML

    buffer = io.StringIO()
    YAML(typ="safe", pure=True).dump(config.to_dict(), buffer)
    storage.atomic_write_bytes(path, buffer.getvalue().encode())


# ==================================================================================================
# Argument checks and usage: what parse cannot know, before any file is written
# ==================================================================================================


def check_text(config):
    """Every text value must be UTF-8: config.yaml, the logs and TensorBoard's writer store them as
    such (a folder name from bytes that are not UTF-8 reaches Python as lone surrogates)."""
    for key, value in tools.flatten(config.to_dict()).items():
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raw = os.fsencode(text)
                raise tools.ConfigError(f"Invalid value {raw!r} for --{key}: not UTF-8 text; give a name in UTF-8 "
                                        "(config.yaml, the logs and TensorBoard store it as such)") from None


def check_processes(config):
    """Modes not yet supported under torchrun: one line before any process group starts."""
    if launch.torchrun_rank() is None:
        return
    for key in ("eval_only", "offline_traindir", "asynchronous"):
        if getattr(config, key, None):
            raise tools.ConfigError(f"--{key} is not supported with torchrun yet; run it as one process "
                                    "(python3 dreamer.py ...)")
    for key in ("envs", "parallel"):  # every rank must collect alike: one measurement would not do for all
        if getattr(config, key, None) == "auto":
            raise tools.ConfigError(f"--{key} auto is not supported with torchrun yet; give --{key} a value")


def check_logdir(logdir):
    """The logdir must be a folder, or creatable, and writable: probed with a temporary file that
    is removed again, because permission bits say nothing for root or read-only mounts."""
    try:  # a name the file system refuses (ENAMETOOLONG), a symlink loop (ELOOP, which resolve raises)
        logdir.resolve(strict=False)
        logdir.exists()
    except (RuntimeError, OSError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise tools.ConfigError(f"Invalid value '{logdir}' for --logdir: the folder cannot be created ({reason}); "
                                "choose a shorter path, or one without a symbolic link that points back into itself"
                                ) from None
    if logdir.exists() and not logdir.is_dir():
        raise tools.ConfigError(f"Invalid value '{logdir}' for --logdir: it is a file, not a folder")
    existing = next(p for p in (logdir, *logdir.parents) if p.exists())
    if not existing.is_dir():
        raise tools.ConfigError(f"Invalid value '{logdir}' for --logdir: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise tools.ConfigError(f"Invalid value '{logdir}' for --logdir: cannot write in {existing} "
                                f"({e.strerror or e})") from None


def check_tasks(config):
    """--task names one task or several, comma-separated, each known to its suite; a run of several
    needs a training environment per task. Returns the config with its task spelled canonically
    (no spaces), as saved."""
    tasks = envs.parse_tasks(config.task)
    for task in tasks:
        envs.check_task(task)
    if (len(tasks) > 1 and not offline(tools.flatten(config.to_dict())) and isinstance(config.envs, int)
            and config.envs < len(tasks)):
        raise tools.ConfigError(f"Invalid value '{config.envs}' for --envs: {len(tasks)} tasks need at least one "
                                f"training environment each; valid: a whole number >= {len(tasks)}")
    return config.replace(task=",".join(tasks))


def check_offline_traindir(config):
    if not config.offline_traindir:
        return
    folder = pathlib.Path(config.offline_traindir).expanduser()
    if not folder.is_dir() or not any(folder.glob("*.npz")):
        raise tools.ConfigError(f"Invalid value '{config.offline_traindir}' for --offline_traindir: "
                                f"{'no episode files (*.npz) in it' if folder.is_dir() else 'no such folder'}")


def fail(message):
    print(f"error: {shorten_values(message)}", file=sys.stderr)
    sys.exit(2)


def shorten_values(message, keep=60):
    """A message with every quoted value longer than `keep` characters cut to its start and length:
    a 100 KB --task is named, not echoed."""
    return re.sub(r"(?<!\w)'([^']{%d,})'(?!\w)" % (keep + 20),
                  lambda m: f"'{m.group(1)[:keep]}...' ({len(m.group(1)):,} characters)", message)


def usage(topic=None):
    """--help [TOPIC]: how to call the script, the presets, and every key with its default and its
    comment from configs.yaml (config_reference); TOPIC, a group or key prefix such as
    `actor` or `dyn_`, narrows the keys."""
    loaded = load_presets()
    presets = [name for name in loaded if name != "defaults"]
    if topic in presets:
        return "\n".join(preset_help(topic, loaded))
    lines = config_help(topic)
    if topic is not None:
        return "\n".join(lines)
    return "\n".join([
        "usage: python3 dreamer.py [--configs PRESET ...] --logdir DIR [--KEY VALUE ...]",
        "       python3 dreamer.py --help [TOPIC]   (TOPIC: a group or key prefix, e.g. actor, dyn_; or a preset,",
        "                                           e.g. debug: what it sets)",
        "       python3 dreamer.py [--configs PRESET ...] [--KEY VALUE ...] --print_config   (the settled config",
        "                                           as YAML; starts nothing, writes nothing)",
        "",
        "DreamerV3 training script: the one entry point.",
        "",
        "Presets (merged in the order given, over `defaults`; --configs a --configs b is --configs a b): "
        + ", ".join(presets),
        f"Every key of {CONFIG_FILE.name} is a flag: --task dmc_walker_walk, --actor.lr 1e-4, --size 64,64;",
        "a boolean flag alone means True. Rerunning the same command resumes the run in --logdir.",
        "",
        f"Keys, with their defaults (from {CONFIG_FILE.name}, the reference):",
        *lines,
    ])


# ==================================================================================================
# The start-up summary
# ==================================================================================================


def summary(config, agent, device_note, resumed_step, ranks=None, weights=None, resolved=None, spec=None):
    """The start-up summary: what runs where, what differs from defaults, how big the model is and,
    given the stored step's `spec` (storage.episode_spec with the replay context's latents), what the
    run will cost. `weights`: the task weights the training environments were made with
    (Resources.weights()); `resolved`: the keys that were 'auto' (compilation.resolve_auto; by default
    those the agent settled)."""
    resolved = agent.resolved if resolved is None else resolved
    defaults = tools.flatten(load_presets()["defaults"])
    changed = {k: v for k, v in tools.flatten(config.to_dict()).items() if defaults.get(k) != v and k not in resolved}
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    params = {"world model": count(agent.wm), "actor": count(agent.task_behavior.actor),
              "critic": count(agent.task_behavior.critic)}
    if agent.expl_behavior is not None:
        params["exploration"] = count(agent.expl_behavior)
    tasks = envs.parse_tasks(config.task)
    several = len(tasks) > 1 and config.envs >= len(tasks)  # offline runs of several have no assignment
    per_task = collections.Counter(envs.task_assignment(tasks, "train", config.envs, weights)) if several else {}
    lines = [
        f"Task: {config.task}" + (" (training environments per task: "
                                  + ", ".join(str(per_task[i]) for i in range(len(tasks))) + "; action size "
                                  f"{agent.act_size}, the widest task's)" if per_task else ""),
        f"Device: {config.device}" + (f" ({device_note})" if device_note else ""),
        "Compile: " + compile_note(config, resolved.get("compile")),
        "Precision: " + precision.precision_note(config),
        "Actor: " + actor_note(config, resolved),
        f"Environments: {config.envs} ({'parallel processes' if config.parallel else 'in-process'})"
        + (" per process" if ranks is not None and ranks.world_size > 1 else ""),
        *([f"Processes: {ranks.describe()}; envs and batch_size are per process"]
          if ranks is not None and ranks.world_size > 1 else []),
        f"Logdir: {config.logdir}",
        "Run: " + (f"resumed from frame {resumed_step}" if resumed_step is not None else "new"),
        "Parameters: " + ", ".join(f"{k} {v:,}" for k, v in params.items()),
        *(storage.cost_lines(config, spec) if spec is not None else []),
        "Changed from defaults: " + (", ".join(f"{k}={v}" for k, v in changed.items()) or "none"),
    ]
    return "\n".join(lines)


def compile_note(config, auto=None):
    """What `compile` runs, what it gains and costs, and with `auto` (compilation.compile_choice's reason;
    None when the value was asked for) why it settled so."""
    if not config.compile:
        return f"off (auto: {auto}; --compile update compiles)" if auto is not None else "off"
    cpu = torch.device(config.device).type == "cpu"
    if config.compile is True:
        what, other = "on, step by step", "--compile update compiles the whole update"
        gain = "on a CPU measured 1.1-1.6x faster per update after a warm-up of one to several minutes"
    else:
        what = "on, the whole update" + ("" if cpu else " as CUDA graphs")
        other = "--compile True compiles step by step"
        gain = ("on a CPU measured 1.83x faster per update (recipe2024 size1m; v1's default size 1.13x) after a "
                "warm-up of about 5 minutes")
    gain = gain if cpu else "the first updates include compilation"
    reason = f"auto: {auto}; " if auto is not None else ""
    # The one compile-failure policy (compilation.CompileError): what cannot be compiled is an error.
    return f"{what} ({reason}{gain}; {other}; --compile False turns it off; a failure to compile stops the run)"


def actor_note(config, resolved):
    """The actor's distribution and gradient, and whether they were chosen from the action space."""
    auto = [key for key in ("actor.dist", "imag_gradient") if key in resolved]
    note = f"{config.actor.dist} distribution, {config.imag_gradient} gradient"
    return note + (f" ({' and '.join(auto)} auto: from the action space)" if auto else "")
