"""Algorithmic pieces of DreamerV3 checked against plain reference computations.

Every expected value here is computed independently of the code under test: numpy loops and the
formulas of the DreamerV3 paper (arXiv 2301.04104), never a second call of the same function.
"""

import copy
import math
import pathlib
import sys

import gymnasium
import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # tests/reference.py

import reference  # noqa: E402

import compilation  # noqa: E402
import config as cfg  # noqa: E402
import distributions  # noqa: E402
import models  # noqa: E402
import networks  # noqa: E402

PRESETS = cfg.load_presets()
FLAGS = ("is_first", "is_last", "is_terminal")


def make_config(*flags):
    return cfg.parse(["--configs", "debug", "--device", "cpu", *flags], presets=copy.deepcopy(PRESETS))


def obs_space():
    spaces = {"image": gymnasium.spaces.Box(0, 255, (16, 16, 3), dtype=np.uint8)}
    spaces.update({k: gymnasium.spaces.Box(0, 1, (), dtype=bool) for k in FLAGS})
    return spaces


ACT_SPACE = gymnasium.spaces.Box(-1, 1, (3,), dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------------------------


def np_symlog(x):
    return np.sign(x) * np.log(1.0 + np.abs(x))


def np_symexp(x):
    return np.sign(x) * (np.exp(np.abs(x)) - 1.0)


def np_log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def np_twohot(x, bins):
    """Two-hot vector of one scalar x over sorted bins: linear interpolation of the two neighbours."""
    target = np.zeros(len(bins))
    if x <= bins[0]:
        target[0] = 1.0
        return target
    if x >= bins[-1]:
        target[-1] = 1.0
        return target
    for k in range(len(bins) - 1):
        if bins[k] <= x < bins[k + 1]:
            frac = (x - bins[k]) / (bins[k + 1] - bins[k])
            target[k] = 1.0 - frac
            target[k + 1] = frac
            return target
    raise AssertionError("unreachable")


def np_kl_categorical(p_logits, q_logits):
    """KL[p || q] summed over the latents, loop over every categorical."""
    p_logits, q_logits = np.asarray(p_logits, np.float64), np.asarray(q_logits, np.float64)
    lead = p_logits.shape[:-2]
    out = np.zeros(lead)
    for index in np.ndindex(*lead):
        total = 0.0
        for s in range(p_logits.shape[-2]):
            p = np.exp(np_log_softmax(p_logits[index][s]))
            q = np.exp(np_log_softmax(q_logits[index][s]))
            total += sum(p[k] * math.log(p[k] / q[k]) for k in range(len(p)))
        out[index] = total
    return out


def np_kl_normal(m1, s1, m2, s2):
    """KL[N(m1, s1) || N(m2, s2)] summed over the last dim, in the textbook form."""
    m1, s1, m2, s2 = (np.asarray(a, np.float64) for a in (m1, s1, m2, s2))
    return (np.log(s2 / s1) + (s1 ** 2 + (m1 - m2) ** 2) / (2 * s2 ** 2) - 0.5).sum(-1)


def np_lambda_return(reward, cont, value, discount, lambda_):
    """reward, cont, value: (H, N) for imagined steps 1..H. Returns R_0..R_{H-1}.

    R_t = r_{t+1} + γ c_{t+1} ((1 - λ) v_{t+1} + λ R_{t+1}),  R_H = v_H.
    """
    horizon = reward.shape[0]
    r = {t + 1: reward[t] for t in range(horizon)}
    c = {t + 1: cont[t] for t in range(horizon)}
    v = {t + 1: value[t] for t in range(horizon)}
    big_r = {horizon: v[horizon]}
    for t in range(horizon - 1, -1, -1):
        big_r[t] = r[t + 1] + discount * c[t + 1] * ((1 - lambda_) * v[t + 1] + lambda_ * big_r[t + 1])
    return np.stack([big_r[t] for t in range(horizon)])


def to_np(x):
    return x.detach().double().cpu().numpy()


# ---------------------------------------------------------------------------------------------
# symlog / symexp
# ---------------------------------------------------------------------------------------------

VALUES = [-1e6, -1000.0, -10.0, -1.0, -0.5, -1e-4, 0.0, 1e-4, 0.5, 1.0, 10.0, 1000.0, 1e6]


def test_symlog_symexp_values():
    x = np.array(VALUES)
    np.testing.assert_allclose(to_np(distributions.symlog(torch.tensor(x))), np_symlog(x), rtol=1e-12, atol=0)
    y = np.linspace(-15, 15, 61)
    np.testing.assert_allclose(to_np(distributions.symexp(torch.tensor(y))), np_symexp(y), rtol=1e-12, atol=0)
    # A few hand-checked values: symlog(e - 1) = 1, symlog(-(e^2 - 1)) = -2.
    assert distributions.symlog(torch.tensor(math.e - 1, dtype=torch.float64)).item() == pytest.approx(1.0, abs=1e-12)
    assert distributions.symlog(torch.tensor(-(math.e ** 2 - 1), dtype=torch.float64)).item() == pytest.approx(-2.0)
    assert distributions.symlog(torch.tensor(0.0)).item() == 0.0
    assert distributions.symexp(torch.tensor(0.0)).item() == 0.0


def test_symlog_symexp_are_inverse_and_odd():
    x = torch.tensor(VALUES, dtype=torch.float64)
    np.testing.assert_allclose(to_np(distributions.symexp(distributions.symlog(x))), VALUES, rtol=1e-10, atol=1e-12)
    y = torch.linspace(-20, 20, 81, dtype=torch.float64)
    np.testing.assert_allclose(to_np(distributions.symlog(distributions.symexp(y))), to_np(y), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(to_np(distributions.symlog(-x)), -to_np(distributions.symlog(x)))


def test_symlog_gradient_away_from_zero():
    x = torch.tensor([-50.0, -2.0, -0.3, 0.3, 2.0, 50.0], dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(distributions.symlog(x).sum(), x)
    np.testing.assert_allclose(to_np(grad), 1.0 / (1.0 + np.abs(to_np(x))), rtol=1e-12)
    (grad,) = torch.autograd.grad(distributions.symexp(x).sum(), x)
    np.testing.assert_allclose(to_np(grad), np.exp(np.abs(to_np(x))), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# two-hot
# ---------------------------------------------------------------------------------------------


def test_twohot_bins_are_255_in_symlog_space_from_minus_20_to_20():
    dist = distributions.TwoHot(torch.zeros(2, 255))
    np.testing.assert_allclose(to_np(dist.bins), np.linspace(-20, 20, 255), atol=1e-5)


def twohot_encode(x, bins, mirrored=False):
    """The dense two-hot target (..., bins) of distributions.twohot_positions."""
    below, above, weight_below, weight_above = distributions.twohot_positions(x, bins, mirrored)
    target = torch.zeros(*x.shape, len(bins))
    target.scatter_add_(-1, below[..., None], weight_below[..., None])
    return target.scatter_add_(-1, above[..., None], weight_above[..., None])


@pytest.mark.parametrize("x", [-25.0, -20.0, -19.99, -3.3, -1e-3, 0.0, 0.05, 7.123, 19.9, 20.0, 21.0, 1e4])
def test_twohot_encode_matches_hand_built_target(x):
    bins = torch.linspace(-20, 20, 255)
    got = to_np(twohot_encode(torch.tensor([x]), bins))[0]
    want = np_twohot(np.float32(x).item(), to_np(bins))
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert got.sum() == pytest.approx(1.0, abs=1e-6)
    assert (got >= 0).all() and (got > 0).sum() <= 2
    if -20 <= x <= 20:  # inside the range the encoding keeps the value: sum(target * bins) == x
        assert (got * to_np(bins)).sum() == pytest.approx(x, abs=1e-4)


def test_twohot_encode_exactly_on_a_bin_is_one_hot():
    bins = torch.linspace(-20, 20, 255)
    for k in (0, 1, 100, 253, 254):
        got = to_np(twohot_encode(bins[k:k + 1], bins))[0]
        want = np.zeros(255)
        want[k] = 1.0
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_twohot_encode_batched_shapes():
    bins = torch.linspace(-20, 20, 255)
    x = torch.linspace(-30, 30, 24).reshape(2, 3, 4)
    got = twohot_encode(x, bins)
    assert got.shape == (2, 3, 4, 255)
    for index in np.ndindex(2, 3, 4):
        np.testing.assert_allclose(to_np(got[index]), np_twohot(x[index].item(), to_np(bins)), atol=1e-5)


def test_twohot_log_prob_against_hand_built_target():
    gen = torch.Generator().manual_seed(0)
    values = torch.tensor([-1e9, -1000.0, -3.3, -0.2, 0.0, 0.7, 5.0, 123.0, 1e6, 1e9])
    logits = torch.randn(len(values), 255, generator=gen) * 3
    got = to_np(distributions.TwoHot(logits).log_prob(values))
    bins = np.linspace(-20, 20, 255)
    log_probs = np_log_softmax(to_np(logits))
    want = [(np_twohot(np_symlog(v), bins) * log_probs[i]).sum() for i, v in enumerate(to_np(values))]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("mirrored", [False, True])
def test_twohot_log_prob_gradient_is_target_minus_softmax(mirrored):
    """d log_prob / d logits = target - softmax (the target's weights sum to 1), written out in
    float64, also for values outside the bins and exactly on one; mirrored logits in their order."""
    gen = torch.Generator().manual_seed(4)
    bins = np.linspace(-20, 20, 255)
    values = np.array([-1e9, -3.3, -0.2, 0.0, np_symexp(bins[200]), 5.0, 123.0, 1e9])
    natural = torch.randn(len(values), 255, generator=gen, dtype=torch.float64) * 3
    logits = (natural[:, MIRRORED_255] if mirrored else natural).clone().requires_grad_()
    dist = distributions.TwoHot(logits, mirrored=mirrored)
    (grad,) = torch.autograd.grad(dist.log_prob(torch.tensor(values)).sum(), logits)
    grad = to_np(grad)[:, np.argsort(MIRRORED_255)] if mirrored else to_np(grad)
    target = np.stack([np_twohot(np_symlog(v), bins) for v in values])
    want = target - np.exp(np_log_softmax(to_np(natural)))
    np.testing.assert_allclose(grad, want, atol=1e-5)


@pytest.mark.parametrize("mirrored", [False, True])
def test_twohot_log_prob_sum_of_two_targets_against_hand_built_targets(mirrored):
    """The critic's two targets (returns and the slow critic's values) read by one gather: the sum
    of both hand-built two-hot targets times the log-softmax, and its gradient the sum of the
    targets minus twice the softmax, written out in float64 (the targets' weights are float32, as
    the distribution computes them); every row's targets differ, some outside the bins."""
    gen = torch.Generator().manual_seed(5)
    bins = np.linspace(-20, 20, 255)
    first = np.array([-1e9, -3.3, -0.2, 0.0, np_symexp(bins[200]), 5.0, 123.0, 1e9])
    second = np.array([7.5, -1e6, 0.01, -42.0, 2.5, np_symexp(bins[3]), -0.6, 3.0])
    natural = torch.randn(len(first), 255, generator=gen, dtype=torch.float64) * 3
    logits = (natural[:, MIRRORED_255] if mirrored else natural).clone().requires_grad_()
    dist = distributions.TwoHot(logits, mirrored=mirrored)
    got = dist.log_prob_sum([torch.tensor(first), torch.tensor(second)])
    (grad,) = torch.autograd.grad(got.sum(), logits)
    grad = to_np(grad)[:, np.argsort(MIRRORED_255)] if mirrored else to_np(grad)
    target = np.stack([np_twohot(np_symlog(a), bins) + np_twohot(np_symlog(b), bins) for a, b in zip(first, second)])
    log_probs = np_log_softmax(to_np(natural))
    np.testing.assert_allclose(to_np(got), (target * log_probs).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(grad, target - 2 * np.exp(log_probs), atol=1e-5)


def test_twohot_mean_is_symexp_of_expected_bin():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, 255, generator=gen) * 2
    got = to_np(distributions.TwoHot(logits).mean())
    probs = np.exp(np_log_softmax(to_np(logits)))
    want = np_symexp((probs * np.linspace(-20, 20, 255)).sum(-1))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert got.shape == (4, 3)


@pytest.mark.parametrize("value", [-2000.0, -1.5, 0.0, 0.25, 42.0, 3e5])
def test_twohot_mean_of_a_two_hot_distribution_recovers_the_value(value):
    bins = np.linspace(-20, 20, 255)
    target = np_twohot(np_symlog(value), bins)
    logits = torch.tensor(np.log(target + 1e-30), dtype=torch.float64)
    assert distributions.TwoHot(logits).mean().item() == pytest.approx(value, rel=1e-4, abs=1e-4)


MIRRORED_255 = list(range(126, -1, -1)) + list(range(127, 255))  # lower half reversed, then the middle and upper


def test_mirrored_order_reverses_the_bins_below_the_middle():
    assert distributions.mirrored_order(255).tolist() == MIRRORED_255
    assert distributions.mirrored_order(6).tolist() == [2, 1, 0, 3, 4, 5]


@pytest.mark.parametrize("squash", [True, False])
def test_twohot_mirrored_reads_logits_in_mirrored_order_as_the_natural_ones(squash):
    """A mirrored TwoHot given the logits permuted into the mirrored order predicts and scores as the
    natural one, against the numpy reference (natural order) written here."""
    gen = torch.Generator().manual_seed(3)
    natural = torch.randn(6, 255, generator=gen) * 2
    mirrored = natural[:, MIRRORED_255]
    dist = distributions.TwoHot(mirrored, squash=squash, mirrored=True)
    bins = np.linspace(-20, 20, 255) if squash else to_np(distributions.symexp_bins(255)).astype(np.float64)
    probs = np.exp(np_log_softmax(to_np(natural)))
    mean = (probs * bins).sum(-1)
    np.testing.assert_allclose(to_np(dist.mean()), np_symexp(mean) if squash else mean, rtol=1e-4, atol=1e-3)
    values = torch.tensor([-1e3, -2.5, -0.01, 0.0, 0.3, 1e4])
    log_probs = np_log_softmax(to_np(natural))
    encoded = [np_symlog(v) if squash else v for v in to_np(values)]
    want = [(np_twohot(np.float32(x).item(), bins) * log_probs[i]).sum() for i, x in enumerate(encoded)]
    np.testing.assert_allclose(to_np(dist.log_prob(values)), want, rtol=1e-4, atol=1e-3)
    assert distributions.TwoHot(torch.zeros(255), squash=squash, mirrored=True).mean().item() == 0.0


def test_twohot_encode_mirrored_is_the_natural_target_permuted():
    bins = torch.linspace(-20, 20, 255)
    x = torch.tensor([-25.0, -20.0, -3.3, 0.0, 0.05, bins[3].item(), 19.9, 21.0])
    natural = to_np(twohot_encode(x, bins))
    mirrored = to_np(twohot_encode(x, bins, mirrored=True))
    np.testing.assert_array_equal(mirrored, natural[:, MIRRORED_255])


# ---------------------------------------------------------------------------------------------
# unimix, one-hot with straight-through gradients
# ---------------------------------------------------------------------------------------------


def test_unimix_logits_mix_one_percent_uniform():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 7, generator=gen) * 4
    got = to_np(torch.softmax(distributions.unimix_logits(logits, 0.01), -1))
    want = 0.99 * np.exp(np_log_softmax(to_np(logits))) + 0.01 / 7
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got.min() >= 0.01 / 7 * (1 - 1e-5)
    np.testing.assert_array_equal(to_np(distributions.unimix_logits(logits, 0.0)), to_np(logits))


def test_one_hot_equals_torch_one_hot_and_compiles_without_a_range_check():
    index = torch.tensor([[0, 3, 1], [2, 2, 0]])
    for dtype in (torch.float32, torch.bfloat16):
        got = distributions.one_hot(index, 4, dtype)
        assert got.dtype == dtype and torch.equal(got, torch.nn.functional.one_hot(index, 4).to(dtype))
    # F.one_hot compiles into a reduction over the indices and an assertion that they are in
    # range, per call; the comparison compiles to neither.
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(lambda i: distributions.one_hot(i, 4, torch.float32), backend=backend)(index)
    ops = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert not any("one_hot" in op or "assert" in op for op in ops), ops


def test_onehot_probs_log_prob_entropy():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5, generator=gen) * 3
    dist = distributions.OneHot(logits, unimix=0.01)
    probs = 0.99 * np.exp(np_log_softmax(to_np(logits))) + 0.01 / 5
    np.testing.assert_allclose(to_np(dist.probs), probs, rtol=1e-5)
    onehot = np.eye(5)[[0, 4, 2, 2, 1, 3]]
    np.testing.assert_allclose(to_np(dist.log_prob(torch.tensor(onehot, dtype=torch.float32))),
                               np.log((probs * onehot).sum(-1)), rtol=1e-5)
    np.testing.assert_allclose(to_np(dist.entropy()), -(probs * np.log(probs)).sum(-1), rtol=1e-5)
    np.testing.assert_array_equal(to_np(dist.mode()).argmax(-1), to_np(logits).argmax(-1))


def onehot_of(raw, made):
    """OneHot of logits with 1% unimix, made from the logits or (from_probs, as the RSSM draws) from
    the mixed probabilities."""
    if made == "logits":
        return distributions.OneHot(raw, unimix=0.01)
    return distributions.OneHot.from_probs(distributions.unimix_probs(raw, 0.01))


@pytest.mark.parametrize("made", ["logits", "probs"])
@pytest.mark.parametrize("method", ["sample", "mode"])
def test_onehot_straight_through_gradient(method, made):
    gen = torch.Generator().manual_seed(4)
    raw = (torch.randn(8, 6, generator=gen) * 2).requires_grad_()
    weights = torch.randn(8, 6, generator=gen)
    torch.manual_seed(0)
    out = getattr(onehot_of(raw, made), method)()
    value = to_np(out)
    # The forward value is a one-hot vector ...
    np.testing.assert_allclose(value.sum(-1), 1.0, atol=1e-6)
    np.testing.assert_allclose(np.minimum(np.abs(value), np.abs(value - 1)), 0.0, atol=1e-6)
    # ... whose gradient is that of the mixed probabilities p' = 0.99 softmax + 0.01 / K:
    # d/dl_j sum_i w_i p'_i = 0.99 p_j (w_j - sum_i w_i p_i).
    (grad,) = torch.autograd.grad((out * weights).sum(), raw)
    p = np.exp(np_log_softmax(to_np(raw)))
    w = to_np(weights)
    want = 0.99 * p * (w - (w * p).sum(-1, keepdims=True))
    np.testing.assert_allclose(to_np(grad), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("made", ["logits", "probs"])
def test_onehot_samples_follow_the_mixed_probabilities(made):
    logits = torch.tensor([[2.0, 0.0, -1.0, -30.0]]).expand(20000, 4)
    torch.manual_seed(1)
    samples = to_np(onehot_of(logits, made).sample())
    p = 0.99 * np.exp(np_log_softmax([2.0, 0.0, -1.0, -30.0])) + 0.01 / 4
    np.testing.assert_allclose(samples.mean(0), p, atol=0.015)
    assert samples[:, 3].sum() > 0  # the uniform mixture reaches even a -30 logit


def test_onehot_with_classes_before_the_categoricals_is_the_same_distribution():
    """OneHot(dim=-2) on (..., classes, stoch) logits, as the RSSM draws its latents, is the
    class-last distribution transposed: the same mixed logits, probabilities, entropy and
    log-probabilities, and, from the same seed, the same samples and mode."""
    logits = torch.randn(5, 7, 4, generator=torch.Generator().manual_seed(9)) * 3  # (B, stoch, classes)
    last = distributions.OneHot(logits, unimix=0.01)
    first = distributions.OneHot(logits.transpose(-1, -2).contiguous(), unimix=0.01, dim=-2)
    t = lambda x: x.transpose(-1, -2)  # noqa: E731
    torch.testing.assert_close(t(first.logits), last.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(t(first.probs), last.probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(first.entropy(), last.entropy(), rtol=0, atol=1e-6)
    torch.manual_seed(4)
    sample = last.sample()
    torch.manual_seed(4)
    assert torch.equal(t(first.sample()), sample)
    assert torch.equal(t(first.mode()), last.mode())
    torch.testing.assert_close(first.log_prob(t(sample)), last.log_prob(sample), rtol=0, atol=1e-6)
    assert len(set(sample.argmax(-1).flatten().tolist())) == 4  # the samples differ: every class drawn


# ---------------------------------------------------------------------------------------------
# Normal, Bernoulli, MSE, SymlogMSE
# ---------------------------------------------------------------------------------------------


def test_normal_log_prob_entropy_and_reparameterised_sample():
    gen = torch.Generator().manual_seed(5)
    mean = torch.randn(4, 3, generator=gen).requires_grad_()
    std = torch.rand(4, 3, generator=gen) + 0.1
    x = torch.randn(4, 3, generator=gen)
    dist = distributions.Normal(mean, std)
    m, s, v = to_np(mean), to_np(std), to_np(x)
    want = (-0.5 * ((v - m) / s) ** 2 - np.log(s) - 0.5 * np.log(2 * np.pi)).sum(-1)
    np.testing.assert_allclose(to_np(dist.log_prob(x)), want, rtol=1e-5)
    np.testing.assert_allclose(to_np(dist.entropy()), (0.5 * np.log(2 * np.pi * np.e * s ** 2)).sum(-1), rtol=1e-5)
    np.testing.assert_array_equal(to_np(dist.mode()), m)
    (grad,) = torch.autograd.grad(dist.sample().sum(), mean)
    np.testing.assert_allclose(to_np(grad), 1.0)


def test_bernoulli_log_prob_mode_mean():
    logits = torch.tensor([[-3.0], [-0.1], [0.0], [0.2], [5.0]])
    value = torch.tensor([[0.0], [1.0], [1.0], [0.0], [1.0]])
    dist = distributions.Bernoulli(logits)
    p = 1 / (1 + np.exp(-to_np(logits)[:, 0]))
    v = to_np(value)[:, 0]
    np.testing.assert_allclose(to_np(dist.log_prob(value)), v * np.log(p) + (1 - v) * np.log(1 - p), rtol=1e-5)
    np.testing.assert_allclose(to_np(dist.mean())[:, 0], p, rtol=1e-6)
    np.testing.assert_array_equal(to_np(dist.mode())[:, 0], [0, 0, 0, 1, 1])


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_mse_and_symlog_mse_sum_over_event_dims(dims):
    gen = torch.Generator().manual_seed(6)
    pred = torch.randn(2, 3, 4, 5, generator=gen)
    value = torch.randn(2, 3, 4, 5, generator=gen) * 50
    p, v = to_np(pred), to_np(value)
    axes = tuple(range(-dims, 0))
    mse = distributions.MSE(pred, dims=dims)
    np.testing.assert_allclose(to_np(mse.log_prob(value)), -((p - v) ** 2).sum(axes), rtol=1e-5)
    np.testing.assert_array_equal(to_np(mse.mode()), p)
    sym = distributions.SymlogMSE(pred, dims=dims)
    np.testing.assert_allclose(to_np(sym.log_prob(value)), -((p - np_symlog(v)) ** 2).sum(axes), rtol=1e-5)
    np.testing.assert_allclose(to_np(sym.mode()), np_symexp(p), rtol=1e-5)


@pytest.mark.parametrize("cls", [distributions.MSE, distributions.SymlogMSE])
def test_mse_with_scalar_event_is_elementwise(cls):
    """dims=0 (a scalar event, e.g. a symlog_mse reward or critic head) must not sum over the batch."""
    pred = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    value = torch.tensor([[1.0, 1.0], [-3.0, 0.0]])
    target = to_np(value) if cls is distributions.MSE else np_symlog(to_np(value))
    got = cls(pred, dims=0).log_prob(value)
    assert got.shape == (2, 2)
    np.testing.assert_allclose(to_np(got), -(to_np(pred) - target) ** 2, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# KL divergences and KL balancing
# ---------------------------------------------------------------------------------------------


def test_kl_categorical_matches_numpy():
    gen = torch.Generator().manual_seed(7)
    lhs = torch.randn(2, 3, 4, 5, generator=gen) * 2
    rhs = torch.randn(2, 3, 4, 5, generator=gen) * 2
    got = distributions.kl_categorical(lhs, rhs)
    assert got.shape == (2, 3)
    np.testing.assert_allclose(to_np(got), np_kl_categorical(to_np(lhs), to_np(rhs)), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(to_np(distributions.kl_categorical(lhs, lhs)), 0.0, atol=1e-6)


def test_kl_normal_matches_textbook_formula():
    gen = torch.Generator().manual_seed(8)
    m1, m2 = torch.randn(2, 3, 6, generator=gen), torch.randn(2, 3, 6, generator=gen)
    s1, s2 = torch.rand(2, 3, 6, generator=gen) + 0.1, torch.rand(2, 3, 6, generator=gen) + 0.1
    got = distributions.kl_normal(m1, s1, m2, s2)
    assert got.shape == (2, 3)
    np.testing.assert_allclose(to_np(got), np_kl_normal(*map(to_np, (m1, s1, m2, s2))), rtol=1e-4)
    np.testing.assert_allclose(to_np(distributions.kl_normal(m1, s1, m1, s1)), 0.0, atol=1e-6)


def discrete_rssm():
    config = make_config()
    return networks.RSSM(config, embed_size=8, action_size=2)


def continuous_rssm():
    config = make_config("--dyn_discrete", "0")
    return networks.RSSM(config, embed_size=8, action_size=2)


def random_logits(seed, shape=(3, 4, 4, 4), scale=1.5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale


def scaled_kl(rssm, post, prior, free, dyn_scale, rep_scale):
    """The KL part of the world model's loss as models.Update sums it, and the raw KLs."""
    dyn, rep, raw_dyn, raw_rep = rssm.kl_loss(post, prior, free)
    return dyn_scale * dyn + rep_scale * rep, raw_dyn, raw_rep

def test_kl_loss_values_with_free_nats_per_step():
    rssm = discrete_rssm()
    post_logit, prior_logit = random_logits(10), random_logits(11)
    kl = np_kl_categorical(to_np(post_logit), to_np(prior_logit))  # (B, T)
    free = float(np.median(kl))  # half of the steps lie below the free nats
    assert (kl < free).any() and (kl > free).any()
    loss, dyn, rep = scaled_kl(rssm, {"logit": post_logit}, {"logit": prior_logit}, free, 0.5, 0.1)
    assert loss.shape == dyn.shape == rep.shape == (3, 4)
    np.testing.assert_allclose(to_np(dyn), kl, rtol=1e-4)
    np.testing.assert_allclose(to_np(rep), kl, rtol=1e-4)
    want = 0.5 * np.maximum(free, kl) + 0.1 * np.maximum(free, kl)
    np.testing.assert_allclose(to_np(loss), want, rtol=1e-4)


def categorical_kl_grads(p_logits, q_logits):
    """Analytic gradients of KL[softmax(p) || softmax(q)], summed over latents, per class."""
    logp, logq = np_log_softmax(p_logits), np_log_softmax(q_logits)
    p, q = np.exp(logp), np.exp(logq)
    grad_q = q - p  # d/dq_logits
    inner = (p * (logp - logq)).sum(-1, keepdims=True)
    grad_p = p * ((logp - logq) - inner)  # d/dp_logits
    return grad_p, grad_q


def test_kl_loss_dyn_term_trains_only_the_prior_and_rep_only_the_posterior():
    rssm = discrete_rssm()
    post_logit = random_logits(12).requires_grad_()
    prior_logit = random_logits(13).requires_grad_()
    grad_p, grad_q = categorical_kl_grads(to_np(post_logit), to_np(prior_logit))
    # dyn = KL[sg(post) || prior]: gradient reaches only the prior.
    loss, _, _ = scaled_kl(rssm, {"logit": post_logit}, {"logit": prior_logit}, 0.0, 1.0, 0.0)
    g_post, g_prior = torch.autograd.grad(loss.sum(), [post_logit, prior_logit])
    np.testing.assert_array_equal(to_np(g_post), 0.0)
    np.testing.assert_allclose(to_np(g_prior), grad_q, rtol=1e-4, atol=1e-6)
    # rep = KL[post || sg(prior)]: gradient reaches only the posterior.
    loss, _, _ = scaled_kl(rssm, {"logit": post_logit}, {"logit": prior_logit}, 0.0, 0.0, 1.0)
    g_post, g_prior = torch.autograd.grad(loss.sum(), [post_logit, prior_logit])
    np.testing.assert_array_equal(to_np(g_prior), 0.0)
    np.testing.assert_allclose(to_np(g_post), grad_p, rtol=1e-4, atol=1e-6)
    # Both together are weighted by dyn_scale and rep_scale.
    loss, _, _ = scaled_kl(rssm, {"logit": post_logit}, {"logit": prior_logit}, 0.0, 0.5, 0.1)
    g_post, g_prior = torch.autograd.grad(loss.sum(), [post_logit, prior_logit])
    np.testing.assert_allclose(to_np(g_prior), 0.5 * grad_q, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(to_np(g_post), 0.1 * grad_p, rtol=1e-4, atol=1e-6)


def test_kl_loss_free_nats_stop_gradients_per_step():
    rssm = discrete_rssm()
    post_logit = random_logits(14).requires_grad_()
    prior_logit = random_logits(15).requires_grad_()
    kl = np_kl_categorical(to_np(post_logit), to_np(prior_logit))
    free = float(np.median(kl))
    _, grad_q = categorical_kl_grads(to_np(post_logit), to_np(prior_logit))
    loss, _, _ = scaled_kl(rssm, {"logit": post_logit}, {"logit": prior_logit}, free, 1.0, 0.0)
    (g_prior,) = torch.autograd.grad(loss.sum(), [prior_logit])
    below = kl < free
    np.testing.assert_array_equal(to_np(g_prior)[below], 0.0)
    np.testing.assert_allclose(to_np(g_prior)[~below], grad_q[~below], rtol=1e-4, atol=1e-6)


def test_kl_loss_continuous_values_and_gradient_routing():
    rssm = continuous_rssm()
    gen = torch.Generator().manual_seed(16)
    stoch = rssm.stoch
    post = {"mean": torch.randn(3, 4, stoch, generator=gen).requires_grad_(),
            "std": (torch.rand(3, 4, stoch, generator=gen) + 0.2).requires_grad_()}
    prior = {"mean": torch.randn(3, 4, stoch, generator=gen).requires_grad_(),
             "std": (torch.rand(3, 4, stoch, generator=gen) + 0.2).requires_grad_()}
    kl = np_kl_normal(to_np(post["mean"]), to_np(post["std"]), to_np(prior["mean"]), to_np(prior["std"]))
    free = float(np.median(kl))
    loss, dyn, rep = scaled_kl(rssm, post, prior, free, 0.5, 0.1)
    np.testing.assert_allclose(to_np(dyn), kl, rtol=1e-4)
    np.testing.assert_allclose(to_np(rep), kl, rtol=1e-4)
    np.testing.assert_allclose(to_np(loss), 0.6 * np.maximum(free, kl), rtol=1e-4)
    leaves = [post["mean"], post["std"], prior["mean"], prior["std"]]
    loss, _, _ = scaled_kl(rssm, post, prior, 0.0, 1.0, 0.0)
    grads = torch.autograd.grad(loss.sum(), leaves)
    assert not to_np(grads[0]).any() and not to_np(grads[1]).any()
    assert to_np(grads[2]).any() and to_np(grads[3]).any()
    # d/d mu2 KL = (mu2 - mu1) / s2^2
    want = (to_np(prior["mean"]) - to_np(post["mean"])) / to_np(prior["std"]) ** 2
    np.testing.assert_allclose(to_np(grads[2]), want, rtol=1e-4, atol=1e-6)
    loss, _, _ = scaled_kl(rssm, post, prior, 0.0, 0.0, 1.0)
    grads = torch.autograd.grad(loss.sum(), leaves)
    assert to_np(grads[0]).any() and to_np(grads[1]).any()
    assert not to_np(grads[2]).any() and not to_np(grads[3]).any()
    # d/d mu1 KL = (mu1 - mu2) / s2^2
    np.testing.assert_allclose(to_np(grads[0]), -want, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# λ-returns
# ---------------------------------------------------------------------------------------------


def random_trajectory(seed, horizon=7, n=5):
    rng = np.random.default_rng(seed)
    reward = rng.normal(size=(horizon, n))
    cont = (rng.random((horizon, n)) > 0.2).astype(np.float64)
    value = rng.normal(size=(horizon, n)) * 3
    return reward, cont, value


@pytest.mark.parametrize("lambda_", [0.0, 0.5, 0.95, 1.0])
def test_lambda_return_matches_reference_loop(lambda_):
    reward, cont, value = random_trajectory(20)
    got = models.lambda_return(*(torch.tensor(a) for a in (reward, cont, value)), 0.97, lambda_)
    assert got.shape == reward.shape
    np.testing.assert_allclose(to_np(got), np_lambda_return(reward, cont, value, 0.97, lambda_), rtol=1e-12)


def test_lambda_zero_is_td0():
    reward, cont, value = random_trajectory(21)
    got = models.lambda_return(*(torch.tensor(a) for a in (reward, cont, value)), 0.9, 0.0)
    np.testing.assert_allclose(to_np(got), reward + 0.9 * cont * value, rtol=1e-12)


def test_lambda_one_is_monte_carlo_with_bootstrap():
    reward, cont, value = random_trajectory(22)
    horizon, gamma = reward.shape[0], 0.9
    want = np.zeros_like(reward)
    for t in range(horizon):  # R_t for state t; rewards and flags of steps t+1..H
        total, factor = 0.0, 1.0
        for k in range(t + 1, horizon + 1):
            total = total + factor * reward[k - 1]
            factor = factor * gamma * cont[k - 1]
        want[t] = total + factor * value[horizon - 1]
    got = models.lambda_return(*(torch.tensor(a) for a in (reward, cont, value)), gamma, 1.0)
    np.testing.assert_allclose(to_np(got), want, rtol=1e-12)


def test_lambda_return_terminal_cuts_the_future():
    reward = np.array([[1.0], [2.0], [4.0]])
    cont = np.array([[1.0], [0.0], [1.0]])
    value = np.array([[10.0], [20.0], [40.0]])
    got = to_np(models.lambda_return(*(torch.tensor(a) for a in (reward, cont, value)), 0.5, 0.5))
    # R_2 = 4 + 0.5 * 40 = 24; R_1 = 2 (terminal at step 2); R_0 = 1 + 0.5 * (0.5 * 10 + 0.5 * 2) = 4.
    np.testing.assert_allclose(got[:, 0], [4.0, 2.0, 24.0])


# ---------------------------------------------------------------------------------------------
# Return normalisation
# ---------------------------------------------------------------------------------------------


def test_return_norm_ema_of_percentiles_over_several_updates():
    norm = models.ReturnNorm()
    rng = np.random.default_rng(30)
    low = high = 0.0
    for i in range(6):
        batch = rng.normal(loc=3 * i, scale=100 + 50 * i, size=(15, 40))
        low = 0.99 * low + 0.01 * np.percentile(batch, 5)
        high = 0.99 * high + 0.01 * np.percentile(batch, 95)
        offset, scale = norm(torch.tensor(batch, dtype=torch.float32))
        assert offset.item() == pytest.approx(low, rel=1e-4, abs=1e-5)
        assert scale.item() == pytest.approx(max(1.0, high - low), rel=1e-4)
        assert norm.low.item() == pytest.approx(low, rel=1e-4, abs=1e-5)
        assert norm.high.item() == pytest.approx(high, rel=1e-4, abs=1e-5)
    assert scale.item() > 1.0  # the range did get past the floor


def test_return_norm_scale_floor_is_one():
    norm = models.ReturnNorm()
    batch = torch.linspace(-0.5, 0.5, 100)
    for _ in range(3):
        offset, scale = norm(batch)
    assert scale.item() == 1.0
    assert offset.item() == pytest.approx((1 - 0.99 ** 3) * np.percentile(to_np(batch), 5), rel=1e-4)


# ---------------------------------------------------------------------------------------------
# Actor-critic
# ---------------------------------------------------------------------------------------------


def make_actor_critic(*flags, reward_fn=None):
    config, _ = compilation.resolve_auto(make_config(*flags), ACT_SPACE)  # as dreamer.main does before building
    torch.manual_seed(0)
    wm = models.WorldModel(obs_space(), ACT_SPACE, config)
    reward_fn = reward_fn or (lambda feat, action: (wm.heads["reward"](feat).mean(), {}))
    return config, wm, models.ActorCritic(config, wm, ACT_SPACE, reward_fn)


def start_states(wm, n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        state = wm.rssm.initial(n)
        return wm.rssm.img_step(state, torch.rand(n, ACT_SPACE.shape[0], generator=gen) * 2 - 1)


def params_np(module):
    return [to_np(p).copy() for p in module.parameters()]


def test_update_slow_critic_ema_every_n_updates():
    _, _, ac = make_actor_critic("--critic.slow_target_update", "3", "--critic.slow_target_fraction", "0.25",
                                 "--critic.outscale", "1.0")
    ref = params_np(ac.critic)
    np.testing.assert_array_equal(np.concatenate([p.ravel() for p in params_np(ac.slow_critic)]),
                                  np.concatenate([p.ravel() for p in ref]))
    gen = torch.Generator().manual_seed(31)
    for i in range(8):
        with torch.no_grad():
            for p in ac.critic.parameters():
                p.add_(torch.randn(p.shape, generator=gen))
        fast = params_np(ac.critic)
        if i % 3 == 0:
            ref = [0.75 * r + 0.25 * f for r, f in zip(ref, fast)]
        ac.update_slow_critic()
        for slow, want in zip(params_np(ac.slow_critic), ref):
            np.testing.assert_allclose(slow, want, rtol=1e-5, atol=1e-6)
    assert int(ac.updates) == 8
    assert not any(p.requires_grad for p in ac.slow_critic.parameters())


def critic_inputs(ac, horizon=5, n=4, seed=32):
    gen = torch.Generator().manual_seed(seed)
    feat = torch.randn(horizon + 1, n, ac.wm[0].rssm.feat_size, generator=gen)
    returns = torch.randn(horizon, n, generator=gen) * 30
    weight = torch.rand(horizon + 1, n, generator=gen)
    return feat, returns, weight


def perturb(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))


def critic_loss_as_trained(ac, feat, returns, weight):
    """ActorCritic.critic_loss given the critic's prediction as ActorCritic.loss computes it: at the
    detached features of steps 0..H-1."""
    return ac.critic_loss(feat.detach(), returns, weight, ac.critic.dist(ac.critic.raw(feat.detach())[:-1]))


def actor_loss_as_trained(ac, feat, action, returns, weight):
    """ActorCritic.actor_loss given the policy and baseline as ActorCritic.loss computes them: the
    actor on the detached features of steps 0..H-1, the critic's values with its weights detached."""
    return ac.actor_loss(action, returns, weight, ac.actor(feat[:-1].detach()), ac.values(feat)[:-1])


@pytest.mark.parametrize("slow_target", [True, False])
def test_critic_loss_two_hot_with_slow_regulariser(slow_target):
    _, _, ac = make_actor_critic("--critic.outscale", "1.0", "--critic.slow_target", str(slow_target))
    perturb(ac.slow_critic, 33)
    feat, returns, weight = critic_inputs(ac)
    loss = critic_loss_as_trained(ac, feat, returns, weight)
    bins = np.linspace(-20, 20, 255)
    natural = np.argsort(MIRRORED_255)  # the heads emit their logits in the mirrored order
    with torch.no_grad():
        log_probs = np_log_softmax(to_np(ac.critic(feat[:-1]).logits)[..., natural])
        slow_probs = np.exp(np_log_softmax(to_np(ac.slow_critic(feat[:-1]).logits)[..., natural]))
    slow_mean = np_symexp((slow_probs * bins).sum(-1))
    want = np.zeros(returns.shape)
    for index in np.ndindex(*returns.shape):
        nll = -(np_twohot(np_symlog(to_np(returns)[index]), bins) * log_probs[index]).sum()
        if slow_target:
            nll += -(np_twohot(np_symlog(slow_mean[index]), bins) * log_probs[index]).sum()
        want[index] = nll
    np.testing.assert_allclose(to_np(loss), (to_np(weight)[:-1] * want).mean(0), rtol=1e-4)  # per start state


def test_critic_loss_symlog_mse_with_slow_regulariser():
    _, _, ac = make_actor_critic("--critic.outscale", "1.0", "--critic.dist", "symlog_mse")
    perturb(ac.slow_critic, 34)
    feat, returns, weight = critic_inputs(ac)
    loss = critic_loss_as_trained(ac, feat, returns, weight)
    with torch.no_grad():
        pred = to_np(ac.critic.out(ac.critic.mlp(feat[:-1])))[..., 0]
        slow = to_np(ac.slow_critic.out(ac.slow_critic.mlp(feat[:-1])))[..., 0]
    want = (pred - np_symlog(to_np(returns))) ** 2 + (pred - slow) ** 2
    np.testing.assert_allclose(to_np(loss), (to_np(weight)[:-1] * want).mean(0), rtol=1e-4)  # per start state


def actor_inputs(ac, horizon=5, n=8, seed=35):
    gen = torch.Generator().manual_seed(seed)
    feat = torch.randn(horizon + 1, n, ac.wm[0].rssm.feat_size, generator=gen)
    action = torch.rand(horizon + 1, n, ACT_SPACE.shape[0], generator=gen) * 1.8 - 0.9
    returns = (torch.randn(horizon, n, generator=gen) * 200).requires_grad_()
    weight = torch.rand(horizon + 1, n, generator=gen)
    return feat, action, returns, weight


@pytest.mark.parametrize("mode", ["dynamics", "reinforce", "both"])
def test_actor_loss_modes_against_reference(mode):
    _, _, ac = make_actor_critic("--imag_gradient", mode, "--imag_gradient_mix", "0.3", "--actor.entropy", "0.05",
                                 "--critic.outscale", "1.0")
    feat, action, returns, weight = actor_inputs(ac)
    loss, metrics = actor_loss_as_trained(ac, feat, action, returns, weight)
    # Reference: returns normalised by a fresh EMA (one update from zero) of the 5th/95th percentiles.
    r = to_np(returns)
    low, high = 0.01 * np.percentile(r, 5), 0.01 * np.percentile(r, 95)
    scale = max(1.0, high - low)
    assert scale > 1.0
    with torch.no_grad():
        base = to_np(ac.critic(feat[:-1]).mean())
        policy = ac.actor(feat[:-1])
        mean, std = to_np(policy.mean_), to_np(policy.dist.stddev)
    a = to_np(action)[:-1]
    logp = (-0.5 * ((a - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)).sum(-1)
    entropy = (0.5 * np.log(2 * np.pi * np.e * std ** 2)).sum(-1)
    normed = (r - low) / scale
    advantage = normed - (base - low) / scale
    dynamics, reinforce = -advantage, -logp * advantage
    term = {"dynamics": dynamics, "reinforce": reinforce, "both": 0.3 * dynamics + 0.7 * reinforce}[mode]
    w = to_np(weight)[:-1]
    want = (w * (term - 0.05 * entropy)).mean(0)  # per start state
    np.testing.assert_allclose(to_np(loss), want, rtol=1e-4, atol=1e-6)
    assert metrics["return_scale"].item() == pytest.approx(scale, rel=1e-5)
    # The return gradient of the mean loss is -w / scale per element for dynamics, none for reinforce.
    (grad,) = torch.autograd.grad(loss.mean(), returns, allow_unused=True)
    share = {"dynamics": 1.0, "reinforce": 0.0, "both": 0.3}[mode]
    got = np.zeros_like(r) if grad is None else to_np(grad)
    np.testing.assert_allclose(got, -share * w / scale / w.size, rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("mode", ["dynamics", "reinforce"])
def test_actor_loss_gradient_matches_v1_including_the_critic_baseline(mode):
    """v1's ImagActorCritic.loss written plainly: adv = (ret - offset) / scale - (base - offset) / scale
    with base = v(s_t) NOT stop-gradded; backprop: -adv, reinforce: -log pi(a) * sg(adv); minus the
    entropy bonus, times the weight. Loss and gradient into the imagined features (which the
    dynamics gradient carries back to the actor) both match."""
    _, _, ac = make_actor_critic("--imag_gradient", mode, "--actor.entropy", "0.05", "--critic.outscale", "1.0")
    feat, action, _, weight = actor_inputs(ac)
    feat.requires_grad_()
    value = ac.critic(feat).mean()  # (H+1, N): returns that depend on feat, as in imagination
    returns = models.lambda_return(value[1:] * 0.5 + 1.0, torch.ones_like(value[1:]), value[1:], 0.99, 0.95) * 50
    inputs = [feat, *ac.actor.parameters()]

    def grads(loss):
        out = torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, out)]

    loss = actor_loss_as_trained(ac, feat, action, returns, weight)[0].mean()
    got = grads(loss)

    # Plain v1: one percentile EMA step from zero; the base carries its gradient.
    flat = returns.detach().flatten()
    low = 0.01 * torch.quantile(flat, 0.05)
    high = 0.01 * torch.quantile(flat, 0.95)
    scale = torch.clamp(high - low, min=1.0)
    # The critic's and the actor's outputs from their layers, the distributions written out (tests/reference.py).
    base = reference.twohot_mean(reference.mlp_head(ac.critic, feat[:-1]), ac.config.critic.dist)
    adv = (returns - low) / scale - (base - low) / scale
    mean, std = reference.actor_dist(ac.actor, ac.config, feat[:-1].detach())
    logpi = reference.normal_log_prob(action[:-1].detach(), mean, std)
    entropy = reference.normal_entropy(std)
    term = -adv if mode == "dynamics" else -logpi * adv.detach()
    want_loss = ((term - 0.05 * entropy) * weight[:-1]).mean()
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    for a, b in zip(got, grads(want_loss)):  # the formulas written out round otherwise: relative to each tensor
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()) + 1e-10)
    assert got[1].abs().sum() > 0 and bool(got[0].abs().sum() > 0) is (mode == "dynamics")
    if mode == "dynamics":  # the baseline's share is not zero: stop-gradding it would change the gradient
        detached = (returns - low) / scale - (base.detach() - low) / scale
        without_base = grads(((-detached - 0.05 * entropy) * weight[:-1]).mean())
        assert (got[0] - without_base[0]).abs().max() > 1e-4


@pytest.mark.parametrize("mode, passes", [("reinforce", 1), ("dynamics", 2)])
def test_imagined_loss_runs_the_critic_once_under_reinforce(mode, passes):
    """The official code reads the values and the critic's prediction from one pass of the critic;
    only the dynamics gradient needs a second one, through the features. critic_value is the
    prediction at steps 0..H-1, written out."""
    _, _, ac = make_actor_critic("--imag_gradient", mode, "--critic.outscale", "1.0")
    feat, action, _, _ = actor_inputs(ac)
    calls = []
    first = next(m for m in ac.critic.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda *_: calls.append(1))
    _, _, metrics = ac.imagined_loss(feat, action, ac.actor.raw(feat), torch.ones(feat.shape[1]))
    assert len(calls) == passes
    with torch.no_grad():
        want = reference.twohot_mean(reference.mlp_head(ac.critic, feat[:-1]), ac.config.critic.dist)
    assert metrics["critic_value"].item() == pytest.approx(want.mean().item(), rel=1e-5)


def test_actor_loss_entropy_weight():
    _, _, ac = make_actor_critic("--imag_gradient", "reinforce", "--reward_EMA", "False")
    feat, action, returns, weight = actor_inputs(ac)
    values = {}
    for eta in (0.0, 0.3):
        ac.config = ac.config.replace({"actor.entropy": eta})  # the config is read-only: a new one
        values[eta] = actor_loss_as_trained(ac, feat, action, returns, weight)[0].mean().item()
    with torch.no_grad():
        std = to_np(ac.actor(feat[:-1]).dist.stddev)
    entropy = (0.5 * np.log(2 * np.pi * np.e * std ** 2)).sum(-1)
    assert values[0.3] - values[0.0] == pytest.approx(-0.3 * (to_np(weight)[:-1] * entropy).mean(), rel=1e-4)


def test_actor_loss_onehot_reinforce_without_return_norm():
    _, wm, _ = make_actor_critic()
    config = make_config("--actor.dist", "onehot", "--actor.std", "none", "--imag_gradient", "reinforce",
                         "--reward_EMA", "False", "--actor.entropy", "0.01")
    act_space = gymnasium.spaces.Box(0, 1, (4,), dtype=np.float32)
    ac = models.ActorCritic(config, wm, act_space, lambda feat, action: feat.sum(-1))
    gen = torch.Generator().manual_seed(36)
    feat = torch.randn(4, 3, wm.rssm.feat_size, generator=gen)
    action = torch.eye(4)[torch.randint(0, 4, (4, 3), generator=gen)]
    returns = torch.randn(3, 3, generator=gen) * 5
    weight = torch.rand(4, 3, generator=gen)
    loss, _ = actor_loss_as_trained(ac, feat, action, returns, weight)
    with torch.no_grad():
        raw = to_np(ac.actor.out(ac.actor.mlp(feat[:-1])))
        base = to_np(ac.critic(feat[:-1]).mean())
    probs = 0.99 * np.exp(np_log_softmax(raw)) + 0.01 / 4
    logp = np.log((probs * to_np(action)[:-1]).sum(-1))
    entropy = -(probs * np.log(probs)).sum(-1)
    want = (to_np(weight)[:-1] * (-logp * (to_np(returns) - base) - 0.01 * entropy)).mean(0)
    np.testing.assert_allclose(to_np(loss), want, rtol=1e-4)


def capture_actor_loss(ac, wm):
    """Wrap the imagination and actor_loss to record the imagined features and the loss's inputs,
    and at that moment the targets the reference needs."""
    seen = {}
    imagine, actor_loss = ac.imagine, ac.actor_loss

    def imagined(start):
        feat, action, out = imagine(start)
        with torch.no_grad():
            seen.update(feat=feat.detach().clone(), value=ac.critic(feat[1:]).mean().clone(),
                        cont=wm.heads["cont"](feat[1:]).mode()[..., 0].clone(),
                        reward=ac.reward_fn(feat, action)[0].clone())
        return feat, action, out

    def recorded(action, returns, weight, *args):
        seen.update(returns=returns.detach().clone(), weight=weight.clone())
        return actor_loss(action, returns, weight, *args)

    ac.imagine, ac.actor_loss = imagined, recorded
    return seen


def behavior_update(config, wm, ac, start, start_cont):
    """One step of an actor-critic with optimizers of its own, as Plan2Explore steps its: its terms
    from the start states (N, ...) taken as one sequence (models.loss's Imagination), the world model
    frozen; returns the metrics."""
    post = {k: v[None] for k, v in start.items()}
    data = {"is_first": torch.zeros(1, len(start_cont)), "cont": start_cont[None]}
    terms, _, _, metrics = models.loss(ac, data, part="behavior", post=post, replay=False)
    metrics.update(models.step(models.behavior_optimizers(config, ac), terms, wm.scales))
    ac.update_slow_critic()
    return metrics


def test_train_step_weight_and_returns_against_reference():
    config, wm, ac = make_actor_critic("--critic.outscale", "1.0", "--discount", "0.9", "--discount_lambda", "0.8",
                                       reward_fn=lambda feat, action: (feat[..., :3].sum(-1), {}))
    perturb(ac.slow_critic, 37)
    with torch.no_grad():  # a continue head that predicts both outcomes
        wm.heads["cont"].out.bias.fill_(0.2)
    seen = capture_actor_loss(ac, wm)
    start = start_states(wm, n=6)
    start_cont = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    metrics = behavior_update(config, wm, ac, start, start_cont)
    cont = np.concatenate([to_np(start_cont)[None], to_np(seen["cont"])], 0)  # (H+1, N)
    assert 0 < cont[1:].mean() < 1
    gamma, horizon = 0.9, config.imag_horizon
    weight = np.zeros_like(cont)
    for t in range(horizon + 1):  # weight_t = gamma^t * prod_{i<=t} c_i
        weight[t] = gamma ** t * np.prod(cont[:t + 1], 0)
    np.testing.assert_allclose(to_np(seen["weight"]), weight, rtol=1e-5, atol=1e-7)
    assert seen["weight"].shape == (horizon + 1, 6)
    want = np_lambda_return(to_np(seen["reward"])[1:], cont[1:], to_np(seen["value"]), gamma, 0.8)
    np.testing.assert_allclose(to_np(seen["returns"]), want, rtol=1e-4, atol=1e-5)
    assert int(ac.updates) == 1
    assert all(p.grad is None for p in wm.parameters())  # the world model is not trained here
    assert all(p.requires_grad for p in wm.parameters())  # ... and is unfrozen afterwards
    assert metrics["actor_grad_norm"].item() > 0 and metrics["critic_grad_norm"].item() > 0


@pytest.mark.parametrize("mode", ["dynamics", "reinforce"])
def test_actor_gradient_reaches_the_bootstrap_value(mode):
    """With zero rewards and no entropy bonus, the return is made of critic values only; the actor
    must still learn from it (dynamics: backprop through the values of imagined states)."""
    config, wm, ac = make_actor_critic("--critic.outscale", "1.0", "--actor.entropy", "0.0", "--imag_gradient",
                                       mode, reward_fn=lambda feat, action: (feat.sum(-1) * 0.0, {}))
    perturb(ac.slow_critic, 38)
    metrics = behavior_update(config, wm, ac, start_states(wm, n=6), torch.ones(6))
    assert metrics["actor_grad_norm"].item() > 1e-6


def test_actor_samples_stay_in_the_action_box_with_straight_through_gradient():
    """Actions beyond [-1, 1] would be clipped by the environment but not by the world model's
    imagination; the actor scales them back into the box, keeping the reparameterised gradient."""
    mean = torch.zeros(20000, 3, requires_grad=True)
    dist = distributions.Normal(mean, torch.full((20000, 3), 2.0), absmax=1.0)
    sample = dist.sample()
    assert sample.abs().max() <= 1.0 + 1e-6
    assert (sample.abs() > 0.999).float().mean() > 0.5  # std 2: most samples were outside the box
    sample.sum().backward()
    assert mean.grad.abs().sum() > 0
    unbounded = distributions.Normal(torch.zeros(20000, 3), torch.full((20000, 3), 2.0)).sample()
    assert unbounded.abs().max() > 2.0
