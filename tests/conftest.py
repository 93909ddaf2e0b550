"""Fixtures shared by several test files."""

import shutil

import pytest
import torch


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
    import dreamer
    import envs

    env = envs.make_env(dreamer.parse(["--configs", "debug"]), "train", 0)
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
