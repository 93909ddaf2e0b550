"""parallel.Parallel against parallel.Damy, and how it handles failing, dying and hanging workers.

The fake environments are module-level classes, so spawned workers import them from this file.
"""

import contextlib
import functools
import multiprocessing
import os
import pathlib
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import gymnasium
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import parallel  # noqa: E402


class FakeEnv:
    """Observations drawn from a generator seeded with `seed`; the vector also echoes the action.

    fail_at / hang_at / pause_at: the step number at which step() raises / sleeps forever / sleeps 0.5 s.
    """

    def __init__(self, seed=0, length=4, fail_at=None, hang_at=None, pause_at=None, fail_in_ctor=False):
        if fail_in_ctor:
            raise ValueError("cannot build this environment")
        self.rng = np.random.default_rng(seed)
        self.length, self.fail_at, self.hang_at, self.pause_at = length, fail_at, hang_at, pause_at
        self.t = 0

    @property
    def obs_space(self):
        return {"image": gymnasium.spaces.Box(0, 255, (32, 32, 3), np.uint8),  # large: shared memory
                "vector": gymnasium.spaces.Box(-np.inf, np.inf, (3,), np.float32)}

    @property
    def act_space(self):
        return gymnasium.spaces.Box(-1, 1, (2,), np.float32)

    def _obs(self, action_sum):
        return {"image": self.rng.integers(0, 256, (32, 32, 3), np.uint8),
                "vector": np.append(self.rng.normal(size=2), action_sum).astype(np.float32),
                "is_first": self.t == 0, "is_last": self.t == self.length, "is_terminal": False}

    def reset(self):
        self.t = 0
        return self._obs(0.0)

    def step(self, action):
        self.t += 1
        if self.t == self.fail_at:
            raise ValueError(f"broken at step {self.t}")
        if self.t == self.hang_at:
            time.sleep(1000)
        if self.t == self.pause_at:
            time.sleep(0.5)
        return self._obs(float(np.sum(action))), float(self.rng.normal()), self.t == self.length, {"t": self.t}

    def close(self):
        pass


