"""Run environments in-process (`Damy`) or one per worker process (`Parallel`), same interface.

`step(action)` and `reset()` return a callable that yields the result. `Parallel` sends the
request at once and blocks only when the callable is called, so a loop that first sends to every
environment and then collects the results steps all of them at the same time.

A worker that raises, dies or hangs surfaces as `WorkerError` (or, with restart, as a fresh episode)
instead of a hang, and no worker outlives its parent: workers are daemons, closed by `close()`, by
a finalizer at exit and, if the parent is killed, by themselves.

Both count the seconds their environment spends in `step` where it runs (`step_seconds`,
`step_count`), for the per-environment step cost in the logs (resources.measure_env times an
environment in-process and in workers before training, for `--envs auto` / `--parallel auto`).

Then the experience collection of a run (`Collector`, `make_envs`, `run_episodes`).
"""

import concurrent.futures
import functools
import multiprocessing
import os
import pickle
import queue
import select
import signal
import sys
import threading
import time
import traceback
import weakref
from multiprocessing import shared_memory

import cloudpickle
import numpy as np

import envs

# Observation arrays of at least this many bytes come back through shared memory, not the pipe.
SHARED_MIN_BYTES = 1024
# Seconds a worker gets at least to build its environment: a spawned process imports torch and the
# suite, and some simulators take minutes to start, far longer than a step (Parallel's `timeout`).
BUILD_SECONDS = 600


class Damy:
    """In-process environment with the same interface as `Parallel`.

    With `own_thread`, the environment lives on a thread of its own: it is built, stepped and closed
    there, whichever thread calls, and several such environments step at the same time. Rendering
    contexts (MuJoCo's EGL) are bound to the thread that uses them, so an environment that the main
    thread prefills and an actor thread then steps (CollectorThread) needs this.
    """

    in_process = True  # it steps when asked, in the caller's process: parallel.Collector asks it last

    def __init__(self, ctor, index=0, own_thread=False, name=None):
        self.index, self.name = index, name
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


def env_label(index, name=None):
    """How messages name an environment: `Environment 3 (dmc_walker_walk)`."""
    return f"Environment {index}" + (f" ({name})" if name else "")


class WorkerError(RuntimeError):
    """An environment worker failed: it raised, died or stopped answering.

    `index` is the environment's index; `traceback` the worker's traceback if the environment raised.
    """

    def __init__(self, index, message, worker_traceback=None, name=None):
        self.index, self.traceback = index, worker_traceback
        text = f"{env_label(index, name)}: {message}"
        if worker_traceback:
            text += f"\nTraceback in the worker process:\n{worker_traceback}"
        super().__init__(text)


