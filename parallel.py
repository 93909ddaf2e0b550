"""Run environments in-process (`Damy`) or one per worker process (`Parallel`), same interface.

`step(action)` and `reset()` return a callable that yields the result. `Parallel` sends the
request at once and blocks only when the callable is called, so a loop that first sends to every
environment and then collects the results steps all of them at the same time.

A worker that raises, dies or hangs surfaces as `WorkerError` (or, with restart, as a fresh episode)
instead of a hang, and no worker outlives its parent: workers are daemons, closed by `close()`, by
a finalizer at exit and, if the parent is killed, by themselves.

Both count the seconds their environment spends in `step` where it runs (`step_seconds`,
`step_count`), for the per-environment step cost in the logs; `measure_env` times an environment
in-process and in workers before training, for `--envs auto` / `--parallel auto` in dreamer.py.
"""

import concurrent.futures
import multiprocessing
import os
import pickle
import select
import signal
import threading
import time
import traceback
import warnings
import weakref
from multiprocessing import shared_memory

import cloudpickle
import numpy as np

# Observation arrays of at least this many bytes come back through shared memory, not the pipe.
SHARED_MIN_BYTES = 1024


class Damy:
    """In-process environment with the same interface as `Parallel`.

    With `own_thread`, the environment lives on a thread of its own: it is built, stepped and closed
    there, whichever thread calls, and several such environments step at the same time. Rendering
    contexts (MuJoCo's EGL) are bound to the thread that uses them, so an environment that the main
    thread prefills and an actor thread then steps (dreamer.AsyncLoop) needs this.
    """

    in_process = True  # it steps when asked, in the caller's process: dreamer.Collector asks it last

    def __init__(self, ctor, index=0, own_thread=False):
        self.index = index
        self.step_seconds, self.step_count = 0.0, 0  # time inside env.step, on whichever thread runs it
        self._thread = concurrent.futures.ThreadPoolExecutor(1, f"env{index}") if own_thread else None
        self.env = self._call(ctor)()

    def _call(self, method, *args):
        """A callable that yields `method(*args)`, run on the environment's thread if it has one."""
        if self._thread is None:
            result = method(*args)
            return lambda: result
        return self._thread.submit(method, *args).result

    @property
    def obs_space(self):
        return self.env.obs_space

    @property
    def act_space(self):
        return self.env.act_space

    def step(self, action):
        return self._call(self._timed_step, action)

    def _timed_step(self, action):
        start = time.perf_counter()
        result = self.env.step(action)
        self.step_seconds += time.perf_counter() - start
        self.step_count += 1
        return result

    def reset(self):
        return self._call(self.env.reset)

    def close(self):
        self._call(self.env.close)()
        if self._thread is not None:
            self._thread.shutdown()


class WorkerError(RuntimeError):
    """An environment worker failed: it raised, died or stopped answering.

    `index` is the environment's index; `traceback` the worker's traceback if the environment raised.
    """

    def __init__(self, index, message, worker_traceback=None):
        self.index, self.traceback = index, worker_traceback
        text = f"Environment {index}: {message}"
        if worker_traceback:
            text += f"\nTraceback in the worker process:\n{worker_traceback}"
        super().__init__(text)


# --------------------------------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------------------------------


class _Shared:
    """Stands in a reply for an array that the worker wrote to shared memory."""


def _worker(conn, payload, parent_pid):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    env, buffers = None, {}
    try:
        env = cloudpickle.loads(payload)()
        _send(conn, ("ok", (env.obs_space, env.act_space)))  # unasked: the parent reads it on first use
        while True:
            method, args = pickle.loads(conn.recv_bytes())
            if method == "close":
                return
            if method == "attach":
                buffers = {key: _attach(*spec) for key, spec in args.items()}
                continue
            start = time.perf_counter()
            result = getattr(env, method)(*args)
            if method == "reset":
                result = _to_shared(result, buffers)
            else:  # the step's own seconds go last: the parent's wait also holds the others' steps
                result = (_to_shared(result[0], buffers), *result[1:], time.perf_counter() - start)
            _send(conn, ("ok", result))
    except EOFError:
        pass  # the parent closed its end of the pipe
    except Exception:  # every error goes back to the parent, with its traceback
        try:
            _send(conn, ("error", traceback.format_exc()))
        except OSError:
            pass  # the parent is gone
    finally:
        if env is not None:
            try:
                env.close()
            except Exception:  # closing a broken environment may fail too; the process ends anyway
                pass


