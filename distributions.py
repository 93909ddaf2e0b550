"""The output distributions of the networks' heads and the KL terms between latents.

symlog/symexp and two-hot (`TwoHot`: the reward and critic heads), one-hot with unimix (`OneHot`:
discrete latents and actions), the bounded diagonal Gaussian (`Normal`: continuous actions and
latents), the squared-error heads (`SymlogMSE`, `MSE`: decoders) and the continue flag
(`Bernoulli`). Each has `mode()`, `log_prob()` and, where a head samples, `sample()` and `entropy()`.

The official code (embodied/jax/outs.py) names some differently: `SymlogMSE` is its MSE with
squash=symlog, `Bernoulli` its Binary, `unimix_logits` the mixing inside its Categorical, and
`kl_categorical` / `kl_normal` its Categorical.kl / Normal.kl.
"""

import contextlib
import threading

import torch
import torch.nn.functional as F

# torch.distributions' argument validation, off in every run: it checks each parameter tensor with a
# value read back to the host (a device synchronisation per distribution made: dozens per update on
# CUDA), and any torch.compile switches it off for the whole process, so eager and compiled runs would
# catch a NaN differently. Non-finite values are caught where they matter, alike in both: a loss by
# the update's own check (logs.RunLog.check_losses), an action by the collector (parallel.NonFiniteStep).
VALIDATE = False

# ==================================================================================================
# Noise: where every sample's random numbers come from
# ==================================================================================================

# Each sample draws its noise through `uniform` and `normal`. By default from torch's global
# generator, exactly as torch.rand and Normal.rsample would (a run alone is unchanged). Several seeds
# in one process (seeds.py) give each seed's thread its own generator (`generator`), and the batched
# update replays each seed's noise from a tape drawn up front (seeds.Tape, set by `tape`): inside
# torch.func.vmap no per-seed generator can be called, so the same numbers are drawn before it, in
# the same order.
_local = threading.local()


@contextlib.contextmanager
def _thread_setting(name, value):
    before = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield value
    finally:
        setattr(_local, name, before)


def generator(gen):
    """Draw the noise of this thread's samples from `gen` (a torch.Generator) in the block."""
    return _thread_setting("generator", gen)


def current_generator():
    """This thread's generator (`generator`), or None: torch's global one."""
    return getattr(_local, "generator", None)


def tape(source):
    """Take the noise of this thread's samples from `source` (a seeds.Tape: `source.take(kind,
    shape, device)`, kind 'uniform' or 'normal') in the block."""
    return _thread_setting("tape", source)


def uniform(shape, device):
    """U[0, 1) float32 noise of `shape`: torch.rand, from this thread's generator or tape."""
    source = getattr(_local, "tape", None)
    if source is not None:
        return source.take("uniform", tuple(shape), device)
    return torch.rand(shape, device=device, generator=getattr(_local, "generator", None))


def normal(shape, device):
    """N(0, 1) float32 noise of `shape`, drawn as torch.distributions.Normal.rsample draws it."""
    source = getattr(_local, "tape", None)
    if source is not None:
        return source.take("normal", tuple(shape), device)
    return torch.empty(shape, device=device).normal_(generator=getattr(_local, "generator", None))


def symlog(x):
    return torch.sign(x) * torch.log1p(x.abs())


def symexp(x):
    return torch.sign(x) * torch.expm1(x.abs())


def one_hot(index, classes, dtype, dim=-1):
    """F.one_hot(index, classes) as `dtype`, its classes at the negative `dim`, by comparison:
    F.one_hot checks that every index is in range, which compiled costs a reduction and an
    assertion per call (the indices here are in range by construction)."""
    assert dim < 0, dim
    classes_at_dim = torch.arange(classes, device=index.device).reshape(classes, *[1] * (-dim - 1))
    return (index.unsqueeze(dim) == classes_at_dim).to(dtype)


