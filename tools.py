"""Leaf utilities that the rest of the project builds on, in five sections (in this order):

1. Distributions: symlog/symexp, two-hot, one-hot with unimix, bounded normal, MSE heads.
2. Files: atomic writes (through a temporary file, synced, renamed) and write errors; the fault
   points a test can stop a write at; whether a nest of tensors is finite.
3. Schedules: the counters that decide when to train, log and evaluate, the checkpoint clock, and
   the asynchronous loop's samples-per-insert rate limiter.
4. Processes: one training process, or one of several started by torchrun (data parallel), and
   the stops and saves they agree on.
5. Configuration: the read-only Config (here, a leaf, because spawned environment workers unpickle
   it), the error a user's mistake raises, and the helpers the modules below config.py read
   (config.py holds the schema, the parser and the checks).

Episode and checkpoint files and the replay are in storage.py, logging and progress in logs.py. Nothing here
imports another module of the project or knows about the world model or the environments.
"""

import contextlib
import copy
import ctypes
import datetime
import errno
import os
import pathlib
import random
import re
import signal
import threading
import time
import uuid

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
# 2. Files
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
    see half; a kill -9 may leave the temporary file, which the next start clears (episode files:
    storage.recover_episodes; the logdir's: `resume_checkpoint`).

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
# 3. Schedules
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
# 4. Processes
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


# The NVIDIA driver each CUDA major version of a torch build needs (NVIDIA's CUDA release notes:
# 13.x from R580, 12.x from R525 with minor-version compatibility).
CUDA_DRIVERS = {"13": "R580", "12": "R525"}
CUDA_FIX = ("install a torch built for an older CUDA (README, Install: e.g. --index-url "
            "https://download.pytorch.org/whl/cu126) or update the driver, or run with --device cpu")


def cuda_problem(device):
    """Why `device` (a torch.device of type cuda) cannot be used here, in torch's own words with
    the fix; None when it can."""
    built = torch.version.cuda
    if built is None:
        return (f"this torch ({torch.__version__}) is a CPU build, without CUDA; install a CUDA one "
                "(README, Install: python3 -m pip install --force-reinstall torch==2.13.0) or run with --device cpu")
    driver = CUDA_DRIVERS.get(built.split(".")[0], f"for CUDA {built}")
    needs = f"torch {torch.__version__} is built for CUDA {built} (NVIDIA driver {driver} or newer)"
    try:
        torch.cuda.init()  # raises with torch's reason: no driver, a driver too old, no GPU
    except (RuntimeError, AssertionError) as e:
        reason = " ".join(str(e).split()).split(". ")[0].rstrip(".") or type(e).__name__
        return f"{reason}; {needs}; {CUDA_FIX}"
    count = torch.cuda.device_count()
    if not count:
        return f"no CUDA GPU is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); {needs}"
    if device.index is not None and device.index >= count:
        return f"there is no GPU {device.index}: this machine has {count} (cuda:0 to cuda:{count - 1})"
    return None


def resolve_device(config):
    """Settle --device: `auto` is cuda:0 where CUDA can be used and the CPU otherwise; an explicit
    cuda that cannot be used is a ConfigError naming torch's reason and the fix (a run meant for a
    GPU never runs on the CPU unasked). Returns the config and, for `auto`, the reason for its
    choice (the start-up summary prints it); None for an explicit device."""
    if config.device == "auto":
        problem = cuda_problem(torch.device("cuda", 0))
        if problem is None:
            return config.replace(device="cuda:0"), f"auto: CUDA is usable ({torch.cuda.get_device_name(0)})"
        return config.replace(device="cpu"), f"auto: no usable GPU, so the CPU: {problem.split('; ')[0]}"
    try:
        device = torch.device(config.device)
    except RuntimeError:
        raise ConfigError(f"Invalid value '{config.device}' for --device; valid: auto, cpu, cuda, "
                          "cuda:<index>") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"Invalid value '{config.device}' for --device; valid: auto, cpu, cuda, cuda:<index>")
    problem = cuda_problem(device) if device.type == "cuda" else None
    if problem is not None:
        raise ConfigError(f"--device {config.device} cannot be used: {problem}")
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
# 5. Configuration
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
