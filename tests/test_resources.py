"""--envs auto / --parallel auto (resources.Resources, decide_resources) and the per-environment step
cost (env/<i>/step_ms). The decision is a pure function of measured costs: it is tested on
stand-in costs, with the expected rates worked out by hand in the comments; the measurement itself
is run once on the debug task, and the end-to-end runs replace it by stand-in costs."""

import copy
import functools
import json
import pathlib
import sys
import time

import gymnasium
import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import envs  # noqa: E402
import parallel  # noqa: E402
import resources  # noqa: E402
import tools  # noqa: E402

PRESETS = cfg.load_presets()
SHORT = ["--configs", "debug", "--eval_episode_num", "0", "--time_limit", "40"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_config(*flags):
    return cfg.parse(["--configs", "debug", *flags], presets=copy.deepcopy(PRESETS))


def costs(env_ms=20.0, worker_ms=21.0, extra=0.5, policy=1.0, update=0.01, update_1=None, cores=4, gpu=False,
          task="t"):
    """Stand-in costs for decide_resources, one task unless env_ms/worker_ms are dicts."""
    out = {"env_ms": env_ms if isinstance(env_ms, dict) else {task: env_ms},
           "worker_ms": worker_ms if isinstance(worker_ms, dict) else {task: worker_ms},
           "extra_worker_ms": extra, "worker_start_s": 1.0, "policy_ms": policy, "policy_extra_ms": 0.0,
           "update_s": update, "cores": cores, "max_threads": cores, "gpu": gpu}
    if update_1 is not None:
        out.update({"update_1_s": update_1, "policy_1_ms": policy, "policy_1_extra_ms": 0.0})
    return out


def decide(stand_in, tasks=("t",), train_ratio=1.0, batch=(10, 10), **kwargs):
    return resources.decide_resources(stand_in, list(tasks), train_ratio, *batch, **kwargs)


# ----------------------------------------------------------------------------------------------
# The decision, on stand-in costs
# ----------------------------------------------------------------------------------------------


def test_env_bound_takes_every_worker_process_it_may():
    # Learner: 0.01 updates per step x 0.01 s. In-process, n environments cost n x 20 ms a step:
    # ~50 steps/s whatever n. In workers on 4 cores, 4 environments take max(21 + 3 x 0.5, 4 x 21 / 4)
    # = 22.5 ms: 4 / (1 + 22.5 + 0.4) ms = 167 steps/s; more than 4 (the cap, 2 x cores = 8) adds waves.
    decision = decide(costs(), max_envs=4)
    assert (decision["envs"], decision["parallel"]) == (4, True)
    assert decision["bound"] == "environments"
    assert decision["steps_per_s"] == pytest.approx(4 / (1e-3 + 22.5e-3 + 4 * 0.01 * 0.01))


def test_learner_bound_takes_one_environment_and_every_learner_thread():
    # 0.5 updates per policy step x 2 s: 1 s a step. One in-process environment: 1 / (1 + 20 + 1000) ms
    # = 0.979 steps/s; the best, 8 in workers: 8 / (1 + max(24.5, 42) + 8000) ms = 0.9947. The first is
    # within 3% of it, so one environment in-process. Threads: Amdahl through 2 s (4 threads) and
    # 6 s (1 thread) says 4 threads are fastest.
    decision = decide(costs(update=2.0, update_1=6.0), train_ratio=50)
    assert (decision["envs"], decision["parallel"], decision["threads"]) == (1, False, 4)
    assert decision["bound"] == "learner"
    assert decision["steps_per_s"] == pytest.approx(1 / (1e-3 + 20e-3 + 1.0))


def test_more_threads_measured_slower_gives_the_learner_one():
    # On a loaded machine an update on 4 threads took 3 s and on one 2 s: one thread it is.
    decision = decide(costs(update=3.0, update_1=2.0), train_ratio=50)
    assert decision["threads"] == 1
    assert decision["steps_per_s"] == pytest.approx(1 / (1e-3 + 20e-3 + 0.5 * 2.0))


def test_async_overlaps_collection_with_updates_and_needs_fewer_environments():
    # Env 50 ms in-process (52 in a worker, +1 per further one), policy 1 ms, 0.5 updates per step,
    # an update 0.1 s on 4 threads and 0.15 s on 1: Amdahl share s = (1 - 0.1 / 0.15) / (1 - 1 / 4).
    stand_in = costs(env_ms=50.0, worker_ms=52.0, extra=1.0, update=0.1, update_1=0.15)
    sync = decide(stand_in, train_ratio=50, max_envs=8)
    # Sync adds the two: one in-process environment gives 1 / (1 + 50 + 50) ms = 9.9 steps/s; in
    # workers the environments' time per step shrinks (4: 4 / (1 + 55 + 200) ms = 15.6 steps/s).
    assert sync["parallel"] is True and sync["envs"] >= 4 and sync["threads"] == 4
    assert sync["steps_per_s"] < 16
    # Async overlaps them: the learner on 3 threads wants 1 / (0.5 u(3)) steps/s = 18.9; one
    # in-process environment on the remaining core supplies 1 / (1 + 50) ms = 19.6 steps/s.
    asynchronous = decide(stand_in, train_ratio=50, max_envs=8, asynchronous=True)
    assert (asynchronous["envs"], asynchronous["parallel"], asynchronous["threads"]) == (1, False, 3)
    share = (1 - 0.1 / 0.15) / (1 - 1 / 4)
    assert asynchronous["steps_per_s"] == pytest.approx(1 / (0.5 * 0.15 * (1 - share + share / 3)))
    assert asynchronous["bound"] == "learner"


def test_expensive_tasks_get_the_worker_processes_and_the_remainder():
    # A cheap task (0.3 ms in-process, 1.5 ms through a worker) and an expensive one (30 / 31 ms).
    # With 3 environments the remainder goes to the expensive task: 2 of it, 1 of the cheap one.
    # Workers for the expensive task only: max(0.3 + 2 x 0.2, 31 + 0.2, (62 + 0.3) / 4) = 31.2 ms;
    # workers for all: 31.4 ms, the cheap one in-process: the fewest processes within 3% wins.
    stand_in = costs(env_ms={"cheap": 0.3, "dear": 30.0}, worker_ms={"cheap": 1.5, "dear": 31.0}, extra=0.2)
    decision = decide(stand_in, tasks=("cheap", "dear"), envs=3)
    assert decision["tasks"] == {"cheap": {"envs": 1, "processes": False}, "dear": {"envs": 2, "processes": True}}
    assert decision["parallel"] == "mixed"
    assert decision["steps_per_s"] == pytest.approx(3 / (1e-3 + 31.2e-3 + 3 * 0.01 * 0.01))


def test_cheap_environment_stays_in_process():
    # 0.3 ms in-process against 1.5 ms through a worker: workers never pay.
    decision = decide(costs(env_ms=0.3, worker_ms=1.5), envs=4)
    assert decision["parallel"] is False


def test_a_short_run_does_not_start_workers_it_cannot_earn_back():
    # The env-bound case above: 4 workers give 167 steps/s against at most 4 / 81.4 ms = 49.1
    # in-process. Over 30 policy steps, starting them (1 s) costs more than it saves: 30 / (30 / 167 + 1)
    # = 25.4 steps/s; over 100 000 it does not. In-process, 2 environments (2 / 41.2 ms = 48.5) are the
    # fewest within 3% of the best.
    decision = decide(costs(), max_envs=4, steps=30)
    assert (decision["envs"], decision["parallel"]) == (2, False)
    assert decision["steps_per_s"] == pytest.approx(2 / 41.2e-3)
    assert decide(costs(), max_envs=4, steps=100000)["parallel"] is True


def test_explicit_values_are_kept_and_gpu_threads_left_alone():
    decision = decide(costs(), envs=2, parallel=False)
    assert (decision["envs"], decision["parallel"]) == (2, False)
    assert decide(costs(update=3.0, update_1=2.0), threads=4)["threads"] == 4
    assert decide(costs(gpu=True))["threads"] is None


# ----------------------------------------------------------------------------------------------
# Parsing and bad values
# ----------------------------------------------------------------------------------------------


def test_auto_parses_and_explicit_values_stay():
    config = make_config("--envs", "auto", "--parallel", "auto")
    assert (config.envs, config.parallel) == ("auto", "auto")
    config = make_config("--envs", "3", "--parallel")
    assert (config.envs, config.parallel) == (3, True)
    assert make_config("--parallel", "False").parallel is False


@pytest.mark.parametrize("args, message", [
    (["--envs", "autox"], "Invalid value 'autox' for --envs: expected a whole number or auto"),
    (["--envs", "0"], "Invalid value '0' for --envs; valid: auto or a whole number >= 1"),
    (["--envs", "2.5"], "Invalid value '2.5' for --envs: expected a whole number"),
    (["--parallel", "sometimes"], "Invalid value 'sometimes' for --parallel"),
])
def test_bad_values_exit_2_with_one_line(tmp_path, capsys, args, message):
    logdir = tmp_path / "run"
    with pytest.raises(SystemExit) as error:
        dreamer.main([*SHORT, "--logdir", str(logdir), *args])
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not logdir.exists()


# ----------------------------------------------------------------------------------------------
# Resources: summary, resources.json, resume
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def stand_in_measurement(monkeypatch):
    """measure_costs replaced by stand-in costs (one env-bound task on 2 cores); records its calls."""
    calls = []

    def measure(config, tasks, max_threads, make_agent):
        calls.append(list(tasks))
        return costs(env_ms=20.0, worker_ms=21.0, extra=0.5, cores=2, task=config.task)

    monkeypatch.setattr(resources, "measure_costs", measure)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    yield calls
    torch.set_num_threads(threads)


def test_resources_settle_report_save_and_reuse(tmp_path, stand_in_measurement):
    config = make_config("--envs", "auto", "--parallel", "auto")
    sizing = resources.Resources(config, tmp_path, dreamer.Dreamer)
    config = sizing.settle()
    # 2 cores, 0.16 updates per step x 10 ms, env-bound: in workers n environments cost
    # n / (1 + max(21 + (n - 1) 0.5, 21 n / 2) + 1.6 n) ms: 2: 77.8, 3: 80.4, 4: 81.0 steps/s; 3 is
    # the fewest within 3% of the best. In-process at most 45.8 (4 x 20 ms a step).
    assert (config.envs, config.parallel) == (3, True)
    assert torch.get_num_threads() == 2
    text = "\n".join(sizing.lines)
    assert "Resources: envs, parallel auto, measured" in text and "3 environments in worker processes" in text
    assert "learner on 2 torch threads" in text and "environments-bound" in text
    assert "step 20.00 ms in-process, 21.00 ms in a worker" in text and "0.16 updates per policy step" in text
    sizing.save()
    saved = json.loads((tmp_path / "resources.json").read_text())
    assert saved["decision"]["envs"] == 3 and saved["costs"]["env_ms"] == {"dmc_cartpole_balance": 20.0}
    assert saved["settings"]["train_ratio"] == 32
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically: no temporary file left
    # A second start with the same settings reuses it and says so; explicit values still win.
    again = make_config("--envs", "auto", "--parallel", "False")
    sizing = resources.Resources(again, tmp_path, dreamer.Dreamer)
    again = sizing.settle()
    assert (again.envs, again.parallel) == (3, False)
    assert "reused from" in sizing.lines[0] and len(stand_in_measurement) == 1
    # Other settings (a train ratio) measure afresh.
    resources.Resources(make_config("--envs", "auto", "--train_ratio", "64"), tmp_path, dreamer.Dreamer).settle()
    assert len(stand_in_measurement) == 2


def test_decision_gives_task_weights_and_placement(tmp_path, stand_in_measurement):
    sizing = resources.Resources(make_config("--envs", "auto", "--parallel", "auto"), tmp_path, dreamer.Dreamer)
    assert sizing.weights() is None and sizing.processes() is None  # nothing decided yet
    sizing.settle()
    task = "dmc_cartpole_balance"
    assert envs.assign_tasks([task], 3, sizing.weights()) == [0, 0, 0]
    assert sizing.processes() == {task: True}
    explicit = resources.Resources(make_config("--envs", "auto", "--parallel", "False"), tmp_path / "b",
                                   dreamer.Dreamer)
    explicit.settle()
    assert explicit.processes() is None  # --parallel given: config.parallel for every environment


@pytest.mark.parametrize("counts", [[1, 3], [2, 2], [3, 1], [1, 1], [2, 5], [4, 1]])
def test_weights_reproduce_the_decided_counts_in_the_task_assignment(counts):
    config = make_config("--task", "dmc_cartpole_balance,dmc_cartpole_swingup")
    sizing = resources.Resources(config, pathlib.Path("."), dreamer.Dreamer)
    sizing.record = {"decision": {"tasks": {"dmc_cartpole_balance": {"envs": counts[0]},
                                            "dmc_cartpole_swingup": {"envs": counts[1]}}}}
    assignment = envs.assign_tasks(["a", "b"], sum(counts), sizing.weights())
    assert [assignment.count(0), assignment.count(1)] == counts


def test_make_envs_places_each_task_as_told():
    config = make_config("--task", "dmc_cartpole_balance,dmc_cartpole_swingup", "--envs", "2")
    created = parallel.make_envs(config, "train", 2, processes={"dmc_cartpole_balance": False,
                                                               "dmc_cartpole_swingup": True})
    try:
        assert [env.in_process for env in created] == [True, False]  # round-robin: balance, swingup
        assert [type(env.env) for env in created] == [parallel.Damy, parallel.Parallel]  # inside TaskEnv
    finally:
        for env in created:
            env.close()


def test_auto_with_several_tasks_places_only_the_expensive_one_in_workers(tmp_path, monkeypatch,
                                                                          stand_in_measurement):
    # Balance cheap (0.3 ms in-process, 1.5 through a worker), swingup dear (30 / 31 ms), 3 environments:
    # as in test_expensive_tasks_get_the_worker_processes_and_the_remainder.
    tasks = ["dmc_cartpole_balance", "dmc_cartpole_swingup"]
    monkeypatch.setattr(resources, "measure_costs", lambda config, names, max_threads, make_agent: costs(
        env_ms=dict(zip(tasks, (0.3, 30.0))), worker_ms=dict(zip(tasks, (1.5, 31.0))), extra=0.2, cores=4))
    config = make_config("--task", ",".join(tasks), "--envs", "3", "--parallel", "auto", "--steps", "1e6")
    sizing = resources.Resources(config, tmp_path, dreamer.Dreamer)
    config = sizing.settle()
    created = parallel.make_envs(config, "train", config.envs, 0, sizing.weights(), sizing.processes())
    try:
        placed = sorted((tasks[env.task_index], env.in_process) for env in created)
        assert placed == [(tasks[0], True), (tasks[1], False), (tasks[1], False)]
        assert "2 of the environments" in "\n".join(sizing.lines)
    finally:
        for env in created:
            env.close()


def test_start_up_summary_counts_the_environments_the_decision_gave_each_task(tmp_path, capsys, monkeypatch,
                                                                             stand_in_measurement):
    # Balance cheap in-process (0.3 ms), swingup dear (30 ms): the decision gives swingup the remainder
    # environment, 2 of 3, where round-robin would give it 1.
    tasks = ["dmc_cartpole_balance", "dmc_cartpole_swingup"]
    monkeypatch.setattr(resources, "measure_costs", lambda config, names, max_threads, make_agent: costs(
        env_ms=dict(zip(tasks, (0.3, 30.0))), worker_ms=dict(zip(tasks, (31.0, 31.0))), extra=0.2, cores=4))
    dreamer.main([*SHORT, "--task", ",".join(tasks), "--envs", "3", "--parallel", "auto", "--logdir",
                  str(tmp_path / "run"), "--steps", "12", "--prefill", "6", "--pretrain", "0"])
    out = capsys.readouterr().out
    assert "training environments per task: 1, 2;" in out


def test_explicit_values_skip_the_measurement(tmp_path, stand_in_measurement):
    sizing = resources.Resources(make_config("--envs", "3"), tmp_path, dreamer.Dreamer)
    sizing.settle()
    sizing.save()
    assert stand_in_measurement == [] and sizing.lines == [] and not (tmp_path / "resources.json").exists()


def test_auto_run_prints_the_decision_logs_step_ms_and_resumes_with_it(tmp_path, capsys, stand_in_measurement):
    logdir = tmp_path / "run"
    # In-process, n environments cost n / (1 + 21.6 n) ms: 1: 44.2, 2: 45.2, 4: 45.8 steps/s: 2.
    dreamer.main([*SHORT, "--envs", "auto", "--parallel", "False", "--logdir", str(logdir), "--steps", "40",
                  "--log_every", "20"])
    out = capsys.readouterr().out
    assert "Environments: 2 (in-process)" in out and "Resources: envs auto, measured" in out
    assert json.loads((logdir / "resources.json").read_text())["decision"]["envs"] == 2
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    steps_ms = [row["env/1/step_ms"] for row in rows if "env/1/step_ms" in row]
    assert steps_ms and all(value > 0 for value in steps_ms)
    dreamer.main([*SHORT, "--envs", "auto", "--parallel", "False", "--logdir", str(logdir), "--steps", "60"])
    out = capsys.readouterr().out
    assert "Run: resumed" in out and "reused from" in out and "Environments: 2 (in-process)" in out
    assert len(stand_in_measurement) == 1


@pytest.mark.slow  # an in-process training run
def test_auto_with_the_asynchronous_loop_sets_the_learners_threads(tmp_path, capsys, monkeypatch,
                                                                  stand_in_measurement):
    # 2 cores, 0.16 updates per step, an update 2 s on one thread and 1 s on two, in-process. The
    # learner on one thread leaves a core to the environments: min(1 / 21 ms, 1 / (0.16 x 2 s)) = 3.1
    # steps/s; on two it leaves none, and the two take turns: 1 / (21 ms + 0.16 s) = 5.52 with one
    # environment, 2 / (41 ms + 0.32 s) = 5.54 with two (within 3%): one environment, two threads.
    monkeypatch.setattr(resources, "measure_costs", lambda config, tasks, max_threads, make_agent: costs(
        env_ms=20.0, worker_ms=21.0, update=1.0, update_1=2.0, cores=2, task=config.task))
    logdir = tmp_path / "run"
    dreamer.main([*SHORT, "--envs", "auto", "--asynchronous", "--logdir", str(logdir), "--steps", "40",
                  "--log_every", "20"])
    out = capsys.readouterr().out
    assert "Resources: envs auto, measured" in out and "1 environment in-process" in out
    assert "Asynchronous: learner on cpu with 2 torch threads" in out
    decision = json.loads((logdir / "resources.json").read_text())["decision"]
    assert decision["threads"] == 2 and decision["steps_per_s"] == pytest.approx(1 / (21e-3 + 0.16))
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("env/0/step_ms", 0) > 0 for row in rows)


