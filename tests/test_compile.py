"""`compile True` really compiles, and computes the same update as the plain eager code.

These are the suite's CUDA-relevant tests: they run on the CPU unless DREAMER_TEST_DEVICE names
another device (benchmarks/gpu_check.sh sets `cuda`); a device that is not there is an error, never
a skip.
"""

import copy
import logging
import os

import numpy as np
import pytest
import torch
import torch._dynamo.convert_frame as convert_frame
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

import compilation
import config as cfg
import dreamer
import envs
import exploration
import networks
import precision
import storage

DEVICE = os.environ.get("DREAMER_TEST_DEVICE", "cpu")
# The reference update below decodes the image alone: the debug preset keeps every observation key.
IMAGE_ONLY = ("--encoder.mlp_keys", "$^", "--encoder.cnn_keys", "image", "--decoder.mlp_keys", "$^",
              "--decoder.cnn_keys", "image")


def make_agent_and_batch(compile_, *flags):
    config = cfg.parse(["--configs", "debug", "--device", DEVICE, "--compile", str(compile_), *IMAGE_ONLY, *flags])
    env = envs.make_env(config, "train", 0)
    replay = storage.Replay(1000, 1, seed=0)
    obs, action = env.reset(), np.zeros(env.act_space.shape, np.float32)
    rng = np.random.default_rng(0)
    for _ in range(60):
        replay.add({**obs, "action": action, "reward": np.float32(0.0)})
        action = rng.uniform(-1, 1, env.act_space.shape).astype(np.float32)
        obs, reward, done, _ = env.step(action)
    torch.manual_seed(0)
    agent = dreamer.Dreamer(env.obs_space, env.act_space, config).to(config.device)
    return agent, replay.sample(config.batch_size, config.batch_length)


def scaled_kl(rssm, post, prior, free, dyn_scale, rep_scale):
    """The KL part of the world model's loss as models.Update sums it, and the raw KLs."""
    dyn, rep, raw_dyn, raw_rep = rssm.kl_loss(post, prior, free)
    return dyn_scale * dyn + rep_scale * rep, raw_dyn, raw_rep

def reference_update(agent, batch):
    """The update written plainly, as the paper states it: every network run where its output is
    needed, full backward passes collected with autograd.grad, nothing reused or frozen.

    Returns the losses and the gradients (clipped as the optimizers clip them) of the world model,
    actor and critic; steps only the world model, whose new weights the imagination uses.
    """
    config, wm, ac = agent.config, agent.wm, agent.task_behavior
    rssm = wm.rssm
    data = wm.preprocess(batch)
    (batch_size, length), horizon = data["is_first"].shape, config.imag_horizon

    # World model: filter the sequence one step at a time.
    embed = wm.encoder({k: v.flatten(0, 1) for k, v in data.items()}).unflatten(0, (batch_size, length))
    state, posts = rssm.initial(batch_size), []
    for t in range(length):
        state = rssm.obs_step(state, data["action"][:, t], embed[:, t], data["is_first"][:, t])
        posts.append(state)
    post = {k: torch.stack([s[k] for s in posts], 1) for k in posts[0]}
    prior = rssm.prior(post["deter"])
    kl, _, _ = scaled_kl(rssm, post, prior, config.kl_free, config.dyn_scale, config.rep_scale)
    feat = rssm.get_feat(post)
    image = -wm.heads["decoder"](feat)["image"].log_prob(data["image"])
    reward = -wm.heads["reward"](feat).log_prob(data["reward"])
    cont = -wm.heads["cont"](feat).log_prob(data["cont"][..., None])
    model_loss = (image + reward + cont + kl).mean()
    model_params = list(wm.parameters())
    model_grads = clipped(torch.autograd.grad(model_loss, model_params), config.grad_clip)
    for p, g in zip(model_params, model_grads):
        p.grad = g.clone()
    agent.optimizers()["model"].opt.step()

    # Imagination from every posterior state, the world model's weights held fixed.
    state = {k: v.detach().flatten(0, 1) for k, v in post.items()}
    feats, actions = [], []
    for t in range(horizon + 1):
        feats.append(rssm.get_feat(state))
        actions.append(ac.actor(feats[-1].detach()).sample())
        if t < horizon:
            state = rssm.img_step(state, actions[-1])
    feat, action = torch.stack(feats), torch.stack(actions)  # (H+1, N, ...)
    reward = wm.heads["reward"](feat[1:]).mean()
    cont = torch.cat([data["cont"].flatten()[None], wm.heads["cont"](feat[1:]).mode()[..., 0].detach()])
    weight = torch.cumprod(config.discount * cont, 0) / config.discount
    value = ac.critic(feat).mean()
    returns, last = [], value[-1]
    for t in reversed(range(horizon)):
        last = reward[t] + config.discount * cont[t + 1] * (
            (1 - config.discount_lambda) * value[t + 1] + config.discount_lambda * last)
        returns.insert(0, last)
    returns = torch.stack(returns)  # (H, N)
    low, high = 0.01 * torch.quantile(returns.detach().flatten(), torch.tensor([0.05, 0.95], device=returns.device))
    scale = torch.clamp(high - low, min=1.0)  # the EMAs start at zero: one step of decay 0.99
    policy = ac.actor(feat[:-1].detach())
    normed_returns = (returns - low) / scale
    advantage = normed_returns - (value[:-1] - low) / scale  # v1: the baseline keeps its gradient
    if config.imag_gradient == "dynamics":
        objective = advantage
    else:  # reinforce
        objective = policy.log_prob(action[:-1].detach()) * advantage.detach()
    actor_loss = (weight[:-1] * (-objective - config.actor.entropy * policy.entropy())).mean()
    actor_params = list(ac.actor.parameters())
    actor_grads = clipped(torch.autograd.grad(actor_loss, actor_params, retain_graph=True), config.actor.grad_clip)
    critic = ac.critic(feat[:-1].detach())
    slow = ac.slow_critic(feat[:-1].detach()).mean()
    critic_loss = (weight[:-1] * (-critic.log_prob(returns.detach()) - critic.log_prob(slow))).mean()
    critic_params = list(ac.critic.parameters())
    critic_grads = clipped(torch.autograd.grad(critic_loss, critic_params), config.critic.grad_clip)
    losses = {"model_loss": model_loss, "actor_loss": actor_loss, "critic_loss": critic_loss}
    return {k: float(v.detach()) for k, v in losses.items()}, {"model": model_grads, "actor": actor_grads,
                                                     "critic": critic_grads}


