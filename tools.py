"""Shared building blocks, in six sections (in this order):

1. Distributions: symlog/symexp, two-hot, one-hot with unimix, bounded normal, MSE heads.
2. Replay: episode files written atomically as .npz (in chunks while an episode runs), and the
   sequence replay buffer.
3. Logging: TensorBoard, metrics.jsonl, metrics.csv and W&B back ends, videos, atomic checkpoint
   files, write errors.
4. Schedules: the counters that decide when to train, log and evaluate, the checkpoint clock, and
   the asynchronous loop's samples-per-insert rate limiter.
5. Processes: one training process, or one of several started by torchrun (data parallel), and
   the stops and saves they agree on.
6. Configuration: the read-only Config, presets, command-line parsing and checks, the saved config.

Nothing here knows about the world model or the environments.
"""

import argparse
import collections
import contextlib
import copy
import ctypes
import datetime
import difflib
import errno
import io
import itertools
import json
import math
import os
import pathlib
import pickle
import random
import re
import signal
import sys
import threading
import time
import uuid
import warnings

import numpy as np
import torch
import torch.nn.functional as F

# ==================================================================================================
# 1. Distributions
# ==================================================================================================


def symlog(x):
    return torch.sign(x) * torch.log1p(x.abs())


def symexp(x):
    return torch.sign(x) * torch.expm1(x.abs())


class TwoHot:
    """Categorical over `bins` two-hot bins (Eq. 9-10 of the paper).

    squash True (the paper's 'symlog_disc'): bins equally spaced in symlog space from low to
    high; the prediction is symexp(E[bin]) and the loss the cross-entropy against the two-hot
    encoding of symlog(target). squash False (the 2024 recipe's 'symexp_twohot'): the bins
    themselves are symexp-spaced (symexp_bins), prediction E[bin] and target encoded as is.
    """

    def __init__(self, logits, low=-20.0, high=20.0, squash=True):
        logits = logits.float()  # distribution parameters in float32 also under autocast (official code)
        self.logits = logits  # (..., bins)
        self.log_probs = torch.log_softmax(logits, -1)
        self.squash = squash
        if squash:
            bins = torch.linspace(low, high, logits.shape[-1], device=logits.device)
            if low == -high:  # exactly antisymmetric, with an exact 0 in the middle
                bins = (bins - bins.flip(0)) / 2
        else:
            bins = symexp_bins(logits.shape[-1], high, logits.device)
        self.bins = bins

    def mean(self):  # (...)
        probs = self.log_probs.exp()
        n = probs.shape[-1]
        if n % 2 == 1:
            # Add mirrored bins first, so that uniform probabilities predict exactly 0.
            m = n // 2
            lower = (probs[..., :m] * self.bins[:m]).flip(-1)
            upper = probs[..., m + 1:] * self.bins[m + 1:]
            expected = (lower + upper).sum(-1) + probs[..., m] * self.bins[m]
        else:
            expected = (probs * self.bins).sum(-1)
        return symexp(expected) if self.squash else expected

    mode = mean

    def log_prob(self, value):  # value: (...) -> (...)
        value = value.float()
        target = twohot_encode(symlog(value) if self.squash else value, self.bins)
        return (target * self.log_probs).sum(-1)


