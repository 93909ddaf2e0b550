"""--seeds N: several seeds in one process, one batched update (seeds.py).

Seed k of a batched run computes what the same seed computes alone (episodes, losses, weights);
seeds do not leak into each other; every seed is a run of its own in <logdir>/seed<k> and resumes;
what it cannot do yet is one line, exit 2."""

import copy
import json
import pathlib

import numpy as np
import pytest
import torch
from test_design import batch_for

import config as cfg
import distributions
import dreamer
import envs
import seeds

pytestmark = pytest.mark.usefixtures("one_thread")

# 100 frames (50 steps) of batches of 4 x 10 at ratio 96 (2.4 updates a step): more than 50
# updates once the replay holds a batch (recipe2024's start) or a sequence (v1's).
FLAGS = ("--configs", "debug", "--steps", "100", "--batch_size", "4", "--batch_length", "10", "--train_ratio", "96",
         "--log_every", "10", "--eval_every", "1e9", "--eval_episode_num", "0", "--time_limit", "25")
TIMING = ("fps", "busy", "per_s", "_ms", "time", "wait", "lag")  # metrics of the clock, not of the run
RECIPES = {"v1": (), "recipe2024": ("--configs", "recipe2024", "debug")}
STEPS = {"v1": "100", "recipe2024": "130"}  # recipe2024 first fills one batch, with its reset steps


def metrics(logdir):
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


def episodes(logdir):
    """The stored training episodes in the order they were written (their names start with the time)."""
    found = {}
    for index, path in enumerate(sorted((logdir / "train_eps").glob("*.npz"))):
        with np.load(path) as data:
            found[index] = {k: data[k] for k in data.files}
    return found


def assert_close(batched, alone, rtol=1e-5):
    """Two metrics rows or arrays equal to float tolerance, key by key."""
    assert batched.keys() == alone.keys()
    for key in alone:
        a, b = np.asarray(alone[key], np.float64), np.asarray(batched[key], np.float64)
        assert a.shape == b.shape, key
        np.testing.assert_allclose(b, a, rtol=rtol, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_seed_of_a_batched_run_computes_what_it_computes_alone(tmp_path, recipe):
    flags = [*RECIPES[recipe], *FLAGS[2:]] if recipe != "v1" else list(FLAGS)
    flags += ["--steps", STEPS[recipe]]
    dreamer.main([*flags, "--seeds", "2", "--logdir", str(tmp_path / "batched")])
    dreamer.main([*flags, "--seed", "1", "--logdir", str(tmp_path / "alone")])
    batched, alone = tmp_path / "batched" / "seed1", tmp_path / "alone"
    rows, alone_rows = metrics(batched), metrics(alone)
    assert len(rows) == len(alone_rows) >= 4
    assert sum(any(k.startswith("world_model/") for k in row) for row in alone_rows) >= 3, "rows without losses"
    assert torch.load(alone / "latest.pt", weights_only=True)["counters"]["updates"] >= 50
    for row, alone_row in zip(rows, alone_rows):
        timing = {k for k in alone_row if any(word in k for word in TIMING)}
        assert_close({k: v for k, v in row.items() if k not in timing},
                     {k: v for k, v in alone_row.items() if k not in timing})
    found, alone_found = episodes(batched), episodes(alone)
    assert found.keys() == alone_found.keys() and len(found) >= 2
    for name in alone_found:
        assert_close(found[name], alone_found[name])
    # Its checkpoint holds its own weights, not the whole stack (storage.own_tensors): the size of the alone one's.
    size, alone_size = (batched / "latest.pt").stat().st_size, (alone / "latest.pt").stat().st_size
    assert abs(size - alone_size) < 0.1 * alone_size, (size, alone_size)
    weights = torch.load(batched / "latest.pt", weights_only=True)["agent"]
    alone_weights = torch.load(alone / "latest.pt", weights_only=True)["agent"]
    for key, value in alone_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)
    # The other seed is another run: its own episodes.
    other = episodes(tmp_path / "batched" / "seed0")
    assert not np.array_equal(other[0]["action"], alone_found[0]["action"])


# -- no leak ----------------------------------------------------------------------------------------