def clipped(grads, clip):
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return [g * torch.clamp(clip / (norm + 1e-6), max=1.0) for g in grads]


@pytest.fixture(scope="module", params=["dynamics", "reinforce"])
def updates(request):
    """One eager update and the plain reference's, from the same weights and samples."""
    flags = ("--imag_gradient", request.param)
    eager, batch = make_agent_and_batch(False, *flags)
    reference, _ = make_agent_and_batch(False, *flags)
    # The reward and critic heads start at zero, which would hide any error in the gradients
    # through their outputs; give them (and the slow critic, apart) some weights.
    gen = torch.Generator().manual_seed(2)
    behavior = eager.task_behavior
    with torch.no_grad():
        for layer in (eager.wm.heads["reward"].out, behavior.critic.out, behavior.slow_critic.out):
            layer.weight.copy_(0.1 * torch.randn(layer.weight.shape, generator=gen))
    initial = copy.deepcopy(eager.state_dict())
    reference.load_state_dict(copy.deepcopy(initial))
    torch.manual_seed(1)  # the same latent and action samples in every update
    metrics, _ = eager.update.train_step(batch)
    results = {"eager": (eager, {k: float(v) for k, v in metrics.items()}), "flags": flags, "initial": initial,
               "batch": batch}
    torch.manual_seed(1)
    results["reference"] = reference_update(reference, batch)
    return results


@pytest.fixture(scope="module")
def compiled(updates):
    """The same update with compile True (Inductor), from the same weights and samples."""
    # Inductor draws random numbers its own way; this makes it use eager's generator, so that all
    # updates see the same latent and action samples.
    torch._inductor.config.fallback_random = True
    agent, _ = make_agent_and_batch(True, *updates["flags"])
    agent.load_state_dict(copy.deepcopy(updates["initial"]))
    torch.manual_seed(1)
    metrics, _ = agent.update.train_step(updates["batch"])
    yield agent, {k: float(v) for k, v in metrics.items()}
    torch._inductor.config.fallback_random = False


def grads_of(agent):
    modules = {"model": agent.wm, "actor": agent.task_behavior.actor, "critic": agent.task_behavior.critic}
    return {k: [p.grad for p in m.parameters()] for k, m in modules.items()}


