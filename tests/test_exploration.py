"""Exploration behaviours (exploration.py) and their wiring into dreamer.py.

Unit tests build small agents in-process on a fake proprioceptive space; the end-to-end tests run
short `dreamer.py --configs debug` trainings, the subprocess ones concurrently to save time.
"""

import json
import os
import pathlib
import subprocess
import sys

import gymnasium
import numpy as np
import pytest
import torch

import config as cfg
import dreamer
import storage
from envs import wrappers

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROPRIO = ["--encoder.mlp_keys", ".*", "--encoder.cnn_keys", "$^", "--decoder.mlp_keys", ".*",
           "--decoder.cnn_keys", "$^"]
OBS_SPACE = {"position": gymnasium.spaces.Box(-np.inf, np.inf, (3,), np.float32),
             "velocity": gymnasium.spaces.Box(-np.inf, np.inf, (2,), np.float32), **wrappers.flag_spaces()}
BOX = gymnasium.spaces.Box(-1, 1, (2,), np.float32)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_config(*flags):
    return cfg.parse(["--configs", "debug", *PROPRIO, "--expl_behavior", "plan2explore", *flags])


def make_agent(*flags, act_space=BOX):
    torch.manual_seed(0)
    config = make_config(*flags)
    return dreamer.Dreamer(OBS_SPACE, act_space, config), config


def fake_batch(config, batch=4, length=None, act_size=2, firsts=()):
    """Random replay batch (B, T, ...); is_first at t = 0 and at the given (b, t)."""
    length = length or config.batch_length
    rng = np.random.default_rng(0)
    is_first = np.zeros((batch, length), bool)
    is_first[:, 0] = True
    for b, t in firsts:
        is_first[b, t] = True
    return {"position": rng.normal(size=(batch, length, 3)).astype(np.float32),
            "velocity": rng.normal(size=(batch, length, 2)).astype(np.float32),
            "action": rng.uniform(-1, 1, (batch, length, act_size)).astype(np.float32),
            "reward": rng.normal(size=(batch, length)).astype(np.float32),
            "is_first": is_first, "is_last": np.zeros((batch, length), bool),
            "is_terminal": np.zeros((batch, length), bool)}


def member_predictions(ensemble, inputs):
    """Each member applied on its own, with plain matmuls: (K, N, D), independent of Ensemble.forward."""
    outs = []
    for k in range(len(ensemble.weights[0])):
        x = inputs
        for i, (weight, bias) in enumerate(zip(ensemble.weights, ensemble.biases)):
            x = x @ weight[k] + bias[k, 0]
            if i < len(ensemble.weights) - 1:
                x = ensemble.act(x)
        outs.append(x)
    return torch.stack(outs)


# ----------------------------------------------------------------------------------------------
# Disagreement and intrinsic reward
# ----------------------------------------------------------------------------------------------


def test_disagreement_small_on_training_data_large_far_from_it():
    agent, config = make_agent("--disag_target", "deter", "--model_lr", "1e-2")
    p2e, rssm = agent.expl_behavior, agent.wm.rssm
    # Latent sequences whose next deter is a fixed function of the current feature: consistent data.
    gen = torch.Generator().manual_seed(1)
    mixing = torch.randn(rssm.feat_size, rssm.deter, generator=gen) / rssm.feat_size ** 0.5
    batch, length = 4, config.batch_length
    classes = torch.randint(0, rssm.discrete, (batch, length, rssm.stoch), generator=gen)
    stoch = torch.nn.functional.one_hot(classes, rssm.discrete).float()
    deter = [torch.tanh(torch.randn(batch, rssm.deter, generator=gen))]
    for t in range(length - 1):
        deter.append(torch.tanh(torch.cat([stoch[:, t].flatten(1), deter[t]], -1) @ mixing))
    post = {"stoch": stoch, "deter": torch.stack(deter, 1)}
    action, is_first = torch.zeros(batch, length, 2), torch.zeros(batch, length)
    seen = rssm.get_feat(post)[:, :-1].reshape(-1, rssm.feat_size)
    far = 3 * torch.randn(256, rssm.feat_size, generator=gen)
    with torch.no_grad():
        initial = p2e.disagreement(seen).mean()
    for _ in range(300):
        p2e.optimizer(p2e.ensemble_loss(post, None, action, is_first))
    with torch.no_grad():
        on_seen, on_far = p2e.disagreement(seen).mean(), p2e.disagreement(far).mean()
    assert on_seen < 0.02 * initial, (on_seen, initial)
    assert on_far > 100 * on_seen, (on_far, on_seen)


