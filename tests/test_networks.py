"""Networks: RSSM transitions and resets, encoders/decoders, heads, actor and gradient routing.

Expected values come from plain formulas written here (numpy), not from the code under test.
"""

import copy
import pathlib
import sys

import gymnasium
import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import compilation  # noqa: E402
import config as cfg  # noqa: E402
import models  # noqa: E402
import networks  # noqa: E402
import tools  # noqa: E402

PRESETS = cfg.load_presets()
FLAGS = ("is_first", "is_last", "is_terminal")
ACT_SPACE = gymnasium.spaces.Box(-1, 1, (3,), dtype=np.float32)


def make_config(*flags):
    """The debug config with its 'auto' keys settled, as dreamer.Dreamer settles them, for a
    continuous action space unless the flags ask for a onehot actor."""
    config = cfg.parse(["--configs", "debug", "--device", "cpu", *flags], presets=copy.deepcopy(PRESETS))
    if config.actor.dist == "auto":
        config, _ = compilation.resolve_auto(config, ACT_SPACE)
    return config


def obs_space(**extra):
    spaces = {"image": gymnasium.spaces.Box(0, 255, (16, 16, 3), dtype=np.uint8),
              "vec": gymnasium.spaces.Box(-np.inf, np.inf, (5,), dtype=np.float32),
              "log_debug": gymnasium.spaces.Box(-np.inf, np.inf, (2,), dtype=np.float32)}
    spaces.update(extra)
    spaces.update({k: gymnasium.spaces.Box(0, 1, (), dtype=bool) for k in FLAGS})
    return spaces


def to_np(x):
    return x.detach().double().cpu().numpy()


def np_log_softmax(logits):
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def np_symlog(x):
    return np.sign(x) * np.log(1.0 + np.abs(x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(x))


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# RSSM
# ---------------------------------------------------------------------------------------------


def make_rssm(*flags, embed=10, actions=3):
    torch.manual_seed(0)
    return networks.RSSM(make_config(*flags), embed, actions)


def random_state(rssm, batch, seed):
    with torch.no_grad():
        state = rssm.initial(batch)
        state = rssm.img_step(state, torch.rand(batch, 3, generator=gen(seed)) * 2 - 1)
        return rssm.img_step(state, torch.rand(batch, 3, generator=gen(seed + 1)) * 2 - 1)


def test_rssm_discrete_shapes_and_one_hot_latents():
    rssm = make_rssm()
    assert (rssm.stoch, rssm.discrete, rssm.deter) == (4, 4, 32)
    embed = torch.randn(2, 5, 10, generator=gen(0))
    action = torch.rand(2, 5, 3, generator=gen(1))
    is_first = torch.zeros(2, 5)
    is_first[:, 0] = 1
    post = rssm.observe(embed, action, is_first)
    prior = rssm.prior(post["deter"])
    assert set(prior) == {"deter", "logit"} and prior["logit"].shape == (2, 5, 4, 4)
    for state in (post,):
        assert state["deter"].shape == (2, 5, 32)
        assert state["stoch"].shape == (2, 5, 4, 4)
        assert state["logit"].shape == (2, 5, 4, 4)
        stoch = to_np(state["stoch"])
        np.testing.assert_allclose(stoch.sum(-1), 1.0, atol=1e-6)
        np.testing.assert_allclose(np.minimum(np.abs(stoch), np.abs(stoch - 1)), 0.0, atol=1e-6)
        # Unimix: every class keeps at least 1% / K of the probability.
        assert np.exp(np_log_softmax(to_np(state["logit"]))).min() >= 0.01 / 4 * (1 - 1e-4)
    np.testing.assert_array_equal(to_np(post["deter"]), to_np(prior["deter"]))
    assert rssm.feat_size == 4 * 4 + 32
    assert rssm.get_feat(post).shape == (2, 5, 48)
    np.testing.assert_array_equal(to_np(rssm.get_feat(post))[..., :16], to_np(post["stoch"]).reshape(2, 5, 16))
    np.testing.assert_array_equal(to_np(rssm.get_feat(post))[..., 16:], to_np(post["deter"]))
    imagined = rssm.imagine_with_action(torch.rand(2, 3, 3), {k: v[:, -1] for k, v in post.items()})
    assert imagined["stoch"].shape == (2, 3, 4, 4) and imagined["deter"].shape == (2, 3, 32)


def test_rssm_discrete_stats_mix_in_one_percent_uniform():
    rssm = make_rssm()
    layer = torch.nn.Linear(8, 16)  # an output layer whose rows are (categorical, class) in order
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 8, generator=gen(23)) * 5)  # far from uniform before the mixture
        layer.bias.copy_(torch.randn(16, generator=gen(24)))
    x = torch.randn(3, 8, generator=gen(25))
    stats, class_major = rssm._stats(layer, x)
    logit = stats["logit"]  # computed class-major, read (B, stoch, classes)
    assert logit.shape == (3, 4, 4) and class_major.shape == (3, 4, 4)
    probs = np.exp(np_log_softmax(to_np(logit)))
    raw = (to_np(x) @ to_np(layer.weight).T + to_np(layer.bias)).reshape(3, 4, 4)
    want = 0.99 * np.exp(np_log_softmax(raw)) + 0.01 / 4
    np.testing.assert_allclose(probs, want, rtol=1e-4, atol=1e-7)
    # The probabilities the latents are drawn from: the same, class-major (B, classes, stoch).
    np.testing.assert_allclose(to_np(class_major).transpose(0, 2, 1), want, rtol=1e-5, atol=1e-7)