def symexp_bins(num, high=20.0, device=None):
    """`num` bins at symexp of points equally spaced in [-high, high], exactly antisymmetric
    (with an exact 0 in the middle when num is odd)."""
    half = symexp(torch.linspace(-high, 0.0, (num + 1) // 2 if num % 2 else num // 2, device=device))
    mirror = -half[:-1].flip(0) if num % 2 else -half.flip(0)
    return torch.cat([half, mirror])


def twohot_encode(x, bins):
    """Two-hot target (..., bins) for values x (...) already in bin space."""
    num = len(bins)
    below = ((bins <= x[..., None]).sum(-1) - 1).clamp(0, num - 1)
    above = (num - (bins > x[..., None]).sum(-1)).clamp(0, num - 1)
    equal = below == above
    dist_below = torch.where(equal, 1.0, (bins[below] - x).abs())
    dist_above = torch.where(equal, 1.0, (bins[above] - x).abs())
    total = dist_below + dist_above
    return (F.one_hot(below, num) * (dist_above / total)[..., None]
            + F.one_hot(above, num) * (dist_below / total)[..., None])


class SymlogMSE:
    """Regression in symlog space: the network predicts symlog(x)."""

    def __init__(self, pred, dims=1):
        self.pred = pred.float()
        self.dims = tuple(range(-dims, 0))

    def mode(self):
        return symexp(self.pred)

    mean = mode

    def log_prob(self, value):
        error = (self.pred - symlog(value)) ** 2
        return -error.sum(self.dims) if self.dims else -error


class MSE:
    """Plain squared error, summed over the event dims (used for images in [0, 1])."""

    def __init__(self, pred, dims=1):
        self.pred = pred.float()
        self.dims = tuple(range(-dims, 0))

    def mode(self):
        return self.pred

    mean = mode

    def log_prob(self, value):
        error = (self.pred - value) ** 2
        return -error.sum(self.dims) if self.dims else -error


class Bernoulli:
    """Continue flag: one logit per step, event shape (1,)."""

    def __init__(self, logits):
        self.logits = logits.float()  # (..., 1)

    def mode(self):
        return (self.logits > 0).float()

    def mean(self):
        return torch.sigmoid(self.logits)

    def log_prob(self, value):
        return -F.binary_cross_entropy_with_logits(self.logits, value, reduction="none").sum(-1)


def unimix_logits(logits, unimix):
    """Mix `unimix` of the uniform distribution into a softmax and return its logits."""
    if unimix <= 0:
        return logits
    probs = torch.softmax(logits, -1)
    probs = (1 - unimix) * probs + unimix / logits.shape[-1]
    return torch.log(probs)


class OneHot:
    """Categorical over the last dim with one-hot samples and straight-through gradients."""

    def __init__(self, logits, unimix=0.0):
        self.logits = unimix_logits(logits.float(), unimix)  # (..., classes)
        self.log_probs = torch.log_softmax(self.logits, -1)
        self.probs = self.log_probs.exp()

    def mode(self):
        index = self.logits.argmax(-1)
        onehot = F.one_hot(index, self.logits.shape[-1]).to(self.probs.dtype)
        return onehot + (self.probs - self.probs.detach())  # exactly one-hot in value

    def sample(self):
        # Inverse-CDF sampling: one uniform per categorical, much faster than torch.multinomial.
        cdf = self.probs.detach().float().cumsum(-1)
        uniform = torch.rand(*cdf.shape[:-1], 1, device=cdf.device)
        index = (cdf < uniform * cdf[..., -1:]).sum(-1).clamp(max=cdf.shape[-1] - 1)
        onehot = F.one_hot(index, self.logits.shape[-1]).to(self.probs.dtype)
        return onehot + (self.probs - self.probs.detach())  # exactly one-hot in value

    def log_prob(self, onehot):
        return (onehot * self.log_probs).sum(-1)

    def entropy(self):
        return -(self.probs * self.log_probs).sum(-1)


class Normal:
    """Diagonal Gaussian over the last dim (continuous actions, continuous latents).

    With `absmax`, samples are scaled back into [-absmax, absmax] with a straight-through
    gradient, so that the actions the world model imagines are the ones the environment executes.
    """

    def __init__(self, mean, std, absmax=None):
        mean, std = mean.float(), std.float()
        self.dist = torch.distributions.Normal(mean, std)
        self.mean_ = mean
        self.absmax = absmax

    def mode(self):
        return self.mean_

    def sample(self):
        sample = self.dist.rsample()
        if self.absmax is not None:
            sample = sample * (self.absmax / sample.abs().clamp(min=self.absmax)).detach()
        return sample

    def log_prob(self, value):
        return self.dist.log_prob(value).sum(-1)

    def entropy(self):
        return self.dist.entropy().sum(-1)


def kl_categorical(lhs_logits, rhs_logits):
    """KL[lhs || rhs] for independent categoricals (..., stoch, classes) -> (...)."""
    lhs_log = torch.log_softmax(lhs_logits, -1)
    rhs_log = torch.log_softmax(rhs_logits, -1)
    return (lhs_log.exp() * (lhs_log - rhs_log)).sum(-1).sum(-1)


def kl_normal(lhs_mean, lhs_std, rhs_mean, rhs_std):
    """KL[lhs || rhs] for diagonal Gaussians (..., stoch) -> (...)."""
    var_ratio = (lhs_std / rhs_std) ** 2
    term = ((lhs_mean - rhs_mean) / rhs_std) ** 2
    return 0.5 * (var_ratio + term - 1 - torch.log(var_ratio)).sum(-1)


# ==================================================================================================
# 2. Replay
# ==================================================================================================


def episode_name():
    """A new episode's name, `<time stamp>-<unique id>`: its files (the whole episode, or its
    chunks while it runs) all start with it, so names alone sort them by time and group them."""
    return f"{datetime.datetime.now().strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:8]}"


def save_episode(directory, episode, name=None):
    """Write one episode (dict of arrays, time first) as compressed .npz, atomically.

    The file name, `<name>-<length>.npz`, carries a time stamp, a unique id (`name`, by default a new
    `episode_name()`) and the length, so that the newest episodes can be found from names alone and
    a crash never leaves a half-written episode behind. Raises WriteError when the file cannot be
    written (full disk, read-only folder).
    """
    directory = pathlib.Path(directory)
    filename = directory / f"{name or episode_name()}-{len(episode['reward'])}.npz"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(filename, e) from None
    with io.BytesIO() as buffer:
        np.savez_compressed(buffer, **episode)
        atomic_write_bytes(filename, buffer.getvalue())
    return filename


# A chunk of a running episode: `<name>-c<index>-<length>.npz`, index from 0 (zero-padded, so that
# names sort in order). Chunk 0 holds the episode's first, action-less step; the chunks of an episode
# concatenated are the episode so far. Once its whole file `<name>-<length>.npz` exists they are stale.
CHUNK_DIGITS = 8


def parse_episode_file(path):
    """(episode name, chunk index or None for a whole episode, length) from a file name; a name of
    another form is a whole episode of unknown length (None), named by itself."""
    parts = pathlib.Path(path).stem.split("-")
    try:
        length = int(parts[-1])
    except ValueError:
        return pathlib.Path(path).stem, None, None
    if len(parts) >= 4 and parts[-2].startswith("c") and parts[-2][1:].isdigit():
        return "-".join(parts[:-2]), int(parts[-2][1:]), length
    if len(parts) < 2:
        return pathlib.Path(path).stem, None, None
    return "-".join(parts[:-1]), None, length


def episode_files(directory):
    """The episodes stored in a folder, newest first: [(name, [file, ...])], one file for a whole
    episode, the chunks in order for one that was still running (or cut short by a kill). Chunks
    of an episode whose whole file exists are left out: a kill between writing the whole episode and
    removing its chunks leaves both, and each step must count once."""
    whole, chunks = {}, collections.defaultdict(list)
    for path in pathlib.Path(directory).glob("*.npz"):
        name, index, _ = parse_episode_file(path)
        if index is None:
            whole[path.stem] = (name, [path])
        else:
            chunks[name].append((index, path))
    names = {name for name, _ in whole.values()}
    items = list(whole.values())
    for name, found in chunks.items():
        if name not in names:
            items.append((name, [path for _, path in sorted(found)]))
    return sorted(items, key=lambda item: item[0], reverse=True)


def read_episode(files, on_bad_chunk=None):
    """One episode from its file, or from its chunks (concatenated; a missing or unreadable chunk ends
    it there, so that no two steps that did not follow each other become neighbours, and the chunks
    before it stay). An unreadable chunk after the first is reported to `on_bad_chunk(path, problem,
    later)`, `later` the number of chunks after it that are dropped with it; an unreadable first
    chunk or whole file raises."""
    parts = []
    for position, path in enumerate(files):
        _, index, _ = parse_episode_file(path)
        if index is not None and index != position:
            break
        try:
            with path.open("rb") as f:
                data = np.load(f)
                parts.append({k: data[k] for k in data.keys()})
        except Exception as e:  # noqa: BLE001 - any unreadable chunk ends the episode there
            if not parts:
                raise
            if on_bad_chunk is not None:
                on_bad_chunk(path, f"unreadable ({e})", len(files) - position - 1)
            break
    if not parts:
        raise ValueError("its first chunk is missing")
    if len(parts) == 1:
        return parts[0]
    keys = set(parts[0])
    if any(set(part) != keys for part in parts):
        raise ValueError("its chunks hold different keys")
    return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}


class EpisodeWriter:
    """One environment's episodes on disk as they are collected, so that a kill loses at most one
    unfinished chunk: every `chunk_size` steps are written as a chunk file (atomically) once they are
    final, and the whole episode once it ends, which then replaces its chunks. chunk_size 0 writes
    whole episodes only.

    `add(steps)` takes the episode so far (a list of step dicts, newest last) after each new step.
    A chunk never holds the newest step: its stored policy latent (models.ReplayContext) is filled in
    only when the policy acts on it, so a chunk is written once chunk_size steps before the newest
    are unwritten. `finish(episode)` writes the whole episode first and removes the chunks after it:
    a kill in between leaves stale chunks that loading and counting ignore (`episode_files`), so no
    step is lost or read twice.
    """

    def __init__(self, directory, chunk_size):
        self.directory, self.chunk_size = pathlib.Path(directory), int(chunk_size)
        self._start()

    def _start(self):
        self.name, self.chunks, self.written = episode_name(), [], 0

    def add(self, steps):
        if len(steps) == 1 and self.written:  # a new episode (after a restarted worker): the old one's chunks stay
            self._start()
        if not self.chunk_size or len(steps) - 1 - self.written < self.chunk_size:
            return None
        part = steps[self.written:self.written + self.chunk_size]
        chunk = {k: np.stack([step[k] for step in part]) for k in part[0]}
        path = self.directory / f"{self.name}-c{len(self.chunks):0{CHUNK_DIGITS}d}-{len(part)}.npz"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WriteError(path, e) from None
        with io.BytesIO() as buffer:
            np.savez_compressed(buffer, **chunk)
            atomic_write_bytes(path, buffer.getvalue())
        self.chunks.append(path)
        self.written += len(part)
        return path

    def finish(self, episode):
        """Write the whole `episode` (dict of (T, ...) arrays), remove its chunks, and start the next one."""
        path = save_episode(self.directory, episode, self.name)
        for chunk in self.chunks:
            chunk.unlink(missing_ok=True)
        self._start()
        return path


# Keys an episode may lack: `task` (the step's index into the run's --task list) came with runs of
# several tasks; an episode stored before holds steps of a single task, index 0.
OPTIONAL_KEYS = ("task",)


def episode_spec(obs_space, act_space):
    """What every stored episode must hold: key -> (per-step shape, dtype), from the run's spaces."""
    spec = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in obs_space.items() if not k.startswith("log_")}
    spec["action"] = (tuple(act_space.shape), np.dtype(np.float32))
    spec["reward"] = ((), np.dtype(np.float32))
    spec["task"] = ((), np.dtype(np.int32))
    return spec


