"""Where a run executes: its processes, its device and each process's random state.

- Processes: the one process of a plain run (`SingleProcess`) or one of several started by torchrun
  (`Distributed`, data parallel), chosen in one place (`processes`); the stops (`Stops`) and saves
  (`Agreement`) that the ranks agree on.
- The device: --device settled (`resolve_device`), with the reason a GPU cannot be used
  (`cuda_problem`), and glibc kept from returning freed memory (`keep_freed_memory`).
- Random state: seeding (`seed_everything`), every generator's state as checkpoint data
  (`rng_state`, `set_rng_state`), and a measurement that leaves it as it was (`kept_random_state`).

Nothing here knows about the world model or the environments.
"""

import contextlib
import ctypes
import datetime
import os
import random
import signal
import threading
import time

import numpy as np
import torch

import distributions
from tools import ConfigError

# ==================================================================================================
# Processes: one, or torchrun's ranks
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
    """SIGTERM and Ctrl-C as a request to stop at the loop's next safe point: the handler only notes
    the request (`code`: 1 Ctrl-C, 2 SIGTERM), and the loop ends there (Trainer.stop_if_asked) after
    saving; under torchrun `Agreement` exchanges it first, so that every rank stops at the same update
    and saves one checkpoint together. A handler that raised from inside whatever code was running
    could land in a cleanup where Python discards the exception ("Exception ignored in ..."), and the
    run would go on: a noted request is never lost.

    A second signal `repeat_after` seconds or more after the first stops at once (raises
    `exceptions[signal]()`); signals closer together are the same request (torchrun forwards the
    SIGTERM or Ctrl-C it gets to every worker, and schedulers and terminals signal the whole group,
    so each worker gets one stop twice within milliseconds). A loop that does not reach its safe
    point within `deadline` seconds of the first signal (a long evaluation) is stopped as a second
    signal would, again every second until it is: a raise that a cleanup swallowed comes back.
    Handlers are installed for the `with` block (main thread only), and only when `enabled`; once a stop
    was noted they stay past it, for the run's closing, and whoever installed the ones before puts them back."""

    CODES = {signal.SIGINT: 1, signal.SIGTERM: 2}  # exchanged by max: SIGTERM wins over Ctrl-C

    def __init__(self, exceptions, enabled=True, repeat_after=2.0, deadline=20.0):
        self.exceptions, self.enabled, self.repeat_after, self.deadline = exceptions, enabled, repeat_after, deadline
        self.code, self.first, self.previous = 0, None, {}
        self.signum, self.overdue, self.timer = None, False, None

    def handle(self, signum, frame):
        now = time.monotonic()
        if self.overdue or (self.code and now - self.first >= self.repeat_after):
            raise self.exceptions[signum]()
        if not self.code:
            self.first, self.signum = now, signum
            if self.deadline is not None and self.previous:
                self.timer = threading.Timer(self.deadline, self.expire)
                self.timer.daemon = True
                self.timer.start()
        self.code = max(self.code, self.CODES[signum])

    def expire(self):
        """The deadline passed without a stop: the main thread gets the signal again, every second."""
        self.overdue = True
        while self.previous:
            import _thread

            _thread.interrupt_main(self.signum)
            time.sleep(1.0)

    def exception(self, code):
        """The exception a stop agreed with `code` ends the run with (as its signal would)."""
        return next(self.exceptions[sig] for sig, c in self.CODES.items() if c == code)()

    def __enter__(self):
        if self.enabled and threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handle) for sig in self.CODES}
        return self

    def __exit__(self, *exc):
        previous, self.previous = self.previous, {}  # ends the deadline's repeats
        if self.timer is not None:
            self.timer.cancel()
        if self.code:
            # The stop under way keeps this handler while the run closes its environments: a copy of the
            # same burst is still the same request (a raise there would cut a close short), a later signal
            # still stops at once. Whoever installed the handlers before it puts them back (dreamer.main).
            return
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Agreement:
    """What the ranks of a run decide together at a point each reaches at the same iteration: whether
    every replay is ready to train, whether a checkpoint is due (any rank's `clock`, a `Clock`) and
    whether any rank was asked to stop (`stops.code`). One collective of three numbers, at the update
    boundary (Trainer.update, whose readiness check was that collective already): the counters and
    schedules are the same on every rank, so all reach it together, at every iteration that owes
    updates; never once per update. Without torchrun it exchanges nothing."""

    def __init__(self, ranks, clock, stops):
        self.ranks, self.clock, self.stops = ranks, clock, stops
        self.save_due, self.agreed_stop = False, 0

    @property
    def stop_code(self):
        """The stop to act on: agreed at the last settle under torchrun; a single process reads its
        own request at once, at any safe point, updates owed or not."""
        own = self.stops.code if self.ranks.world_size == 1 else 0
        return max(self.agreed_stop, own)

    def settle(self, ready):
        """Whether every rank is `ready`; notes a due save and a stop request, kept until acted on."""
        not_ready, due, stop = self.ranks.max_each([float(not ready), float(self.clock()), float(self.stops.code)])
        self.save_due = self.save_due or bool(due)
        self.agreed_stop = max(self.agreed_stop, int(stop))
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


# ==================================================================================================
# The device and the memory allocator
# ==================================================================================================


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


# ==================================================================================================
# Random state
# ==================================================================================================


class SideStream:
    """A CUDA stream of its own for the device work of another thread (the asynchronous actor,
    dreamer.Trainer.train_asynchronously), so that each of its waits for the device (the action it
    needs back) waits for its own kernels, not behind the learner's queued update on the default
    stream. On a CPU it does nothing. `with side():` runs work on it; `with side.handover():` wraps a
    change of what its work reads (the learner's weights copied in, on the caller's stream): the copy
    waits for the work queued on the side stream, and the side stream's later work for the copy."""

    def __init__(self, device):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def handover(self):
        if self.stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        yield
        self.stream.wait_stream(current)


def seed_everything(seed, deterministic):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses otherwise
        torch.use_deterministic_algorithms(True)


def rng_state(replay_rng):
    """Every random state as tensors and plain lists, so checkpoints load with weights_only. The
    torch state is the one the samples draw from: this thread's generator where it has one (a
    seed of --seeds N, distributions.generator), else torch's global one."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    own = distributions.current_generator()
    # On CUDA the samples draw from each device's own generator: saved too, so that a resumed CUDA run
    # repeats the straight one ([] where CUDA was never used: nothing drew from it).
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return {"torch": torch.get_rng_state() if own is None else own.get_state(), "cuda": cuda,
            "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
            "python": [version, list(internal), gauss_next], "replay": replay_rng.bit_generator.state}


def set_rng_state(state, replay_rng):
    own = distributions.current_generator()
    if own is None:
        torch.set_rng_state(state["torch"])
    else:
        own.set_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():  # older checkpoints and CPU runs hold none
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    replay_rng.bit_generator.state = state["replay"]


@contextlib.contextmanager
def kept_random_state():
    """Random numbers drawn in the block leave no trace: every generator is as before it afterwards
    (resources.measure_costs times a throwaway agent in one, so the run starts as it would without)."""
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