def _send(conn, message):
    # Plain pickle: cheaper per message than Connection.send; cloudpickle only ships the constructor.
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def _watch_parent(parent_pid):
    # A dead parent shows on the pipe only when the worker next reads it; an environment stuck in a
    # long step would outlive it, so look once a second whether the worker was orphaned.
    while os.getppid() == parent_pid:
        time.sleep(1)
    os._exit(1)


def _attach(name, shape, dtype):
    memory = shared_memory.SharedMemory(name)
    return memory, np.ndarray(shape, dtype, memory.buf)  # the memory object keeps the mapping alive


def _to_shared(obs, buffers):
    """Write the arrays that fit a shared buffer into it; the reply carries a `_Shared` marker instead."""
    obs = dict(obs)
    for key, (_, array) in buffers.items():
        value = obs.get(key)
        if isinstance(value, np.ndarray) and value.shape == array.shape and value.dtype == array.dtype:
            array[...] = value
            obs[key] = _Shared()
    return obs


# --------------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------------


class _Lost(Exception):
    """The worker died or stopped answering (as opposed to the environment raising)."""


class _Worker:
    """A worker process and the parent's end of its pipe; stopped by `stop()`, collection or exit."""

    def __init__(self, context, payload):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, payload, os.getpid()), daemon=True)
        # An ignored signal stays ignored in the child, so a Ctrl-C cannot interrupt its start-up
        # either, before `_worker` runs. (Only the main thread may change handlers; a Ctrl-C in
        # these few milliseconds is lost.)
        main = threading.current_thread() is threading.main_thread()
        handler = signal.getsignal(signal.SIGINT) if main else None  # None: not ours to change
        if handler is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.process.start()
        finally:
            if handler is not None:
                signal.signal(signal.SIGINT, handler)
        child.close()
        self.poller = select.poll()
        self.poller.register(self.conn.fileno(), select.POLLIN)
        self.poller.register(self.process.sentinel, select.POLLIN)
        self.stop = weakref.finalize(self, _stop, self.process, self.conn)  # also runs at exit

    def send(self, message):
        try:
            self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        except OSError:
            pass  # the worker is gone; waiting for its reply finds out how

    def receive(self, timeout):
        """The next reply; raises `_Lost` if the worker died or did not answer within `timeout` s."""
        # One poll over the pipe and the process sentinel: a reply and a death are both seen at once.
        ready = dict(self.poller.poll(None if timeout is None else timeout * 1000))
        if not ready.get(self.conn.fileno(), 0) & select.POLLIN:
            # Only the sentinel (or a hang-up of the pipe): do not read, as a child of the environment
            # may still hold the pipe's other end open and the read would block.
            if not ready:
                raise _Lost(f"did not answer within {timeout} s")
            raise _Lost(_exit_reason(self.process))
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise _Lost(_exit_reason(self.process)) from None


def _stop(process, conn):
    try:
        conn.send_bytes(pickle.dumps(("close", None)))
    except OSError:
        pass  # already gone
    process.join(1)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


def _exit_reason(process):
    process.join(1)  # the exit code is known only once it is reaped
    code = process.exitcode
    if code is None:
        return "closed its pipe"
    if code < 0:
        return f"died from signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _unlink(buffers):
    for memory, _, _ in buffers.values():
        memory.unlink()
        try:
            memory.close()
        except BufferError:
            pass  # an array still points into it; the mapping goes with that array