def step_bytes(spec):
    """Bytes of one replayed step of `spec` (episode_spec, plus any stored latents): what the replay
    holds in memory per step, and what an episode file holds per step before compression."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in spec.values())


def available_memory(device="cpu"):
    """Bytes of memory free for new allocations: on a CUDA device its free memory, else the host's
    (Linux MemAvailable; elsewhere None: not known)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0] if torch.cuda.is_available() else None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def total_memory(device="cpu"):
    """Bytes of memory the device has in all (a CUDA device's, else the host's MemTotal; None where not
    known): more than this can never be allocated, however much is freed."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[1] if torch.cuda.is_available() else None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


LATENT = "latent_"  # prefix of the policy latents stored with each step (models.ReplayContext)


def fit_latents(episode, spec):
    """The episode with its stored policy latents (`latent_*` keys, see models.ReplayContext)
    made to fit `spec`: latents the spec wants but the episode lacks (written by a run without
    replay context), or holds in another shape (another model size), become zeros, which the
    replay context reads as the initial state; latents the spec does not want are dropped."""
    length = len(episode["reward"]) if "reward" in episode else 0
    fitted = {k: v for k, v in episode.items() if not k.startswith(LATENT) or k in spec}
    for key, (shape, dtype) in spec.items():
        value = fitted.get(key)
        if key.startswith(LATENT) and (value is None or value.shape != (length, *shape) or value.dtype != dtype):
            fitted[key] = np.zeros((length, *shape), dtype)
    return fitted


def episode_problem(episode, spec):
    """Why `episode` (dict of (T, ...) arrays) does not fit `spec`, or None when it does.

    `log_*` keys are free: they only feed the suite metrics.
    """
    keys = {k for k in episode if not k.startswith("log_")}
    if keys - set(spec):
        return f"unexpected keys {sorted(keys - set(spec))}"
    if set(spec) - keys - set(OPTIONAL_KEYS):
        return f"missing keys {sorted(set(spec) - keys - set(OPTIONAL_KEYS))}"
    lengths = {len(v) if np.ndim(v) else 0 for k, v in episode.items() if k in spec}
    if len(lengths) != 1 or 0 in lengths:
        return f"keys of different or zero lengths {sorted(lengths)}"
    for key, (shape, dtype) in spec.items():
        if key not in episode:  # optional
            continue
        value = episode[key]
        if value.shape[1:] != shape:
            return f"'{key}' has step shape {value.shape[1:]}, expected {shape}"
        if value.dtype != dtype:
            return f"'{key}' has dtype {value.dtype}, expected {dtype}"
    return None


def non_finite_problem(episode):
    """Why an episode's values cannot be trained on (NaN or infinite floats: every update that samples
    them would turn the weights non-finite), or None."""
    bad = [key for key, value in episode.items() if not key.startswith("log_") and np.asarray(value).dtype.kind == "f"
           and not np.isfinite(value).all()]
    return f"non-finite values in {', '.join(map(repr, bad))}" if bad else None


def skip_warning(filename, problem):
    """One line per skipped episode file."""
    print(f"warning: skipping episode {filename}: {problem}", file=sys.stderr, flush=True)


def load_episodes(directory, limit=None, spec=None, on_skip=skip_warning):
    """Load the newest episodes whose lengths sum to at most `limit` steps, oldest first.

    An episode is a whole file, or the chunks of one that was still running (`episode_files`): its
    steps so far, a partial episode. A corrupt or unreadable file, and with `spec` (see
    `episode_spec`) an episode that does not fit the run's spaces, is skipped and reported to
    `on_skip(filename, problem)`, never fatal. Stored policy latents are fitted to the spec first
    (`fit_latents`). With `spec`, an episode without `task` gets task 0 at every step (OPTIONAL_KEYS).
    """
    directory = pathlib.Path(directory)
    if not directory.exists():
        return []
    episodes, total = [], 0

    def bad_chunk(path, problem, later):
        on_skip(f"{path}" + (f" (and its {later} later chunks)" if later else ""),
                f"{problem}; the episode's chunks before it are kept")

    for _, files in episode_files(directory):
        try:
            episode = read_episode(files, bad_chunk)
            if spec is not None:
                episode = fit_latents(episode, spec)
            problem = episode_problem(episode, spec) if spec is not None else None
            if problem is None and "reward" not in episode:
                problem = "missing key 'reward'"
            if problem is None:
                problem = non_finite_problem(episode)
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, never fatal
            problem = f"unreadable ({e})"
        if problem is not None:
            on_skip(files[0] if len(files) == 1 else f"{files[0]} (and its {len(files) - 1} later chunks)", problem)
            continue
        length = len(episode["reward"])
        if limit is not None and total + length > limit:
            break
        total += length
        if spec is not None and "task" in spec and "task" not in episode:
            episode["task"] = np.zeros(length, np.int32)
        episodes.append(episode)
    return episodes[::-1]


def recover_episodes(directory):
    """After a kill -9: the temporary files that episode writes left in `directory` (atomic_write_bytes)
    become their file where complete (every array loads) and that file does not exist yet, and are
    deleted otherwise; the chunks of an episode whose whole file exists (a kill before they were
    removed) are deleted too. Only the run that holds the logdir may call it. Returns one line
    saying what it did, or None when there was nothing to do."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return None
    promoted, removed, size = 0, 0, 0
    for temp, target in temp_files(directory):
        if target.suffix != ".npz":
            continue
        complete = False
        if not target.exists():
            try:
                with np.load(temp) as data:
                    for key in data.files:
                        data[key]  # noqa: B018 - reads and checks every array
                complete = True
            except Exception:  # noqa: BLE001 - cut short by the kill
                pass
        if complete:
            os.replace(temp, target)
            promoted += 1
        else:
            size += temp.stat().st_size
            temp.unlink()
            removed += 1
    whole = {parse_episode_file(path)[0] for path in directory.glob("*.npz") if parse_episode_file(path)[1] is None}
    stale = [path for path in directory.glob("*.npz") if parse_episode_file(path)[1] is not None
             and parse_episode_file(path)[0] in whole]
    for path in stale:
        size += path.stat().st_size
        path.unlink()
    if not (promoted or removed or stale):
        return None
    sync_folder(directory)
    done = [f"{promoted} complete temporary file(s) became their episode file"] if promoted else []
    done += [f"removed {removed} incomplete temporary file(s)"] if removed else []
    done += [f"removed {len(stale)} chunk(s) of episodes stored whole"] if stale else []
    return f"Recovered episode files in {directory} after a kill: {', '.join(done)} ({size / 1e6:.3g} MB freed)"


def stored_steps(directory):
    """Policy steps held in a folder's episode files, read from their names without opening them:
    a whole episode of `...-<length>.npz` holds length - 1 (its first step has no action), as does
    the first chunk of a running one; every later chunk holds its length. Chunks made stale by
    their episode's whole file count nothing (`episode_files`)."""
    total = 0
    for _, files in episode_files(directory):
        for path in files:
            _, index, length = parse_episode_file(path)
            if length is not None:
                total += max(0, length - 1) if not index else length
    return total


class Stream:
    """Ring buffer of consecutive steps from one environment, as growable arrays: numpy arrays in
    host memory, or with `device` torch tensors there (replay_device), which a batch is gathered
    from without a copy from the host."""

    def __init__(self, capacity, device=None):
        self.capacity, self.device = capacity, device
        self.data = {}
        self.count = 0  # steps ever written

    def __len__(self):
        return min(self.count, self.capacity)

    def empty(self, shape, dtype):
        """An array to hold steps: dtype a numpy dtype (the first step's) or, when a tensor grows, a torch one."""
        if self.device is None:
            return np.empty(shape, dtype)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        return torch.empty(shape, dtype=dtype, device=self.device)

    def add(self, step):
        """Append one step; returns its index among all steps ever written (its id in this stream)."""
        if not self.data:
            size = min(self.capacity, 1024)
            self.data = {k: self.empty((size, *np.shape(v)), np.asarray(v).dtype) for k, v in step.items()}
        size = len(next(iter(self.data.values())))
        if self.count == size and size < self.capacity:
            new = min(self.capacity, 2 * size)
            for key, array in self.data.items():
                grown = self.empty((new, *array.shape[1:]), array.dtype)
                grown[:size] = array
                self.data[key] = grown
        index = self.count % self.capacity
        for key, value in step.items():
            self.data[key][index] = value if self.device is None else torch.as_tensor(np.ascontiguousarray(value))
        self.count += 1
        return self.count - 1

    def indices(self, starts, length):
        """Physical indices (len(starts), length) of logical positions (0 = oldest step)."""
        offset = self.count % self.capacity if self.count > self.capacity else 0
        return (offset + starts[:, None] + np.arange(length)[None]) % self.capacity

    def gather(self, array, phys):
        """array[phys] for numpy indices phys, on the array's device."""
        return array[phys] if self.device is None else array[torch.as_tensor(phys, device=array.device)]

    def first(self):
        """Id (index among all steps ever written) of the oldest step still held."""
        return self.count - len(self)

    def write(self, first, values):
        """Overwrite the steps with ids first, first + 1, ... by values (dict of (L, ...) arrays or
        tensors); steps no longer held (dropped for newer ones) are left out."""
        ids = first + np.arange(len(next(iter(values.values()))))
        held = (ids >= self.first()) & (ids < self.count)
        phys = ids[held] % self.capacity  # a step's slot: its id modulo the capacity (see add)
        for key, value in values.items():
            if self.device is None:
                self.data[key][phys] = np.asarray(value)[held]
            else:
                value = torch.as_tensor(value, device=self.device)
                self.data[key][torch.as_tensor(phys, device=self.device)] = value[torch.as_tensor(held,
                                                                                                  device=self.device)]


