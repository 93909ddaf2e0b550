"""Several tasks in one run (--task a,b,c): task lists, round-robin, padded actions, the errors,
per-task logging and evaluation, the task of every stored step, resume, --parallel, --asynchronous."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import gymnasium
import numpy as np
import pytest

import config as cfg
import dreamer
import envs
import parallel
import storage
from envs import wrappers

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")

# Two cheap DMC tasks with 1 and 2 action dimensions; from proprioception (no rendering), of which
# they share only `velocity` (2,): the other keys differ and are dropped.
TASKS = "dmc_cartpole_balance,dmc_reacher_easy"
# Short episodes (20 policy steps), one evaluation episode per task at the start and the end.
SMALL = ["--configs", "debug", "--task", TASKS, "--time_limit", "40", "--eval_every", "1000",
         "--eval_episode_num", "1", "--log_every", "40", "--train_ratio", "16",
         *[f"--{part}.{kind}_keys={pattern}" for part in ("encoder", "decoder")
           for kind, pattern in (("cnn", "$^"), ("mlp", "^velocity$"))]]


def box(*shape, dtype=np.float32):
    if dtype == np.uint8:
        return gymnasium.spaces.Box(0, 255, shape, dtype=dtype)
    return gymnasium.spaces.Box(-np.inf, np.inf, shape, dtype=dtype)


# -- task lists and their assignment to environments ------------------------------------------------


def test_task_list_parses_and_one_task_stays_one():
    assert envs.parse_tasks("dmc_walker_walk") == ["dmc_walker_walk"]
    assert envs.parse_tasks("dmc_walker_walk, dmc_walker_run,dmc_cheetah_run") == [
        "dmc_walker_walk", "dmc_walker_run", "dmc_cheetah_run"]
    for bad, message in (("a,,b", "an empty task name"), ("a,b,a", "a named more than once")):
        with pytest.raises(ValueError, match=message):
            envs.parse_tasks(bad)


def test_environments_go_round_robin_and_by_weight():
    assert envs.assign_tasks(["a"], 3) == [0, 0, 0]
    assert envs.assign_tasks(["a", "b", "c"], 3) == [0, 1, 2]
    assert envs.assign_tasks(["a", "b", "c"], 7) == [0, 1, 2, 0, 1, 2, 0]
    # Weights 3:1 over 6: one each, the other 4 split 3:1 -> 4 and 2, dealt out in turns.
    assert envs.assign_tasks(["a", "b"], 6, weights=[3, 1]) == [0, 1, 0, 1, 0, 0]
    assert envs.assign_tasks(["a", "b", "c"], 3, weights=[100, 1, 1]) == [0, 1, 2]  # never none
    with pytest.raises(ValueError, match="2 environments cannot run 3 tasks"):
        envs.assign_tasks(["a", "b", "c"], 2)


def test_evaluation_gets_its_count_of_every_task():
    config = cfg.parse(["--configs", "debug", "--task", "dmc_walker_walk,dmc_cheetah_run"])
    tasks = envs.parse_tasks(config.task)
    assert envs.task_assignment(tasks, "train", 3) == [0, 1, 0]
    assert envs.task_assignment(tasks, "eval", 2) == [0, 0, 1, 1]


# -- common spaces -----------------------------------------------------------------------------------


FLAGS = wrappers.flag_spaces()


def test_common_spaces_keep_shared_keys_and_drop_unread_ones():
    walker = {"image": box(16, 16, 3, dtype=np.uint8), "height": box(1), "velocity": box(9), **FLAGS}
    cheetah = {"image": box(16, 16, 3, dtype=np.uint8), "position": box(8), "velocity": box(9), **FLAGS}
    obs, act = envs.common_spaces(["w", "c"], [walker, cheetah], [box(6), box(6)], used={"image"})
    assert sorted(obs) == ["image", "is_first", "is_last", "is_terminal", "velocity"]
    assert act.shape == (6,)


def test_common_action_space_is_the_widest_with_the_union_of_bounds():
    narrow = gymnasium.spaces.Box(np.float32([-1, -2]), np.float32([1, 2]))
    wide = gymnasium.spaces.Box(np.float32([-3, -1, -1]), np.float32([0.5, 1, 1]))
    _, act = envs.common_spaces(["a", "b"], [FLAGS, FLAGS], [narrow, wide], used=set())
    np.testing.assert_array_equal(act.low, [-3, -2, -1])
    np.testing.assert_array_equal(act.high, [1, 2, 1])
    _, act = envs.common_spaces(["a", "b"], [FLAGS, FLAGS], [wrappers.OneHotSpace(4), wrappers.OneHotSpace(6)],
                                used=set(), noops=[0, 0])
    assert act.shape == (6,) and act.discrete


@pytest.mark.parametrize("obs_spaces, act_spaces, noops, message", [
    ([{"orientations": box(14)}, {"position": box(8)}], [box(6), box(6)], None,
     "Observation key 'orientations' is read by the model but only walker has it, not cheetah"),
    ([{"orientations": box(14)}, {"orientations": box(4)}], [box(6), box(6)], None,
     r"Observation key 'orientations' differs between tasks \(walker \(14,\) float32, cheetah \(4,\) float32\)"),
    ([FLAGS, FLAGS], [box(6), wrappers.OneHotSpace(3)], None,
     r"Tasks mix discrete actions \(cheetah\) and continuous actions \(walker\)"),
    ([FLAGS, FLAGS], [wrappers.OneHotSpace(2), wrappers.OneHotSpace(3)], [None, None],
     "Task walker has 2 actions and cannot be padded to 3"),
])
def test_spaces_that_do_not_fit_name_the_keys_and_tasks(obs_spaces, act_spaces, noops, message):
    with pytest.raises(ValueError, match=message):
        envs.common_spaces(["walker", "cheetah"], obs_spaces, act_spaces, used={"orientations"}, noops=noops)


# -- padded actions ----------------------------------------------------------------------------------


class Recording:
    """A stand-in environment that records every action it executes."""

    def __init__(self, act_space):
        self.act_space, self.obs_space, self.executed = act_space, FLAGS, []

    def reset(self):
        return {"is_first": True, "is_last": False, "is_terminal": False}

    def step(self, action):
        self.executed.append(action)
        return {"is_first": False, "is_last": False, "is_terminal": False}, 0.0, False, {}


def test_continuous_environment_executes_its_leading_dimensions():
    inner = Recording(box(2))
    env = wrappers.TaskEnv(inner, 1, FLAGS, box(6))
    actions = np.random.default_rng(0).uniform(-1, 1, (5, 6)).astype(np.float32)
    for action in actions:
        env.step(action)
    np.testing.assert_array_equal(np.stack(inner.executed), actions[:, :2])
    assert env.act_space.shape == (6,) and env.task_index == 1


def test_discrete_environment_maps_padded_actions_to_its_noop():
    class Discrete4(Recording):
        pass

    inner = Discrete4(gymnasium.spaces.Discrete(4))
    # The suite stack: one-hot actions of size 4, then padded to 6 with the no-op at index 3.
    env = wrappers.TaskEnv(wrappers.OneHotAction(inner), 0, FLAGS, wrappers.OneHotSpace(6), noop=3)
    chosen = [0, 5, 2, 4, 3, 1]
    for index in chosen:
        env.step(np.eye(6, dtype=np.float32)[index])
    assert inner.executed == [0, 3, 2, 3, 3, 1]  # own actions as they are, 4 and 5 -> the no-op 3


def test_padding_wraps_a_parallel_handle_whose_step_returns_a_callable():
    inner = Recording(box(1))
    env = wrappers.TaskEnv(parallel.Damy(lambda: inner), 0, FLAGS, box(3))
    obs, reward, done, info = env.step(np.float32([0.5, -0.25, 1.0]))()
    np.testing.assert_array_equal(inner.executed[0], [0.5])
    assert obs["is_first"] is False


# -- evaluation ----------------------------------------------------------------------------------------


class Episodic(Recording):
    """Episodes of `length` steps, reward 1 per step."""

    def __init__(self, length):
        super().__init__(box(1))
        self.length, self.t = length, 0

    def reset(self):
        self.t = 0
        return super().reset()

    def step(self, action):
        self.t += 1
        obs, _, _, info = super().step(action)
        return {**obs, "is_last": self.t == self.length}, 1.0, self.t == self.length, info


class StandInAgent:
    def policy(self, obs, state, mode="train"):
        return np.zeros((len(obs["is_first"]), 1), np.float32), None


def test_evaluation_runs_its_count_of_each_task_however_long_their_episodes():
    # Task 0 ends episodes every 2 steps, task 1 every 7: a count over all tasks would take task 0's.
    env_list = [wrappers.TaskEnv(parallel.Damy(lambda n=n: Episodic(n)), task, FLAGS, box(1))
                for task, n in ((0, 2), (1, 7))]
    episodes = parallel.run_episodes(StandInAgent(), env_list, 3, None)
    assert [(int(e["task"][0]), len(e["reward"]) - 1) for e in episodes] == [(0, 2)] * 3 + [(1, 7)] * 3


# -- stored episodes ---------------------------------------------------------------------------------


def test_old_single_task_episodes_still_load_as_task_zero(tmp_path):
    spec = storage.episode_spec({"vector": box(3), **FLAGS}, box(2))
    assert spec["task"] == ((), np.dtype(np.int32))
    old = {"vector": np.zeros((5, 3), np.float32), "action": np.zeros((5, 2), np.float32),
           "reward": np.zeros(5, np.float32), **{k: np.zeros(5, bool) for k in FLAGS}}
    assert storage.episode_problem(old, spec) is None
    storage.save_episode(tmp_path, old)
    storage.save_episode(tmp_path, {**old, "task": np.full(5, 2.0, np.float32)})  # a wrong dtype is still caught
    skipped = []
    loaded = storage.load_episodes(tmp_path, spec=spec, on_skip=lambda f, problem: skipped.append(problem))
    assert len(loaded) == 1 and skipped == ["'task' has dtype float32, expected int32"]
    np.testing.assert_array_equal(loaded[0]["task"], np.zeros(5, np.int32))


# -- errors: one line, exit status 2, nothing written ------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--task", "dmc_walker_walk,dmc_walker_run,dmc_cheetah_run", "--envs", "2"],
     "Invalid value '2' for --envs: 3 tasks need at least one training environment each; valid: a whole number "
     ">= 3"),
    (["--task", "dmc_walker_walk,,dmc_cheetah_run"], "an empty task name"),
    (["--task", "dmc_walker_walk,dmc_walker_walk"], "dmc_walker_walk named more than once"),
    (["--task", "dmc_walker_walk,dmc_walker_wlak", "--envs", "2"], "Unknown DMC task 'dmc_walker_wlak'"),
    # Built, then refused: proprio keys the encoder reads exist only in one of the tasks.
    (["--task", "dmc_cartpole_balance,dmc_pendulum_swingup", "--envs", "2", "--encoder.mlp_keys", ".*"],
     "Observation key 'orientation' is read by the model but only dmc_pendulum_swingup has it, not "
     "dmc_cartpole_balance"),
    (["--task", "dmc_cartpole_balance,gym_CartPole-v1", "--envs", "2"],
     "Tasks mix discrete actions (gym_CartPole-v1) and continuous actions (dmc_cartpole_balance)"),
    (["--task", "gym_CartPole-v1,gym_Acrobot-v1", "--envs", "2", "--encoder.mlp_keys", "$^", "--decoder.mlp_keys",
      "$^"], "Task gym_CartPole-v1 has 2 actions and cannot be padded to 3"),
    (["--task", "gym_MountainCar-v0,gym_Acrobot-v1", "--envs", "2", "--encoder.mlp_keys", ".*"],
     "Observation key 'vector' differs between tasks (gym_MountainCar-v0 (2,) float32, gym_Acrobot-v1 (6,)"),
])
def test_errors_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, args, message):
    logdir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        dreamer.main(["--configs", "debug", "--logdir", str(logdir), *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert not logdir.exists()


# -- end to end: per-task logs and evaluation, stored tasks, resume with --parallel, --asynchronous ---


def train(logdir, *args):
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"), OMP_NUM_THREADS="1")
    command = [sys.executable, str(ROOT / "dreamer.py"), *SMALL, "--logdir", str(logdir), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def metrics(logdir):
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    return {key for row in rows for key in row}


def stored(folder):
    episodes = []
    for path in sorted(folder.glob("*.npz")):
        with np.load(path) as data:
            episodes.append({k: data[k] for k in data.keys()})
    return episodes


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three environments over two tasks (cartpole, reacher, cartpole), 240 frames: every
    environment finishes two episodes of 20 steps."""
    logdir = tmp_path_factory.mktemp("multitask") / "run"
    return logdir, train(logdir, "--envs", "3", "--steps", "240")