class NonFiniteStep(ValueError):
    """An environment returned a NaN or infinite observation or reward: storing it would poison the replay."""


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
                raise _Lost(f"did not answer within {timeout} s (env_timeout)")
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

    A worker that dies, or does not answer a step or reset within `timeout` seconds (a stopped or
    hung simulator; building the environment gets at least BUILD_SECONDS), is replaced by a fresh
    one when `restart` is true, with a one-line warning on stderr: a pending `step` then returns the
    new episode's first observation as `(obs, 0.0, False, {"restarted": True})`. Otherwise, and
    whenever the environment raises, the call raises `WorkerError`, and so does every later call.
    `name` (the task) goes into these messages beside `index`.
    """

    in_process = False  # a request returns at once: parallel.Collector sends these first

    def __init__(self, ctor, index=0, restart=True, timeout=600, shared_memory=True, name=None):
        self.index, self.restart, self.timeout, self.shared_memory = index, restart, timeout, shared_memory
        self.name = name
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
        status, result = self._worker.receive(max(self.timeout, BUILD_SECONDS))
        if status == "error":
            raise WorkerError(self.index, "building the environment raised", result, self.name)
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
                self._fail(WorkerError(self.index, f"{method}() raised in the worker", result, self.name))
            return self._unpack(method, result)
        self._worker.process.kill()  # it may only be stuck; either way it is done
        self._worker.stop()
        if not self.restart:
            self._fail(f"the worker process {reason}; not restarted (restart=False, env_failure: stop)")
        lost = "dropping its episode" if method == "step" else "between episodes, nothing to drop"
        # One line, without the source location a warnings.warn would add.
        print(f"warning: {env_label(self.index, self.name)}: the worker process {reason}; restarting it ({lost}).",
              file=sys.stderr, flush=True)
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
            self._fail(WorkerError(self.index, "reset() raised in the restarted worker", result, self.name))
        return self._unpack("reset", result)

    def _fail(self, error):
        """Remember the error, so every later call raises it too, stop the worker and raise."""
        self._failure = error if isinstance(error, WorkerError) else WorkerError(self.index, error, name=self.name)
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
# A uniform random action, as an environment takes it (resources.py measures environments with it)
# --------------------------------------------------------------------------------------------------


def random_action(act_space, rng):
    """A uniform action: one of the one-hot vectors of a discrete space, else a point in the box."""
    if getattr(act_space, "discrete", False):
        action = np.zeros(act_space.shape, np.float32)
        action[rng.integers(act_space.shape[0])] = 1.0
        return action
    return rng.uniform(act_space.low, act_space.high).astype(np.float32)


# ==================================================================================================
# Experience collection: the environments of a run, stepped together under one policy
# ==================================================================================================


# Worker processes import this module and need neither torch nor the tools built on it: the parts
# below import `tools` and `torch` where they use them.

class Collector:
    """Steps a list of environments together under one batched policy and records every step.

    Each environment's steps go to its own replay stream; episodes are written to `directory`
    (in chunks of `chunk_size` steps while they run: storage.EpisodeWriter) and their return and
    length reported to `on_episode` when they end. With a replay `context`
    (models.ReplayContext, replay_context > 0) each step also holds the latent the policy
    computed on it, filled in once the policy has seen the step (zeros until then: the last step
    of an episode keeps them).
    """

    def __init__(self, env_list, replay, directory, on_episode, action_repeat=1, context=None, chunk_size=0):
        self.envs, self.replay, self.directory, self.on_episode = env_list, replay, directory, on_episode
        # Per environment: its episode files, written in chunks of chunk_size steps as they fill.
        if directory is not None:
            import storage

            self.writers = [storage.EpisodeWriter(directory, chunk_size) for _ in env_list]
        else:
            self.writers = None
        self.action_repeat = action_repeat
        self.context = context if context is not None and context.spec else None
        self.newest = [None] * len(env_list)  # per environment: (step, replay id) of the step the policy sees next
        self.obs = [None] * len(env_list)
        self.episodes = [[] for _ in env_list]
        self.state = None
        self.dropped = 0  # episodes lost to environment workers that died
        # Per environment: policy steps, finished episodes, last return; steps at the last status().
        self.env_steps = [0] * len(env_list)
        self.env_episodes = [0] * len(env_list)
        self.env_returns = [float("nan")] * len(env_list)
        self.env_restarts = [0] * len(env_list)
        self.status_mark = (time.time(), [0] * len(env_list), self.step_costs())
        act_space = env_list[0].act_space
        self.zero_action = np.zeros(act_space.shape, np.float32)
        # Every step records its environment's task (index into the --task list; 0 with one task).
        # In a run of several, a task may observe keys beyond those all share (envs.common_spaces):
        # they are dropped.
        self.tasks = [getattr(env, "task_index", 0) for env in env_list]
        self.dropped_keys = [getattr(env, "dropped_keys", frozenset()) for env in env_list]

    def _observe(self, index, obs):
        drop = self.dropped_keys[index]
        self.obs[index] = {k: v for k, v in obs.items() if k not in drop} if drop else obs
        return self.obs[index]

    def _record(self, index, obs, action, reward):
        step = {k: np.asarray(v) for k, v in obs.items()}
        step["action"] = np.asarray(action, np.float32)
        step["reward"] = np.float32(reward)
        bad = [k for k, v in step.items()
               if v.dtype.kind == "f" and k != "action" and not k.startswith("log_") and not np.isfinite(v).all()]
        if bad:  # refused before it reaches a file or the replay, where every update would sample it
            env = self.envs[index]
            label = env_label(getattr(env, "index", index), getattr(env, "name", None))
            raise NonFiniteStep(f"{label} returned a non-finite {', '.join(bad)} at step "
                                f"{len(self.episodes[index])} of its episode; it was not stored")
        step["task"] = np.int32(self.tasks[index])
        if self.context is not None:
            step.update({k: v[0] for k, v in self.context.entries(None, 1).items()})
        self.episodes[index].append(step)
        if self.writers is not None:
            self.writers[index].add(self.episodes[index])
        stepid = None
        if self.replay is not None:
            stepid = self.replay.add({k: v for k, v in step.items() if not k.startswith("log_")}, index)
        self.newest[index] = (step, stepid)

    def _store_latents(self, state):
        """Attach the latents of the policy's `state` to the steps it just acted on."""
        entries = self.context.entries(state, len(self.envs))  # (N, ...) each
        for i, (step, _) in enumerate(self.newest):
            step.update({k: v[i] for k, v in entries.items()})
        if self.replay is not None:  # one step (L = 1) from each environment's newest id
            self.replay.update([stepid for _, stepid in self.newest], {k: v[:, None] for k, v in entries.items()})

    def _reset(self, indices):
        futures = [(i, self.envs[i].reset()) for i in indices]
        for i, future in futures:
            self._record(i, self._observe(i, future()), self.zero_action, 0.0)

    def step(self, policy):
        """One policy step in every environment; returns the number of policy steps taken."""
        self._reset([i for i, obs in enumerate(self.obs) if obs is None])
        batch = {k: np.stack([obs[k] for obs in self.obs]) for k in self.obs[0] if not k.startswith("log_")}
        actions, self.state = policy(batch, self.state)
        if not np.isfinite(actions).all():
            raise NonFiniteStep("the policy gave non-finite actions")
        if self.context is not None:
            self._store_latents(self.state)
        # All step at once: the workers' requests go out before in-process environments step here.
        # (`in_process` of parallel.Damy / Parallel, forwarded by the wrappers; False sorts first.)
        order = sorted(range(len(self.envs)), key=lambda i: getattr(self.envs[i], "in_process", True))
        futures = {i: self.envs[i].step(actions[i]) for i in order}
        done_indices = []
        for i, action in enumerate(actions):
            obs, reward, done, info = futures[i]()
            obs = self._observe(i, obs)
            if info.get("restarted"):  # the worker died and came back with a fresh episode
                self.dropped += 1
                self.env_restarts[i] += 1
                self.episodes[i] = []
                self._record(i, obs, self.zero_action, 0.0)
                continue
            self._record(i, obs, action, reward)
            self.env_steps[i] += 1
            if done:
                self._finish(i)
                done_indices.append(i)
        for i in done_indices:
            self.obs[i] = None
        return len(self.envs)

    def _finish(self, index):
        steps = self.episodes[index]
        episode = {k: np.stack([s[k] for s in steps]) for k in steps[0]}
        if self.writers is not None:
            self.writers[index].finish(episode)
        self.episodes[index] = []
        self.env_episodes[index] += 1
        self.env_returns[index] = float(episode["reward"].sum())
        self.on_episode(episode)

    def unstored(self):
        """Policy steps taken but in no episode file yet: each running episode's steps after its last
        chunk (its first step, the reset, is no policy step); a checkpoint counts them as stored, so
        that a resume counts them once, when their file appears (storage.Checkpoints.resume)."""
        if self.writers is None:
            return 0
        return sum(len(steps) - max(writer.written, 1) for steps, writer in zip(self.episodes, self.writers) if steps)

    def step_costs(self):
        """(seconds inside env.step, steps) per environment, as counted where each one runs."""
        return [(getattr(env, "step_seconds", 0.0), getattr(env, "step_count", 0)) for env in self.envs]

    def status(self):
        """Per-environment steps, episodes, last return, frames per second and mean ms per step of the
        environment itself (step_ms; NaN without steps) since the last call."""
        now, (then, marks, costs) = time.time(), self.status_mark
        seconds = max(now - then, 1e-9)
        current = self.step_costs()
        rows = [{"steps": steps, "episodes": episodes, "last_return": ret, "restarts": restarts,
                 "fps": (steps - mark) * self.action_repeat / seconds,
                 "step_ms": 1e3 * (spent - spent0) / (count - count0) if count > count0 else float("nan")}
                for steps, episodes, ret, restarts, mark, (spent, count), (spent0, count0)
                in zip(self.env_steps, self.env_episodes, self.env_returns, self.env_restarts, marks, current, costs)]
        self.status_mark = (now, list(self.env_steps), current)
        return rows