class Replay:
    """Uniform sequence replay over one stream of consecutive steps per environment.

    Sequences may cross episode boundaries inside a stream; `is_first` marks where the world
    model must reset its latent state, as in the official implementation. The oldest steps are
    dropped once `capacity` steps are held in total.

    Every step has an id (stream, index among the stream's steps) by which `update` rewrites it
    (the policy's latents, the replay context's write-back, models.ReplayContext).

    Thread-safe: an actor thread may add while the learner samples (a sample copies its steps out
    under the lock, so a later add never changes a batch already taken).
    """

    def __init__(self, capacity, streams, seed=0, device=None):
        per_stream = max(1, int(np.ceil(capacity / streams)))
        self.device = None if device is None else torch.device(device)  # replay_device: None is host memory
        self.streams = [Stream(per_stream, self.device) for _ in range(streams)]
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()

    @property
    def nbytes(self):
        """Bytes the stored steps' arrays take now (they grow to capacity as steps come in)."""
        with self.lock:
            return sum(array.nbytes for stream in self.streams for array in stream.data.values())

    def __len__(self):
        with self.lock:
            return sum(len(s) for s in self.streams)

    def add(self, step, stream=0):
        """Append one step to a stream; returns its id (stream, index among the stream's steps)."""
        with self.lock:
            return stream, self.streams[stream].add(step)

    def add_episode(self, episode, stream=0):
        length = len(episode["reward"])
        with self.lock:
            for t in range(length):
                self.streams[stream].add({k: v[t] for k, v in episode.items()})

    def ready(self, length):
        with self.lock:
            return any(len(s) >= length for s in self.streams)

    def sample(self, batch, length, ids=False, alloc=np.empty):
        """A batch of sequences: dict of arrays (batch, length, ...), tensors on the device for a
        replay there; with `ids` also the id of each sequence's first step, (batch, 2) int64 of
        (stream, index), for `update`. `alloc(shape, dtype)` makes each array the batch is copied
        into (Prefetcher: pinned memory; a replay on the device allocates there)."""
        with self.lock:
            data, first = self._sample(batch, length, alloc)
        return (data, first) if ids else data

    def update(self, ids, values):
        """Overwrite stored steps: row b of values (dict of (batch, L, ...) arrays) goes to the L
        steps from id ids[b] (as `sample` gives them) on; steps dropped meanwhile are left out."""
        with self.lock:
            for row, (stream, first) in enumerate(np.asarray(ids)):
                self.streams[stream].write(int(first), {k: v[row] for k, v in values.items()})

    def _sample(self, batch, length, alloc=np.empty):
        starts = np.array([max(0, len(s) - length + 1) for s in self.streams], np.float64)
        if starts.sum() == 0:
            raise RuntimeError(f"Replay holds no sequence of length {length} yet.")
        which = self.rng.choice(len(self.streams), size=batch, p=starts / starts.sum())
        out = {}
        first = np.stack([which, np.zeros(batch, np.int64)], 1).astype(np.int64)
        for index in np.unique(which):
            stream = self.streams[index]
            rows = np.nonzero(which == index)[0]
            start = self.rng.integers(0, starts[index], size=len(rows))
            phys = stream.indices(start, length)
            first[rows, 1] = stream.first() + start
            for key, array in stream.data.items():
                if key not in out:
                    out[key] = (alloc((batch, length, *array.shape[1:]), array.dtype) if self.device is None
                                else torch.empty((batch, length, *array.shape[1:]), dtype=array.dtype,
                                                 device=self.device))
                out[key][rows if self.device is None else torch.as_tensor(rows, device=self.device)] = \
                    stream.gather(array, phys)
        return out, first


def strip_logs(episode):
    """Replay keeps what the model trains on; `log_*` keys only feed the suite metrics."""
    return {k: v for k, v in episode.items() if not k.startswith("log_")}


def select_keys(obs_space, cnn_pattern, mlp_pattern):
    """Image keys (rank 3) matching cnn_pattern and vector keys (rank <= 1) matching mlp_pattern."""
    skip = ("is_first", "is_last", "is_terminal", "reward")
    shapes = {k: v.shape for k, v in obs_space.items() if k not in skip and not k.startswith("log_")}
    cnn = {k: s for k, s in shapes.items() if len(s) == 3 and re.match(cnn_pattern, k)}
    mlp = {k: s for k, s in shapes.items() if len(s) in (0, 1) and re.match(mlp_pattern, k)}
    return cnn, mlp


def cost_lines(config, spec, free=None):
    """What the run will cost: its updates, the replay's memory once it holds dataset_size steps
    (the device's with replay_device), the episode files' disk per million steps; a WARNING when the
    replay cannot fit in the memory free now (`free`, bytes; by default available_memory())."""
    step = step_bytes(spec)
    replay = step * config.dataset_size
    device = config.device if config.replay_device else "cpu"
    free = available_memory(device) if free is None else free
    where = f"{torch.device(device).type.upper()} memory" if config.replay_device else "memory"
    gb = lambda n: f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"  # noqa: E731
    lines = [f"Cost: {total_updates(config):,} updates to {config.steps:,} frames; replay {gb(replay)} of {where} at "
             f"capacity ({config.dataset_size:,} steps x {step:,} bytes); episode files at most {gb(step * 1e6)} per "
             "million steps on disk (compressed .npz, images usually less)"]
    if free is not None and replay > free:
        fix = "lower --dataset_size" + (", or --replay_device False" if config.replay_device else "")
        lines.append(f"WARNING: the replay needs {gb(replay)} at capacity and {gb(free)} of {where} is free; the run "
                     f"will run out of memory as the replay fills: {fix}")
    return lines


class Prefetcher:
    """The learner's replay batches, without a stall on the device: on CUDA each batch is sampled
    into pinned host memory and copied with non_blocking=True, and while an update runs the next
    batch of the same run of updates is sampled on a background thread (`ahead`; on a CPU the
    thread would compete with the update for the cores, so there it samples on demand).

    The batches and their order are those of plain Replay.sample calls with the same random
    stream: a batch sampled ahead is taken before anything else samples, and the write-back of the
    update before it (models.ReplayContext.write_back, which calls `update` here) is applied to it
    too, as if it had been sampled after. Only within one run of updates (`next(more=True)`): the
    steps the environments add between runs reach the next batch as without prefetching.
    """

    def __init__(self, replay, batch, length, device="cpu", ahead=None):
        self.replay, self.batch, self.length = replay, batch, length
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # A replay on the device gathers its batch there, in no time worth a thread.
        self.ahead = (self.cuda and replay.device is None) if ahead is None else ahead
        self.pending = None  # (thread, result dict) of the batch being sampled ahead

    def host_array(self, shape, dtype):
        """Where a batch is sampled into: pinned memory on CUDA (an asynchronous copy needs it),
        plain numpy otherwise."""
        if not self.cuda:
            return np.empty(shape, dtype)
        like = torch.from_numpy(np.empty(0, dtype)).dtype
        return torch.empty(shape, dtype=like, pin_memory=True).numpy()  # the array keeps the tensor alive

    def sample(self):
        return self.replay.sample(self.batch, self.length, ids=True, alloc=self.host_array)

    def next(self, more=False):
        """The next batch: (batch, ids, data): batch a dict of host arrays (B, L, ...), ids (B, 2)
        as Replay.sample gives them, data the batch as tensors on the device (on CUDA, copied
        asynchronously) or None (on a CPU: preprocess converts the host arrays). `more`: another
        batch follows in this run of updates; it is sampled ahead while this one trains."""
        batch, ids = self._take() if self.pending is not None else self.sample()
        if self.replay.device is not None:  # replay_device: the batch is on the device already
            return batch, ids, batch
        data = self.to_device(batch) if self.cuda else None
        if more and self.ahead:
            result = {}

            def work():
                try:
                    result["value"] = self.sample()
                except BaseException as e:  # noqa: BLE001 - raised in the learner's thread by _take
                    result["error"] = e

            thread = threading.Thread(target=work, name="prefetch", daemon=True)
            thread.start()
            self.pending = (thread, result)
        return batch, ids, data

    def _take(self):
        thread, result = self.pending
        thread.join()
        self.pending = None
        if "error" in result:
            raise result["error"]
        return result["value"]

    def to_device(self, batch):
        """dict of host arrays -> dict of tensors on the device, copied without waiting. The copy
        is made from the pinned tensor behind each array (host_array), so that the caching host
        allocator keeps its memory until the copy is done."""
        return {k: host_tensor(v).to(self.device, non_blocking=True) for k, v in batch.items()}

    def update(self, ids, values):
        """Replay.update, also applied to a batch sampled ahead of it (see the class)."""
        if self.pending is not None:
            thread, result = self.pending
            thread.join()
            if "value" in result:
                batch, pending_ids = result["value"]
                overlay(batch, pending_ids, self.length, ids, values)
        self.replay.update(ids, values)


def host_tensor(array):
    """The tensor a numpy array was made from by Tensor.numpy() (a pinned buffer), else a tensor
    sharing the array's memory."""
    base = array.base
    if isinstance(base, torch.Tensor) and base.data_ptr() == array.ctypes.data and base.shape == array.shape:
        return base
    return torch.from_numpy(array)