def agents_of(config, env, count):
    agents, generators = [], []
    for k in range(count):
        torch.manual_seed(k)
        agents.append(dreamer.Dreamer(env.obs_space, env.act_space, config))
        generators.append(seeds.seed_generator("cpu"))
    return agents, generators


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_seed_batch_changes_no_other_seed(recipe):
    config = cfg.parse([*(RECIPES[recipe] or ("--configs", "debug")), "--compile", "False"])
    env = envs.make_env(config, "train", 0)
    try:
        runs, template = [], agents_of(config, env, 1)[0][0]
        fixed = [{k: batch_for(template, env, seed=10 * k + i) for k in range(3)} for i in range(3)]
        for perturb in (False, True):
            agents, generators = agents_of(config, env, 3)
            batched = seeds.BatchedUpdate(agents, generators)
            for i in range(3):
                batches = dict(fixed[i])
                if perturb:
                    batches[1] = {**batches[1], "reward": batches[1]["reward"] + 1.0}
                results = batched.run({k: (batch, None) for k, batch in batches.items()})
            runs.append(([{k: v.detach().clone() for k, v in a.state_dict().items()} for a in agents], results))
    finally:
        env.close()
    (clean, clean_metrics), (perturbed, perturbed_metrics) = runs
    for k in (0, 2):
        for key in clean[k]:
            assert torch.equal(clean[k][key], perturbed[k][key]), (k, key)
        assert all(torch.equal(clean_metrics[k][0][m], perturbed_metrics[k][0][m]) for m in clean_metrics[k][0])
    # The perturbed seed did see its batch. Not through rew_loss alone: recipe2024's reward head starts at
    # zero weights, so its loss is log(255) whatever the reward until the weights move past float32's resolution,
    # which the warm-up's first tiny steps may not (whether they do depends on the CPU's rounding).
    assert any(not torch.equal(clean[1][key], perturbed[1][key]) for key in clean[1])
    assert any(not torch.equal(clean_metrics[1][0][m], perturbed_metrics[1][0][m]) for m in clean_metrics[1][0])


def test_an_absent_seed_keeps_its_weights_moments_and_state():
    config = cfg.parse(["--configs", "recipe2024", "debug", "--compile", "False"])
    env = envs.make_env(config, "train", 0)
    try:
        agents, generators = agents_of(config, env, 2)
        batched = seeds.BatchedUpdate(agents, generators)
        batched.run({k: (batch_for(agents[0], env, seed=k), None) for k in range(2)})  # moments exist
        before = copy.deepcopy(agents[1].state_dict()), copy.deepcopy(agents[1].optimizer_state())
        rng = generators[1].get_state()
        results = batched.run({0: (batch_for(agents[0], env, seed=5), None)})
    finally:
        env.close()
    assert set(results) == {0}
    for key, value in before[0].items():
        assert torch.equal(agents[1].state_dict()[key], value), key
    joint = agents[1].optimizer_state()["update"]["opt"]["state"]
    for index, state in before[1]["update"]["opt"]["state"].items():
        assert all(torch.equal(joint[index][name], value) for name, value in state.items())
    assert torch.equal(generators[1].get_state(), rng)


# -- the pieces ---------------------------------------------------------------------------------------


def test_a_recording_tape_stands_in_zeros_on_the_samples_device():
    """The batched update records its noise draws with one pass on the training device; the zeros that
    stand in for the noise must be on that device (on the first GPU run they were on the host, and the
    8-seed update stopped: 'found at least two devices'). The meta device stands in for the GPU here."""
    recorder = seeds.Tape()
    with distributions.tape(recorder):
        onehot = distributions.OneHot(torch.randn(4, 3, 5, device="meta")).sample()
        normal = distributions.normal((6, 2), torch.device("meta"))  # Normal.sample's noise
    assert onehot.device.type == normal.device.type == "meta"
    assert recorder.draws == [("uniform", (4, 3, 1)), ("normal", (6, 2))]


def test_a_tape_hands_out_the_noise_its_generator_would_have_drawn():
    logits = torch.randn(4, 3, 5)
    mean, std = torch.randn(6, 2), torch.rand(6, 2) + 0.1

    def draw():
        return distributions.OneHot(logits).sample(), distributions.Normal(mean, std).sample()

    recorder = seeds.Tape()
    with distributions.tape(recorder):
        draw()
    assert [kind for kind, _ in recorder.draws] == ["uniform", "normal"]
    gen = torch.Generator().manual_seed(3)
    with distributions.generator(gen):
        expected = draw()
    values = seeds.Tape.draw(recorder.draws, torch.Generator().manual_seed(3), "cpu")
    with distributions.tape(seeds.Tape(values)):
        taped = draw()
    for a, b in zip(taped, expected):
        assert torch.equal(a, b)
    torch.manual_seed(3)  # no generator: torch's global one, as torch.rand and Normal.rsample draw
    plain = draw()
    for a, b in zip(plain, expected):
        assert torch.equal(a, b)


