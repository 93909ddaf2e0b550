"""Run environments in-process (`Damy`) or one per worker process (`Parallel`), same interface.

`step(action)` and `reset()` return a callable that yields the result. `Parallel` sends the
request at once and blocks only when the callable is called, so a loop that first sends to every
environment and then collects the results steps all of them at the same time.
"""

import multiprocessing
import traceback

import cloudpickle


class Damy:
    """In-process environment with the same interface as `Parallel`."""

    def __init__(self, ctor, index=0):
        self.index = index
        self.env = ctor()

    @property
    def obs_space(self):
        return self.env.obs_space

    @property
    def act_space(self):
        return self.env.act_space

    def step(self, action):
        result = self.env.step(action)
        return lambda: result

    def reset(self):
        result = self.env.reset()
        return lambda: result

    def close(self):
        self.env.close()


class WorkerError(RuntimeError):
    """An environment raised inside its worker process; carries the worker's traceback."""


def _worker(conn, payload):
    try:
        env = cloudpickle.loads(payload)()
        while True:
            method, args = conn.recv()
            if method == "close":
                break
            if method == "spaces":
                conn.send(("ok", (env.obs_space, env.act_space)))
                continue
            conn.send(("ok", getattr(env, method)(*args)))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    except Exception:  # noqa: BLE001 - every error goes back to the parent with its traceback
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
    finally:
        try:
            env.close()
        except Exception:  # noqa: BLE001, S110 - closing a broken environment may fail too
            pass
        conn.close()


class Parallel:
    """One environment in its own process (spawn start method, constructor sent with cloudpickle)."""

    def __init__(self, ctor, index=0, restart=True, timeout=600):
        self.index, self.timeout, self.restart = index, timeout, restart
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, cloudpickle.dumps(ctor)), daemon=True)
        self.process.start()
        child.close()
        self.conn.send(("spaces", ()))
        self._obs_space, self._act_space = self._receive()

    @property
    def obs_space(self):
        return self._obs_space

    @property
    def act_space(self):
        return self._act_space

    def _receive(self):
        # Poll in short slices so that a worker that died is noticed instead of waited for forever.
        waited = 0.0
        while not self.conn.poll(0.1):
            waited += 0.1
            if not self.process.is_alive():
                raise WorkerError(f"Environment worker {self.index} died (exit code {self.process.exitcode}).")
            if waited > self.timeout:
                raise WorkerError(f"Environment worker {self.index} did not answer in {self.timeout} s.")
        try:
            status, result = self.conn.recv()
        except (EOFError, ConnectionResetError) as e:
            raise WorkerError(f"Environment worker {self.index} died (exit code {self.process.exitcode}).") from e
        if status == "error":
            raise WorkerError(f"Environment {self.index} raised in its worker:\n{result}")
        return result

    def step(self, action):
        self.conn.send(("step", (action,)))
        return self._receive

    def reset(self):
        self.conn.send(("reset", ()))
        return self._receive

    def close(self):
        try:
            self.conn.send(("close", ()))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