@pytest.mark.parametrize("intr, extr, log, action_cond", [
    (1.0, 0.0, False, False), (0.5, 0.0, True, False), (2.0, 0.3, True, True), (0.0, 1.0, False, False)])
def test_intrinsic_reward_matches_reference(intr, extr, log, action_cond):
    agent, config = make_agent("--expl_intr_scale", str(intr), "--expl_extr_scale", str(extr),
                               "--disag_log", str(log), "--disag_action_cond", str(action_cond))
    p2e = agent.expl_behavior
    torch.nn.init.normal_(agent.wm.heads["reward"].out.weight)  # zero-initialised otherwise
    feat = torch.randn(config.imag_horizon + 1, 7, agent.wm.rssm.feat_size)
    action = torch.rand(config.imag_horizon + 1, 7, 2) * 2 - 1
    with torch.no_grad():
        reward, stats = p2e.intrinsic_reward(feat, action)
        inputs = torch.cat([feat, action], -1) if action_cond else feat
        preds = member_predictions(p2e.ensemble, inputs.reshape(-1, inputs.shape[-1]))
        mean = preds.mean(0)
        variance = ((preds - mean) ** 2).sum(0) / (len(preds) - 1)  # Eq. 5 of Plan2Explore
        disag = variance.mean(-1).reshape(reward.shape)
        expected = intr * (torch.log(disag) if log else disag)
        expected = expected + extr * agent.wm.heads["reward"](feat).mean()
    assert reward.shape == (config.imag_horizon + 1, 7)
    torch.testing.assert_close(reward, expected, rtol=1e-4, atol=1e-6)
    intrinsic = intr * (torch.log(disag) if log else disag)
    for name, value in (("mean", intrinsic.mean()), ("std", intrinsic.std()), ("max", intrinsic.max())):
        torch.testing.assert_close(stats[f"intr_reward_{name}"], value, rtol=1e-4, atol=1e-6)


def test_log_disagreement_stays_finite_when_members_agree():
    agent, config = make_agent("--disag_log", "True")
    p2e = agent.expl_behavior
    with torch.no_grad():  # every member a copy of the first: zero variance everywhere
        for param in [*p2e.ensemble.weights, *p2e.ensemble.biases]:
            param.copy_(param[:1].expand_as(param))
    feat = torch.randn(config.imag_horizon + 1, 5, agent.wm.rssm.feat_size, requires_grad=True)
    reward, _ = p2e.intrinsic_reward(feat, None)
    reward.sum().backward()
    assert torch.isfinite(reward).all() and torch.isfinite(feat.grad).all()
    assert (reward < -10).all()  # far below the reward of members that disagree


# ----------------------------------------------------------------------------------------------
# Targets and the ensemble's training pairs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("discrete", [4, 0])
@pytest.mark.parametrize("target", ["stoch", "deter", "embed", "feat"])
def test_targets_have_the_right_size(target, discrete):
    agent, config = make_agent("--disag_target", target, "--dyn_discrete", str(discrete))
    p2e = agent.expl_behavior
    data = agent.wm.preprocess(fake_batch(config))
    with torch.no_grad():
        _, post, embed, _ = agent.wm.loss(data)
    stoch = config.dyn_stoch * discrete if discrete else config.dyn_stoch
    flat_stoch = post["stoch"].reshape(*post["stoch"].shape[:2], -1)
    expected = {"stoch": flat_stoch, "deter": post["deter"], "embed": embed,
                "feat": torch.cat([flat_stoch, post["deter"]], -1)}[target]
    size = {"stoch": stoch, "deter": config.dyn_deter, "embed": embed.shape[-1],
            "feat": stoch + config.dyn_deter}[target]
    assert expected.shape[-1] == size
    assert p2e.target(post, embed).shape == (4, config.batch_length, size)
    torch.testing.assert_close(p2e.target(post, embed), expected)
    metrics = p2e.train_step(post, embed, data)
    assert metrics["expl_ensemble_loss"] > 0
    for key in ("expl_ensemble_loss", "expl_intr_reward_mean", "expl_intr_reward_std", "expl_intr_reward_max",
                "expl_actor_loss", "expl_critic_loss"):
        assert torch.isfinite(metrics[key]), key