class CollectorThread:
    """Asynchronous collection: a thread steps `collector` under `policy` while the `limiter`
    (tools.SamplesPerInsert) allows, until `frames` frames, and hands each step's policy steps and
    the episodes it finished to the learner through a queue (`take`): the learner alone counts
    them. The thread owns the collector from `start` to `close` and counts its own steps
    (`frames`, which its policy may read); `stopwatch` times its waits (env_wait) and steps (env).

    A step holds `step_lock` until it is handed over: the learner takes the lock to find the
    collection between two steps (a save's counters, limiter and episode files agree). Its
    weights change only between policy calls (`policy_lock`). An error ends the thread and is
    kept in `error`, for the learner to raise; the limiter then lets the learner make the updates
    still owed.
    """

    def __init__(self, collector, policy, limiter, policy_steps, frames, stopwatch):
        self.collector, self.policy, self.limiter, self.stopwatch = collector, policy, limiter, stopwatch
        self.policy_steps, self.until = policy_steps, frames
        self.handed = queue.Queue()  # (policy steps, [finished episodes]) per step
        self.finished = []  # the episodes of the step under way
        self.step_lock, self.policy_lock = threading.Lock(), threading.Lock()
        self.stop, self.done = threading.Event(), threading.Event()
        self.error = None
        self.thread = threading.Thread(target=self._run, name="actor", daemon=True)

    @property
    def frames(self):
        return self.policy_steps * self.collector.action_repeat

    def start(self):
        self.collector.on_episode = self.finished.append
        self.thread.start()

    def take(self):
        """What the thread handed over since the last call: (policy steps, finished episodes) per step."""
        while True:
            try:
                yield self.handed.get_nowait()
            except queue.Empty:
                return

    def _policy(self, obs, state):
        with self.policy_lock:
            return self.policy(obs, state)

    def _run(self):
        import torch

        # Intra-op threads are set per thread: the policy on a few observations gets one, and the
        # learner keeps all of its own (the learner on cores - 1 threads, switched to all while the actor
        # waited, measured ~1.5x slower updates than sync on 2 cores).
        torch.set_num_threads(1)
        try:
            while not self.stop.is_set() and self.frames < self.until:
                with self.stopwatch.time("env_wait"):
                    if not self.limiter.wait_insert(timeout=0.05):
                        continue
                with self.step_lock, self.stopwatch.time("env"):
                    steps = self.collector.step(self._policy)
                    self.policy_steps += steps
                    self.limiter.inserted(steps)
                    self.handed.put((steps, self.finished[:]))
                    self.finished.clear()
        except BaseException as e:  # noqa: BLE001 - handed to the learner's thread, raised there
            self.error = e
        finally:
            self.limiter.finish()  # the learner makes the updates still owed, then stops
            self.done.set()

    def close(self):
        """Stop the thread (Ctrl-C, an error, or the end); the environments are closed by their owner."""
        self.stop.set()
        self.limiter.close()
        if self.thread.is_alive():
            self.thread.join()