def test_rssm_draws_its_class_major_latents_as_the_class_last_distribution():
    """The RSSM computes and samples its categoricals class-major; its state reads (B, stoch,
    classes) and equals what OneHot of the state's logits gives from the same seed."""
    rssm = make_rssm()
    stats, probs = rssm._stats(rssm.img_stats, torch.randn(6, rssm.img_stats.in_features, generator=gen(7)) * 3)
    assert stats["logit"].shape == (6, 4, 4)
    torch.manual_seed(3)
    want = rssm.dist(stats).sample()
    torch.manual_seed(3)
    assert torch.equal(rssm._draw(stats, probs, sample=True), want)
    assert torch.equal(rssm._draw(stats, probs, sample=False), rssm.dist(stats).mode())
    assert 1 < len(set(want.argmax(-1).flatten().tolist()))  # the samples differ between categoricals


def test_rssm_continuous_shapes_and_min_std():
    rssm = make_rssm("--dyn_discrete", "0", "--dyn_stoch", "6", "--dyn_min_std", "0.3")
    assert rssm.feat_size == 6 + 32
    embed = torch.randn(3, 4, 10, generator=gen(2)) * 10
    post = rssm.observe(embed, torch.rand(3, 4, 3), torch.zeros(3, 4))
    prior = rssm.prior(post["deter"])
    assert post["stoch"].shape == (3, 4, 6)
    for state in (post, prior):
        assert state["mean"].shape == state["std"].shape == (3, 4, 6)
        assert state["deter"].shape == (3, 4, 32)
        assert state["std"].min().item() >= 0.3
    assert rssm.get_feat(post).shape == (3, 4, 38)


STD_ACTS = {
    "softplus": softplus,
    "abs": lambda s: np.abs(s + 1.0),  # as in the reference DreamerV3 implementations: |s + 1|
    "sigmoid": sigmoid,
    "sigmoid2": lambda s: 2.0 * sigmoid(s / 2.0),
}