def overlay(batch, ids, length, written_ids, values):
    """Write `values` (dict of (B', L', ...) arrays, row q for the L' steps from written_ids[q], as
    Replay.update takes them) into `batch` (dict of (B, length, ...) arrays sampled from ids (B, 2))
    wherever the same steps of the same stream are in both; later rows win, as in Replay.update."""
    ids, written_ids = np.asarray(ids), np.asarray(written_ids)
    span = len(next(iter(values.values()))[0])
    for q, (stream, first) in enumerate(written_ids):
        for r in np.nonzero(ids[:, 0] == stream)[0]:
            start = ids[r, 1]
            low, high = max(start, first), min(start + length, first + span)
            if low < high:
                for key, value in values.items():
                    value = value if isinstance(batch[key], torch.Tensor) else np.asarray(value)
                    batch[key][r, low - start:high - start] = value[q, low - first:high - first]


# ==================================================================================================
# 3. Logging and checkpoint files
# ==================================================================================================


class WriteError(OSError):
    """A file that cannot be written: a full disk (ENOSPC), a read-only folder (EROFS, EACCES), ...
    Its message names the file and the error in one line; nothing half-written is left behind."""

    def __init__(self, path, error, note=None):
        super().__init__(error.errno, error.strerror or str(error))
        self.path, self.note = pathlib.Path(path), note

    def __str__(self):
        note = f"; {self.note}" if self.note else ""
        return f"cannot write {self.path}: {self.strerror} (errno {self.errno}){note}"

    @property
    def hint(self):
        """What to do about it."""
        full = self.errno in (errno.ENOSPC, errno.EDQUOT)
        return f"{'free space' if full else 'make it writable'} and rerun to resume"


def fault_point(name, path):
    """Called at each step of a checkpoint or episode write (`name`: "half written", "written",
    "previous kept", "replaced"), with the file being written: tests set `fault_hook` to kill the
    process there (tests/test_faults.py), as a kill -9 at that instant would."""
    if fault_hook is not None:
        fault_hook(name, pathlib.Path(path))


fault_hook = None


def temp_path(path):
    """The temporary file a write of `path` goes through: `.<name>.<8 hex digits>.tmp` beside it,
    a name `temp_files` finds again after a kill."""
    path = pathlib.Path(path)
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


TEMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{8}\.tmp$")


def temp_files(folder, name=None):
    """The temporary files of `temp_path` in `folder` (those of files named `name`, or of any),
    with the file each was to become: [(temp, target)], oldest first."""
    found = []
    for temp in pathlib.Path(folder).glob(".*.tmp"):
        match = TEMP_PATTERN.match(temp.name)
        target = match and match["name"]
        while target and TEMP_PATTERN.match(target):  # a temp of a temp: how saves before issue 32 wrote
            target = TEMP_PATTERN.match(target)["name"]
        if target and (name is None or target == name) and temp.is_file():
            found.append((temp, temp.with_name(target)))
    return sorted(found, key=lambda item: item[0].stat().st_mtime)


def write_synced(path, data):
    """Write `data` to `path` and flush it to the disk (fault points "half written", "written")."""
    with pathlib.Path(path).open("wb") as f:
        half = len(data) // 2
        f.write(data[:half])
        f.flush()
        fault_point("half written", path)
        f.write(data[half:])
        f.flush()
        os.fsync(f.fileno())
    fault_point("written", path)


def sync_folder(folder):
    """Make the renames in `folder` durable (a power cut after a rename otherwise may undo it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename itself is done
    finally:
        os.close(fd)


def atomic_write_bytes(path, data):
    """Write `data` to `path` through a temporary file (`temp_path`) and a rename, so readers never
    see half; a kill -9 may leave the temporary file, which `recover_episodes` (episode files) and
    `recover_checkpoint` clear at the next start.

    On failure the temporary file is removed (a full disk gets its space back) and WriteError
    names `path`; `path` itself is untouched.
    """
    path = pathlib.Path(path)
    tmp = temp_path(path)
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
        fault_point("replaced", path)
    except BaseException as e:  # Ctrl-C in a single process too: no temporary file stays behind
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only folder, where it was never written
            pass
        if isinstance(e, OSError):
            raise WriteError(path, e) from None
        raise


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, unsafe to unpickle (`unsafe`), or with non-finite values."""

    def __init__(self, message, unsafe=False):
        super().__init__(message)
        self.unsafe = unsafe


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


def previous_path(path):
    """Where `save_checkpoint` keeps the checkpoint it replaced: latest.pt -> previous.pt."""
    return pathlib.Path(path).with_name("previous.pt")


def save_checkpoint(path, state):
    """Write `state` to `path` and keep the checkpoint it replaces as previous.pt, so that a kill -9
    at any instant leaves the newest complete checkpoint findable: the state goes to a temporary
    file (`temp_path`, flushed to disk), then latest.pt becomes previous.pt and the temporary file
    latest.pt. A kill before the first rename leaves latest.pt as it was, after it only previous.pt
    and the complete temporary file; `resume_checkpoint` promotes that one at the next start.
    Non-finite weights are refused: they would replace the last good checkpoint.
    """
    if not all_finite(state):
        raise CheckpointError("the state to save holds non-finite values")
    path = pathlib.Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    tmp = temp_path(path)
    try:
        write_synced(tmp, buffer.getbuffer())
    except BaseException as e:  # a full disk gets its space back; Ctrl-C leaves nothing either
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # named as the checkpoint, not its temporary file; nothing was replaced
            raise WriteError(path, e) from None
        raise
    # Ctrl-C or SIGTERM between the renames would leave latest.pt in the temporary file; hold them until done.
    signals = {signal.SIGINT, signal.SIGTERM}
    blocked = threading.current_thread() is threading.main_thread()
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        if path.exists():
            os.replace(path, previous_path(path))
            fault_point("previous kept", path)
        os.replace(tmp, path)
        sync_folder(path.parent)
        fault_point("replaced", path)
    except OSError as e:  # renames need no space; a folder turned read-only can refuse them
        raise WriteError(path, e) from None
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def _torch_reason(error):
    """The line of a torch.load error that says what is wrong, without torch's advice around it
    (which suggests weights_only=False, the one thing never to do with a refused file)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    advice = ("Weights only load failed", "(1)", "(2)", "In PyTorch", "Re-running", "Check the documentation",
              "Please file an issue", "Please use", "This file can still be loaded")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(advice)] or lines
    reason = lines[0] if lines else type(error).__name__
    return reason.split(". ")[0].rstrip(".")[:200]  # its first sentence: what follows is advice again


def pickle_globals(path):
    """(the globals, as module.name, that the pickles of a checkpoint file ask to call or build,
    whether every pickle was read to its end), found with pickletools, which runs nothing: the
    .pkl members of a torch.save zip archive, or the file as one plain pickle."""
    import pickletools
    import zipfile

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                streams = [archive.read(name) for name in archive.namelist() if name.endswith(".pkl")]
        else:
            streams = [pathlib.Path(path).read_bytes()]
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return [], False
    found, complete = [], bool(streams)
    for data in streams:
        strings, memo = [], {}
        try:
            for opcode, arg, _ in pickletools.genops(data):
                name = opcode.name
                if name in ("GLOBAL", "INST"):
                    found.append(arg.replace(" ", "."))
                elif name == "STACK_GLOBAL":
                    found.append(".".join(map(str, strings[-2:])))
                elif name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                    memo[len(memo) if name == "MEMOIZE" else arg] = strings[-1] if strings else None
                elif name in ("GET", "BINGET", "LONG_BINGET"):
                    strings.append(memo.get(arg))
                elif isinstance(arg, str):
                    strings.append(arg)
        except Exception:  # noqa: BLE001 - a damaged or cut pickle: what was read so far is what it asked for
            complete = False
    return found, complete


def _unsafe_globals(found):
    """The globals among `found` that torch's weights-only loading does not allow."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed = set(_get_allowed_globals())
    except ImportError:  # another torch: its own message still decides (load_checkpoint)
        allowed = {name for name in found if name.startswith(("torch.", "collections.OrderedDict"))}
    return sorted({name for name in found if name not in allowed})