class TwoHot:
    """Categorical over `bins` two-hot bins (Eq. 9-10 of the paper).

    squash True (the paper's 'symlog_disc'): bins equally spaced in symlog space from -high to
    high; the prediction is symexp(E[bin]) and the loss the cross-entropy against the two-hot
    encoding of symlog(target). squash False (the 2024 recipe's 'symexp_twohot'): the bins
    themselves are symexp-spaced (symexp_bins), prediction E[bin] and target encoded as is.

    mirrored: the logits come in `mirrored_order` (the heads' output layer emits them so): the
    bins below the middle one reversed, so that each lies at the same offset from the start as
    its mirror image from the middle, and the symmetric mean pairs them without flipping a tensor
    (a flip is a gather that Inductor cannot vectorise along the bins).
    """

    def __init__(self, logits, high=20.0, squash=True, mirrored=False):
        logits = logits.float()  # distribution parameters in float32 also under autocast (official code)
        self.logits = logits  # (..., bins), in mirrored_order when mirrored
        self.squash, self.mirrored, self._log_probs = squash, mirrored, None
        if squash:
            bins = torch.linspace(-high, high, logits.shape[-1], device=logits.device)
            bins = (bins - bins.flip(0)) / 2  # exactly antisymmetric, with an exact 0 in the middle
        else:
            bins = symexp_bins(logits.shape[-1], high, logits.device)
        self.bins = bins  # ascending, whatever the logits' order; bins[k] == -bins[-1 - k]

    def mean(self):  # (...)
        # The official code's symmetric sum, so that uniform probabilities predict exactly 0: each
        # bin above the middle paired with its mirror image below it (the bins are antisymmetric;
        # the middle one of an odd count is 0 and adds nothing), summed over the pairs as
        # bin * (p_upper - p_lower). The softmax is divided out once per row: the same expectation
        # with one exponential per bin instead of a log-softmax and its exponential. Its
        # denominator is summed over the same pairs (and the middle bin), so that one compiled loop
        # over the pairs computes both sums from the logits: summed over all bins, the
        # exponentials were stored and read back (a 15.7 MB buffer per head on the imagined
        # states at size1m; 3.2 -> 2.4 ms per head, benchmarks/README, round 28).
        logits, n = self.logits, self.logits.shape[-1]
        shift = logits.amax(-1, keepdim=True).detach()  # cancels
        lower = logits[..., :n // 2] if self.mirrored else logits[..., :n // 2].flip(-1)
        lower, upper = torch.exp(lower - shift), torch.exp(logits[..., (n + 1) // 2:] - shift)
        total = (upper + lower).sum(-1)
        if n % 2:  # the middle bin (0) weighs in the denominator only
            total = total + torch.exp(logits[..., n // 2] - shift[..., 0])
        expected = ((upper - lower) * self.bins[(n + 1) // 2:]).sum(-1) / total
        return symexp(expected) if self.squash else expected

    mode = mean

    def log_prob(self, value):  # value: (...) -> (...)
        return self.log_prob_sum([value])

    def log_prob_sum(self, values):  # [(...), ...] -> (...): the sum of log p(value) over values
        # Each two-hot target's sum with the log-probabilities read at its two bins: the same sum
        # (the other terms are zeros), and the dense target, compiled, saved a mask per bin for the
        # backward pass that its kernels stored one byte at a time (about a tenth of the compiled
        # imagined loss's time at size1m; benchmarks/README, round 25). Every target's bins are
        # read by one gather: its backward pass fills one buffer of the logits' size with zeros
        # and scatters into it, where a gather per bin did so for each (round 27).
        index, weight = [], []
        for value in values:
            value = value.float()
            below, above, weight_below, weight_above = twohot_positions(
                symlog(value) if self.squash else value, self.bins, self.mirrored)
            index += [below, above]
            weight += [weight_below, weight_above]
        picked = self.log_probs.gather(-1, torch.stack(index, -1))
        return (torch.stack(weight, -1) * picked).sum(-1)

    @property
    def log_probs(self):  # (..., bins): computed where a loss needs them, once (the critic's two targets)
        if self._log_probs is None:  # not functools.cached_property: its lock breaks dynamo's graph
            self._log_probs = torch.log_softmax(self.logits, -1)
        return self._log_probs


def mirrored_order(num, device=None):
    """The bins' order in a mirrored TwoHot: position k holds bin order[k] (ascending bins
    numbered 0..num-1): the lower half reversed, then the rest as it is; for 255 bins 126..0,
    127..254, so that bins 126-j and 128+j, mirror images, lie at positions j and 128+j."""
    half = num // 2
    return torch.cat([torch.arange(half - 1, -1, -1, device=device), torch.arange(half, num, device=device)])


def symexp_bins(num, high=20.0, device=None):
    """`num` bins at symexp of points equally spaced in [-high, high], exactly antisymmetric
    (with an exact 0 in the middle when num is odd)."""
    half = symexp(torch.linspace(-high, 0.0, (num + 1) // 2 if num % 2 else num // 2, device=device))
    mirror = -half[:-1].flip(0) if num % 2 else -half.flip(0)
    return torch.cat([half, mirror])


def twohot_positions(x, bins, mirrored=False):
    """The two-hot encoding of values x (...) as the positions of its two bins (below, above),
    int64 (...), and their weights (...), as the official code computes them: the bins nearest
    below and above x, weighted by the distance to the other one; outside the bins all weight on
    the nearest end (below == above, two halves)."""
    num = len(bins)
    # The count of bins at or below x by binary search (the bins ascend): the same positions as
    # counting the comparisons with every bin, which compiled took five times as long
    # (benchmarks/README, round 27). Flat and contiguous, so that it never copies its input and warns,
    # also where a compiled graph lays the values out strided (reshape) or a 1-D view is (contiguous).
    at_or_below = torch.bucketize(x.reshape(-1).contiguous(), bins, right=True).reshape(x.shape)
    below = (at_or_below - 1).clamp(0, num - 1)
    above = at_or_below.clamp(0, num - 1)
    equal = below == above
    dist_below = torch.where(equal, 1.0, (bins[below] - x).abs())
    dist_above = torch.where(equal, 1.0, (bins[above] - x).abs())
    total = dist_below + dist_above
    if mirrored:  # the positions of bins below and above: the lower half's are reversed
        half = num // 2
        below = torch.where(below < half, half - 1 - below, below)
        above = torch.where(above < half, half - 1 - above, above)
    return below, above, dist_above / total, dist_below / total


class SymlogMSE:
    """Regression in symlog space: the network predicts symlog(x)."""

    def __init__(self, pred, dims=1):
        self.pred = pred.float()
        self.dims = tuple(range(-dims, 0))

    def mode(self):
        return symexp(self.pred)

    mean = mode

    def log_prob(self, value):
        error = (self.pred - symlog(value)) ** 2
        return -error.sum(self.dims) if self.dims else -error

    def log_prob_sum(self, values):  # the sum of log p(value) over values
        return sum(self.log_prob(value) for value in values)


class MSE:
    """Plain squared error, summed over the event dims (used for images in [0, 1])."""

    def __init__(self, pred, dims=1):
        self.pred = pred.float()
        self.dims = tuple(range(-dims, 0))

    def mode(self):
        return self.pred

    mean = mode

    def log_prob(self, value):
        error = (self.pred - value) ** 2
        return -error.sum(self.dims) if self.dims else -error

    def log_prob_sum(self, values):  # the sum of log p(value) over values
        return sum(self.log_prob(value) for value in values)


class Bernoulli:
    """Continue flag: one logit per step, event shape (1,)."""

    def __init__(self, logits):
        self.logits = logits.float()  # (..., 1)

    def mode(self):
        return (self.logits > 0).float()

    def mean(self):
        return torch.sigmoid(self.logits)

    def log_prob(self, value):
        return -F.binary_cross_entropy_with_logits(self.logits, value, reduction="none").sum(-1)


def unimix_logits(logits, unimix, dim=-1):
    """Mix `unimix` of the uniform distribution into a softmax over `dim` and return its logits."""
    if unimix <= 0:
        return logits
    return torch.log(unimix_probs(logits, unimix, dim))


def unimix_probs(logits, unimix, dim=-1):
    """The softmax over `dim` with `unimix` of the uniform distribution mixed in."""
    return (1 - unimix) * torch.softmax(logits, dim) + unimix / logits.shape[dim]


class OneHot:
    """Categorical over the classes at `dim` (negative; the last by default) with one-hot samples
    and straight-through gradients. The RSSM samples its latents with the classes at -2, before
    the categoricals (networks.RSSM._stats says why)."""

    def __init__(self, logits, unimix=0.0, dim=-1):
        assert dim < 0, dim
        self.dim = dim
        self.logits = unimix_logits(logits.float(), unimix, dim)  # (..., classes, ...)
        self.log_probs = torch.log_softmax(self.logits, dim)
        self.probs = self.log_probs.exp()

    @classmethod
    def from_probs(cls, probs, dim=-1):
        """The categorical of normalised `probs` (..., classes, ...), its logits their log. Sampling
        reads the probabilities as given: the RSSM draws every latent from its unimix
        probabilities so, without their log, log-softmax and exponential on the way (which a
        compiled rollout then never computes; benchmarks/README, round 28)."""
        assert dim < 0, dim
        dist = cls.__new__(cls)
        dist.dim, dist.probs = dim, probs.float()
        dist.logits = dist.log_probs = torch.log(dist.probs)
        return dist

    def mode(self):
        onehot = one_hot(self.logits.argmax(self.dim), self.logits.shape[self.dim], self.probs.dtype, self.dim)
        return onehot + (self.probs - self.probs.detach())  # exactly one-hot in value

    def sample(self):
        # Inverse-CDF sampling: one uniform per categorical, much faster than torch.multinomial.
        classes = self.logits.shape[self.dim]
        cdf = self.probs.detach().float().cumsum(self.dim)
        # Drawn with the classes last, so that every categorical gets the same number in any layout.
        noise = uniform((*cdf.movedim(self.dim, -1).shape[:-1], 1), cdf.device).movedim(-1, self.dim)
        index = (cdf < noise * cdf.narrow(self.dim, classes - 1, 1)).sum(self.dim).clamp(max=classes - 1)
        onehot = one_hot(index, classes, self.probs.dtype, self.dim)
        return onehot + (self.probs - self.probs.detach())  # exactly one-hot in value

    def log_prob(self, onehot):
        return (onehot * self.log_probs).sum(self.dim)

    def entropy(self):
        return -(self.probs * self.log_probs).sum(self.dim)


class Normal:
    """Diagonal Gaussian over the last dim (continuous actions, continuous latents).

    With `absmax`, samples are scaled back into [-absmax, absmax] with a straight-through
    gradient, so that the actions the world model imagines are the ones the environment executes.
    """

    def __init__(self, mean, std, absmax=None):
        mean, std = mean.float(), std.float()
        self.dist = torch.distributions.Normal(mean, std, validate_args=VALIDATE)  # see VALIDATE
        self.mean_ = mean
        self.absmax = absmax

    def mode(self):
        return self.mean_

    def sample(self):
        mean, std = self.dist.loc, self.dist.scale  # rsample's loc + eps * scale, with this thread's eps
        sample = mean + normal(mean.shape, mean.device) * std
        if self.absmax is not None:
            sample = sample * (self.absmax / sample.abs().clamp(min=self.absmax)).detach()
        return sample

    def log_prob(self, value):
        return self.dist.log_prob(value).sum(-1)

    def entropy(self):
        return self.dist.entropy().sum(-1)


class Uniform:
    """Uniform over the box [low, high] (the random exploration's actions)."""

    def __init__(self, low, high):
        self.low, self.high = low, high
        self.dist = torch.distributions.Independent(torch.distributions.Uniform(low, high, validate_args=VALIDATE), 1,
                                                    validate_args=VALIDATE)  # see VALIDATE

    def sample(self):  # torch.distributions.Uniform.rsample, with this thread's noise
        return self.low + uniform(self.low.shape, self.low.device) * (self.high - self.low)

    def log_prob(self, value):
        return self.dist.log_prob(value)

    def entropy(self):
        return self.dist.entropy()


def kl_categorical(lhs_logits, rhs_logits):
    """KL[lhs || rhs] for independent categoricals (..., stoch, classes) -> (...)."""
    lhs_log = torch.log_softmax(lhs_logits, -1)
    rhs_log = torch.log_softmax(rhs_logits, -1)
    return (lhs_log.exp() * (lhs_log - rhs_log)).sum(-1).sum(-1)


def kl_normal(lhs_mean, lhs_std, rhs_mean, rhs_std):
    """KL[lhs || rhs] for diagonal Gaussians (..., stoch) -> (...)."""
    var_ratio = (lhs_std / rhs_std) ** 2
    term = ((lhs_mean - rhs_mean) / rhs_std) ** 2
    return 0.5 * (var_ratio + term - 1 - torch.log(var_ratio)).sum(-1)