def assert_matches_reference(agent, metrics, reference, rtol, name):
    want_losses, want_grads = reference
    for key, want in want_losses.items():
        assert metrics[key] == pytest.approx(want, rel=rtol, abs=1e-7), key
    for group, grads in grads_of(agent).items():
        assert len(grads) == len(want_grads[group])
        for i, (got, want) in enumerate(zip(grads, want_grads[group])):
            assert got is not None, f"{group} parameter {i} got no gradient"
            torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()) + 1e-9,
                                       msg=f"{name}: {group} parameter {i}")


def test_update_matches_plain_reference_update(updates):
    """The optimised update (one critic pass for both losses, reused actor outputs, gradients only
    where needed) gives the reference's losses and gradients, to 1e-5 relative."""
    assert_matches_reference(*updates["eager"], updates["reference"], 1e-5, "eager")


@pytest.mark.slow  # Inductor compiles the update in the compiled fixture
def test_compiled_update_matches_plain_reference_update(updates, compiled):
    """The same with compile on, to 1e-3 relative (Inductor fuses and reorders float32 arithmetic)."""
    assert_matches_reference(*compiled, updates["reference"], 1e-3, "compiled")


@pytest.mark.slow  # Inductor compiles the update in the compiled fixture
def test_compile_true_runs_compiled_code(updates, compiled):
    agent, _ = compiled
    assert agent.compiled, "compile True compiled nothing"
    assert agent.wm.rssm.obs_step.calls > 0 and agent.wm.rssm.img_step.calls > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert not updates["eager"][0].compiled
    names = {fn.name for fn in agent.compiled}
    # The critic stays eager: its one forward is backpropagated twice, each time into a different part.
    assert "task_behavior.actor.mlp" in names and "task_behavior.slow_critic.mlp" in names
    assert "task_behavior.critic.mlp" not in names


@pytest.mark.slow  # Inductor compiles the update in the compiled fixture
def test_compiled_update_matches_eager_update(updates, compiled):
    """Same losses and the same parameters after one update, to float32 tolerance."""
    (eager, eager_metrics), (compiled, compiled_metrics) = updates["eager"], compiled
    assert eager_metrics.keys() == compiled_metrics.keys()
    for key in ("model_loss", "kl_loss", "image_loss", "rew_loss", "actor_loss", "critic_loss",
                "model_grad_norm", "actor_grad_norm", "critic_grad_norm"):
        assert compiled_metrics[key] == pytest.approx(eager_metrics[key], rel=1e-3, abs=1e-5), key
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5, msg=name)


def test_a_step_that_cannot_be_compiled_is_an_error_naming_it_never_an_eager_fallback():
    """compile True follows compile 'update''s policy: a compiler failure stops the run in one line."""
    def broken(*args, **kwargs):
        raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, RuntimeError("no C++ compiler"), None)

    compiled = compilation.Compiled(lambda x: x + 1, "add_one")
    compiled.compiled = broken
    with pytest.raises(compilation.CompileError, match=r"compile True: add_one cannot be compiled \(.*no C\+\+ "
                                                    r"compiler.*\); --compile False runs eagerly"):
        compiled(1)
    assert compiled.calls == 0
    # An error of the function itself is not a compile failure: it keeps its own type and traceback.
    def wrong(x):
        raise KeyError("its own bug")

    compiled.compiled = wrong
    with pytest.raises(KeyError, match="its own bug"):
        compiled(1)


def test_precision_16_trains_in_bfloat16_on_cpu_and_scales_grads_only_on_cuda():

    config = cfg.parse(["--configs", "debug", "--precision", "16"])
    with precision.autocast(config):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    assert not precision.use_scaler(config)
    assert precision.use_scaler(cfg.parse(["--configs", "debug", "--precision", "16", "--device", "cuda:0"]))
    assert not precision.use_scaler(cfg.parse(["--configs", "debug", "--precision", "32", "--device", "cuda:0"]))
    agent, batch = make_agent_and_batch(False, "--precision", "16")  # on DEVICE: float16 and scaling on CUDA
    assert agent.optimizers()["model"].scaler.is_enabled() is (torch.device(DEVICE).type == "cuda")
    metrics, _ = agent.update.train_step(batch)
    assert all(torch.isfinite(v).all() for v in metrics.values())


def test_agent_runs_on_the_chosen_device(updates):
    agent, _ = updates["eager"]
    assert {p.device.type for p in agent.parameters()} == {torch.device(DEVICE).type}


