"""Data-parallel training under torchrun: 2 CPU processes (gloo) on 127.0.0.1, the debug preset.

The update tests run this file itself under torchrun (`python3 tests/test_distributed.py updates
OUT` is the worker); the others run dreamer.py under torchrun as a user would.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import gymnasium
import numpy as np
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import config as cfg  # noqa: E402
import distributions  # noqa: E402
import dreamer  # noqa: E402
import launch  # noqa: E402
import optim  # noqa: E402
import tools  # noqa: E402
from envs import wrappers  # noqa: E402

PROPRIO = ["--encoder.mlp_keys", ".*", "--encoder.cnn_keys", "$^", "--decoder.mlp_keys", ".*",
           "--decoder.cnn_keys", "$^"]
OBS_SPACE = {"position": gymnasium.spaces.Box(-np.inf, np.inf, (3,), np.float32),
             "velocity": gymnasium.spaces.Box(-np.inf, np.inf, (2,), np.float32), **wrappers.flag_spaces()}
BOX = gymnasium.spaces.Box(-1, 1, (2,), np.float32)
BATCH = 4  # per rank
MORE = 3  # updates after the first, each rank on its own batches


def environment():
    return dict(os.environ, OMP_NUM_THREADS="1", MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"),
                MASTER_ADDR="127.0.0.1")


def torchrun(*args, processes=2, timeout=240):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=environment(), timeout=timeout, cwd=ROOT)


# -- the update: one process on the whole batch == two processes on its halves ----------------------


def deterministic_sampling():
    """Samples are modes, so that the two halves of a batch see the noise the whole one does."""
    distributions.OneHot.sample = distributions.OneHot.mode
    distributions.Normal.sample = distributions.Normal.mode


# The paper's sequential update with Plan2Explore, and the 2024 recipe's joint update (one LaProp
# step with adaptive clipping and the replay value loss).
UPDATES = {"sequential": ["--expl_behavior", "plan2explore"],
           "joint": ["--update", "joint", "--imag_gradient", "reinforce", "--opt", "laprop", "--agc", "0.3",
                     "--critic.repval", "0.3"]}


def make_agent(update):
    torch.manual_seed(0)
    config = cfg.parse(["--configs", "debug", *PROPRIO, *UPDATES[update], "--batch_size", str(BATCH),
                        "--batch_length", "6"])
    return dreamer.Dreamer(OBS_SPACE, BOX, config)


def make_batch(size, seed):
    """A replayed batch (B, T, ...) with episode starts and terminals. Only the first half holds an
    episode boundary: Plan2Explore's ensemble loss averages over the pairs that do not cross one,
    so the halves hold different numbers of pairs."""
    rng = np.random.default_rng(seed)
    is_first = np.zeros((size, 6), bool)
    is_first[:, 0] = True
    is_first[0, 3] = True
    return {"position": rng.normal(size=(size, 6, 3)).astype(np.float32),
            "velocity": rng.normal(size=(size, 6, 2)).astype(np.float32),
            "action": rng.uniform(-1, 1, (size, 6, 2)).astype(np.float32),
            "reward": rng.normal(size=(size, 6)).astype(np.float32),
            "is_first": is_first, "is_last": np.zeros((size, 6), bool), "is_terminal": rng.random((size, 6)) < 0.2}


def update(agent, batch):
    """One train_step; (metrics as floats, parameters and buffers, averaged gradients)."""
    metrics, _ = agent.update.train_step(batch)
    state = {k: v.detach().clone() for k, v in agent.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in agent.named_parameters() if p.grad is not None}
    return {k: float(v) for k, v in metrics.items()}, state, grads


def worker(out):
    """Run by torchrun: each rank updates on its half of the batch, then on batches of its own."""
    torch.set_num_threads(1)
    deterministic_sampling()
    ranks = launch.processes("cpu")
    for name in UPDATES:
        agent = make_agent(name)
        if ranks.rank:  # other initial weights on rank 1: the broadcast from rank 0 must replace them
            for p in agent.parameters():
                torch.nn.init.normal_(p.data)
        agent.distribute(ranks)
        half = {k: v[ranks.rank * BATCH:(ranks.rank + 1) * BATCH] for k, v in make_batch(2 * BATCH, 0).items()}
        metrics, state, grads = update(agent, half)
        for i in range(MORE):
            agent.update.train_step(make_batch(BATCH, 10 * ranks.rank + i + 1))
        later = {k: v.detach().clone() for k, v in agent.state_dict().items()}
        torch.save({"metrics": metrics, "state": state, "grads": grads, "later": later},
                   out / f"{name}{ranks.rank}.pt")
    ranks.close()


@pytest.fixture(scope="module")
def ranks_updated(tmp_path_factory):
    out = tmp_path_factory.mktemp("updates")
    result = torchrun(pathlib.Path(__file__), "updates", out, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return {name: [torch.load(out / f"{name}{r}.pt", weights_only=True) for r in range(2)] for name in UPDATES}


@pytest.mark.parametrize("name", list(UPDATES))
def test_one_update_on_two_ranks_equals_one_process_on_their_batches_together(ranks_updated, monkeypatch, name):
    monkeypatch.setattr(distributions.OneHot, "sample", distributions.OneHot.mode)
    monkeypatch.setattr(distributions.Normal, "sample", distributions.Normal.mode)
    torch.set_num_threads(1)
    agent = make_agent(name)
    metrics, state, grads = update(agent, make_batch(2 * BATCH, 0))
    ranks = ranks_updated[name]
    # Each rank's loss is the mean over its half; the whole batch's is their mean (Plan2Explore's
    # ensemble loss divides each rank's sum by the mean count of pairs over the ranks).
    losses = {"sequential": ("model_loss", "actor_loss", "critic_loss", "expl_ensemble_loss", "expl_actor_loss"),
              "joint": ("model_loss", "actor_loss", "critic_loss", "joint_loss")}[name]
    for key in losses:
        mean = (ranks[0]["metrics"][key] + ranks[1]["metrics"][key]) / 2
        assert mean == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    # Clipping saw the averaged gradient: the norms every rank reports are the whole batch's.
    norms = {"sequential": ("model_grad_norm", "actor_grad_norm", "critic_grad_norm", "expl_ensemble_grad_norm"),
             "joint": ("joint_grad_norm",)}[name]
    for key in norms:
        for rank in ranks:
            assert rank["metrics"][key] == pytest.approx(metrics[key], rel=1e-4), key
    assert grads.keys() == ranks[0]["grads"].keys() and len(grads) > 20
    for name, grad in grads.items():
        for rank in ranks:
            torch.testing.assert_close(rank["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # Parameters, the slow critic and the return percentiles' EMAs after the step.
    for name, value in state.items():
        for rank in ranks:
            torch.testing.assert_close(rank["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert any("return_norm.high" in name for name in state)


@pytest.mark.parametrize("name", list(UPDATES))
def test_parameters_stay_bitwise_identical_across_ranks(ranks_updated, name):
    first, second = ranks_updated[name]
    for key in first["later"]:
        assert torch.equal(first["later"][key], second["later"][key]), key
    # ... though the ranks trained on different batches after the first update.
    assert not all(torch.equal(first["later"][k], first["state"][k]) for k in first["later"])


# -- dreamer.py under torchrun -------------------------------------------------------------------


DEBUG = ["dreamer.py", "--configs", "dmc_proprio", "debug", "--device", "cpu", "--eval_every", "200"]


def test_a_torchrun_run_logs_once_checkpoints_and_resumes(tmp_path):
    logdir = tmp_path / "run"
    result = torchrun(*DEBUG, "--logdir", logdir, "--steps", "200")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("Run: new") == 1 and "Processes: 2 (torchrun, gloo" in result.stdout
    # One logdir: rank 0 writes the logs, the config and the checkpoint; each rank its episodes.
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in logdir.rglob("metrics.jsonl")) == ["metrics.jsonl"]
    assert len(list(logdir.rglob("config.yaml"))) == 1 and len(list(logdir.rglob("latest.pt"))) == 1
    assert list((logdir / "train_eps").glob("*.npz")) and list((logdir / "train_eps" / "rank1").glob("*.npz"))
    state = torch.load(logdir / "latest.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["ranks"]) == 1
    assert state["counters"]["policy_steps"] * 2 == 200  # frames are each rank's
    # Ranks sample their own batches: their replay random states differ.
    assert state["ranks"][0]["rng"]["replay"] != state["rng"]["replay"]

    result = torchrun(*DEBUG, "--logdir", logdir, "--steps", "300")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("resumed from frame 200") == 1
    state = torch.load(logdir / "latest.pt", weights_only=True)
    assert state["counters"]["policy_steps"] * 2 == 300
    rows = (logdir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(row)["step"] for row in rows]
    assert steps == sorted(steps) and steps[-1] == 300

    # Another number of processes: one line, exit 2, nothing written.
    before = {p: p.read_bytes() for p in logdir.rglob("*") if p.is_file() and p.name != "run.lock"}
    command = [sys.executable, *DEBUG, "--logdir", str(logdir), "--steps", "400"]
    single = subprocess.run(command, capture_output=True, text=True, env=environment(), timeout=120, cwd=ROOT)
    assert single.returncode == 2, single.stderr[-2000:]
    assert "saved by 2 process(es) and this run has 1" in single.stderr
    after = {p: p.read_bytes() for p in logdir.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert after == before


FAILING = """
import os, sys
sys.path.insert(0, {root!r})
import dreamer

