"""Shared building blocks, in five sections (in this order):

1. Distributions: symlog/symexp, two-hot, one-hot with unimix, bounded normal, MSE heads.
2. Replay: episode files written atomically as .npz, and the sequence replay buffer.
3. Logging: TensorBoard + metrics.jsonl, videos, atomic checkpoint files.
4. Schedules: the counters that decide when to train, log and evaluate, and the asynchronous
   loop's samples-per-insert rate limiter.
5. Processes: one training process, or one of several started by torchrun (data parallel).

Nothing here knows about the world model or the environments.
"""

import collections
import datetime
import io
import json
import os
import pathlib
import pickle
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


def save_episode(directory, episode):
    """Write one episode (dict of arrays, time first) as compressed .npz, atomically.

    The file name carries time stamp, a unique id and the length, so that the newest episodes can
    be found from names alone and a crash never leaves a half-written episode behind.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    length = len(episode["reward"])
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S%f")
    filename = directory / f"{stamp}-{uuid.uuid4().hex[:8]}-{length}.npz"
    with io.BytesIO() as buffer:
        np.savez_compressed(buffer, **episode)
        atomic_write_bytes(filename, buffer.getvalue())
    return filename


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


def skip_warning(filename, problem):
    """One line per skipped episode file."""
    print(f"warning: skipping episode {filename}: {problem}", file=sys.stderr, flush=True)


def load_episodes(directory, limit=None, spec=None, on_skip=skip_warning):
    """Load the newest episodes whose lengths sum to at most `limit` steps, oldest first.

    A corrupt or unreadable file, and with `spec` (see `episode_spec`) an episode that does not
    fit the run's spaces, is skipped and reported to `on_skip(filename, problem)`, never fatal.
    Stored policy latents are fitted to the spec first (`fit_latents`). With `spec`, an episode
    without `task` gets task 0 at every step (OPTIONAL_KEYS).
    """
    directory = pathlib.Path(directory)
    if not directory.exists():
        return []
    files = sorted(directory.glob("*.npz"), reverse=True)
    episodes, total = [], 0
    for filename in files:
        try:
            with filename.open("rb") as f:
                data = np.load(f)
                episode = {k: data[k] for k in data.keys()}
            if spec is not None:
                episode = fit_latents(episode, spec)
            problem = episode_problem(episode, spec) if spec is not None else None
            if problem is None and "reward" not in episode:
                problem = "missing key 'reward'"
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, never fatal
            problem = f"unreadable ({e})"
        if problem is not None:
            on_skip(filename, problem)
            continue
        length = len(episode["reward"])
        if limit is not None and total + length > limit:
            break
        total += length
        if spec is not None and "task" in spec and "task" not in episode:
            episode["task"] = np.zeros(length, np.int32)
        episodes.append(episode)
    return episodes[::-1]


def stored_steps(directory):
    """Policy steps held in a folder's episode files, read from their names (`...-<length>.npz`,
    which counts the first, action-less step too) without opening them."""
    total = 0
    for filename in pathlib.Path(directory).glob("*.npz"):
        try:
            total += max(0, int(filename.stem.rsplit("-", 1)[1]) - 1)
        except (IndexError, ValueError):
            continue
    return total


class Stream:
    """Ring buffer of consecutive steps from one environment, as growable numpy arrays."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.data = {}
        self.count = 0  # steps ever written

    def __len__(self):
        return min(self.count, self.capacity)

    def add(self, step):
        """Append one step; returns its index among all steps ever written (its id in this stream)."""
        if not self.data:
            size = min(self.capacity, 1024)
            self.data = {k: np.empty((size, *np.shape(v)), np.asarray(v).dtype) for k, v in step.items()}
        size = len(next(iter(self.data.values())))
        if self.count == size and size < self.capacity:
            new = min(self.capacity, 2 * size)
            for key, array in self.data.items():
                grown = np.empty((new, *array.shape[1:]), array.dtype)
                grown[:size] = array
                self.data[key] = grown
        index = self.count % self.capacity
        for key, value in step.items():
            self.data[key][index] = value
        self.count += 1
        return self.count - 1

    def indices(self, starts, length):
        """Physical indices (len(starts), length) of logical positions (0 = oldest step)."""
        offset = self.count % self.capacity if self.count > self.capacity else 0
        return (offset + starts[:, None] + np.arange(length)[None]) % self.capacity

    def first(self):
        """Id (index among all steps ever written) of the oldest step still held."""
        return self.count - len(self)

    def write(self, first, values):
        """Overwrite the steps with ids first, first + 1, ... by values (dict of (L, ...) arrays);
        steps no longer held (dropped for newer ones) are left out."""
        ids = first + np.arange(len(next(iter(values.values()))))
        held = (ids >= self.first()) & (ids < self.count)
        phys = ids[held] % self.capacity  # a step's slot: its id modulo the capacity (see add)
        for key, value in values.items():
            self.data[key][phys] = np.asarray(value)[held]


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

    def __init__(self, capacity, streams, seed=0):
        per_stream = max(1, int(np.ceil(capacity / streams)))
        self.streams = [Stream(per_stream) for _ in range(streams)]
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()

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
        """A batch of sequences: dict of arrays (batch, length, ...); with `ids` also the id of each
        sequence's first step, (batch, 2) int64 of (stream, index), for `update`. `alloc(shape,
        dtype)` makes each array the batch is copied into (Prefetcher: pinned memory)."""
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
                    out[key] = alloc((batch, length, *array.shape[1:]), array.dtype)
                out[key][rows] = array[phys]
        return out, first


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
        self.ahead = self.cuda if ahead is None else ahead
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
                    batch[key][r, low - start:high - start] = np.asarray(value)[q, low - first:high - first]