def load_checkpoint(path, device="cpu", keys=()):
    """Load a checkpoint without running code from it (`weights_only`: tensors and plain data).

    Raises CheckpointError with the reason in one line: `unsafe` set for a file that asks to call
    or build anything else (os.system, exec, eval, any class: someone made it so, and it is never
    skipped), unset for a damaged one (empty, cut short, not a checkpoint, or a state without one
    of `keys`).
    """
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols of files it then refuses
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = _torch_reason(e)
        found, complete = pickle_globals(path)
        unsafe = _unsafe_globals(found)
        if unsafe or "global" in reason.lower():  # either sign: torch's wording changes between versions
            asks = f" ({', '.join(unsafe)})" if unsafe else ""
            raise CheckpointError(f"refusing to load {path}: it holds objects other than tensors and plain "
                                  f"data{asks}, which could run code; torch: {reason}", unsafe=True) from None
        what = "cut short or damaged" if not complete else "not a checkpoint"
        raise CheckpointError(f"cannot read {path}: {what} ({reason})") from None
    except EOFError:
        raise CheckpointError(f"cannot read {path}: empty or cut short (it ends early)") from None
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {_torch_reason(e)}") from None
    missing = [key for key in keys if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(f"cannot read {path}: incomplete, without {', '.join(map(repr, missing))}")
    return state


def load_checkpoint_or_previous(path, device="cpu", keys=()):
    """(state, path it came from, notes) from `path`, or from previous.pt when `path` is missing,
    damaged (load_checkpoint, with `keys`) or non-finite; (None, None, notes) when neither exists.
    Reads only: a run beside training (--eval_only) uses it too.

    A checkpoint that is unsafe to unpickle is an error, never skipped: someone changed the file.
    """
    path, notes = pathlib.Path(path), []
    for candidate in (path, previous_path(path)):
        if not candidate.exists():
            if candidate == path and previous_path(path).exists():
                notes.append(f"{path} is missing")
            continue
        try:
            state = load_checkpoint(candidate, device, keys)
        except CheckpointError as e:
            if e.unsafe:
                raise
            notes.append(str(e))
            continue
        if not all_finite(state):
            notes.append(f"{candidate} holds non-finite values")
            continue
        if candidate != path:
            notes.append(f"using the previous checkpoint {candidate}")
        return state, candidate, notes
    if notes:
        raise CheckpointError("no usable checkpoint: " + "; ".join(notes))
    return None, None, notes


def recover_checkpoint(path, device="cpu", keys=()):
    """After a kill -9 in `save_checkpoint`: promote the newest complete temporary file of `path`
    (verified by loading it) to `path`, keeping the one it replaces as previous.pt as a save would,
    and delete every other temporary file of `path`. Only the run that holds the logdir may call
    it. Returns one line saying what it did, or None when there was nothing to do."""
    path = pathlib.Path(path)
    temps = [temp for temp, _ in temp_files(path.parent, path.name)]
    if not temps:
        return None
    promoted, removed, size = None, 0, 0
    for temp in reversed(temps):  # newest first: the first complete one is the save the kill cut short
        if promoted is None:
            try:
                state = load_checkpoint(temp, device, keys)
            except CheckpointError:
                state = None
            if state is not None and all_finite(state):
                # Complete means written after latest.pt (the save writes it first): it replaces latest.pt.
                if path.exists():
                    os.replace(path, previous_path(path))
                os.replace(temp, path)
                promoted = temp
                continue
        size += temp.stat().st_size
        temp.unlink()
        removed += 1
    sync_folder(path.parent)
    done = [f"promoted the complete {promoted.name} to {path.name}"] if promoted else []
    if removed:
        done.append(f"removed {removed} incomplete or older temporary checkpoint file(s) ({size / 1e6:.3g} MB)")
    return f"Recovered from a kill during a checkpoint write: {' and '.join(done)}"


def resume_checkpoint(path, device="cpu", keys=()):
    """What a training run resumes from: `recover_checkpoint`, then `load_checkpoint_or_previous`. A
    damaged latest.pt is kept aside as latest.pt.damaged, so that the next save does not make it
    previous.pt in place of the good one. Returns (state, path it came from, notes)."""
    path = pathlib.Path(path)
    recovered = recover_checkpoint(path, device, keys)
    state, used, notes = load_checkpoint_or_previous(path, device, keys)
    if used is not None and used != path and path.exists():
        damaged = path.with_name(path.name + ".damaged")
        os.replace(path, damaged)
        notes.append(f"kept the damaged {path.name} aside as {damaged.name}")
    if notes:
        notes = ["; ".join(notes)]  # one line
    return state, used, ([recovered] if recovered else []) + notes


class LogdirBusy(RuntimeError):
    """Another live process holds the run's logdir."""


def lock_logdir(logdir):
    """Hold an exclusive lock on `logdir` for as long as the returned file stays open.

    flock locks belong to the open file, so the kernel releases them when the holder exits in any
    way, kill -9 included: a dead run never leaves its logdir locked. The holder's pid and host
    are written into the file so a second run can name it.
    """
    import fcntl
    import socket

    f = (pathlib.Path(logdir) / "run.lock").open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown process"
        f.close()
        raise LogdirBusy(f"{logdir} is in use by another run ({holder}); wait for it to end or use another "
                         "--logdir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def video_frames(video):
    """video: (B, T, H, W, C) uint8 or float in [0, 1] -> (T, H, B * W, C) uint8, the batch entries
    laid side by side, as every back end shows it."""
    video = np.asarray(video)
    if np.issubdtype(video.dtype, np.floating):
        video = np.clip(255 * video, 0, 255).astype(np.uint8)
    batch, time, height, width, channels = video.shape
    return video.transpose(1, 2, 0, 3, 4).reshape(time, height, batch * width, channels)


def _video_warning(name, error):
    warnings.warn(f"Could not write video {name}: {error}", stacklevel=3)


class TensorBoardOutput:
    """Scalars, videos and text as TensorBoard events in the logdir."""

    def __init__(self, logdir, step, config):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run continues its curves: events written after the checkpoint are dropped.
        self.writer = SummaryWriter(str(logdir), purge_step=step if step else None, max_queue=1000)

    def write(self, step, scalars, videos):
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        for name, frames in videos.items():  # frames: (T, H, W, C) uint8
            try:
                self.writer.add_video(name, frames[None].transpose(0, 1, 4, 2, 3), step, fps=16)
            except Exception as e:  # noqa: BLE001 - a missing video encoder must not end training
                _video_warning(name, e)
        self.writer.flush()

    def text(self, name, value, step):
        self.writer.add_text(name, value, step)

    def close(self):
        self.writer.close()


def set_aside(path, kept, damaged, problem):
    """A log file with `damaged` lines that cannot be read (the first: `problem`): the file as it was
    is kept as <name>.damaged (or .damaged.1, ...), `kept` (its readable lines, text) replaces it, and
    one warning line says so; the run goes on."""
    backup = path.with_name(path.name + ".damaged")
    for n in itertools.count(1):
        if not backup.exists():
            break
        backup = path.with_name(f"{path.name}.damaged.{n}")
    os.replace(path, backup)
    atomic_write_bytes(path, kept.encode())
    print(f"warning: {path}: {damaged} damaged line(s) left out ({problem}); the file as it was is kept as "
          f"{backup.name}", file=sys.stderr, flush=True)


class JsonlOutput:
    """metrics.jsonl: one JSON object per write, {"step": frames, name: value, ...}. Damaged lines
    (a kill -9 mid-line, an edit) are left out at the start, the file as it was set aside (set_aside)."""

    def __init__(self, logdir, step, config):
        self.path = pathlib.Path(logdir) / "metrics.jsonl"
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        keep, damaged, problem = [], 0, None
        for number, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
                if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
                    raise ValueError("not an object with a step")
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                damaged += 1
                problem = problem or f"line {number}: {str(e)[:80]}"
                continue
            if not step or row["step"] <= step:  # a resumed run drops what came after its checkpoint
                keep.append(line.decode("utf-8"))
        text = "".join(line + "\n" for line in keep)
        if damaged:
            set_aside(self.path, text, damaged, problem)
        elif text.encode() != data:
            atomic_write_bytes(self.path, text.encode())

    def write(self, step, scalars, videos):
        if scalars:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **scalars}) + "\n")

    def text(self, name, value, step):
        pass

    def close(self):
        pass


def _csv_step(row):
    try:
        return float(row.get("step"))
    except (TypeError, ValueError):
        return None


