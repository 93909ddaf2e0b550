"""Fixtures shared by several test files, the `slow` tier and the per-test time limit.

The tiers: `python3 -m pytest -m "not slow"` is the quick check while changing code (680 tests in 205 s at two
threads on a 2-core machine beside a one-thread run at ecee42a; tests/test_seeds.py's runs of batched seeds against
seeds alone add about three minutes at one thread); `python3 -m pytest -q` runs
everything (README, Tests; .ci/run). A test is slow when it starts processes, compiles
(torch.compile, compilation.compile_update / compile_steps), or uses a module fixture that trains or
starts processes: pytest_collection_modifyitems marks it by reading the code the test and its
fixtures run (their own and the helpers of their module); `@pytest.mark.slow` marks the rest that
take seconds (in-process training runs).
"""

import inspect
import os
import shutil
import signal
import types

import pytest
import torch

# What a test's code names when it starts processes or compiles (attribute and global names).
STARTS_PROCESSES = {"subprocess", "Popen", "multiprocessing", "Parallel", "torchrun"}
COMPILES = {"compile_update", "compile_steps", "Region", "Compiled"}
TRAINS = {"main"}  # dreamer.main: a training run
LIMIT = int(os.environ.get("DREAMER_TEST_LIMIT", "1200"))  # seconds per test, its fixtures' set-up included


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes, compiles, trains or takes seconds (not in the quick "
                                       'tier, pytest -m "not slow"; tests/conftest.py)')


def codes(function, module, seen=None):
    """The code objects `function` runs, with the nested ones and those of the functions and
    classes of `module` (the test file) it names, each once."""
    seen = set() if seen is None else seen
    stack = [getattr(function, "__code__", None)]
    while stack:
        code = stack.pop()
        if code is None or code in seen:
            continue
        seen.add(code)
        yield code
        stack += [const for const in code.co_consts if isinstance(const, types.CodeType)]
        for name in code.co_names:
            value = vars(module).get(name) if module is not None else None
            if getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(value):
                stack.append(value.__code__)
            elif inspect.isclass(value):
                stack += [v.__code__ for v in vars(value).values() if inspect.isfunction(v)]


def slow_reason(code_objects, trains_counts=False):
    names = set().union(*(code.co_names for code in code_objects))
    consts = set().union(*({c for c in code.co_consts if isinstance(c, str)} for code in code_objects))
    if names & STARTS_PROCESSES or {"--parallel", "dreamer.py"} & consts:
        return "starts processes"
    if names & COMPILES:
        return "compiles"
    if trains_counts and names & TRAINS:
        return "trains"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") or not isinstance(item, pytest.Function):
            continue
        module = item.module
        reason = slow_reason(list(codes(item.function, module)))
        # The fixtures the test asks for by name, and theirs: a module or session fixture that
        # trains, compiles or starts processes makes every test of it slow (autouse ones, such as
        # test_suites' training_runs, select their own work).
        defs, queue, seen = item._fixtureinfo.name2fixturedefs, list(item._fixtureinfo.argnames), set()
        while queue and reason is None:
            name = queue.pop()
            if name in seen or name not in defs:
                continue
            seen.add(name)
            fixture = defs[name][-1]
            fixture_module = inspect.getmodule(fixture.func)
            found = slow_reason(list(codes(fixture.func, fixture_module)), trains_counts=fixture.scope != "function")
            if found is not None:
                reason = f"{found} in its {fixture.scope} fixture {name}"
            queue += list(fixture.argnames)
        if reason is not None:
            item.add_marker(pytest.mark.slow(reason=reason))


class TestTimeLimit(BaseException):
    """A test ran past LIMIT: not an Exception, so that no `except Exception` in the code under test
    swallows it."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test, its fixtures' set-up included (a module fixture's training run, an in-process
    training run), ends within LIMIT seconds: a hang fails with a message instead of holding the suite."""

    def expire(signum, frame):
        raise TestTimeLimit(f"{item.nodeid} ran past {LIMIT} s (tests/conftest.py LIMIT; DREAMER_TEST_LIMIT sets it)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(LIMIT)
    try:
        return (yield)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a shared machine their spinning costs
    many times the work itself. A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def spaces():
    """Observation and action spaces of the debug task, taken as dreamer.main takes them."""
    import config as cfg
    import envs

    env = envs.make_env(cfg.parse(["--configs", "debug"]), "train", 0)
    try:
        return env.obs_space, env.act_space
    finally:
        env.close()


@pytest.fixture(scope="module")
def base_run(request, tmp_path_factory):
    """A finished 40-frame run of the module's SHORT flags (one 20-step episode, one checkpoint at
    frame 40); tests copy it (run_copy) before changing it."""
    import dreamer

    logdir = tmp_path_factory.mktemp("base") / "run"
    dreamer.main([*request.module.SHORT, "--logdir", str(logdir), "--steps", "40"])
    return logdir


@pytest.fixture
def run_copy(base_run, tmp_path):
    logdir = tmp_path / "run"
    shutil.copytree(base_run, logdir)
    return logdir
