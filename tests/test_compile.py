"""`compile True` really compiles, and computes the same update as the plain eager code."""

import copy

import numpy as np
import pytest
import torch

import dreamer
import envs
import tools


def make_agent_and_batch(compile_):
    config = dreamer.parse(["--configs", "debug", "--compile", str(compile_)])
    env = envs.make_env(config, "train", 0)
    replay = tools.Replay(1000, 1, seed=0)
    obs, action = env.reset(), np.zeros(env.act_space.shape, np.float32)
    rng = np.random.default_rng(0)
    for _ in range(60):
        replay.add({**obs, "action": action, "reward": np.float32(0.0)})
        action = rng.uniform(-1, 1, env.act_space.shape).astype(np.float32)
        obs, reward, done, _ = env.step(action)
    torch.manual_seed(0)
    agent = dreamer.Dreamer(env.obs_space, env.act_space, config)
    return agent, replay.sample(config.batch_size, config.batch_length)


@pytest.fixture(scope="module")
def updates():
    # Inductor draws random numbers its own way; this makes it use eager's generator, so that both
    # updates see the same latent and action samples.
    torch._inductor.config.fallback_random = True
    eager, batch = make_agent_and_batch(False)
    compiled, _ = make_agent_and_batch(True)
    compiled.load_state_dict(copy.deepcopy(eager.state_dict()))
    results = {}
    for name, agent in (("eager", eager), ("compiled", compiled)):
        torch.manual_seed(1)  # the same latent and action samples in both updates
        metrics = agent.train_step(batch)
        results[name] = (agent, {k: float(v) for k, v in metrics.items()})
    yield results
    torch._inductor.config.fallback_random = False


def test_compile_true_runs_compiled_code(updates):
    agent, _ = updates["compiled"]
    assert agent.compiled, "compile True compiled nothing"
    assert all(not fn.failed for fn in agent.compiled)
    assert agent.wm.rssm.obs_step.calls > 0 and agent.wm.rssm.img_step.calls > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert not updates["eager"][0].compiled


def test_compiled_update_matches_eager_update(updates):
    """Same losses and the same parameters after one update, to float32 tolerance."""
    (eager, eager_metrics), (compiled, compiled_metrics) = updates["eager"], updates["compiled"]
    assert eager_metrics.keys() == compiled_metrics.keys()
    for key in ("model_loss", "kl_loss", "image_loss", "reward_loss", "actor_loss", "critic_loss",
                "model_grad_norm", "actor_grad_norm", "critic_grad_norm"):
        assert compiled_metrics[key] == pytest.approx(eager_metrics[key], rel=1e-3, abs=1e-5), key
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5, msg=name)


def test_compile_falls_back_to_eager_where_compilation_fails(monkeypatch):
    import networks

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    compiled = networks.Compiled(lambda x: x + 1, "add_one")
    compiled.compiled = broken
    with pytest.warns(UserWarning, match="torch.compile of add_one failed"):
        assert compiled(1) == 2
    assert compiled.failed and compiled(2) == 3


def test_precision_16_trains_in_bfloat16_on_cpu_and_scales_grads_only_on_cuda():
    import models

    config = dreamer.parse(["--configs", "debug", "--precision", "16"])
    with models.autocast(config):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    assert not models.use_scaler(config)
    assert models.use_scaler(dreamer.parse(["--configs", "debug", "--precision", "16", "--device", "cuda:0"]))
    assert not models.use_scaler(dreamer.parse(["--configs", "debug", "--precision", "32", "--device", "cuda:0"]))
    agent, batch = make_agent_and_batch(False)
    agent.config.precision = 16
    metrics = agent.train_step(batch)
    assert all(torch.isfinite(v).all() for v in metrics.values())