def test_torchrun_refuses_auto(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(tools.ConfigError, match="--envs auto is not supported with torchrun"):
        cfg.check_processes(make_config("--envs", "auto"))


# ----------------------------------------------------------------------------------------------
# Measuring, and the per-environment step cost
# ----------------------------------------------------------------------------------------------


class SlowEnv:
    """Sleeps `seconds` in every step: a step cost that is at least known."""

    def __init__(self, seconds=0.004):
        self.seconds = seconds

    obs_space = property(lambda self: {"obs": gymnasium.spaces.Box(-1, 1, (2,), np.float32),
                                       "is_first": gymnasium.spaces.Box(0, 1, (), bool)})
    act_space = property(lambda self: gymnasium.spaces.Box(-1, 1, (1,), np.float32))

    def reset(self):
        return {"obs": np.zeros(2, np.float32), "is_first": True}

    def step(self, action):
        time.sleep(self.seconds)
        return {"obs": np.zeros(2, np.float32), "is_first": False}, 0.0, False, {}

    def close(self):
        pass


@pytest.mark.parametrize("kind", ["damy", "thread", "parallel"])
def test_every_environment_counts_its_own_step_time(kind):
    make = {"damy": lambda: parallel.Damy(SlowEnv), "thread": lambda: parallel.Damy(SlowEnv, own_thread=True),
            "parallel": lambda: parallel.Parallel(SlowEnv)}[kind]
    env = make()
    try:
        env.reset()()
        for _ in range(5):
            env.step(np.zeros(1, np.float32))()
        assert env.step_count == 5
        assert env.step_seconds >= 5 * 0.004  # slept at least that long inside env.step
    finally:
        env.close()


def test_collector_status_reports_step_ms_per_interval():
    env_list = [parallel.Damy(functools.partial(SlowEnv, 0.004)), parallel.Damy(functools.partial(SlowEnv, 0.0))]
    collector = parallel.Collector(env_list, None, None, lambda episode: None)
    policy = lambda obs, state: (np.zeros((2, 1), np.float32), None)  # noqa: E731
    assert all(np.isnan(row["step_ms"]) for row in collector.status())  # no steps yet
    for _ in range(3):
        collector.step(policy)
    rows = collector.status()
    assert rows[0]["step_ms"] >= 4.0 and rows[0]["step_ms"] > rows[1]["step_ms"]
    assert np.isnan(collector.status()[0]["step_ms"])  # a fresh interval


@pytest.mark.slow  # measures for seconds
def test_measure_env_and_time_agent_on_the_debug_task():
    config = make_config()
    measured = resources.measure_env(functools.partial(envs.make_env, config, "train", 0), steps=15, budget=1.0)
    for key in ("step_ms", "worker_ms", "extra_worker_ms", "worker_start_s"):
        assert np.isfinite(measured[key]) and measured[key] >= 0, key
    assert measured["worker_ms"] > 0 and measured["step_ms"] > 0
    torch.manual_seed(0)
    agent = dreamer.Dreamer(measured["obs_space"], measured["act_space"], config)
    before = {k: v.clone() for k, v in agent.state_dict().items()}
    timed = resources.time_agent(agent, measured["obs_space"], measured["act_space"], config, 1, False)
    assert set(timed) == {"policy_ms", "policy_extra_ms", "update_s"} and timed["update_s"] > 0
    assert any(not torch.equal(before[k], v) for k, v in agent.state_dict().items())  # it really updated


def test_measure_costs_keeps_the_random_state(monkeypatch):
    config = make_config()
    monkeypatch.setattr(resources, "measure_env", lambda ctor, seed=0: {
        **dict(zip(("obs_space", "act_space"), spaces_of(config))), "step_ms": 1.0, "worker_ms": 2.0,
        "extra_worker_ms": 0.1, "worker_start_s": 0.5})
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    result = resources.measure_costs(config, [config.task], 1, dreamer.Dreamer)
    assert torch.equal(torch.rand(3), expected)
    assert result["env_ms"] == {config.task: 1.0} and result["update_s"] > 0 and result["gpu"] is False


def spaces_of(config):
    env = envs.make_env(config, "train", 0)
    try:
        return env.obs_space, env.act_space
    finally:
        env.close()