@pytest.mark.parametrize("offset, action_cond", [(1, False), (1, True), (3, True), (0, False), (0, True)])
def test_ensemble_loss_pairs_align_and_skip_episode_boundaries(offset, action_cond):
    agent, config = make_agent("--disag_target", "embed", "--disag_offset", str(offset),
                               "--disag_action_cond", str(action_cond))
    p2e, rssm = agent.expl_behavior, agent.wm.rssm
    batch = fake_batch(config, firsts=[(0, 5), (2, 11), (2, 12)])
    data = agent.wm.preprocess(batch)
    with torch.no_grad():
        _, post, embed, _ = agent.wm.loss(data)
        loss = p2e.ensemble_loss(post, embed, data["action"], data["is_first"])
        # Reference: every pair (t, t + offset) inside one episode; the action taken after step t
        # is stored with step t + 1, so action conditioning needs that step inside the episode too.
        feat, errors = rssm.get_feat(post), []
        span = max(offset, 1) if action_cond else offset
        for b in range(len(feat)):
            for t in range(config.batch_length - span):
                if data["is_first"][b, t + 1:t + span + 1].any():
                    continue
                x = torch.cat([feat[b, t], data["action"][b, t + 1]]) if action_cond else feat[b, t]
                pred = member_predictions(p2e.ensemble, x[None])[:, 0]
                errors.append(((pred - embed[b, t + offset]) ** 2).mean())
    torch.testing.assert_close(loss, torch.stack(errors).mean(), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Random exploration
# ----------------------------------------------------------------------------------------------


def test_random_covers_continuous_action_space():
    agent, config = make_agent("--expl_behavior", "random", act_space=BOX)
    assert not list(agent.expl_behavior.parameters()) and agent.expl_behavior.train_step(*[None] * 3) == {}
    obs = {k: v[:, 0] for k, v in fake_batch(config, batch=20000, length=1).items() if k != "action"}
    actions, _ = agent.policy(obs, None, "explore")
    assert actions.shape == (20000, 2)
    assert actions.min() >= -1 and actions.max() <= 1
    assert actions.min() < -0.99 and actions.max() > 0.99
    for dim in range(2):  # every tenth of [-1, 1] gets its share
        counts, _ = np.histogram(actions[:, dim], bins=10, range=(-1, 1))
        assert np.all(np.abs(counts / len(actions) - 0.1) < 0.015), counts
    assert abs(np.corrcoef(actions.T)[0, 1]) < 0.05  # dimensions drawn independently


def test_random_covers_discrete_action_space():
    agent, config = make_agent("--expl_behavior", "random", "--actor.dist", "onehot",
                               act_space=wrappers.OneHotSpace(5))
    obs = {k: v[:, 0] for k, v in fake_batch(config, batch=20000, length=1, act_size=5).items() if k != "action"}
    actions, _ = agent.policy(obs, None, "explore")
    assert set(np.unique(actions)) == {0.0, 1.0} and np.all(actions.sum(-1) == 1)
    frequencies = actions.mean(0)
    assert np.all(np.abs(frequencies - 0.2) < 0.015), frequencies


# ----------------------------------------------------------------------------------------------
# The switch at expl_until, in a real (tiny) training run
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # an in-process training run each
@pytest.mark.parametrize("behavior, until, explore_steps", [
    ("random", 20, 10), ("random", 0, None), ("greedy", 20, 0)])
def test_expl_until_switches_to_the_task_policy(behavior, until, explore_steps, tmp_path, monkeypatch):
    """Policy steps come at frames 0, 2, 4, ... (no prefill, action_repeat 2): the exploration
    policy acts at frames below expl_until, the task policy from then on; 0 means always explore."""
    modes, policy = [], dreamer.Dreamer.policy

    def recording_policy(self, obs, state, mode="train"):
        modes.append(mode)
        return policy(self, obs, state, mode)

    monkeypatch.setattr(dreamer.Dreamer, "policy", recording_policy)
    dreamer.main(["--configs", "debug", "--logdir", str(tmp_path), "--expl_behavior", behavior,
                  "--expl_until", str(until), "--steps", "40", "--prefill", "0", "--pretrain", "0",
                  "--train_ratio", "1", "--eval_episode_num", "0", "--action_repeat", "2"])
    assert len(modes) == 20
    if explore_steps is None:
        explore_steps = len(modes)
    assert modes == ["explore"] * explore_steps + ["train"] * (len(modes) - explore_steps)


# ----------------------------------------------------------------------------------------------
# Training runs through dreamer.py and resuming them
# ----------------------------------------------------------------------------------------------

RUN_FLAGS = ["--configs", "debug", "--time_limit", "40", "--eval_every", "0", "--log_every", "1000"]


def launch(logdir, behavior, steps):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "dreamer.py", *RUN_FLAGS, "--logdir", str(logdir), "--expl_behavior", behavior,
               "--steps", str(steps)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process):
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    return output