class Parallel:
    """One environment in its own worker process, with the interface of `Damy`.

    The worker is started with the spawn method and builds the environment from `ctor`, sent with
    cloudpickle; construction does not wait for it, so many environments start at the same time.
    Observation arrays of at least `SHARED_MIN_BYTES` come back through shared memory.

    A worker that dies or does not answer within `timeout` seconds is replaced by a fresh one when
    `restart` is true: a pending `step` then returns the new episode's first observation as
    `(obs, 0.0, False, {"restarted": True})`. Otherwise, and whenever the environment raises, the
    call raises `WorkerError`, and so does every later call.
    """

    in_process = False  # a request returns at once: dreamer.Collector sends these first

    def __init__(self, ctor, index=0, restart=True, timeout=600, shared_memory=True):
        self.index, self.restart, self.timeout, self.shared_memory = index, restart, timeout, shared_memory
        self._context = multiprocessing.get_context("spawn")
        self._payload = cloudpickle.dumps(ctor)
        self._spaces = None
        self._buffers = {}  # key -> (SharedMemory, shape, dtype), kept across restarts
        self._release = weakref.finalize(self, _unlink, self._buffers)  # also runs at exit
        self._failure = None  # the WorkerError that ended this environment
        self._pending = None  # the callable of the request in flight
        self._worker = _Worker(self._context, self._payload)
        self._connected = False
        self.step_seconds, self.step_count = 0.0, 0  # time inside env.step, measured in the worker

    @property
    def pid(self):
        """Process id of the current worker (a restart changes it)."""
        return self._worker.process.pid

    @property
    def obs_space(self):
        self._ensure_connected()
        return self._spaces[0]

    @property
    def act_space(self):
        self._ensure_connected()
        return self._spaces[1]

    def step(self, action):
        return self._request("step", action)

    def reset(self):
        return self._request("reset")

    def close(self):
        self._worker.stop()
        self._release()
        self._failure = self._failure or WorkerError(self.index, "used after close()")

    def _ensure_connected(self):
        if self._failure:
            raise self._failure
        if not self._connected:
            try:
                self._connect()
            except _Lost as e:
                self._fail(f"the worker {e} while building the environment")
            except WorkerError as e:
                self._fail(e)

    def _connect(self):
        """Take the spaces the worker sends once its environment exists; give it the shared buffers."""
        status, result = self._worker.receive(self.timeout)
        if status == "error":
            raise WorkerError(self.index, "building the environment raised", result)
        if self._spaces is None:
            self._spaces = result
            if self.shared_memory:
                self._create_buffers(result[0])
        if self._buffers:
            specs = {key: (memory.name, shape, dtype) for key, (memory, shape, dtype) in self._buffers.items()}
            self._worker.send(("attach", specs))
        self._connected = True

    def _create_buffers(self, obs_space):
        for key, space in obs_space.items():
            shape, dtype = getattr(space, "shape", None), getattr(space, "dtype", None)
            if shape is None or dtype is None or np.dtype(dtype).kind not in "biuf":
                continue
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if size >= SHARED_MIN_BYTES:
                memory = shared_memory.SharedMemory(create=True, size=size)
                self._buffers[key] = (memory, tuple(shape), np.dtype(dtype))

    def _request(self, method, *args):
        if self._pending is not None:
            self._pending()  # every reply uses the same shared buffers: take the last one out first
        self._ensure_connected()
        self._worker.send((method, args))
        result = []

        def reply():
            if not result:
                result.append(self._reply(method))
                self._pending = None  # only now: after an interruption the next request drains this reply
            return result[0]

        self._pending = reply
        return reply

    def _reply(self, method):
        if self._failure:
            raise self._failure
        try:
            status, result = self._worker.receive(self.timeout)
        except _Lost as e:
            reason = str(e)
        else:
            if status == "error":
                self._fail(WorkerError(self.index, f"{method}() raised in the worker", result))
            return self._unpack(method, result)
        self._worker.process.kill()  # it may only be stuck; either way it is done
        self._worker.stop()
        if not self.restart:
            self._fail(f"the worker process {reason}; not restarted (restart=False, env_failure: stop)")
        warnings.warn(f"Environment {self.index}: the worker process {reason}; restarting it and "
                      "dropping its episode.", RuntimeWarning, stacklevel=3)
        obs = self._restart()
        return obs if method == "reset" else (obs, 0.0, False, {"restarted": True})

    def _restart(self):
        """A fresh worker with a fresh episode; fails for good if that does not work either."""
        self._worker = _Worker(self._context, self._payload)
        self._connected = False
        try:
            self._connect()
            self._worker.send(("reset", ()))
            status, result = self._worker.receive(self.timeout)
        except (_Lost, OSError) as e:
            self._fail(f"the worker was restarted, but the new one failed too: {e}")
        except WorkerError as e:
            self._fail(e)
        if status == "error":
            self._fail(WorkerError(self.index, "reset() raised in the restarted worker", result))
        return self._unpack("reset", result)

    def _fail(self, error):
        """Remember the error, so every later call raises it too, stop the worker and raise."""
        self._failure = error if isinstance(error, WorkerError) else WorkerError(self.index, error)
        self._worker.stop()
        raise self._failure

    def _unpack(self, method, result):
        if method == "step":
            *result, seconds = result
            result = tuple(result)
            self.step_seconds += seconds
            self.step_count += 1
        obs = result if method == "reset" else result[0]
        for key, value in obs.items():
            if isinstance(value, _Shared):  # copied out: the buffer is overwritten by the next step
                memory, shape, dtype = self._buffers[key]
                obs[key] = np.ndarray(shape, dtype, memory.buf).copy()
        return result