class CsvOutput:
    """metrics.csv: the rows of metrics.jsonl as one flat table, a column per metric (step first,
    then in the order metrics first appear), an empty cell where a row lacks a metric.

    A row is appended while the header holds all its metrics. A metric that appears later (eval/
    after the first evaluation) widens the header: the file is then rewritten whole, atomically,
    which happens only the few times a new name turns up.
    """

    def __init__(self, logdir, step, config):
        import csv

        self.csv = csv
        self.path = pathlib.Path(logdir) / "metrics.csv"
        self.columns, rows = ["step"], []
        if self.path.exists():
            try:
                with self.path.open(newline="") as f:
                    reader = csv.DictReader(f)
                    self.columns = list(reader.fieldnames or ["step"])
                    rows = list(reader)
            except (UnicodeDecodeError, csv.Error) as e:  # not text: nothing of it can be kept
                set_aside(self.path, "", "all", str(e)[:80])
                self.columns, rows = ["step"], []
            good = [row for row in rows if _csv_step(row) is not None]
            kept = [row for row in good if not step or _csv_step(row) <= step]  # a resumed run drops what came after
            if len(good) < len(rows):
                self._rewrite(kept, damaged=len(rows) - len(good))
            elif len(kept) < len(rows):
                self._rewrite(kept)

    def _rewrite(self, rows, damaged=0):
        buffer = io.StringIO()
        writer = self.csv.DictWriter(buffer, self.columns, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        if damaged:
            set_aside(self.path, buffer.getvalue(), damaged, "rows without a numeric step")
        else:
            atomic_write_bytes(self.path, buffer.getvalue().encode())

    def write(self, step, scalars, videos):
        if not scalars:
            return
        row = {"step": step, **{name: repr(float(value)) for name, value in scalars.items()}}
        new = [name for name in row if name not in self.columns]
        if new or not self.path.exists():
            rows = []
            if self.path.exists():
                with self.path.open(newline="") as f:
                    rows = list(self.csv.DictReader(f))
            self.columns += new
            self._rewrite([*rows, row])
            return
        with self.path.open("a", newline="") as f:
            self.csv.DictWriter(f, self.columns, restval="", lineterminator="\n").writerow(row)

    def text(self, name, value, step):
        pass

    def close(self):
        pass


WANDB_MISSING = "--logger wandb needs the wandb package, which is not installed: pip install wandb"


class WandbOutput:
    """A Weights & Biases run: the saved config as the run's config, scalars, videos (where
    video_pred_log is on) and text, against the frame count `step`.

    The run's id is kept in logdir/wandb_id.txt, so a resumed training run continues the same W&B
    run. W&B refuses steps that go backwards, and a resumed run repeats the frames between its
    checkpoint and the kill: every value is therefore logged with `step` as its x axis (the
    metric "step", defined as the step metric of all others) rather than as W&B's own step, so the
    repeated frames show up as a short overlap instead of being dropped. WANDB_MODE=offline keeps
    the run on disk (logdir/wandb/) for a later `wandb sync`.
    """

    ID_FILE = "wandb_id.txt"

    @staticmethod
    def check():
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError(WANDB_MISSING) from None

    def __init__(self, logdir, step, config):
        import wandb

        self.wandb = wandb
        logdir = pathlib.Path(logdir)
        config = config or {}
        options = config.get("wandb") or {}
        id_file = logdir / self.ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits
            atomic_write_bytes(id_file, (run_id + "\n").encode())
        self.run = wandb.init(
            project=options.get("project") or None, entity=options.get("entity") or None,
            group=options.get("group") or None, name=options.get("name") or logdir.resolve().name,
            tags=list(options.get("tags") or []) or None, id=run_id, resume="allow", dir=str(logdir),
            config=config, settings=wandb.Settings(console="off"))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, step, scalars, videos):
        data = {"step": step, **scalars}
        for name, frames in videos.items():  # frames: (T, H, W, C) uint8; W&B takes (T, C, H, W)
            try:
                data[name] = self.wandb.Video(frames.transpose(0, 3, 1, 2), fps=16, format="mp4")
            except Exception as e:  # noqa: BLE001 - a missing video encoder must not end training
                _video_warning(name, e)
        self.run.log(data)

    def text(self, name, value, step):
        self.run.log({"step": step, name: self.wandb.Html(f"<pre>{value}</pre>")})

    def close(self):
        self.run.finish()


# --logger names -> back ends; tools.check_loggers validates a list of them.
LOGGERS = {"tensorboard": TensorBoardOutput, "jsonl": JsonlOutput, "csv": CsvOutput, "wandb": WandbOutput}


def check_loggers(names):
    """Raise ValueError, in one line, for a --logger list that names an unknown back end, names
    none, or names one whose package is missing (wandb is optional). Writes nothing."""
    valid = ", ".join(LOGGERS)
    if isinstance(names, str) or not names:
        raise ValueError(f"Invalid value '{names if isinstance(names, str) else ''}' for --logger; valid: one or "
                         f"more of {valid}, comma-separated")
    for name in names:
        if name not in LOGGERS:
            raise ValueError(f"Invalid value '{name}' for --logger; valid: one or more of {valid}, comma-separated")
    for name in dict.fromkeys(names):
        check = getattr(LOGGERS[name], "check", None)
        if check:
            check()


class Logger:
    """Scalars and videos, collected between writes and sent at `write()` to each back end of
    `outputs` (names of LOGGERS: TensorBoard events, metrics.jsonl, metrics.csv, W&B).

    Scalars may be tensors; they are converted to floats only when written, so the training step
    never waits on the device for logging. `config` is the run's config as a dict (W&B's run
    config and options).
    """

    def __init__(self, logdir, step=0, outputs=("tensorboard", "jsonl"), config=None):
        check_loggers(list(outputs))
        self.logdir = pathlib.Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.outputs = [LOGGERS[name](self.logdir, step, config) for name in dict.fromkeys(outputs)]
        self.scalars = collections.defaultdict(list)
        self.videos = {}

    def scalar(self, name, value):
        self.scalars[name].append(value)

    def video(self, name, value):
        self.videos[name] = value

    def write(self, step):
        values = {}
        for name, items in self.scalars.items():
            values[name] = float(torch.as_tensor([float(v) for v in items], dtype=torch.float64).mean())
        videos = {name: video_frames(video) for name, video in self.videos.items()}
        for output in self.outputs:
            output.write(step, values, videos)
        self.scalars.clear()
        self.videos.clear()
        return values

    def text(self, name, value, step):
        for output in self.outputs:
            output.text(name, value, step)

    def close(self):
        for output in self.outputs:
            output.close()


class NullLogger:
    """What every process but the main one logs to under torchrun: nothing."""

    def scalar(self, name, value):
        pass

    def video(self, name, value):
        pass

    def text(self, name, value, step):
        pass

    def write(self, step):
        return {}

    def close(self):
        pass


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
        eta = datetime.timedelta(seconds=int(max(self.total - frames, 0) / fps)) if fps > 0 else "?"
        done = min(frames / self.total, 1.0) if self.total else 1.0  # a few frames past --steps (or of --steps 0)
        parts = [f"frames {frames}/{self.total} ({100 * done:.1f}%)"]
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


def env_status_line(rows):
    """One line for the environments' status rows (parallel.Collector.status), however many there
    are: steps, episodes, fps and step time as min/median/max, and the environments whose worker
    was restarted."""
    def spread(key, digits=1):
        values = np.array([row[key] for row in rows], float)
        values = values[np.isfinite(values)]
        if not len(values):
            return "-"
        low, mid, high = np.min(values), np.median(values), np.max(values)
        return f"{low:.{digits}f}/{mid:.{digits}f}/{high:.{digits}f}"

    restarted = [f"{i} ({row['restarts']}x)" for i, row in enumerate(rows) if row.get("restarts")]
    return (f"  envs {len(rows)} (min/median/max): steps {spread('steps', 0)} | episodes "
            f"{sum(row['episodes'] for row in rows)} | fps {spread('fps')} | step {spread('step_ms')} ms"
            + (f" | restarted: env {', '.join(restarted)}" if restarted else ""))


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


def write_mp4(path, frames, fps=30):
    import imageio.v2 as imageio

    tmp = path.with_name(f".{path.stem}.tmp.mp4")
    imageio.mimwrite(tmp, list(frames), fps=fps, format="FFMPEG", macro_block_size=1)
    os.replace(tmp, path)


class FirstCalls:
    """Calls of a kind that is slow the first time (a compiling update: minutes on a CPU): the first
    call of each `name` is a Phase of its own, a bar in a terminal or log lines, so that the wait is
    not silent; later ones run plainly. `interactive()` says whether stdout is a terminal."""

    def __init__(self, label, interactive):
        self.label, self.interactive, self.seen = label, interactive, set()

    def __call__(self, name, fn, *args):
        if name in self.seen:
            return fn(*args)
        self.seen.add(name)
        with Phase(f"{self.label} ({name})", 1, "call", self.interactive()) as phase:
            out = fn(*args)
            phase.update(1)
        return out