def test_training_and_evaluation_are_logged_per_task(run):
    logdir, result = run
    keys = metrics(logdir)
    for scope in ("train", "eval"):
        for name in ("return", "length"):
            assert f"{scope}/{name}" in keys
            for task in TASKS.split(","):
                assert f"{scope}/{task}/{name}" in keys, f"{scope}/{task}/{name}"
    assert "eval/dmc_reacher_easy/episodes" in keys
    assert "Task: dmc_cartpole_balance,dmc_reacher_easy (training environments per task: 2, 1; action size 2, " \
           "the widest task's)" in result.stdout
    assert "  envs 3 (min/median/max): steps " in result.stdout  # one status line for all environments


def test_each_task_logs_its_share_of_the_frames(run):
    """train/<task>/frames: two of the three environments run cartpole, so it has 2/3 of each
    logged step's frames and reacher 1/3 (the environments step together)."""
    logdir, _ = run
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "train/dmc_cartpole_balance/frames" in row]
    assert logged
    for row in logged:
        assert row["train/dmc_cartpole_balance/frames"] == pytest.approx(row["step"] * 2 / 3)
        assert row["train/dmc_reacher_easy/frames"] == pytest.approx(row["step"] / 3)


def test_every_stored_step_records_its_task_and_acts_in_the_widest_space(run):
    logdir, _ = run
    train_eps, eval_eps = stored(logdir / "train_eps"), stored(logdir / "eval_eps")
    assert sorted(int(e["task"][0]) for e in train_eps) == [0, 0, 0, 0, 1, 1]  # 2 episodes of each environment
    for episode in train_eps + eval_eps:
        assert episode["task"].dtype == np.int32 and len(set(episode["task"])) == 1
        assert episode["action"].shape[1:] == (2,)
        assert sorted(episode) == ["action", "is_first", "is_last", "is_terminal", "reward", "task", "velocity"]
    # eval_episode_num episodes of each task at each of the two evaluations.
    assert sorted(int(e["task"][0]) for e in eval_eps) == [0, 0, 1, 1]
    config = (logdir / "config.yaml").read_text()
    assert f"task: {TASKS}" in config  # the names the indices refer to