# --------------------------------------------------------------------------------------------------
# Measuring an environment's cost (for --envs auto / --parallel auto)
# --------------------------------------------------------------------------------------------------


def random_action(act_space, rng):
    """A uniform action: one of the one-hot vectors of a discrete space, else a point in the box."""
    if getattr(act_space, "discrete", False):
        action = np.zeros(act_space.shape, np.float32)
        action[rng.integers(act_space.shape[0])] = 1.0
        return action
    return rng.uniform(act_space.low, act_space.high).astype(np.float32)


def _seconds_per_step(env_list, steps, budget, rng):
    """Wall-clock seconds per step of all of `env_list` stepping together (resets included, as in
    training), over `steps` steps or fewer once `budget` seconds have passed; 3 untimed steps first."""
    for env in env_list:
        env.reset()()
    act_space = env_list[0].act_space
    timed, start = 0, None
    for i in range(steps + 3):
        if i == 3:
            start = time.perf_counter()
        futures = [env.step(random_action(act_space, rng)) for env in env_list]
        for env, future in zip(env_list, futures):
            if future()[2]:
                env.reset()()
        timed = i - 2
        if start is not None and timed >= 10 and time.perf_counter() - start > budget:
            break
    return (time.perf_counter() - start) / max(timed, 1)


def measure_env(ctor, steps=200, workers=2, budget=5.0, seed=0):
    """What an environment costs, in-process and in worker processes: a dict of
      step_ms: one step in-process (the caller's thread);
      worker_ms: one step round trip to one worker (its step, the transfer and two wake-ups);
      extra_worker_ms: what each further worker adds to a step of `workers` workers stepping
        together (the parent's serial share: sending, receiving, copying out), 0 if none;
      worker_start_s: from starting a worker until its first observation arrives;
    and the environment's spaces, obs_space and act_space. Each timing runs `steps` steps or
    `budget` seconds, whichever ends first."""
    rng = np.random.default_rng(seed)
    env = Damy(ctor)
    try:
        out = {"obs_space": env.obs_space, "act_space": env.act_space}
        out["step_ms"] = 1e3 * _seconds_per_step([env], steps, budget, rng)
    finally:
        env.close()
    start = time.perf_counter()
    pool = [Parallel(ctor, i, restart=False) for i in range(max(1, workers))]
    try:
        pool[0].reset()()
        out["worker_start_s"] = time.perf_counter() - start
        one = _seconds_per_step(pool[:1], steps, budget, rng)
        out["worker_ms"] = 1e3 * one
        together = _seconds_per_step(pool, steps, budget, rng) if len(pool) > 1 else one
        out["extra_worker_ms"] = 1e3 * max(0.0, together - one) / max(len(pool) - 1, 1)
    finally:
        for worker in pool:
            worker.close()
    return out