# ==================================================================================================
# 4. Schedules
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


class Ratio:
    """Number of updates owed so that updates * replayed_per_update / steps == ratio."""

    def __init__(self, ratio, replayed_per_update):
        self.ratio, self.replayed_per_update = ratio, replayed_per_update
        self.steps_per_update = replayed_per_update / ratio
        self.updates = 0

    def owed(self, steps):
        """Updates owed in total after `steps` steps; multiply first so exact ratios stay exact."""
        return int(steps * self.ratio / self.replayed_per_update)

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
        return int(inserts * self.ratio / self.replayed_per_update)

    def can_sample(self):
        if self.finished:
            return self.updates + 1 <= self.owed(self.inserts)
        return self.updates + 1 <= self.inserts * self.ratio / self.replayed_per_update + self.tolerance

    def can_insert(self):
        return self.inserts * self.ratio / self.replayed_per_update - self.updates <= self.tolerance

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


def total_updates(config):
    """Updates a run makes from its start to `steps` frames: the pretraining, then train_ratio replayed
    steps per policy step after the prefill (Trainer.train: the prefill's steps count as paid for)."""
    policy_steps = max(0, config.steps - config.prefill) / config.action_repeat
    return config.pretrain + int(policy_steps * config.train_ratio / (config.batch_size * config.batch_length))


# ==================================================================================================
# 5. Processes
# ==================================================================================================


class SingleProcess:
    """The one process of a run started without torchrun: every collective is the identity.

    `Distributed` replaces it under torchrun; models and the training loop call the same methods
    either way, so the rank setup is this one choice (see `processes`)."""

    rank, world_size, local_rank, is_main = 0, 1, 0, True

    def device(self, requested):
        return requested

    def describe(self):
        return "1"

    def average_(self, tensors):
        """Average `tensors` over processes, in place."""

    def all_gather(self, tensor):  # (N, ...) per process -> (world_size * N, ...)
        return tensor

    def gather_object(self, value):
        """[value of rank 0, rank 1, ...] on the main process, None elsewhere."""
        return [value]

    def max(self, value):
        return value

    def max_each(self, values):
        """The maximum over processes of each number in `values` (a list), in one collective."""
        return list(values)

    def all(self, flag):
        return flag

    def broadcast_(self, tensors):
        """Overwrite `tensors` with the main process's, in place."""

    def barrier(self):
        pass

    def close(self):
        pass


class Distributed(SingleProcess):
    """One of `world_size` processes of a data-parallel run (torch.distributed, launched by torchrun):
    NCCL between GPUs, gloo between CPU processes. Rank 0 is the main process.

    Collectives run in the same order on every process; `timeout` bounds how long one waits for a
    process that hangs (one that dies ends the job at once: torchrun stops the others)."""

    def __init__(self, rank, world_size, local_rank, device, timeout):
        import torch.distributed as dist

        self.dist, self.rank, self.world_size, self.local_rank = dist, rank, world_size, local_rank
        self.is_main = rank == 0
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            torch.cuda.set_device(local_rank)
        self.backend = "nccl" if self.cuda else "gloo"
        kwargs = {"device_id": torch.device("cuda", local_rank)} if self.cuda else {}
        dist.init_process_group(self.backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout), **kwargs)

    def device(self, requested):
        """cuda -> cuda:<local rank>: one GPU per process on each machine."""
        return f"cuda:{self.local_rank}" if self.cuda else requested

    def describe(self):
        return f"{self.world_size} (torchrun, {self.backend}; this is rank {self.rank})"

    def average_(self, tensors):
        tensors = list(tensors)
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])  # one collective per optimizer step
        self.dist.all_reduce(flat)
        flat /= self.world_size
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def all_gather(self, tensor):
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.dist.all_gather(parts, tensor)
        return torch.cat(parts)

    def gather_object(self, value):
        out = [None] * self.world_size if self.is_main else None
        self.dist.gather_object(value, out, dst=0)
        return out

    def _reduce(self, value, op):
        tensor = torch.tensor([value], dtype=torch.float64, device=self._device())
        self.dist.all_reduce(tensor, op=op)
        return tensor.item()

    def _device(self):
        return torch.device("cuda", self.local_rank) if self.cuda else torch.device("cpu")

    def max(self, value):
        return type(value)(self._reduce(value, self.dist.ReduceOp.MAX))

    def max_each(self, values):
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self._device())
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX)
        return tensor.tolist()

    def all(self, flag):
        return bool(self._reduce(float(bool(flag)), self.dist.ReduceOp.MIN))

    def broadcast_(self, tensors):
        for t in tensors:
            self.dist.broadcast(t, src=0)

    def barrier(self):
        self.dist.barrier()

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class Stops:
    """SIGTERM and Ctrl-C as a request to stop, for a run of several processes: every rank must stop
    at the same update and save one checkpoint together, so the signal handler only notes the
    request (`code`: 1 Ctrl-C, 2 SIGTERM) and `Agreement` exchanges it. A second signal, `repeat_after`
    seconds or more after the first, stops at once (raises `exceptions[signal]()`). Signals closer
    together are the same request: torchrun forwards the SIGTERM or Ctrl-C it gets to every worker,
    and schedulers (SLURM) and terminals signal the whole group, so each worker gets one stop twice
    within milliseconds. Handlers are installed for the `with` block (main thread only), and only
    when `enabled`: a single process keeps the immediate KeyboardInterrupt path."""

    CODES = {signal.SIGINT: 1, signal.SIGTERM: 2}  # exchanged by max: SIGTERM wins over Ctrl-C

    def __init__(self, exceptions, enabled=True, repeat_after=2.0):
        self.exceptions, self.enabled, self.repeat_after = exceptions, enabled, repeat_after
        self.code, self.first, self.previous = 0, None, {}

    def handle(self, signum, frame):
        now = time.monotonic()
        if self.code and now - self.first >= self.repeat_after:
            raise self.exceptions[signum]()
        if not self.code:
            self.first = now
        self.code = max(self.code, self.CODES[signum])

    def exception(self, code):
        """The exception a stop agreed with `code` ends the run with (as its signal would)."""
        return next(self.exceptions[sig] for sig, c in self.CODES.items() if c == code)()

    def __enter__(self):
        if self.enabled and threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handle) for sig in self.CODES}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


class Agreement:
    """What the ranks of a run decide together at a point each reaches at the same iteration: whether
    every replay is ready to train, whether a checkpoint is due (any rank's `clock`, a `Clock`) and
    whether any rank was asked to stop (`stops.code`). One collective of three numbers, at the update
    boundary (Trainer.update, whose readiness check was that collective already): the counters and
    schedules are the same on every rank, so all reach it together, at every iteration that owes
    updates; never once per update. Without torchrun it exchanges nothing."""

    def __init__(self, ranks, clock, stops):
        self.ranks, self.clock, self.stops = ranks, clock, stops
        self.save_due, self.stop_code = False, 0

    def settle(self, ready):
        """Whether every rank is `ready`; notes a due save and a stop request, kept until acted on."""
        not_ready, due, stop = self.ranks.max_each([float(not ready), float(self.clock()), float(self.stops.code)])
        self.save_due = self.save_due or bool(due)
        self.stop_code = max(self.stop_code, int(stop))
        return not not_ready

    def saved(self):
        self.save_due = False
        self.clock.reset()


def torchrun_rank():
    """(rank, world size, local rank) from the variables torchrun sets, or None without torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def processes(device, timeout=1800):
    """The rank setup, chosen in this one place: `Distributed` under torchrun, else `SingleProcess`."""
    found = torchrun_rank()
    if found is None:
        return SingleProcess()
    return Distributed(*found, device, timeout)


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


def resolve_device(config):
    """Fall back to the CPU where CUDA is absent. Returns the config (a new one when it falls back)
    and the reason, for the start-up summary (None when the device is there)."""
    try:
        device = torch.device(config.device)
    except RuntimeError:
        raise ConfigError(f"Invalid value '{config.device}' for --device; valid: cpu, cuda, cuda:<index>") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        return config.replace(device="cpu"), "CUDA is not available"
    return config, None


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


# ==================================================================================================
# 6. Configuration
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


def valid_regex(text):
    try:
        re.compile(text)
    except (re.error, TypeError):
        return False
    return True


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


def save_config(config, path):
    from ruamel.yaml import YAML

    buffer = io.StringIO()
    YAML(typ="safe", pure=True).dump(config.to_dict(), buffer)
    atomic_write_bytes(path, buffer.getvalue().encode())