# ==================================================================================================
# 3. Logging and checkpoint files
# ==================================================================================================


def atomic_write_bytes(path, data):
    """Write `data` to `path` through a temporary file and a rename, so readers never see half."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, unsafe to unpickle, or with non-finite values."""


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
    """Write `state` to `path` atomically and keep the checkpoint it replaces as previous.pt.

    A kill between the two renames leaves only previous.pt, which `load_checkpoint_or_previous`
    falls back to. Non-finite weights are refused: they would replace the last good checkpoint.
    """
    if not all_finite(state):
        raise CheckpointError("the state to save holds non-finite values")
    path = pathlib.Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    atomic_write_bytes(tmp, buffer.getvalue())
    # Ctrl-C or SIGTERM between the renames would leave only previous.pt; hold them until done.
    signals = {signal.SIGINT, signal.SIGTERM}
    blocked = threading.current_thread() is threading.main_thread()
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        if path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def load_checkpoint(path, device="cpu"):
    """Load a checkpoint without running code from it (`weights_only`: tensors and plain data).

    Raises CheckpointError, with the reason in one line, for anything else.
    """
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch names what it refused after "WeightsUnpickler error:"; "Unsupported global" means
        # the file asks to call or build something, anything else is a damaged file.
        reason = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:200]
        if "global" not in reason.lower():
            raise CheckpointError(f"cannot read {path}: not a checkpoint ({reason})") from None
        raise CheckpointError(f"refusing to load {path}: it holds objects other than tensors and plain data, "
                              f"which could run code ({reason})") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {str(e).strip().splitlines()[0][:200]}") from None


def load_checkpoint_or_previous(path, device="cpu"):
    """(state, path it came from, notes) from `path`, or from previous.pt when `path` is missing,
    unreadable or non-finite; (None, None, notes) when neither exists.

    A checkpoint that is unsafe to unpickle is an error, never skipped: someone changed the file.
    """
    path, notes = pathlib.Path(path), []
    for candidate in (path, previous_path(path)):
        if not candidate.exists():
            if candidate == path and previous_path(path).exists():
                notes.append(f"{path} is missing")
            continue
        try:
            state = load_checkpoint(candidate, device)
        except CheckpointError as e:
            if "refusing" in str(e):
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


class Logger:
    """Scalars and videos to TensorBoard and scalars to `metrics.jsonl`, written at `write()`.

    Scalars may be tensors; they are converted to floats only when written, so the training step
    never waits on the device for logging.
    """

    def __init__(self, logdir, step=0):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = pathlib.Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        # A resumed run continues its curves: events written after the checkpoint are dropped.
        self.writer = SummaryWriter(str(self.logdir), purge_step=step if step else None, max_queue=1000)
        self.jsonl = self.logdir / "metrics.jsonl"
        if step:
            self._truncate_jsonl(step)
        self.scalars = collections.defaultdict(list)
        self.videos = {}

    def _truncate_jsonl(self, step):
        if not self.jsonl.exists():
            return
        keep = [line for line in self.jsonl.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        atomic_write_bytes(self.jsonl, "".join(line + "\n" for line in keep).encode())

    def scalar(self, name, value):
        self.scalars[name].append(value)

    def video(self, name, value):
        self.videos[name] = value

    def write(self, step):
        values = {}
        for name, items in self.scalars.items():
            values[name] = float(torch.as_tensor([float(v) for v in items], dtype=torch.float64).mean())
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        for name, video in self.videos.items():
            self._write_video(name, video, step)
        if values:
            with self.jsonl.open("a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")
        self.writer.flush()
        self.scalars.clear()
        self.videos.clear()
        return values

    def _write_video(self, name, video, step):
        """video: (B, T, H, W, C) uint8 or float in [0, 1]; batch entries are laid side by side."""
        video = np.asarray(video)
        if np.issubdtype(video.dtype, np.floating):
            video = np.clip(255 * video, 0, 255).astype(np.uint8)
        batch, time, height, width, channels = video.shape
        frames = video.transpose(1, 2, 0, 3, 4).reshape(1, time, height, batch * width, channels)
        try:
            self.writer.add_video(name, frames.transpose(0, 1, 4, 2, 3), step, fps=16)
        except Exception as e:  # noqa: BLE001 - a missing video encoder must not end training
            warnings.warn(f"Could not write video {name}: {e}", stacklevel=2)

    def text(self, name, value, step):
        self.writer.add_text(name, value, step)

    def close(self):
        self.writer.close()


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