if os.environ["RANK"] == "1":
    original = dreamer.Trainer.update

    def update(self, count, phase=None):
        if self.counters.updates >= 2:
            raise RuntimeError("injected failure")
        return original(self, count, phase)

    dreamer.Trainer.update = update
dreamer.main()
"""


def test_a_rank_that_raises_ends_the_job_and_is_named(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING.format(root=str(ROOT)))
    start = time.time()
    result = torchrun(script, *DEBUG[1:], "--logdir", tmp_path / "run", "--steps", "5000", timeout=120)
    assert result.returncode != 0
    assert "error: rank 1 of 2 failed: RuntimeError: injected failure" in result.stderr
    assert time.time() - start < 90


@pytest.mark.parametrize("flag", ["--eval_only", "--offline_traindir", "--asynchronous"])
def test_modes_not_supported_under_torchrun_are_one_line(flag, tmp_path, monkeypatch, capsys):
    assert flag[2:] in tools.flatten(cfg.load_presets()["defaults"])  # a renamed key fails here, not elsewhere
    args = ["--configs", "debug", "--logdir", str(tmp_path / "run"), flag]
    args += [str(tmp_path)] if flag == "--offline_traindir" else []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stop:
        dreamer.main(args)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} is not supported with torchrun yet"), lines
    monkeypatch.delenv("RANK")
    if flag == "--eval_only":  # without torchrun it is the usual check
        with pytest.raises(tools.ConfigError, match="needs a checkpoint"):
            dreamer.setup(args)
    assert not (tmp_path / "run").exists()


def test_single_process_averages_nothing():
    ranks = launch.SingleProcess()
    grads = [torch.ones(3)]
    ranks.average_(grads)
    assert torch.equal(grads[0], torch.ones(3)) and ranks.is_main and ranks.world_size == 1
    assert isinstance(optim.Optimizer.ranks, launch.SingleProcess)


if __name__ == "__main__" and sys.argv[1] == "updates":
    worker(pathlib.Path(sys.argv[2]))