@pytest.mark.slow  # Inductor compiles the update in the compiled fixture
def test_the_compiled_agent_runs_on_the_chosen_device(compiled):
    agent, _ = compiled
    assert {p.device.type for p in agent.parameters()} == {torch.device(DEVICE).type}


@pytest.mark.slow  # Inductor compiles every network of the agent
def test_compiled_networks_never_hit_the_recompile_limit():
    """Every MLP shares one forward, seen with and without gradients and at several input shapes;
    past dynamo's recompile limit the rest would run eagerly, with only a log line to say so."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    convert_frame.log.addHandler(handler)
    try:
        agent, batch = make_agent_and_batch(  # MLPs of two depths, as in the presets
            True, "--encoder.mlp_keys", ".*", "--decoder.mlp_keys", ".*", "--encoder.mlp_layers", "2",
            "--decoder.mlp_layers", "2", "--expl_behavior", "plan2explore")
        for _ in range(2):
            agent.update.train_step(batch)
        obs, state = {k: v[:, 0] for k, v in batch.items()}, None
        for mode in ("train", "explore", "eval"):
            _, state = agent.policy(obs, state, mode)
    finally:
        convert_frame.log.removeHandler(handler)
    limit_hits = [r.getMessage() for r in records if "recompile_limit" in r.getMessage()]
    assert not limit_hits, limit_hits[0]
    assert len(_debug_get_cache_entry_list(networks.MLP.forward.__code__)) > 8  # the default limit


# -- compilation covers what the presets build -----------------------------------------------------

# Network classes that run inside a compiled body or step function, or only glue compiled ones.
COMPILED_INSIDE = {
    "Head": "its body is an MLP",
    "Actor": "its body is an MLP",
    "SplitLinear": "the output layers after a compiled MLP, eager as the single nn.Linear they replaced",
    "TwoHotLinear": "the two-hot heads' output layer after a compiled MLP, eager as the nn.Linear it reorders",
    "Linear": "the dense layer inside compiled bodies, or an output layer after them, eager as nn.Linear",
    "MultiEncoder": "concatenates its keys around the compiled CNN and MLP",
    "MultiDecoder": "splits the compiled CNN's and MLP's outputs into keys",
    "RSSM": "its per-step functions obs_step and img_step are compiled",
    "GRUCell": "inside the compiled RSSM steps",
    "BlockGRUCell": "inside the compiled RSSM steps",
    "BlockLinear": "inside the compiled RSSM steps",
    "RMSNorm": "inside compiled bodies",
    "ChannelNorm": "inside compiled bodies",
    "ChannelRMSNorm": "inside compiled bodies",
    "LayerNorm": "inside compiled bodies",
    "Plan2Explore": "holds the compiled ensemble and an actor-critic of compiled MLPs",
    "Random": "no network",
}


@pytest.mark.parametrize("flags", [
    [],  # v1, image encoder and decoder
    ["--encoder.mlp_keys", ".*", "--encoder.cnn_keys", "$^", "--decoder.mlp_keys", ".*", "--decoder.cnn_keys", "$^"],
    ["--configs", "debug", "recipe2024"],  # pooled encoder, upsample decoder, block GRU
    ["--expl_behavior", "plan2explore"],
])
def test_every_network_a_preset_builds_is_compiled(flags):
    if flags[:1] == ["--configs"]:
        config = cfg.parse([*flags, "--device", "cpu", "--compile", "True"])
    else:
        config = cfg.parse(["--configs", "debug", "--device", "cpu", "--compile", "True", *flags])
    env = envs.make_env(config, "train", 0)
    agent = dreamer.Dreamer(env.obs_space, env.act_space, config)
    ours = {networks.__name__, exploration.__name__}
    for name, module in agent.named_modules():
        kind = type(module)
        if kind.__module__ not in ours:
            continue
        if isinstance(module, networks.COMPILED + exploration.COMPILED):
            if name.endswith(".critic.mlp"):  # stated in compilation.compile_steps
                assert not isinstance(module.forward, compilation.Compiled), name
            else:
                assert isinstance(module.forward, compilation.Compiled), name
        else:
            assert kind.__name__ in COMPILED_INSIDE, f"{name}: {kind.__name__} is neither compiled nor covered"
    assert isinstance(agent.wm.rssm.obs_step, compilation.Compiled)
    assert isinstance(agent.wm.rssm.img_step, compilation.Compiled)