def test_eval_only_reports_each_task(run, tmp_path):
    logdir = shutil.copytree(run[0], tmp_path / "run")  # the module's run stays as it was for the other tests
    result = train(logdir, "--envs", "3", "--eval_only")
    returns = json.loads((logdir / "eval_only" / "returns.json").read_text())
    assert len(returns["returns"]) == 2 and "Evaluated 2 episodes" in result.stdout
    assert {task: len(r["returns"]) for task, r in returns["tasks"].items()} == {
        "dmc_cartpole_balance": 1, "dmc_reacher_easy": 1}


def test_multitask_run_resumes_asynchronous_with_parallel_workers(run, tmp_path):
    logdir = shutil.copytree(run[0], tmp_path / "run")
    # Two workers (fewer processes to start), one episode each: 80 frames.
    result = train(logdir, "--envs", "2", "--steps", "320", "--parallel", "--asynchronous",
                   "--eval_episode_num", "0")
    assert "resumed from frame 240" in result.stdout and "0 files skipped" in result.stdout
    assert "Environments: 2 (parallel processes)" in result.stdout and "Asynchronous: learner" in result.stdout
    train_eps = stored(logdir / "train_eps")
    assert sorted(int(e["task"][0]) for e in train_eps) == [0] * 5 + [1] * 3
    assert {"train/dmc_cartpole_balance/return", "train/dmc_reacher_easy/return"} <= metrics(logdir)


def test_a_gym_observation_named_task_clashes_with_the_stored_task():
    from envs import gym as suite

    class Tasked(gymnasium.Env):
        observation_space = gymnasium.spaces.Dict({"task": gymnasium.spaces.Box(-1, 1, (2,))})
        action_space = gymnasium.spaces.Discrete(2)

    gymnasium.register("TaskedMultitaskTest-v0", entry_point=Tasked)
    try:
        with pytest.raises(ValueError, match="Observation key 'task' of gym_TaskedMultitaskTest-v0 clashes"):
            suite.Gym("TaskedMultitaskTest-v0")
    finally:
        gymnasium.registry.pop("TaskedMultitaskTest-v0")