@pytest.fixture(autouse=True)
def fail_if_hung():
    """A hang is a failure too: an alarm interrupts any test still running after 120 s."""

    def interrupt(signum, frame):
        raise TimeoutError("the test hung for 120 s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def gone(pid):
    """True once the process has exited (a zombie left to a parent that does not reap counts too)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def assert_gone(pids, within=5.0):
    deadline = time.monotonic() + within
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if not gone(pid)] == [], "worker processes left behind"
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        assert np.asarray(a[key]).dtype == np.asarray(b[key]).dtype, key


def observation(step):
    """A step the collector recorded, without what it added to the observation."""
    return {k: v for k, v in step.items() if k not in ("action", "reward", "task")}


def run_all(envs, actions):
    """Send to every environment first, then collect: how parallel.Collector steps them."""
    futures = [env.step(a) if a is not None else env.reset() for env, a in zip(envs, actions)]
    return [future() for future in futures]


@pytest.mark.parametrize("shared_memory", [True, False])
def test_parallel_matches_damy_with_more_envs_than_cores(shared_memory):
    count = min(os.cpu_count(), 4) + 1  # more than the cores of a small machine; bounded on a large one
    ctors = [functools.partial(FakeEnv, seed=i) for i in range(count)]
    workers = [parallel.Parallel(ctor, i, shared_memory=shared_memory) for i, ctor in enumerate(ctors)]
    local = [parallel.Damy(ctor, i) for i, ctor in enumerate(ctors)]
    pids = [env.pid for env in workers]
    try:
        assert workers[0].obs_space == local[0].obs_space and workers[0].act_space == local[0].act_space
        rng = np.random.default_rng(0)
        kept_workers, kept_local = [], []
        actions = [None] * count  # None: reset
        for _ in range(11):  # crosses episode ends (length 4)
            got, want = run_all(workers, actions), run_all(local, actions)
            for i, (g, w) in enumerate(zip(got, want)):
                if actions[i] is None:
                    g, w = (g, 0.0, False, {}), (w, 0.0, False, {})
                assert_same(g[0], w[0])
                assert g[1:] == w[1:]
                kept_workers.append(g[0])
                kept_local.append(w[0])
                actions[i] = None if g[2] else rng.uniform(-1, 1, 2).astype(np.float32)
        # Arrays handed out earlier must not be overwritten by later steps (shared buffers are reused).
        for g, w in zip(kept_workers, kept_local):
            assert_same(g, w)
        images = [obs["image"] for obs in kept_workers[:count]]
        assert len({image.tobytes() for image in images}) == count  # distinct seeds, distinct observations
        assert all(set(env._buffers) == ({"image"} if shared_memory else set()) for env in workers)
    finally:
        for env in workers + local:
            env.close()
    assert_gone(pids)


def test_environment_exception_names_index_and_carries_traceback():
    env = parallel.Parallel(functools.partial(FakeEnv, fail_at=2), index=3, restart=True)
    pid = env.pid
    env.reset()()
    env.step(np.zeros(2))()
    future = env.step(np.zeros(2))
    with pytest.raises(parallel.WorkerError) as caught:
        future()
    error = caught.value
    assert error.index == 3 and "Environment 3" in str(error) and "step() raised" in str(error)
    assert "ValueError: broken at step 2" in error.traceback and "in step" in error.traceback
    assert error.traceback in str(error)
    with pytest.raises(parallel.WorkerError):  # not restarted: an exception is a bug to see
        env.step(np.zeros(2))
    assert_gone([pid])  # gone after the error, before close()
    env.close()


def test_constructor_exception_names_index_and_carries_traceback():
    env = parallel.Parallel(functools.partial(FakeEnv, fail_in_ctor=True), index=5)
    pid = env.pid
    with pytest.raises(parallel.WorkerError) as caught:
        env.obs_space  # noqa: B018 - the first use waits for the environment
    assert caught.value.index == 5 and "cannot build this environment" in caught.value.traceback
    env.close()
    assert_gone([pid])


def test_killed_worker_is_restarted_and_the_collector_drops_the_episode(capsys):

    env_list = [parallel.Parallel(functools.partial(FakeEnv, seed=i, length=50), i, restart=True, timeout=30)
                for i in range(2)]
    collector = parallel.Collector(env_list, None, None, lambda episode: None)
    policy = lambda obs, state: (np.zeros((len(obs["is_first"]), 2), np.float32), None)  # noqa: E731
    old = env_list[1].pid
    try:
        for _ in range(3):
            collector.step(policy)
        assert [len(steps) for steps in collector.episodes] == [4, 4]
        os.kill(old, signal.SIGKILL)
        start = time.monotonic()
        collector.step(policy)
        assert time.monotonic() - start < 20  # from the death, not the 30 s answer timeout
        lines = capsys.readouterr().err.strip().splitlines()  # one line, with no path or source line
        assert lines == ["warning: Environment 1: the worker process died from signal SIGKILL; restarting it "
                         "(dropping its episode)."], lines
        assert collector.dropped == 1
        assert [len(steps) for steps in collector.episodes] == [5, 1]  # only the fresh episode's start
        assert env_list[1].pid != old
        fresh = FakeEnv(seed=1, length=50)
        assert_same(observation(collector.episodes[1][0]), fresh.reset())  # a new worker, a new episode
        collector.step(policy)
        assert_same(collector.obs[1], fresh.step(np.zeros(2))[0])  # the new worker goes on normally
    finally:
        for env in env_list:
            env.close()
    assert_gone([old, *(env.pid for env in env_list)])


def test_killed_worker_without_restart_raises_cleanly():
    env = parallel.Parallel(functools.partial(FakeEnv, length=50), index=2, restart=False, timeout=30)
    pid = env.pid
    env.reset()()
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(parallel.WorkerError, match="Environment 2: the worker process died from signal SIGKILL"):
        env.step(np.zeros(2))()
    assert time.monotonic() - start < 20  # from the death, not the 30 s answer timeout
    assert "not restarted" in str(pytest.raises(parallel.WorkerError, env.reset).value)
    env.close()
    assert_gone([pid])


@pytest.mark.parametrize("restart", [True, False])
def test_hung_worker_times_out(restart, capsys):
    env = parallel.Parallel(functools.partial(FakeEnv, hang_at=1), index=0, restart=restart, timeout=10)
    # 10 s: also the limit on building the worker, which a loaded machine can take seconds over
    pid = env.pid
    env.reset()()
    future = env.step(np.zeros(2))
    start = time.monotonic()
    if restart:
        obs, reward, done, info = future()
        assert info == {"restarted": True} and obs["is_first"] and (reward, done) == (0.0, False)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "did not answer within 10 s (env_timeout); restarting it" in lines[0], lines
    else:
        with pytest.raises(parallel.WorkerError, match="did not answer within 10 s"):
            future()
    assert time.monotonic() - start < 60  # the 10 s timeout and a restart, not the 1000 s hang
    assert_gone([pid])
    env.close()


@pytest.mark.parametrize("restart", [True, False])
def test_a_stopped_worker_is_one_line_naming_its_environment_within_the_timeout(restart, capsys):
    """A SIGSTOPped worker (a hung simulator looks the same) is handled by env_failure: restarted with
    one warning line, or the end of this environment, once `timeout` passed without an answer."""
    env = parallel.Parallel(functools.partial(FakeEnv, length=50), 4, restart=restart, timeout=2, name="fake_walk")
    pid = env.pid
    env.reset()()
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    expected = "Environment 4 (fake_walk): the worker process did not answer within 2 s (env_timeout)"
    if restart:
        obs, _, _, info = env.step(np.zeros(2))()
        assert info == {"restarted": True} and obs["is_first"]
        assert capsys.readouterr().err.splitlines() == [f"warning: {expected}; restarting it (dropping its episode)."]
        assert env.step(np.zeros(2))()[0]["vector"].shape == (3,)  # the fresh worker answers
    else:
        with pytest.raises(parallel.WorkerError) as caught:
            env.step(np.zeros(2))()
        assert str(caught.value) == f"{expected}; not restarted (restart=False, env_failure: stop)"
    assert 2 <= time.monotonic() - start < 6
    assert_gone([pid])
    env.close()


def test_worker_ignores_sigint_from_its_start():
    env = parallel.Parallel(functools.partial(FakeEnv, length=50), restart=False)
    # Ctrl-C reaches every process of the group; the parent decides. Still starting up, then running:
    os.kill(env.pid, signal.SIGINT)
    env.reset()()
    os.kill(env.pid, signal.SIGINT)
    time.sleep(0.2)
    obs, _, _, _ = env.step(np.ones(2))()
    assert obs["vector"][-1] == 2.0
    env.close()


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C as an interactive Python has it. A shell starts a background job (`pytest ... &`, nohup, some CI
    runners) with SIGINT ignored; Python then installs no KeyboardInterrupt handler, and every child process
    inherits the ignored signal. These tests are about what Ctrl-C does, so they set Python's own handler
    while they run (the children then start with the default disposition)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_interrupted_wait_keeps_replies_in_order(ctrl_c_raises):
    env = parallel.Parallel(functools.partial(FakeEnv, length=50, pause_at=1), restart=False)
    env.reset()()
    future = env.step(np.full(2, 0.5))
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the step runs
    with pytest.raises(KeyboardInterrupt):
        future()
    obs, _, _, info = env.step(np.full(2, 1.0))()  # the late reply to the first step is skipped
    assert obs["vector"][-1] == 2.0 and info == {"t": 2}
    env.close()


PARENT = """
import sys, time
sys.path[:0] = {path!r}
import numpy as np, parallel
from test_parallel import FakeEnv
envs = [parallel.Parallel(FakeEnv), parallel.Parallel(lambda: FakeEnv(hang_at=1))]
for env in envs:
    env.reset()()
envs[1].step(np.zeros(2))  # this worker now sleeps inside step()
print(*[env.pid for env in envs], flush=True)
while True:  # never closes its environments
    envs[0].step(np.zeros(2))()
"""


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_no_worker_outlives_its_parent(how, ctrl_c_raises):
    script = textwrap.dedent(PARENT.format(path=[str(ROOT), str(pathlib.Path(__file__).parent)]))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)  # its own process group, as under a shell
    try:
        assert select.select([parent.stdout], [], [], 30)[0], "the parent printed nothing in 30 s"
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2
        if how == "ctrl-c":
            os.killpg(parent.pid, signal.SIGINT)  # as the terminal does: to the whole process group
        else:
            os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert_gone(pids)
        errors = parent.stderr.read()
        if how == "ctrl-c":
            assert "KeyboardInterrupt" in errors and "spawn_main" not in errors  # no worker traceback
    finally:  # whatever failed above, leave nothing running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_dmc_seeds_are_distinct_and_train_never_shares_with_eval():
    import config as cfg

    config = cfg.parse(["--configs", "dmc_proprio", "--task", "dmc_cartpole_balance", "--parallel", "True",
                        "--seed", "3"])
    train, evaluation = parallel.make_envs(config, "train", 2), parallel.make_envs(config, "eval", 2)
    assert all(isinstance(env, parallel.Parallel) for env in train + evaluation)
    config = config.replace(parallel=False)
    local = parallel.make_envs(config, "train", 1)[0]
    pids = [env.pid for env in train + evaluation]
    try:
        first = [future() for future in [env.reset() for env in train + evaluation]]
        vectors = [np.concatenate([obs["position"], obs["velocity"]]) for obs in first]
        assert len({v.tobytes() for v in vectors}) == 4  # train 0, train 1, eval 0, eval 1 all differ
        assert_same(first[0], local.reset()())  # the same seed in a worker and in-process
        # --parallel with one environment, through the collector (which starts with a new episode).
        collector = parallel.Collector(train[:1], None, None, lambda episode: None)
        policy = lambda obs, state: (np.full((1, 1), 0.5, np.float32), None)  # noqa: E731
        for _ in range(3):
            collector.step(policy)
        want = [local.reset()()] + [local.step(np.full(1, 0.5, np.float32))()[0] for _ in range(3)]
        for step, obs in zip(collector.episodes[0], want, strict=True):
            assert_same(observation(step), obs)
    finally:
        for env in train + evaluation + [local]:
            env.close()
    assert_gone(pids)


class ThreadRecordingEnv:
    """Records the thread of every call: construction, reset, step and close."""

    threads = []

    def __init__(self):
        self.threads.append(("init", threading.get_ident()))
        self.obs_space, self.act_space = {}, gymnasium.spaces.Box(-1, 1, (1,))

    def reset(self):
        self.threads.append(("reset", threading.get_ident()))
        return {"x": np.zeros(1)}

    def step(self, action):
        self.threads.append(("step", threading.get_ident()))
        return {"x": np.ones(1)}, 1.0, False, {}

    def close(self):
        self.threads.append(("close", threading.get_ident()))


@pytest.mark.parametrize("own_thread", [False, True])
def test_damy_own_thread_keeps_every_call_on_one_thread_whoever_calls(own_thread):
    """Rendering contexts are bound to a thread: with own_thread, an environment built by the main thread
    and stepped by another still runs every call on the same thread of its own."""
    ThreadRecordingEnv.threads = []
    env = parallel.Damy(ThreadRecordingEnv, 0, own_thread)
    env.reset()()
    other = threading.Thread(target=lambda: env.step(np.zeros(1))())
    other.start()
    other.join()
    env.close()
    threads = dict(ThreadRecordingEnv.threads)
    assert list(threads) == ["init", "reset", "step", "close"]
    if own_thread:
        assert len(set(threads.values())) == 1 and threading.get_ident() not in threads.values()
    else:
        assert threads["step"] == other.ident and threads["init"] == threading.get_ident()