def make_envs(config, mode, count, first=0, weights=None, processes=None):
    """Environments for `mode`, as many as `task_assignment` gives (`weights`: per task, see
    envs.assign_tasks). `first`: the index (and seed offset) of the first one; under torchrun rank
    k's training environments are k * envs ... (k + 1) * envs - 1, so that no two share a seed.
    `processes`: {task: whether its environments run in worker processes} (by default
    config.parallel for all; a Resources decision may place only the expensive tasks' environments
    in workers). With several tasks every environment is wrapped to present the spaces the tasks
    share (envs.wrappers.TaskEnv)."""
    tasks = envs.parse_tasks(config.task)
    assignment = envs.task_assignment(tasks, mode, count, weights)
    ctors = [functools.partial(envs.make_env, config, mode, first + i, tasks[task])
             for i, task in enumerate(assignment)]
    in_worker = [bool(config.parallel) if processes is None else processes[tasks[task]] for task in assignment]
    # The asynchronous actor steps the training environments from a thread of its own.
    own_thread = config.asynchronous and mode == "train"
    handles = [Parallel(ctor, i, restart=config.env_failure == "restart", timeout=config.env_timeout,
                        name=tasks[task]) if process else Damy(ctor, i, own_thread, tasks[task])
               for i, (ctor, process, task) in enumerate(zip(ctors, in_worker, assignment))]
    try:
        wait_started([env for env in handles if isinstance(env, Parallel)], mode)
        return handles if len(tasks) == 1 else wrap_tasks(config, tasks, handles, assignment)
    except BaseException:
        for env in handles:
            env.close()
        raise