@pytest.mark.parametrize("std_act", list(STD_ACTS))
@pytest.mark.parametrize("mean_act", ["none", "tanh5"])
def test_rssm_continuous_stats_formulas(std_act, mean_act):
    rssm = make_rssm("--dyn_discrete", "0", "--dyn_stoch", "5", "--dyn_min_std", "0.2",
                     "--dyn_std_act", std_act, "--dyn_mean_act", mean_act)
    x = torch.linspace(-12, 12, 2 * 5 * 3).reshape(3, 10)
    identity = torch.nn.Linear(10, 10)  # an output layer that passes x through exactly
    with torch.no_grad():
        identity.weight.copy_(torch.eye(10))
        identity.bias.zero_()
    stats, probs = rssm._stats(identity, x)
    assert probs is None
    raw_mean, raw_std = to_np(x)[:, :5], to_np(x)[:, 5:]
    want_mean = raw_mean if mean_act == "none" else 5.0 * np.tanh(raw_mean / 5.0)
    np.testing.assert_allclose(to_np(stats["mean"]), want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_np(stats["std"]), STD_ACTS[std_act](raw_std) + 0.2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags", [(), ("--dyn_discrete", "0")], ids=["discrete", "continuous"])
def test_rssm_obs_step_resets_where_is_first_learned(flags):
    rssm = make_rssm(*flags)
    with torch.no_grad():
        rssm.initial_deter.copy_(torch.randn(32, generator=gen(3)))
    init = rssm.initial(3)
    np.testing.assert_allclose(to_np(init["deter"]), np.tanh(to_np(rssm.initial_deter))[None].repeat(3, 0),
                               rtol=1e-6)
    state = random_state(rssm, 3, seed=4)
    action = torch.rand(3, 3, generator=gen(5)) * 2 - 1
    embed = torch.randn(3, 10, generator=gen(6))
    is_first = torch.tensor([True, False, True])
    post = rssm.obs_step(state, action, embed, is_first, sample=False)
    for row in range(3):
        if is_first[row]:  # reference: step from the initial state with a zero action, no reset
            ref_state, ref_action = rssm.initial(1), torch.zeros(1, 3)
        else:
            ref_state, ref_action = {k: v[row:row + 1] for k, v in state.items()}, action[row:row + 1]
        ref_post = rssm.obs_step(ref_state, ref_action, embed[row:row + 1], torch.tensor([False]), sample=False)
        assert set(post) == set(ref_post) == set(state)
        for key in post:
            np.testing.assert_allclose(to_np(post[key][row]), to_np(ref_post[key][0]), rtol=1e-5, atol=1e-6)
    # The state that was reset no longer depends on the old state, the others do.
    assert not np.allclose(to_np(post["deter"][0]), to_np(rssm.obs_step(
        {k: v[1:2] for k, v in state.items()}, action[1:2], embed[0:1], torch.tensor([False]), False)["deter"][0]))


def test_rssm_learned_initial_state_is_trained_only_through_reset_rows():
    rssm = make_rssm()
    state = random_state(rssm, 2, seed=7)
    embed = torch.randn(2, 10, generator=gen(8))
    post = rssm.obs_step(state, torch.zeros(2, 3), embed, torch.tensor([True, False]), sample=False)
    (grad,) = torch.autograd.grad(post["deter"][0].sum(), rssm.initial_deter, retain_graph=True)
    assert to_np(grad).any()
    (grad,) = torch.autograd.grad(post["deter"][1].sum(), rssm.initial_deter, allow_unused=True)
    assert grad is None or not to_np(grad).any()


def test_rssm_zeros_initial_state_is_zero():
    rssm = make_rssm("--initial", "zeros")
    assert not any("initial" in name for name, _ in rssm.named_parameters())
    init = rssm.initial(4)
    np.testing.assert_array_equal(to_np(init["deter"]), 0.0)
    np.testing.assert_array_equal(to_np(init["stoch"]), 0.0)


def test_rssm_posterior_sample_is_straight_through():
    rssm = make_rssm()
    state = random_state(rssm, 4, seed=9)
    embed = torch.randn(4, 10, generator=gen(10))
    torch.manual_seed(1)
    post = rssm.obs_step(state, torch.zeros(4, 3), embed, torch.zeros(4, dtype=torch.bool))
    stoch = to_np(post["stoch"])
    np.testing.assert_allclose(np.minimum(np.abs(stoch), np.abs(stoch - 1)), 0.0, atol=1e-6)
    weights = torch.randn(4, 4, 4, generator=gen(11))
    grads = torch.autograd.grad((post["stoch"] * weights).sum(), [rssm.obs_stats.weight], retain_graph=True)
    assert to_np(grads[0]).any()  # the sample passes gradients to the posterior's parameters
    # and those gradients equal the gradients of the (mixed) probabilities.
    probs = torch.softmax(post["logit"], -1)
    (want,) = torch.autograd.grad((probs * weights).sum(), [rssm.obs_stats.weight])
    np.testing.assert_allclose(to_np(grads[0]), to_np(want), rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# World model heads, encoder and decoder
# ---------------------------------------------------------------------------------------------


def make_world_model(*flags, space=None):
    torch.manual_seed(0)
    config = make_config(*flags)
    return config, models.WorldModel(space or obs_space(), ACT_SPACE, config)


@pytest.mark.parametrize("dist", ["symlog_disc", "symexp_twohot"])
def test_two_hot_output_layer_is_the_255_output_layer_in_mirrored_order_with_its_gradients(dist):
    """The two-hot heads' output layer keeps nn.Linear's (255, units) parameters in the bins' order and
    emits its outputs in the mirrored order (bins 126..0, then 127..254) that the head's TwoHot reads."""
    head = networks.Head(7, (), 1, 16, "SiLU", "rms", dist)
    assert type(head.out) is networks.TwoHotLinear
    assert head.out.weight.shape == (255, 16) and head.out.bias.shape == (255,)
    assert [k for k in head.state_dict() if k.startswith("out.")] == ["out.weight", "out.bias"]  # checkpoint keys
    with torch.no_grad():
        head.out.weight.copy_(torch.randn(255, 16, generator=gen(20)))
        head.out.bias.copy_(torch.randn(255, generator=gen(21)))
    order = list(range(126, -1, -1)) + list(range(127, 255))
    weight, bias = to_np(head.out.weight), to_np(head.out.bias)
    x = torch.randn(5, 3, 16, generator=gen(22), requires_grad=True)
    out = head.out(x)
    assert out.shape == (5, 3, 255)
    np.testing.assert_allclose(to_np(out), to_np(x) @ weight[order].T + bias[order], rtol=1e-5, atol=1e-5)
    upstream = torch.randn(5, 3, 255, generator=gen(23))
    (out * upstream).sum().backward()
    flat_x, flat_up = to_np(x).reshape(-1, 16), to_np(upstream).reshape(-1, 255)
    grad_weight, grad_bias = np.zeros((255, 16)), np.zeros(255)
    grad_weight[order], grad_bias[order] = flat_up.T @ flat_x, flat_up.sum(0)
    np.testing.assert_allclose(to_np(head.out.weight.grad), grad_weight, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(to_np(head.out.bias.grad), grad_bias, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(to_np(x.grad), (flat_up @ weight[order]).reshape(5, 3, 16), rtol=1e-4, atol=1e-4)
    assert head.dist(out).mirrored
    assert type(networks.Head(7, (), 1, 16, "SiLU", "rms", "binary").out) is networks.Linear


@pytest.mark.parametrize("dist", ["symlog_disc", "symlog_mse"])
def test_zero_initialised_reward_and_critic_predict_exactly_zero(dist):
    config, wm = make_world_model("--reward_head.dist", dist, "--critic.dist", dist)
    ac = models.ActorCritic(config, wm, ACT_SPACE, lambda feat, action: feat.sum(-1))
    feat = torch.randn(3, 7, wm.rssm.feat_size, generator=gen(12)) * 5
    reward = wm.heads["reward"](feat).mean()
    value = ac.critic(feat).mean()
    assert reward.shape == value.shape == (3, 7)
    assert torch.equal(reward, torch.zeros(3, 7))
    assert torch.equal(value, torch.zeros(3, 7))
    assert torch.equal(ac.slow_critic(feat).mean(), torch.zeros(3, 7))
    assert wm.heads["cont"].out.weight.abs().sum() > 0  # the continue head is not zero-initialised


def test_multi_encoder_shapes_and_key_selection():
    space = obs_space(depth=gymnasium.spaces.Box(0, 255, (16, 16, 1), dtype=np.uint8),
                      scalar=gymnasium.spaces.Box(-np.inf, np.inf, (), dtype=np.float32))
    config = make_config("--encoder.mlp_keys", "vec|scalar", "--encoder.cnn_keys", "image|depth")
    encoder = networks.MultiEncoder(space, config.encoder)
    assert set(encoder.cnn_shapes) == {"image", "depth"} and set(encoder.mlp_shapes) == {"vec", "scalar"}
    # 16 -> 8 -> 4 with depth 4, 8: 8 channels at 4x4, plus the 32 MLP units.
    assert encoder.outdim == 8 * 4 * 4 + 32
    obs = {"image": torch.rand(6, 16, 16, 3), "depth": torch.rand(6, 16, 16, 1), "vec": torch.randn(6, 5),
           "scalar": torch.randn(6), "is_first": torch.zeros(6)}
    assert encoder(obs).shape == (6, encoder.outdim)
    vector_only = networks.MultiEncoder(space, make_config("--encoder.mlp_keys", "vec", "--encoder.cnn_keys",
                                                           "$^").encoder)
    assert vector_only.outdim == 32 and not vector_only.cnn_shapes
    with pytest.raises(ValueError, match="match no observation"):
        networks.MultiEncoder(space, make_config("--encoder.mlp_keys", "$^", "--encoder.cnn_keys", "$^").encoder)
    flags_only = networks.MultiEncoder(space, make_config("--encoder.mlp_keys", ".*", "--encoder.cnn_keys",
                                                          "$^").encoder)
    assert set(flags_only.mlp_shapes) == {"vec", "scalar"}  # no is_first/is_last/is_terminal, no log_


def test_image_encoder_sees_images_centred_on_zero():
    """v1's ImageEncoderResnet feeds `image - 0.5`: a plain conv / channel LayerNorm / SiLU stack,
    written here from the encoder's weights, on the shifted image."""
    space = obs_space()
    config = make_config("--encoder.mlp_keys", "$^", "--encoder.cnn_keys", "image")
    encoder = networks.MultiEncoder(space, config.encoder)
    for module in encoder.modules():  # non-trivial norm parameters, so that they are checked too
        if isinstance(module, torch.nn.LayerNorm):
            with torch.no_grad():
                module.weight.uniform_(0.5, 1.5, generator=gen(14))
                module.bias.uniform_(-0.2, 0.2, generator=gen(15))
    image = torch.rand(4, 16, 16, 3, generator=gen(16))

    def plain(image):
        x = image.permute(0, 3, 1, 2).double()
        convs = [m for m in encoder.cnn.net if isinstance(m, torch.nn.Conv2d)]
        norms = [m for m in encoder.cnn.net if isinstance(m, torch.nn.LayerNorm)]
        for conv, norm in zip(convs, norms):
            x = torch.nn.functional.conv2d(x, conv.weight.double(), None, stride=2, padding=conv.padding)
            mean, var = x.mean(1, keepdim=True), x.var(1, unbiased=False, keepdim=True)
            x = (x - mean) / torch.sqrt(var + norm.eps)
            x = x * norm.weight.double()[:, None, None] + norm.bias.double()[:, None, None]
            x = x * torch.sigmoid(x)
        return x.flatten(1)

    got = to_np(encoder({"image": image}))
    np.testing.assert_allclose(got, to_np(plain(image - 0.5)), rtol=1e-4, atol=1e-5)
    assert not np.allclose(got, to_np(plain(image)), atol=1e-3)


def test_encoder_symlog_inputs():
    space = obs_space()
    flags = ("--encoder.mlp_keys", "vec", "--encoder.cnn_keys", "$^")
    with_symlog = networks.MultiEncoder(space, make_config(*flags).encoder)
    without = networks.MultiEncoder(space, make_config(*flags, "--encoder.symlog_inputs", "False").encoder)
    without.load_state_dict(with_symlog.state_dict())
    x = torch.randn(4, 5, generator=gen(13), dtype=torch.float64).float() * 100
    squashed = torch.tensor(np_symlog(to_np(x)), dtype=torch.float32)
    np.testing.assert_allclose(to_np(with_symlog({"vec": x})), to_np(without({"vec": squashed})), rtol=1e-5,
                               atol=1e-6)
    assert not np.allclose(to_np(with_symlog({"vec": x})), to_np(without({"vec": x})), atol=1e-3)


def test_multi_decoder_shapes_and_image_loss():
    space = obs_space(depth=gymnasium.spaces.Box(0, 255, (16, 16, 1), dtype=np.uint8))
    config = make_config("--decoder.mlp_keys", "vec", "--decoder.cnn_keys", "image|depth")
    decoder = networks.MultiDecoder(48, space, config.decoder)
    feat = torch.randn(2, 3, 48, generator=gen(14))
    dists = decoder(feat)
    assert set(dists) == {"image", "depth", "vec"}
    assert dists["image"].mode().shape == (2, 3, 16, 16, 3)
    assert dists["depth"].mode().shape == (2, 3, 16, 16, 1)
    assert dists["vec"].mode().shape == (2, 3, 5)
    target = torch.rand(2, 3, 16, 16, 3, generator=gen(15))
    got = dists["image"].log_prob(target)
    assert got.shape == (2, 3)
    want = -((to_np(dists["image"].mode()) - to_np(target)) ** 2).sum((-3, -2, -1))
    np.testing.assert_allclose(to_np(got), want, rtol=1e-5)
    vec = torch.randn(2, 3, 5, generator=gen(16)) * 20
    want = -((to_np(dists["vec"].pred) - np_symlog(to_np(vec))) ** 2).sum(-1)
    np.testing.assert_allclose(to_np(dists["vec"].log_prob(vec)), want, rtol=1e-5)


def test_decoder_scalar_vector_key_loss_is_per_step():
    space = obs_space(scalar=gymnasium.spaces.Box(-np.inf, np.inf, (), dtype=np.float32))
    config = make_config("--decoder.mlp_keys", "scalar", "--decoder.cnn_keys", "$^")
    dist = networks.MultiDecoder(48, space, config.decoder)(torch.randn(2, 3, 48, generator=gen(17)))["scalar"]
    assert dist.mode().shape == (2, 3)
    value = torch.randn(2, 3, generator=gen(18)) * 5
    got = dist.log_prob(value)
    assert got.shape == (2, 3)
    np.testing.assert_allclose(to_np(got), -(to_np(dist.pred) - np_symlog(to_np(value))) ** 2, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Actor
# ---------------------------------------------------------------------------------------------


def make_actor(*flags, actions=3):
    config = make_config(*flags)
    torch.manual_seed(0)
    return networks.Actor(20, actions, config.actor, config.units, config.act, config.norm)


def test_actor_normal_learned_std_bounds():
    actor = make_actor("--actor.min_std", "0.2", "--actor.max_std", "0.9", "--actor.outscale", "30.0")
    feat = torch.randn(64, 20, generator=gen(19)) * 10
    dist = actor(feat)
    with torch.no_grad():
        raw = to_np(actor.out(actor.mlp(feat)))
    mean, std = to_np(dist.mode()), to_np(dist.dist.stddev)
    np.testing.assert_allclose(mean, np.tanh(raw[:, :3]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(std, 0.7 * sigmoid(raw[:, 3:] + 2.0) + 0.2, rtol=1e-5, atol=1e-6)
    assert np.abs(mean).max() <= 1.0 and np.abs(mean).max() > 0.99  # saturated but bounded
    assert std.min() >= 0.2 and std.max() <= 0.9
    assert std.min() < 0.25 and std.max() > 0.85  # the whole range is reachable
    sample = dist.sample()
    assert sample.shape == (64, 3) and sample.requires_grad


def test_actor_normal_fixed_std():
    actor = make_actor("--actor.std", "0.5")
    assert actor.out.out_features == 3
    dist = actor(torch.randn(5, 20, generator=gen(20)))
    np.testing.assert_array_equal(to_np(dist.dist.stddev), 0.5)
    assert np.abs(to_np(dist.mode())).max() < 1.0


def test_actor_onehot_with_unimix():
    actor = make_actor("--actor.dist", "onehot", "--actor.std", "none", "--actor.outscale", "30.0", actions=5)
    feat = torch.randn(16, 20, generator=gen(21))
    dist = actor(feat)
    with torch.no_grad():
        raw = to_np(actor.out(actor.mlp(feat)))
    want = 0.99 * np.exp(np_log_softmax(raw)) + 0.01 / 5
    np.testing.assert_allclose(to_np(dist.probs), want, rtol=1e-4, atol=1e-7)
    assert to_np(dist.probs).min() >= 0.01 / 5 * (1 - 1e-4)
    torch.manual_seed(2)
    sample = dist.sample()
    np.testing.assert_allclose(to_np(sample).sum(-1), 1.0, atol=1e-6)
    assert sample.requires_grad  # straight-through
    np.testing.assert_array_equal(to_np(dist.mode()).argmax(-1), raw.argmax(-1))


def test_actor_rejects_unknown_dist():
    with pytest.raises(tools.ConfigError, match="Invalid value 'beta' for --actor.dist; valid: auto, normal, onehot"):
        make_config("--actor.dist", "beta")


# ---------------------------------------------------------------------------------------------
# stop_grad_heads
# ---------------------------------------------------------------------------------------------


def batch(b=2, t=4, seed=22):
    rng = np.random.default_rng(seed)
    is_first = np.zeros((b, t), bool)
    is_first[:, 0] = True
    return {"image": rng.integers(0, 256, (b, t, 16, 16, 3), dtype=np.uint8),
            "vec": rng.normal(size=(b, t, 5)).astype(np.float32),
            "action": rng.uniform(-1, 1, (b, t, 3)).astype(np.float32),
            "reward": rng.normal(size=(b, t)).astype(np.float32),
            "is_first": is_first, "is_last": np.zeros((b, t), bool),
            "is_terminal": rng.random((b, t)) < 0.3}


@pytest.mark.parametrize("stopped", ["reward,cont", ""])
def test_stop_grad_heads_keep_those_heads_off_the_representation(stopped):
    """Every head trains the representation (the official default) except those in stop_grad_heads."""
    _, wm = make_world_model("--stop_grad_heads", stopped, "--reward_head.outscale", "1.0")
    outputs = {}
    for name, head in wm.heads.items():
        head.register_forward_hook(lambda module, inp, out, name=name: outputs.__setitem__(name, out))
    data = wm.preprocess(batch())
    wm.loss(data)
    losses = {"reward": -outputs["reward"].log_prob(data["reward"]).sum(),
              "cont": -outputs["cont"].log_prob(data["cont"][..., None]).sum(),
              "decoder": -outputs["decoder"]["image"].log_prob(data["image"]).sum()}
    representation = list(wm.encoder.parameters()) + list(wm.rssm.parameters())
    for name, loss in losses.items():
        grads = torch.autograd.grad(loss, representation, allow_unused=True, retain_graph=True)
        reaches = any(g is not None and g.abs().sum() > 0 for g in grads)
        assert reaches == (name not in stopped.split(",")), name
        head_grads = torch.autograd.grad(loss, list(wm.heads[name].parameters()), allow_unused=True,
                                         retain_graph=True)
        assert any(g is not None and g.abs().sum() > 0 for g in head_grads)  # the head itself always learns


def test_unknown_stop_grad_head_is_rejected():
    with pytest.raises(ValueError, match="Invalid value 'value' for --stop_grad_heads; valid: decoder, reward, cont"):
        make_world_model("--stop_grad_heads", "decoder,value")


def test_tanh_of_the_recurrent_cells_is_tanh_with_its_gradient():
    """networks.tanh (one exponential) against numpy's tanh in float64, on values from 0 to beyond the
    clamp, and its gradient against 1 - tanh^2: finite everywhere, 0 where float32 tanh is +-1."""
    x = torch.tensor([-1e4, -60.0, -10.5, -9.0, -3.1, -0.7, -1e-3, -1e-8, 0.0, 2e-6, 0.02, 0.55, 1.9, 4.4, 12.0, 1e30],
                     requires_grad=True)
    got = networks.tanh(x)
    want = np.tanh(x.detach().double().numpy())
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=0, atol=2e-7)
    (grad,) = torch.autograd.grad(got.sum(), x)
    assert torch.isfinite(grad).all()
    np.testing.assert_allclose(grad.numpy(), 1 - want ** 2, rtol=0, atol=5e-7)
    assert networks.tanh(torch.tensor(float("nan"))).isnan()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("rows", [8, 1536], ids=["few_rows", "many_rows"])
def test_linear_is_the_affine_map_with_its_gradients_and_many_rows_go_to_onednn(rows, bias, monkeypatch):
    """networks.Linear against x @ W^T + b and its gradients written out in float64, eager and compiled; inputs of
    ONEDNN_MIN_ROWS rows or more call the oneDNN operator (where this torch has it), fewer rows torch's product."""
    calls = []
    operator = networks.onednn_linear
    monkeypatch.setattr(networks, "onednn_linear", lambda *args: calls.append(1) or operator(*args))
    generator = gen(20)
    layer = networks.Linear(48, 24, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 48, generator=generator))
        if bias:
            layer.bias.copy_(torch.randn(24, generator=generator))
    x = torch.randn(2, rows // 2, 48, generator=generator, requires_grad=True)
    upstream = torch.randn(2, rows // 2, 24, generator=generator)
    weight, xs, ups = (to_np(t).astype(np.float64) for t in (layer.weight, x, upstream))
    want = xs @ weight.T + (to_np(layer.bias).astype(np.float64) if bias else 0.0)
    flat = ups.reshape(-1, 24)
    grads = {"x": ups @ weight, "weight": flat.T @ xs.reshape(-1, 48), "bias": flat.sum(0)}
    params = [x, layer.weight] + ([layer.bias] if bias else [])
    for name, fn in (("eager", layer), ("compiled", torch.compile(layer, fullgraph=True))):
        out = fn(x)
        np.testing.assert_allclose(to_np(out), want, rtol=1e-4, atol=1e-4, err_msg=name)
        for key, got in zip(("x", "weight", "bias"), torch.autograd.grad(out, params, upstream)):
            np.testing.assert_allclose(to_np(got), grads[key], rtol=1e-4, atol=1e-3, err_msg=f"{name} {key}")
    assert len(calls) == (2 if rows >= networks.ONEDNN_MIN_ROWS and networks.ONEDNN else 0)


@pytest.mark.parametrize("cpp_wrapper", [False, True], ids=["python_wrapper", "cpp_wrapper"])
def test_compiled_code_calls_onednns_matmul_itself_not_the_python_operator(cpp_wrapper, monkeypatch):
    """With networks.lower_onednn_linear (which compile True and 'update' call), Inductor's code for a Linear of
    many rows calls oneDNN's matmul directly, not the custom operator's Python kernels, under either of its
    wrappers, also where a graph calling the operator compiled before (and Inductor registered its plain
    fallback for it); the layer and its gradients equal the eager ones."""
    from torch._inductor import lowering
    from torch._inductor.utils import run_and_get_code

    monkeypatch.delitem(lowering.lowerings, torch.ops.dreamer.onednn_linear.default, raising=False)
    layer = networks.Linear(48, 24)
    x = torch.randn(1536, 48, generator=gen(22), requires_grad=True)
    uncached = (torch._inductor.config.patch(fx_graph_cache=False),
                torch._functorch.config.patch(enable_autograd_cache=False))  # graphs generated now, not loaded
    torch._dynamo.reset()
    with uncached[0], uncached[1]:
        torch.compile(layer, fullgraph=True)(x)  # before the lowering: Inductor's plain fallback
    networks.lower_onednn_linear()
    networks.lower_onednn_linear()  # idempotent
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.nn.functional.silu(layer(x)), fullgraph=True,
                             options={"cpp_wrapper": cpp_wrapper})
    with uncached[0], uncached[1]:
        got, code = run_and_get_code(compiled, x)
    code = "\n".join(code)
    if networks.ONEDNN:
        assert "_linear_pointwise" in code
        assert "ops.dreamer.onednn_linear.default(" not in code and "dreamer::onednn_linear" not in code
    want = torch.nn.functional.silu(layer(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    upstream = torch.randn(1536, 24, generator=gen(23))
    for a, b in zip(torch.autograd.grad(got, [x, layer.weight, layer.bias], upstream),
                    torch.autograd.grad(want, [x, layer.weight, layer.bias], upstream)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_linear_under_vmap_uses_torch_product():
    """Inside seeds.vmapped (the batched seeds' update) the oneDNN operator, which has no vmap rule, is not called:
    the vmapped layer equals the layer applied to each member."""
    import seeds  # the seeds' vmap context, which sets networks.layout
    layer = networks.Linear(16, 8)
    x = torch.randn(3, 2048, 16, generator=gen(21))
    weights = {k: torch.stack([v, 2 * v, -v]) for k, v in layer.named_parameters()}
    with seeds.vmapped():
        got = torch.func.vmap(lambda w, x: torch.func.functional_call(layer, w, (x,)))(weights, x)
    for i, scale in enumerate((1, 2, -1)):
        want = torch.nn.functional.linear(x[i], scale * layer.weight, scale * layer.bias)
        np.testing.assert_allclose(to_np(got[i]), to_np(want), rtol=1e-5, atol=1e-5)