def test_a_stacked_agent_reads_and_writes_its_row(spaces):
    config = cfg.parse(["--configs", "debug", "--compile", "False"])
    agents = [dreamer.Dreamer(*spaces, config) for _ in range(2)]
    own = [dict(agent.named_parameters()) for agent in agents]
    name = next(iter(own[0]))
    values = [o[name].detach().clone() for o in own]
    stack = seeds.Stack(agents)
    assert stack.params[name].shape == (2, *values[0].shape)
    assert torch.equal(stack.params[name][1], values[1])
    with torch.no_grad():
        own[1][name].add_(1.0)
        stack.params[name][0].mul_(0.0)
    assert torch.equal(stack.params[name][1], values[1] + 1.0)
    assert not own[0][name].any()


# -- the command line ------------------------------------------------------------------------------


def test_seeds_write_runs_of_their_own_and_resume(tmp_path, capsys):
    logdir = tmp_path / "run"
    dreamer.main([*FLAGS, "--steps", "60", "--seeds", "3", "--logdir", str(logdir)])
    runs = [logdir / f"seed{k}" for k in range(3)]
    for run in runs:
        assert (run / "latest.pt").exists() and metrics(run)
        assert cfg.parse(["--configs", "debug"]).seeds == 1
    returns = [[row["train/return"] for row in metrics(run) if "train/return" in row] for run in runs]
    assert len({tuple(r) for r in returns}) == 3, returns
    seeds_saved = [pathlib.Path(run / "config.yaml").read_text() for run in runs]
    assert [f"seed: {k}" in text for k, text in enumerate(seeds_saved)] == [True] * 3
    capsys.readouterr()
    dreamer.main([*FLAGS, "--steps", "80", "--seeds", "3", "--logdir", str(logdir)])
    out = capsys.readouterr().out
    assert "Run: resumed from frame 60" in out
    for k, run in enumerate(runs):
        assert f"seed{k}: Episodes:" in out
        assert torch.load(run / "latest.pt", weights_only=True)["counters"]["policy_steps"] == 40  # 80 frames


@pytest.mark.parametrize("flags, says", [
    (("--seeds", "0"), "Invalid value '0' for --seeds"),
    (("--seeds", "2", "--asynchronous", "True"), "--seeds 2 does not run with --asynchronous yet"),
    (("--seeds", "2", "--compile", "update"), "--seeds 2 does not run with --compile yet"),
])
def test_what_seeds_cannot_do_is_one_line_and_exit_2(tmp_path, capsys, flags, says):
    with pytest.raises(SystemExit) as exit_:
        dreamer.main([*FLAGS, *flags, "--logdir", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_signal_ends_the_seeds_only_after_each_seeds_thread_has_saved_and_closed_its_environments():
    """A Ctrl-C that lands while the main thread waits for the seeds must not let train_together
    return before each seed's thread has finished its save and closed its environments: Python
    3.11's Thread.join, interrupted by a signal, marks a thread that still runs as stopped."""
    import signal
    import threading
    import time

    import launch

    events = []

    class Environment:
        def close(self):
            events.append(("closed", threading.current_thread().name))

    class Trainer:  # stands in for dreamer.Trainer: trains until asked to stop, then saves for a while
        done, frames = False, 0

        def __init__(self):
            self.agreement = type("Agreement", (), {})()
            self.agreement.stops = launch.Stops({signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: SystemExit},
                                                enabled=False)

        def train(self):
            while not self.agreement.stops.code:
                time.sleep(0.01)
            time.sleep(0.5)  # the checkpoint's write
            events.append(("saved", threading.current_thread().name))

    class Batched:
        def leave(self, k):
            events.append(("left", f"seed{k}"))

    main = threading.main_thread().ident
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            seeds.train_together([Trainer()], [torch.Generator()], Batched(), [[Environment()]])
        returned = list(events)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert returned == [("saved", "seed0"), ("left", "seed0"), ("closed", "seed0")]


@pytest.mark.slow  # its own process: the signal handler is the point
def test_sigterm_saves_every_seed_and_a_rerun_resumes_them(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    logdir = tmp_path / "run"
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"), OMP_NUM_THREADS="1")
    argv = [sys.executable, str(root / "dreamer.py"), *FLAGS, "--seeds", "2", "--logdir", str(logdir)]
    process = subprocess.Popen([*argv, "--steps", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not all(list((logdir / f"seed{k}" / "train_eps").glob("*.npz"))
                                             for k in range(2)):
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert err.strip().splitlines() == ["Stopped by SIGTERM; rerun the same command to resume."]
    saved = [torch.load(logdir / f"seed{k}" / "latest.pt", weights_only=True)["counters"] for k in range(2)]
    assert all(counters["policy_steps"] >= 10 for counters in saved), saved
    result = subprocess.run([*argv, "--steps", str(2 * max(c["policy_steps"] for c in saved) + 20)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Run: resumed from frame") == 1  # the summary, of seed0
    for k in range(2):
        assert f"seed{k}: frames" in result.stdout