def read_metrics(logdir):
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One short run per behaviour, started together; then the Plan2Explore run is resumed."""
    root = tmp_path_factory.mktemp("runs")
    processes = {b: launch(root / b, b, 80) for b in ("greedy", "random", "plan2explore")}
    outputs = {b: finish(p) for b, p in processes.items()}
    first = read_metrics(root / "plan2explore")
    first_state = storage.load_checkpoint(root / "plan2explore" / "latest.pt")
    outputs["resumed"] = finish(launch(root / "plan2explore", "plan2explore", 160))
    return {"root": root, "outputs": outputs, "first": first, "first_state": first_state}


EXPL_METRICS = ("expl/ensemble_loss", "expl/intr_reward_mean", "expl/intr_reward_std", "expl/intr_reward_max",
                "expl/actor_loss", "expl/critic_loss", "expl/imag_reward")


@pytest.mark.parametrize("behavior", ["greedy", "random", "plan2explore"])
def test_debug_run_with_each_behavior(behavior, runs):
    logdir = runs["root"] / behavior
    metrics = runs["first"] if behavior == "plan2explore" else read_metrics(logdir)
    state = runs["first_state"] if behavior == "plan2explore" else storage.load_checkpoint(logdir / "latest.pt")
    logged = {k for line in metrics for k in line}
    assert metrics[-1]["step"] >= 80 and "eval/return" in logged and "world_model/model_loss" in logged
    assert "actor/actor_loss" in logged  # the task actor-critic trains under every behaviour
    expl_keys = {k for k in state["agent"] if k.startswith("expl_behavior.")}
    if behavior == "plan2explore":
        assert set(EXPL_METRICS) <= logged
        assert all(np.isfinite(line[k]) for line in metrics for k in EXPL_METRICS if k in line)
        assert any(k.startswith("expl_behavior.ensemble.") for k in expl_keys)
        assert any(k.startswith("expl_behavior.behavior.actor.") for k in expl_keys)
        assert set(state["optimizers"]["expl"]) == {"ensemble", "behavior"}
    else:
        assert not any(k.startswith("expl/") for k in logged)
        assert not expl_keys and "expl" not in state["optimizers"]
    if behavior == "random":  # every training action was uniform in [-1, 1], never the task actor's
        actions = np.concatenate([np.load(f)["action"] for f in (logdir / "train_eps").glob("*.npz")])
        assert len(actions) >= 40 and np.abs(actions).max() <= 1 and actions.std() > 0.4


def test_resume_continues_plan2explore(runs):
    logdir = runs["root"] / "plan2explore"
    metrics = read_metrics(logdir)
    steps = [line["step"] for line in metrics]
    first_end = runs["first"][-1]["step"]
    assert steps == sorted(set(steps)) and steps[-1] >= 160
    assert metrics[:len(runs["first"])] == runs["first"]  # the first run's log is kept as it was
    later = [line for line in metrics if line["step"] > first_end]
    assert later and all(k in later[-1] for k in EXPL_METRICS)
    # Counters and the exploration actor-critic's own update count went on from the checkpoint.
    state = storage.load_checkpoint(logdir / "latest.pt")
    assert state["counters"]["updates"] > runs["first_state"]["counters"]["updates"]
    assert int(state["agent"]["expl_behavior.behavior.updates"]) == state["counters"]["updates"]
    assert set(state["optimizers"]["expl"]) == {"ensemble", "behavior"}
