"""Adaptive gradient clipping per part, as the official code clips: its actor has a `mean` and a
`stddev` layer and its vector decoder a layer per observation key, each with its own kernel and
bias, and `clip_by_agc` scales every one of those parameters by its own norms. Here those output
layers are networks.SplitLinear; the reference below clips the official parameters one by one in
numpy."""

import copy
import pathlib
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import networks  # noqa: E402
import optim  # noqa: E402

PRESETS = cfg.load_presets()
AGC = 0.3


def make_agent(spaces):
    config = cfg.parse(["--configs", "debug", "recipe2024", "--device", "cpu"], presets=copy.deepcopy(PRESETS))
    torch.manual_seed(0)
    return dreamer.Dreamer(*spaces, config)


def np_agc(param, grad, clip=AGC, floor=1e-3):
    """The official clip_by_agc for one parameter."""
    upper = clip * max(floor, np.linalg.norm(param.ravel()))
    return grad / max(1.0, np.linalg.norm(grad.ravel()) / upper)


def official_parts(actor, decoder):
    """{official name: torch parameter}: the layers the official code keeps apart."""
    mean, std = actor.out.parts
    parts = {"pol/mean/kernel": mean.weight, "pol/mean/bias": mean.bias,
             "pol/stddev/kernel": std.weight, "pol/stddev/bias": std.bias}
    for key, layer in zip(decoder.mlp_shapes, decoder.mlp_out.parts):
        parts[f"dec/vec/{key}/kernel"], parts[f"dec/vec/{key}/bias"] = layer.weight, layer.bias
    return parts


def test_actor_mean_std_and_each_vector_key_are_parameters_of_their_own(spaces):
    agent = make_agent(spaces)
    actor, decoder = agent.task_behavior.actor, agent.wm.heads["decoder"]
    actions = spaces[1].shape[0]
    assert [tuple(p.weight.shape) for p in actor.out.parts] == [(actions, actor.mlp.outdim)] * 2
    assert len(decoder.mlp_shapes) >= 2, "the debug task should decode several vector keys"
    assert [p.out_features for p in decoder.mlp_out.parts] == [int(np.prod(s)) for s in decoder.mlp_shapes.values()]
    names = dict(agent.named_parameters())
    assert any(n.endswith("actor.out.parts.1.weight") for n in names)


def test_agc_clips_each_official_part_by_its_own_norm(spaces):
    agent = make_agent(spaces)
    actor, decoder = agent.task_behavior.actor, agent.wm.heads["decoder"]
    parts = official_parts(actor, decoder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in parts.values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    # Gradients of very different sizes, so that a merged matrix would clip some parts that the
    # official code leaves alone (and the other way around).
    grads = [torch.randn(p.shape, generator=generator, dtype=torch.float32) * (10.0 if i % 3 == 0 else 1e-3)
             for i, p in enumerate(parts.values())]
    want = [np_agc(p.detach().double().numpy(), g.double().numpy()) for p, g in zip(parts.values(), grads)]
    got = [g.clone() for g in grads]
    with torch.no_grad():  # as in the optimizer's step
        optim.agc_(list(parts.values()), got, AGC)
    for name, w, g in zip(parts, want, got):
        np.testing.assert_allclose(g.double().numpy(), w, rtol=1e-5, atol=1e-12, err_msg=name)
    # The merged layout of before (one matrix for mean and std) gives another result: the test tells them apart.
    mean_std = np.concatenate([grads[0].numpy(), grads[2].numpy()])
    merged = np_agc(np.concatenate([parts["pol/mean/kernel"].detach().numpy(),
                                    parts["pol/stddev/kernel"].detach().numpy()]), mean_std)
    assert not np.allclose(merged[:len(grads[0])], got[0].numpy(), rtol=1e-3)


def test_the_optimizer_step_clips_per_part(spaces):
    """The optimizer's step clips the gradients in place before its update: after a LaProp step
    with AGC, each part's gradient is the per-part reference."""
    agent = make_agent(spaces)
    params = list(agent.task_behavior.actor.out.parameters()) + list(agent.wm.heads["decoder"].mlp_out.parameters())
    generator = torch.Generator().manual_seed(2)
    start = [p.detach().clone() for p in params]
    grads = [torch.randn(p.shape, generator=generator) * (5.0 if i % 2 else 1e-4) for i, p in enumerate(params)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt = optim.LaProp(params, lr=1e-3, eps=1e-20, betas=(0.9, 0.999), weight_decay=0.0, agc=AGC, warmup=0)
    opt.step()
    for p, p0, g in zip(params, start, grads):
        want = np_agc(p0.double().numpy(), g.double().numpy())
        np.testing.assert_allclose(p.grad.double().numpy(), want, rtol=1e-5, atol=1e-12)
    assert any(not torch.allclose(p.grad, g) for p, g in zip(params, grads)), "nothing was clipped"


@pytest.mark.parametrize("winit", ["fan_avg", "fan_in"])
def test_each_part_is_initialised_on_its_own_fan(winit):
    torch.manual_seed(4)
    layer = networks.init_(networks.SplitLinear(400, [100, 300]), 0.5)
    networks.reinit(layer, winit)
    for part in layer.parts:
        fan_in, fan_out = 400, part.out_features
        want = np.sqrt(0.5 / ((fan_in + fan_out) / 2)) if winit == "fan_avg" else 0.5 / np.sqrt(fan_in)
        assert part.weight.detach().numpy().std() == pytest.approx(want, rel=0.05)
        assert not part.bias.detach().any()