def wait_started(workers, mode, interactive=None):
    """Wait until every worker has built its environment, reporting the start-up as progress
    (logs.Phase: started k/N with the rate and elapsed time, a line at least every 10 s), so that
    no minute passes in silence. The workers start together (Parallel does not wait), so the wait
    is about the slowest one's."""
    if not workers:
        return
    import logs

    interactive = sys.stdout.isatty() if interactive is None else interactive
    with logs.Phase(f"{mode} environment workers", len(workers), "worker", interactive) as phase:
        for done, env in enumerate(workers, 1):
            env.obs_space  # noqa: B018 - blocks until this worker reports its spaces
            phase.update(done)


def wrap_tasks(config, tasks, handles, assignment):
    """Each environment of a run of several tasks wrapped to present the spaces they share; a
    ConfigError names the keys or actions that do not fit (envs.common_spaces)."""
    import tools

    one = {}  # task index -> one of its environments
    for env, task in zip(handles, assignment):
        one.setdefault(task, env)
    present = sorted(one)
    obs_spaces = [one[task].obs_space for task in present]
    used = set()  # the keys the encoder and decoder read in some task
    for space in obs_spaces:
        for part in (config.encoder, config.decoder):
            used.update(*tools.select_keys(space, part.cnn_keys, part.mlp_keys))
    noops = [envs.noop_action(tasks[task]) for task in present]
    try:
        obs_space, act_space = envs.common_spaces([tasks[task] for task in present], obs_spaces,
                                                  [one[task].act_space for task in present], used, noops)
    except envs.TaskError as e:
        raise tools.ConfigError(str(e)) from None
    return [envs.wrappers.TaskEnv(env, task, obs_space, act_space, envs.noop_action(tasks[task]))
            for env, task in zip(handles, assignment)]


def run_episodes(agent, env_list, count, directory):
    """`count` episodes of each task among `env_list`, acting in mode 'eval': the task policy's
    sample, or its mode with eval_sample False (episodes still running at the end are dropped)."""
    finished = {task: [] for task in sorted({getattr(env, "task_index", 0) for env in env_list})}
    collector = Collector(env_list, None, directory, lambda e: finished[int(e["task"][0])].append(e))
    policy = functools.partial(agent.policy, mode="eval")
    while any(len(episodes) < count for episodes in finished.values()):
        collector.step(policy)
    return [episode for episodes in finished.values() for episode in episodes[:count]]


