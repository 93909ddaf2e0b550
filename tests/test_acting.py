"""The policy step captured whole: Dreamer.act takes the environments' observations as tensors on the
device and runs preprocessing and the encoder itself, so that compile 'update' (which captures `act`
as one region) leaves nothing of a policy step to run eagerly; traced here by dynamo with its eager
backend (one graph, the eager step's action)."""

import numpy as np
import pytest
import torch

import config as cfg
import dreamer
import parallel

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def acting():
    config = cfg.parse(["--configs", "debug", "recipe2024", "--device", "cpu", "--compile", "False"])
    train_envs = parallel.make_envs(config, "train", 2)
    torch.manual_seed(0)
    agent = dreamer.Dreamer(train_envs[0].obs_space, train_envs[0].act_space, config)
    obs = [env.reset()() for env in train_envs]
    yield agent, {k: np.stack([o[k] for o in obs]) for k in obs[0] if not k.startswith("log_")}
    for env in train_envs:
        env.close()


def test_preprocessing_and_the_encoder_run_inside_the_captured_policy_call(acting, monkeypatch):
    agent, batch = acting
    assert agent.wm.encoder.cnn_shapes  # images too: their conversion to [0, 1] is part of it
    inside, calls = [False], []
    act, preprocess, encoder = agent.act, agent.wm.preprocess, agent.wm.encoder.forward

    def traced_act(*args):
        inside[0] = True
        try:
            return act(*args)
        finally:
            inside[0] = False

    monkeypatch.setattr(agent, "act", traced_act)
    monkeypatch.setattr(agent.wm, "preprocess", lambda obs: calls.append(("preprocess", inside[0])) or preprocess(obs))
    monkeypatch.setattr(agent.wm.encoder, "forward", lambda data: calls.append(("encoder", inside[0])) or encoder(data))
    agent.policy(batch, None)
    assert calls == [("preprocess", True), ("encoder", True)]


def test_the_policy_step_is_one_graph_that_acts_as_the_eager_one(acting):
    agent, batch = acting
    torch.manual_seed(1)
    eager, state = agent.policy(batch, None)
    torch._dynamo.reset()
    agent.act = torch.compile(agent.act, fullgraph=True, dynamic=False, backend="eager")  # a graph break: an error
    torch.manual_seed(1)
    traced, traced_state = agent.policy(batch, None)
    np.testing.assert_array_equal(traced, eager)
    for key in state[2]:
        np.testing.assert_array_equal(traced_state[2][key], state[2][key])
    torch._dynamo.reset()
