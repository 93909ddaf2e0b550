"""Neural network modules: RSSM, encoders, decoders, MLP heads and the actor."""

import math
import threading
import typing

import numpy as np
import torch
from torch import nn

import distributions
import tools

ACTIVATIONS = {"SiLU": nn.SiLU, "ELU": nn.ELU, "ReLU": nn.ReLU, "Tanh": nn.Tanh, "GELU": nn.GELU}


layout = threading.local()  # `vmapped` True on a thread inside torch.func.vmap (set by seeds.vmapped)


def image_layout():
    """The memory format of conv activations: channels_last, which oneDNN and cuDNN run fastest,
    except inside torch.func.vmap (seeds.py's batched update), which cannot query it."""
    return torch.contiguous_format if getattr(layout, "vmapped", False) else torch.channels_last


def init_(module, scale=1.0, fan="avg"):
    """Truncated-normal initialisation of every linear/conv weight; biases start at zero.

    fan 'avg' (the paper's): std = sqrt(scale / fan_avg). fan 'in' (the 2024 recipe): std =
    scale / sqrt(fan_in), so that an output scale of 0.01 shrinks the layer a hundredfold.
    Scale 0 gives a zero layer, which the reward and critic heads use so that their first
    predictions are exactly zero. The scale is kept on the layer, so that `reinit` can redraw it
    under the other rule.
    """
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.ConvTranspose2d, BlockLinear)):
            m.init_scale = scale
            if m.bias is not None:
                nn.init.zeros_(m.bias)
            if scale == 0:
                nn.init.zeros_(m.weight)
                continue
            fan_in, fan_out = fan_sizes(m)
            if fan == "avg":
                std = math.sqrt(scale / ((fan_in + fan_out) / 2))
            else:
                std = scale / math.sqrt(fan_in)
            std /= 0.87962566103423978  # the std of a unit normal truncated to [-2, 2]
            nn.init.trunc_normal_(m.weight, 0.0, std, -2 * std, 2 * std)
    return module


def fan_sizes(layer):
    """(fan_in, fan_out) of a layer's weight as the layer sees them."""
    if isinstance(layer, BlockLinear):  # counted over all blocks, as for the dense layer it replaces
        return layer.in_features, layer.out_features
    fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(layer.weight)
    if isinstance(layer, nn.ConvTranspose2d):
        fan_in, fan_out = fan_out, fan_in
    return fan_in, fan_out


WINITS = ("fan_avg", "fan_in")


def reinit(module, winit):
    """Redraw every layer `init_` has seen under the initialisation rule `winit`, each with the
    scale it was built with. 'fan_avg' is what construction already did, so it leaves the
    weights (and the random stream) untouched."""
    if winit == "fan_avg":
        return module
    for m in module.modules():
        if hasattr(m, "init_scale"):
            init_(m, m.init_scale, fan="in")
    return module


NORMS = ("layer", "rms", "none")


class RMSNorm(nn.Module):
    """Scale-only RMS normalisation of the last dim (the 2024 recipe): x / sqrt(mean(x^2) + eps) * scale."""

    def __init__(self, size, eps=1e-4):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()  # the mean of squares in full precision, also under autocast
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose mean and variance are computed in float32 also under autocast (as the
    official code normalises), the output cast back to the input's dtype."""

    def forward(self, x):
        dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):
            x = nn.functional.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.to(dtype)


def make_norm(norm, size):
    """The normalisation layer of `norm` over the last dim, or None. LayerNorm keeps the paper's
    eps 1e-3 and RMSNorm the 2024 recipe's 1e-4."""
    kind = norm
    if kind == "layer":
        return LayerNorm(size, eps=1e-3)
    if kind == "rms":
        return RMSNorm(size)
    return None


# -- The dense layers' product on the CPU ------------------------------------------------------------
# torch's CPU wheels multiply float32 matrices with MKL, which runs the tall products of this update
# (16,384 imagined states x 640 features -> 64 units) at about two thirds of the speed of oneDNN's
# matmul on AMD CPUs (benchmarks/gemm_widths.py). Inductor calls oneDNN's matmul only for frozen
# inference weights, so Linear calls it as an operator of its own, which compiled graphs call as is;
# on few rows (the policy's and the filter's steps) MKL is faster, and those stay with torch.
ONEDNN_MIN_ROWS = 1024
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")  # x86 wheels


@torch.library.custom_op("dreamer::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: typing.Optional[torch.Tensor]) -> torch.Tensor:
    """nn.functional.linear computed by oneDNN's matmul (CPU, float32)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _onednn_linear_shape(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _onednn_linear_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _onednn_linear_backward(ctx, grad):  # the gradients of x @ weight.T + bias, by torch's products
    x, weight = ctx.saved_tensors
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = rows.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_bias = rows.sum(0) if ctx.needs_input_grad[2] else None
    return grad_x, grad_weight, grad_bias


onednn_linear.register_autograd(_onednn_linear_backward, setup_context=_onednn_linear_context)


def lower_onednn_linear():
    """Have Inductor's compiled code call oneDNN's matmul itself where a graph calls onednn_linear.
    As the custom operator, each call passed through two Python functions (its autograd and its
    CPU kernel) on the way, about 14 µs each of ~200 calls per update at size1m (benchmarks/README,
    round 28); the backward pass is traced into torch's products either way. Idempotent; it
    replaces the plain fallback that Inductor registers for the operator where a graph that calls
    it compiled before."""
    from torch._inductor import lowering

    op = torch.ops.dreamer.onednn_linear.default
    if not ONEDNN or getattr(lowering.lowerings.get(op), "calls_onednn", False):
        return
    matmul = lowering.fallback_handler(torch.ops.mkldnn._linear_pointwise.default, add_to_fallback_set=False)

    def lowered(x, weight, bias):
        return matmul(x, weight, bias, "none", [], "")

    lowered.calls_onednn = True  # register_lowering's wrapper keeps the attribute (functools.wraps)
    lowering.register_lowering(op, type_promotion_kind=None)(lowered)


def linear(x, weight, bias=None):
    """nn.functional.linear, its product in oneDNN for float32 CPU inputs of ONEDNN_MIN_ROWS rows
    or more (not inside torch.func.vmap, for which the operator has no rule)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and rows >= ONEDNN_MIN_ROWS
            and ONEDNN and not getattr(layout, "vmapped", False)):
        return onednn_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (the same parameters, initialisation and checkpoint keys) whose product is `linear`'s."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


def has_bias(norm):
    """A layer followed by LayerNorm needs no bias (the norm removes the mean); RMSNorm keeps it."""
    return norm != "layer"


def dense(inp, out, act, norm):
    """Linear -> norm -> activation, the block every MLP here is made of."""
    layers = [Linear(inp, out, bias=has_bias(norm))]
    norm_layer = make_norm(norm, out)
    if norm_layer is not None:
        layers.append(norm_layer)
    layers.append(ACTIVATIONS[act]())
    return layers


class MLP(nn.Module):
    """Stack of `layers` dense blocks; optionally applies symlog to its inputs."""

    def __init__(self, inp, layers, units, act="SiLU", norm="layer", symlog_inputs=False):
        super().__init__()
        blocks = []
        for i in range(layers):
            blocks += dense(inp if i == 0 else units, units, act, norm)
        self.net = init_(nn.Sequential(*blocks))
        self.symlog_inputs = symlog_inputs
        self.outdim = units if layers else inp

    def forward(self, x):
        if self.symlog_inputs:
            x = distributions.symlog(x)
        return self.net(x)


class SplitLinear(nn.Module):
    """Dense layers side by side on one input, their outputs concatenated: a layer whose output parts
    are separate parameters, as in the official code, where the actor's mean and std and each vector
    key of the decoder have a layer of their own. It matters for adaptive gradient clipping, which
    scales each parameter by its own norm: one merged matrix would share one factor."""

    def __init__(self, inp, sizes):
        super().__init__()
        self.sizes = [int(n) for n in sizes]
        self.parts = nn.ModuleList(Linear(inp, n) for n in self.sizes)
        self.in_features, self.out_features = inp, sum(self.sizes)

    @property
    def weight(self):  # (out, in), the parts stacked: to read, not a parameter
        return torch.cat([part.weight for part in self.parts], 0)

    def forward(self, x):  # (..., inp) -> (..., sum(sizes))
        return torch.cat([part(x) for part in self.parts], -1)


class TwoHotLinear(Linear):
    """The two-hot heads' output layer: an nn.Linear (the same parameters, in the bins' ascending
    order, initialisation and checkpoint keys) whose outputs come in the bins'
    `distributions.mirrored_order` (the weight's rows read in that order), which the head's
    TwoHot reads without a flip. Its product runs on the weight padded with zero rows to a
    multiple of 16 outputs, the padding sliced off again: the heads have the paper's 255 bins,
    and CPU GEMMs run 255 outputs at about half the speed of 256 (benchmarks/README, "Two-hot
    output width"). A zero row adds nothing to the other outputs: they equal the unpadded
    layer's up to the GEMM's rounding (bitwise on batches here)."""

    MULTIPLE = 16

    def __init__(self, inp, bins):
        super().__init__(inp, bins)
        self.register_buffer("order", distributions.mirrored_order(bins), persistent=False)

    def forward(self, x):
        pad = -self.out_features % self.MULTIPLE
        weight = nn.functional.pad(self.weight[self.order], (0, 0, 0, pad))
        bias = nn.functional.pad(self.bias[self.order], (0, pad))
        return linear(x, weight, bias)[..., :self.out_features]


class Head(nn.Module):
    """MLP followed by an output layer that parameterises a distribution.

    dist: 'symlog_disc' (255-bin two-hot in symlog space), 'symexp_twohot' (255 symexp-spaced
    bins, the 2024 recipe), 'symlog_mse', 'mse' or 'binary'.
    """

    DISTS = ("symlog_disc", "symexp_twohot", "symlog_mse", "mse", "binary")
    VALUE_DISTS = DISTS[:3]  # of the reward and critic heads (config's reward_head.dist and critic.dist)

    def __init__(self, inp, shape, layers, units, act, norm, dist, outscale=1.0, bins=255):
        super().__init__()
        self.shape = tuple(shape)
        self.kind = dist
        self.mlp = MLP(inp, layers, units, act, norm)
        if dist in ("symlog_disc", "symexp_twohot"):
            self.out = init_(TwoHotLinear(self.mlp.outdim, bins), outscale)
        else:
            self.out = init_(Linear(self.mlp.outdim, int(np.prod(self.shape))), outscale)

    def raw(self, x):  # (..., inp) -> (..., out): the distribution's parameters
        return self.out(self.mlp(x))

    def forward(self, x):
        return self.dist(self.raw(x))

    def dist(self, x):
        if self.kind in ("symlog_disc", "symexp_twohot"):
            return distributions.TwoHot(x, squash=self.kind == "symlog_disc", mirrored=True)  # TwoHotLinear's order
        x = x.reshape(*x.shape[:-1], *self.shape)
        if self.kind == "binary":
            return distributions.Bernoulli(x)
        cls = distributions.SymlogMSE if self.kind == "symlog_mse" else distributions.MSE
        return cls(x, dims=len(self.shape))


class Actor(nn.Module):
    """Policy head. 'normal': tanh mean and std bounded in [min_std, max_std] (learned) or a fixed
    std, samples scaled back into [-absmax, absmax] (v1) or, with absmax 0, left unbounded for the
    environment to clip (2024); 'onehot': categorical with `unimix` uniform mixture and
    straight-through samples."""

    def __init__(self, inp, actions, config, units, act, norm):  # config: the actor group
        super().__init__()
        self.kind = config.dist
        if self.kind not in ACTOR_DISTS:  # 'auto' is settled before any network is built (compilation.resolve_auto)
            raise ValueError(f"actor.dist '{self.kind}' has no distribution; valid: {', '.join(ACTOR_DISTS)}")
        self.mlp = MLP(inp, config.layers, units, act, norm)
        learned = self.kind == "normal" and config.std == "learned"
        # mean and std are separate layers (each clipped by its own norm), one layer otherwise
        self.out = init_(SplitLinear(self.mlp.outdim, [actions] * (2 if learned else 1)), config.outscale)
        self.learned_std = learned
        self.std, self.min_std, self.max_std = config.std, config.min_std, config.max_std
        self.absmax = config.absmax or None  # 0: samples stay unbounded and the environment clips them
        self.unimix = config.unimix_ratio

    def raw(self, feat):  # (..., F) -> (..., D): the parameters of the distribution, unconstrained
        return self.out(self.mlp(feat))

    def dist(self, x):
        if self.kind == "onehot":
            return distributions.OneHot(x, self.unimix)
        assert self.kind == "normal", self.kind  # the only other kind (ACTOR_DISTS, checked at construction)
        if self.learned_std:
            mean, std = x.chunk(2, -1)
            std = (self.max_std - self.min_std) * torch.sigmoid(std + 2.0) + self.min_std
        else:
            mean, std = x, torch.full_like(x, float(self.std))
        return distributions.Normal(torch.tanh(mean), std, absmax=self.absmax)

    def forward(self, feat):
        return self.dist(self.raw(feat))


class ChannelNorm(LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ChannelRMSNorm(RMSNorm):
    """RMSNorm over the channels of an NCHW tensor."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def channel_norm(norm, channels):
    """The normalisation layer of `norm` over the channels of an NCHW tensor, or None."""
    kind = norm
    if kind == "layer":
        return ChannelNorm(channels, eps=1e-3)
    if kind == "rms":
        return ChannelRMSNorm(channels)
    return None


def conv_stages(size, minres):
    stages = int(np.log2(size) - np.log2(minres))
    if 2 ** stages * minres != size:
        raise tools.ConfigError(f"Image size {size} must be minres ({minres}) times a power of two")
    return stages


def conv_stage(conv, norm, act, pool=None):
    """One encoder stage: the convolution, the optional pooling, the channel norm and the activation."""
    norm_layer = channel_norm(norm, conv.out_channels)
    return [conv, *([pool] if pool is not None else []), *([norm_layer] if norm_layer is not None else []),
            ACTIVATIONS[act]()]


class ConvEncoder(nn.Module):
    """Strided convolutions halving the resolution down to `minres`, depth doubling each stage."""

    def __init__(self, shape, depth, kernel_size, minres, act, norm):
        super().__init__()
        height, width, channels = shape
        layers, inp = [], channels
        for i in range(conv_stages(height, minres)):
            out = depth * 2 ** i
            conv = nn.Conv2d(inp, out, kernel_size, 2, padding=(kernel_size - 1) // 2, bias=has_bias(norm))
            layers += conv_stage(conv, norm, act)
            inp = out
        self.net = init_(nn.Sequential(*layers))
        self.outdim = inp * minres * (width // (height // minres))

    def forward(self, image):  # (B, H, W, C) in [0, 1] -> (B, outdim)
        # Centred on zero, as v1's ImageEncoderResnet feeds its first convolution.
        x = (image - 0.5).permute(0, 3, 1, 2).contiguous(memory_format=image_layout())
        return self.net(x).flatten(1)


class ConvDecoder(nn.Module):
    """Mirror of ConvEncoder: a linear layer to (depth_max, minres, minres), then transposed convs."""

    def __init__(self, inp, shape, depth, kernel_size, minres, act, norm, outscale, sigmoid):
        super().__init__()
        height, width, channels = shape
        stages = conv_stages(height, minres)
        self.minres, self.shape, self.sigmoid = minres, tuple(shape), sigmoid
        self.start = depth * 2 ** (stages - 1)
        self.linear = init_(Linear(inp, minres * minres * self.start))
        layers, ch = [], self.start
        for i in range(stages):
            last = i == stages - 1
            out = channels if last else ch // 2
            conv = nn.ConvTranspose2d(ch, out, kernel_size, 2, padding=(kernel_size - 1) // 2,
                                      output_padding=kernel_size % 2, bias=last or has_bias(norm))
            layers.append(init_(conv, outscale if last else 1.0))
            if not last:
                if channel_norm(norm, out) is not None:
                    layers.append(channel_norm(norm, out))
                layers.append(ACTIVATIONS[act]())
            ch = out
        self.net = nn.Sequential(*layers)

    def forward(self, feat):  # (..., inp) -> (..., H, W, C)
        lead = feat.shape[:-1]
        x = self.linear(feat.reshape(-1, feat.shape[-1]))
        x = x.reshape(-1, self.start, self.minres, self.minres).contiguous(memory_format=image_layout())
        x = self.net(x).permute(0, 2, 3, 1)
        x = torch.sigmoid(x) if self.sigmoid else x + 0.5
        return x.reshape(*lead, *self.shape)


def pooled_depths(depth, stages):
    """Channels of the 2024 recipe's conv stages: depth x [2, 3, 4, 4], then 4 for any further stage."""
    return [depth * (2, 3, 4)[min(i, 2)] for i in range(stages)]


class PooledConvEncoder(nn.Module):
    """The 2024 recipe's image encoder: per stage a stride-1 convolution, 2x2 max-pooling, norm and
    activation, channels depth x [2, 3, 4, 4], down to `minres`; inputs shifted to [-0.5, 0.5]."""

    def __init__(self, shape, depth, kernel_size, minres, act, norm):
        super().__init__()
        height, width, channels = shape
        layers, inp = [], channels
        for out in pooled_depths(depth, conv_stages(height, minres)):
            conv = nn.Conv2d(inp, out, kernel_size, 1, padding="same", bias=has_bias(norm))
            layers += conv_stage(conv, norm, act, nn.MaxPool2d(2))
            inp = out
        self.net = init_(nn.Sequential(*layers))
        self.outdim = inp * minres * (width // (height // minres))

    def forward(self, image):  # (B, H, W, C) in [0, 1] -> (B, outdim)
        x = image.permute(0, 3, 1, 2).contiguous(memory_format=image_layout()) - 0.5
        return self.net(x).flatten(1)


class UpsampleConvDecoder(nn.Module):
    """The 2024 recipe's image decoder. A spatial seed (minres, minres, C) is the sum of a
    block-linear map of deter (8 blocks, each filling C/8 channels) and a two-layer map of the
    stochastic state; then per stage nearest-neighbour 2x upsampling, a stride-1 convolution,
    norm and activation, channels depth x [4, 3, 2] towards the image (the recipe's sigmoid
    output is decoder.cnn_sigmoid)."""

    def __init__(self, stoch_size, deter_size, shape, depth, kernel_size, minres, act, norm, outscale, units,
                 sigmoid=True, blocks=8):
        super().__init__()
        self.sigmoid = sigmoid
        height, width, channels = shape
        stages = conv_stages(height, minres)
        depths = pooled_depths(depth, stages)
        self.shape, self.blocks, self.deter_size = tuple(shape), blocks, deter_size
        self.seed_shape = (minres, width // (height // minres), depths[-1])  # (h, w, C)
        size = int(np.prod(self.seed_shape))
        self.from_deter = BlockLinear(deter_size, size, blocks)
        self.from_stoch = init_(nn.Sequential(*dense(stoch_size, 2 * units, act, norm), Linear(2 * units, size)))
        self.seed_norm = channel_norm(norm, depths[-1]) or nn.Identity()
        self.seed_act = ACTIVATIONS[act]()
        layers, inp = [], depths[-1]
        outs = [*depths[:-1][::-1], channels]
        for i, out in enumerate(outs):
            last = i == len(outs) - 1
            layers.append(nn.Upsample(scale_factor=2, mode="nearest"))
            conv = nn.Conv2d(inp, out, kernel_size, 1, padding="same", bias=last or has_bias(norm))
            layers.append(init_(conv, outscale if last else 1.0))
            if not last:
                if channel_norm(norm, out) is not None:
                    layers.append(channel_norm(norm, out))
                layers.append(ACTIVATIONS[act]())
            inp = out
        self.net = nn.Sequential(*layers)

    def forward(self, feat):  # (..., stoch + deter) -> (..., H, W, C) in (0, 1)
        lead = feat.shape[:-1]
        feat = feat.reshape(-1, feat.shape[-1])
        stoch, deter = feat[:, :-self.deter_size], feat[:, -self.deter_size:]
        h, w, c = self.seed_shape
        # Block k of the block-linear output is an (h, w, C / blocks) slab: channels block-major.
        x0 = self.from_deter(deter).reshape(-1, self.blocks, h, w, c // self.blocks).permute(0, 2, 3, 1, 4)
        x = x0.reshape(-1, h, w, c) + self.from_stoch(stoch).reshape(-1, h, w, c)
        x = x.permute(0, 3, 1, 2).contiguous(memory_format=image_layout())  # (N, C, h, w)
        x = self.seed_act(self.seed_norm(x))
        x = self.net(x).permute(0, 2, 3, 1)
        x = torch.sigmoid(x) if self.sigmoid else x + 0.5
        return x.reshape(*lead, *self.shape)


class MultiEncoder(nn.Module):
    """Encodes image keys with one CNN (channels concatenated) and vector keys with one MLP."""

    def __init__(self, obs_space, config):
        super().__init__()
        self.cnn_shapes, self.mlp_shapes = tools.select_keys(obs_space, config.cnn_keys, config.mlp_keys)
        if not self.cnn_shapes and not self.mlp_shapes:
            keys = ", ".join(k for k in obs_space if k not in ("is_first", "is_last", "is_terminal"))
            raise tools.ConfigError(f"encoder.cnn_keys '{config.cnn_keys}' and encoder.mlp_keys '{config.mlp_keys}' "
                             f"match no observation; available keys: {keys}")
        self.outdim = 0
        if self.cnn_shapes:
            height, width = next(iter(self.cnn_shapes.values()))[:2]
            channels = sum(s[-1] for s in self.cnn_shapes.values())
            self.cnn = IMAGE_ENCODERS[config.cnn]((height, width, channels), config.cnn_depth, config.kernel_size,
                                                  config.minres, config.act, config.norm)
            self.outdim += self.cnn.outdim
        if self.mlp_shapes:
            size = sum(int(np.prod(s)) for s in self.mlp_shapes.values())
            self.mlp = MLP(size, config.mlp_layers, config.mlp_units, config.act, config.norm, config.symlog_inputs)
            self.outdim += self.mlp.outdim

    def forward(self, obs):  # obs: dict of (B, ...) -> (B, outdim)
        outs = []
        if self.cnn_shapes:
            outs.append(self.cnn(torch.cat([obs[k] for k in self.cnn_shapes], -1)))
        if self.mlp_shapes:
            lead = next(iter(obs.values())).shape[:1]
            outs.append(self.mlp(torch.cat([obs[k].reshape(*lead, -1) for k in self.mlp_shapes], -1)))
        return torch.cat(outs, -1)


class MultiDecoder(nn.Module):
    """Reconstructs the observation keys matching its own cnn_keys / mlp_keys from the latent
    feature; returns one distribution per key."""

    def __init__(self, feat_size, obs_space, config, deter_size=None):
        super().__init__()
        self.cnn_shapes, self.mlp_shapes = tools.select_keys(obs_space, config.cnn_keys, config.mlp_keys)
        if self.cnn_shapes:
            height, width = next(iter(self.cnn_shapes.values()))[:2]
            channels = sum(s[-1] for s in self.cnn_shapes.values())
            if config.cnn == "transposed":
                self.cnn = ConvDecoder(feat_size, (height, width, channels), config.cnn_depth, config.kernel_size,
                                       config.minres, config.act, config.norm, config.outscale, config.cnn_sigmoid)
            else:  # upsample: needs deter apart from the stochastic state, feat is [stoch, deter]
                self.cnn = UpsampleConvDecoder(feat_size - deter_size, deter_size, (height, width, channels),
                                               config.cnn_depth, config.kernel_size, config.minres, config.act,
                                               config.norm, config.outscale, config.mlp_units, config.cnn_sigmoid)
        if self.mlp_shapes:  # one MLP for all vector keys, then an output layer per key
            self.sizes = [int(np.prod(s)) for s in self.mlp_shapes.values()]
            self.mlp = MLP(feat_size, config.mlp_layers, config.mlp_units, config.act, config.norm)
            self.mlp_out = init_(SplitLinear(self.mlp.outdim, self.sizes), config.outscale)  # a layer per key
            self.vector_dist = VECTOR_DISTS[config.vector_dist]

    @property
    def keys(self):
        """The decoded observation keys, in the order of forward's output."""
        return [*self.cnn_shapes, *self.mlp_shapes]

    def forward(self, feat):  # (B, T, F) -> {key: dist over (B, T, ...)}
        dists = {}
        if self.cnn_shapes:
            image = self.cnn(feat)
            splits = [s[-1] for s in self.cnn_shapes.values()]
            for key, part in zip(self.cnn_shapes, image.split(splits, -1)):
                dists[key] = distributions.MSE(part, dims=3)
        if self.mlp_shapes:
            out = self.mlp_out(self.mlp(feat))
            for (key, shape), part in zip(self.mlp_shapes.items(), out.split(self.sizes, -1)):
                dists[key] = self.vector_dist(part.reshape(*feat.shape[:-1], *shape), dims=len(shape))
        return dists


def tanh(x):
    """tanh through one exponential, 1 - 2 / (exp(2x) + 1), within 2e-7 of torch.tanh: the GRU
    cells' candidate runs on every recurrent step, and a compiled CPU kernel computes torch.tanh
    (Sleef's, to 1 ulp) at several times the cost of an exponential (benchmarks/elementwise.py).
    x is clamped to [-10, 10] first, where float32 tanh is +-1 already, so that exp cannot
    overflow into a NaN gradient."""
    return 1 - 2 / (torch.exp(2 * x.clamp(-10.0, 10.0)) + 1)


class GRUCell(nn.Module):
    """GRU with LayerNorm on the gates and the update gate biased towards keeping the state."""

    def __init__(self, inp, size, norm="layer"):
        super().__init__()
        self.linear = Linear(inp + size, 3 * size, bias=has_bias(norm))
        self.norm = make_norm(norm, 3 * size) or nn.Identity()
        init_(self)

    def forward(self, x, h):
        parts = self.norm(self.linear(torch.cat([x, h], -1)))
        reset, cand, update = parts.chunk(3, -1)
        reset = torch.sigmoid(reset)
        cand = tanh(reset * cand)
        update = torch.sigmoid(update - 1)
        return update * cand + (1 - update) * h


class BlockLinear(nn.Module):
    """Block-diagonal linear layer: input and output split into `blocks` equal groups, output group
    i computed from input group i only, with blocks times fewer weights than a dense layer."""

    def __init__(self, inp, out, blocks, bias=True):
        super().__init__()
        if inp % blocks or out % blocks:
            raise tools.ConfigError(f"BlockLinear sizes {inp} -> {out} must be divisible by blocks ({blocks})")
        self.in_features, self.out_features, self.blocks = inp, out, blocks
        self.weight = nn.Parameter(torch.empty(blocks, inp // blocks, out // blocks))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None
        init_(self)

    def forward(self, x):  # (..., inp) -> (..., out)
        x = x.reshape(*x.shape[:-1], self.blocks, self.in_features // self.blocks)
        x = torch.einsum("...gi,gio->...go", x, self.weight).flatten(-2)
        return x if self.bias is None else x + self.bias


# From this many rows on (the imagination's 1,024 starts) the CPU computes the block GRU's gates block by
# block, each block's product followed by its update: one product of all eight blocks writes a 6.3 MB
# output that MKL zeroes first and the update reads back from memory, where a block's 0.8 MB stay in the
# cache (an imagined step's gates and update compiled: 4.2-4.5 -> 3.7-3.9 ms, benchmarks/README, round 26).
# Fewer rows (the filter's and the policy's steps) pay more for eight calls than they save.
BLOCKWISE_MIN_ROWS = 1024


class BlockGRUCell(nn.Module):
    """The 2024 recipe's recurrent cell: a GRU whose `deter` state is split into `blocks` groups,
    each updated by block-diagonal layers from its own part of the state and from a shared
    embedding of the previous state, latent and action (separate input layers for each).

    Takes x = [stoch_flat, action] and h = deter, like GRUCell after the RSSM's img_in. Actions
    are scaled by 1 / max(1, |a|), so that unbounded actions cannot blow up the state.
    """

    def __init__(self, stoch_size, action_size, hidden, deter, blocks, act, norm):
        super().__init__()
        self.sizes, self.blocks, self.deter = (stoch_size, action_size), blocks, deter
        self.deter_in = init_(nn.Sequential(*dense(deter, hidden, act, norm)))
        self.stoch_in = init_(nn.Sequential(*dense(stoch_size, hidden, act, norm)))
        self.action_in = init_(nn.Sequential(*dense(action_size, hidden, act, norm)))
        self.hidden = BlockLinear(deter + blocks * 3 * hidden, deter, blocks, bias=has_bias(norm))
        self.hidden_norm = make_norm(norm, deter) or nn.Identity()
        self.hidden_act = ACTIVATIONS[act]()
        self.gates = BlockLinear(deter, 3 * deter, blocks)

    def forward(self, x, h):  # x (B, stoch_flat + A), h (B, deter) -> (B, deter)
        stoch, action = x.split(self.sizes, -1)
        action = action / action.abs().clamp(min=1.0).detach()
        embed = torch.cat([self.deter_in(h), self.stoch_in(stoch), self.action_in(action)], -1)  # (B, 3 hidden)
        x = self.hidden_act(self.hidden_norm(self.block_input(h, embed)))
        if h.device.type == "cpu" and h.numel() // self.deter >= BLOCKWISE_MIN_ROWS:
            # Block by block, each block's gates used while they are in the cache (see BLOCKWISE_MIN_ROWS).
            size, layer = self.deter // self.blocks, self.gates
            blocks = zip(x.split(size, -1), h.split(size, -1), layer.weight, layer.bias.chunk(self.blocks))
            return torch.cat([self.update(xk @ weight + bias, hk) for xk, hk, weight, bias in blocks], -1)
        gates = self.gates(x).reshape(*h.shape[:-1], self.blocks, 3 * self.deter // self.blocks)
        return self.update(gates, h.reshape(*h.shape[:-1], self.blocks, -1)).flatten(-2)

    @staticmethod
    def update(gates, h):  # gates (..., 3 n), h (..., n) of one block or of every block -> the new h (..., n)
        reset, cand, update = gates.chunk(3, -1)
        cand = tanh(torch.sigmoid(reset) * cand)
        update = torch.sigmoid(update - 1)
        return update * cand + (1 - update) * h

    def block_input(self, h, embed):  # h (B, deter), embed (B, 3 hidden) -> (B, deter)
        """The hidden BlockLinear applied to each block's own part of h concatenated with the
        shared embedding, as the official code builds it (the embedding repeated for every block),
        computed without the repeat: the embedding's part of every block at once as one dense
        product, the blocks' own parts as a block-diagonal one, the two summed."""
        layer, blocks = self.hidden, self.blocks
        own_size = self.deter // blocks
        own_weight, shared_weight = layer.weight.split([own_size, layer.weight.shape[1] - own_size], 1)
        groups = h.reshape(*h.shape[:-1], blocks, own_size)
        own = torch.einsum("...gi,gio->...go", groups, own_weight).flatten(-2)
        # (blocks, 3 hidden, out / blocks) -> (3 hidden, out): block g's outputs in columns g*out/blocks...
        shared = embed @ shared_weight.transpose(0, 1).flatten(1)
        out = own + shared
        return out if layer.bias is None else out + layer.bias


class RSSM(nn.Module):
    """Recurrent state-space model: deterministic GRU state `deter` and stochastic state `stoch`.

    With discrete > 0 the stochastic state is `stoch` categoricals of `discrete` classes each
    (unimix, straight-through samples); with discrete == 0 it is a diagonal Gaussian of size stoch.
    A state is a dict of tensors: deter (B, deter), stoch (B, stoch[, discrete]) and the
    distribution parameters (logit, or mean and std).
    """

    def __init__(self, config, embed_size, action_size):
        super().__init__()
        self.stoch, self.discrete, self.deter = config.dyn_stoch, config.dyn_discrete, config.dyn_deter
        self.unimix, self.rec_depth = config.unimix_ratio, config.dyn_rec_depth
        self.mean_act, self.std_act, self.min_std = config.dyn_mean_act, config.dyn_std_act, config.dyn_min_std
        self.initial_mode = config.initial
        stoch_flat = self.stoch * self.discrete if self.discrete else self.stoch
        hidden, act, norm = config.dyn_hidden, config.act, config.norm
        if config.dyn_cell == "gru":
            self.img_in = init_(nn.Sequential(*dense(stoch_flat + action_size, hidden, act, norm)))
            self.cell = GRUCell(hidden, self.deter, norm)
        else:  # blockgru: the block GRU embeds deter, stoch and action itself
            self.img_in = nn.Identity()
            self.cell = BlockGRUCell(stoch_flat, action_size, hidden, self.deter, config.dyn_blocks, act, norm)
        img_layers = [dense(self.deter if i == 0 else hidden, hidden, act, norm) for i in range(config.dyn_img_layers)]
        self.img_out = init_(nn.Sequential(*[layer for block in img_layers for layer in block]))
        self.obs_out = init_(nn.Sequential(*dense(self.deter + embed_size, hidden, act, norm)))
        stats = self.stoch * self.discrete if self.discrete else 2 * self.stoch
        self.img_stats = init_(Linear(hidden, stats))
        self.obs_stats = init_(Linear(hidden, stats))
        if self.initial_mode == "learned":
            self.initial_deter = nn.Parameter(torch.zeros(self.deter))
        self.feat_size = stoch_flat + self.deter
        # The stats layers' rows in (class, categorical) order: row c * stoch + s is row s * classes + c.
        class_major = None
        if self.discrete:
            class_major = torch.arange(stoch_flat).reshape(self.stoch, self.discrete).t().flatten()
        self.register_buffer("class_major", class_major, persistent=False)

    # -- state helpers -----------------------------------------------------------------------------

    def _stats(self, layer, x):
        """The distribution's parameters from its output layer (img_stats or obs_stats) on x, in
        float32 also under autocast, as in the official code; with them, for categoricals, their
        unimix probabilities, class-major (..., classes, stoch), which `_draw` samples (None for
        Gaussians). The logits are the probabilities' log, as the official code mixes them.

        Categorical logits leave the layer class-major, its rows taken in (class, categorical)
        order (`class_major`), and are mixed (unimix) and sampled (`_draw`) in that layout: the
        softmaxes over each categorical's few classes (4 at size1m) then run along the long
        contiguous axis of the categoricals, which compiled kernels vectorise, instead of along
        the classes, which made them several times slower. The state keeps them as a
        (..., stoch, classes) view, the layout everything else reads."""
        if self.discrete:
            rows = self.class_major
            logit = linear(x, layer.weight[rows], layer.bias[rows]).float().unflatten(-1, (self.discrete, self.stoch))
            if self.unimix > 0:
                probs = distributions.unimix_probs(logit, self.unimix, dim=-2)
                logit = torch.log(probs)
            else:
                logit = torch.log_softmax(logit, -2)
                probs = logit.exp()
            return {"logit": logit.transpose(-1, -2)}, probs
        mean, std = layer(x).float().chunk(2, -1)
        if self.mean_act == "tanh5":  # else "none", the only other choice (config.SCHEMA)
            mean = 5.0 * torch.tanh(mean / 5.0)
        std = STD_ACTS[self.std_act](std)
        return {"mean": mean, "std": std + self.min_std}, None

    def _draw(self, stats, probs, sample):
        """The stochastic state of `stats` (and, for categoricals, their class-major `probs`, see
        `_stats`): a sample, or the mode. Categoricals are returned as (..., stoch, classes)."""
        if self.discrete:
            dist = distributions.OneHot.from_probs(probs, dim=-2)
            return (dist.sample() if sample else dist.mode()).transpose(-1, -2)
        dist = self.dist(stats)
        return dist.sample() if sample else dist.mode()

    def dist(self, stats):
        if self.discrete:
            return distributions.OneHot(stats["logit"])
        return distributions.Normal(stats["mean"], stats["std"])

    def initial(self, batch):
        """The state before the first observation: learned (tanh of a parameter) or zeros."""
        device = self.img_stats.weight.device
        if self.initial_mode == "zeros":
            deter = torch.zeros(batch, self.deter, device=device)
        else:
            deter = torch.tanh(self.initial_deter).expand(batch, self.deter)
        prior, probs = self._prior(deter)
        stoch = self._draw(prior, probs, sample=False)
        if self.initial_mode == "zeros":
            stoch = torch.zeros_like(stoch)
        return {"deter": deter, "stoch": stoch, **prior}

    def get_feat(self, state):  # -> (..., stoch*discrete + deter)
        stoch = state["stoch"]
        if self.discrete:
            stoch = stoch.reshape(*stoch.shape[:-2], self.stoch * self.discrete)
        return torch.cat([stoch, state["deter"]], -1)

    # -- transitions ------------------------------------------------------------------------------

    def img_step(self, state, action, sample=True):
        """Prior p(z_t | h_t) with h_t = f(h_{t-1}, z_{t-1}, a_{t-1}), and its sample z_t."""
        prior, probs = self._prior(self._deter(state, action))
        return {"deter": prior["deter"], "stoch": self._draw(prior, probs, sample), **prior}

    def _deter(self, state, action):
        """h_t = f(h_{t-1}, z_{t-1}, a_{t-1}): the recurrent step (a method of its own, not a call
        of img_step, so that a compiled obs_step never nests a separately compiled img_step)."""
        stoch = state["stoch"]
        if self.discrete:
            stoch = stoch.reshape(*stoch.shape[:-2], self.stoch * self.discrete)
        x = self.img_in(torch.cat([stoch, action], -1))
        deter = state["deter"]
        for _ in range(self.rec_depth):
            deter = self.cell(x, deter)
        return deter

    def prior(self, deter):
        """The prior p(z_t | h_t) at deter (..., D): {deter, and its distribution's parameters}, no
        sample. An observed sequence's priors come from it after the filter, as the official code
        computes them (rssm.loss); img_step draws from it."""
        return self._prior(deter)[0]

    def _prior(self, deter):  # (the prior, its categoricals' probabilities for _draw)
        stats, probs = self._stats(self.img_stats, self.img_out(deter))
        return {"deter": deter, **stats}, probs

    def obs_step(self, state, action, embed, is_first, sample=True, init=None):
        """Posterior q(z_t | h_t, x_t); resets state and action where is_first. The prior is not
        needed to filter: the official code computes it after the filter (`prior`) and so does
        WorldModel.loss, from every step's deter at once.

        `init`, the initial state of this batch, is computed unless given (observe computes it
        once per sequence rather than once per step).
        """
        keep = (1.0 - is_first.float())[:, None]
        init = self.initial(len(is_first)) if init is None else init
        state = {k: v * keep.reshape(-1, *[1] * (v.dim() - 1)) + init[k] * (1 - keep).reshape(-1, *[1] * (v.dim() - 1))
                 for k, v in state.items()}
        deter = self._deter(state, action * keep)
        stats, probs = self._stats(self.obs_stats, self.obs_out(torch.cat([deter, embed], -1)))
        return {"deter": deter, "stoch": self._draw(stats, probs, sample), **stats}

    def observe(self, embed, action, is_first, state=None):
        """Filter a sequence: embed (B, T, E), action (B, T, A), is_first (B, T) -> the posteriors,
        a dict of (B, T, ...). The steps run in chunks of chunk_length(T) (observe_chunk), which
        compile 'update' compiles as one graph called T / chunk times."""
        init = self.initial(embed.shape[0])
        state = self.carried(init if state is None else state)
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            # The later chunks start from states with a gradient (from the weights); so does the first,
            # not to be a graph of its own (the replay context's latents and a zero initial state have
            # none; the one they get here is unused).
            state = {k: v if v.requires_grad else v.detach().requires_grad_() for k, v in state.items()}
        size, posts = chunk_length(embed.shape[1]), []
        for t in range(0, embed.shape[1], size):
            state, post = self.observe_chunk(state, action[:, t:t + size], embed[:, t:t + size],
                                             is_first[:, t:t + size], init)
            posts.append(post)
        return cat_steps(posts, 1)

    def observe_chunk(self, state, action, embed, is_first, init):
        """obs_step over the K steps of action (B, K, A), embed (B, K, E) and is_first (B, K) from
        `state`, resetting to `init`: the last posterior's carried part and the posteriors (B, K, ...)."""
        posts = []
        for t in range(embed.shape[1]):
            posts.append(self.obs_step(state, action[:, t], embed[:, t], is_first[:, t], init=init))
            state = {k: posts[-1][k] for k in self.CARRIED}
        return self.carried(state), stack_steps(posts, 1)

    # What the next step reads of a state (obs_step, img_step).
    CARRIED = ("deter", "stoch")

    @classmethod
    def carried(cls, state):
        """The CARRIED part of a state, contiguous: what observe carries from chunk to chunk. Every
        chunk then starts from tensors of the same keys and strides, the first (from the initial
        state, with its logits, or the replay context's latents, rows of a wider buffer) as the later
        ones (from a chunk's posterior, whose stoch is a class-major view); else compile 'update'
        compiles observe_chunk's forward and backward graphs again for the first (over a minute of
        the warm-up at recipe2024 size1m on a CPU)."""
        return {k: state[k].contiguous() for k in cls.CARRIED}

    def imagine_with_action(self, action, state):
        """Open-loop prediction: action (B, T, A) from state (B, ...) -> priors (B, T, ...)."""
        priors = []
        for t in range(action.shape[1]):
            state = self.img_step(state, action[:, t])
            priors.append(state)
        return {k: torch.stack([s[k] for s in priors], 1) for k in priors[0]}

    # -- loss ---------------------------------------------------------------------------------

    def kl_loss(self, post, prior, free):
        """KL balancing with free nats (Eq. 5 of the paper), per step (B, T): the two terms

        dyn = max(free, KL[sg(post) || prior]),  rep = max(free, KL[post || sg(prior)]),

        which models.loss_scales weighs, and the two KLs before the free nats (for the metrics).
        """
        sg = lambda s: {k: v.detach() for k, v in s.items()}  # noqa: E731
        raw_dyn = self.kl(sg(post), prior)
        raw_rep = self.kl(post, sg(prior))
        return torch.clamp(raw_dyn, min=free), torch.clamp(raw_rep, min=free), raw_dyn, raw_rep

    def kl(self, lhs, rhs):
        if self.discrete:
            return distributions.kl_categorical(lhs["logit"], rhs["logit"])
        return distributions.kl_normal(lhs["mean"], lhs["std"], rhs["mean"], rhs["std"])


# The longest chunk of recurrent steps (RSSM.observe_chunk, models.ActorCritic.imagine_steps) that
# compile 'update' compiles as one graph: its graphs' size, and so its compilation time, no longer
# grows with batch_length and imag_horizon (TorchRL's DreamerV3 unrolls its scan by 8 likewise).
UNROLL = 8


def chunk_length(steps):
    """The chunk that `steps` recurrent steps run in: the longest that divides them and is at most
    UNROLL, so that every chunk has one length and one compiled graph serves all (64 -> 8, 15 -> 5;
    a prime length over UNROLL runs one step at a time)."""
    return max((k for k in range(1, min(steps, UNROLL) + 1) if steps % k == 0), default=1)


def stack_steps(states, dim):
    """A list of state dicts -> one dict of tensors stacked along `dim`."""
    return {k: torch.stack([s[k] for s in states], dim) for k in states[0]}


def cat_steps(chunks, dim):
    """A list of state dicts of stacked steps -> one dict, concatenated along `dim`."""
    return {k: torch.cat([c[k] for c in chunks], dim) for k in chunks[0]}


# How the RSSM bounds the mean (dyn_mean_act) and the standard deviation (dyn_std_act) of Gaussian latents.
MEAN_ACTS = ("none", "tanh5")
STD_ACTS = {"softplus": nn.functional.softplus, "abs": lambda s: (s + 1.0).abs(),
            "sigmoid": torch.sigmoid, "sigmoid2": lambda s: 2 * torch.sigmoid(s / 2)}
IMAGE_ENCODERS = {"strided": ConvEncoder, "pooled": PooledConvEncoder}  # encoder.cnn
VECTOR_DISTS = {"symlog_mse": distributions.SymlogMSE, "mse": distributions.MSE}  # decoder.vector_dist
ACTOR_DISTS = ("normal", "onehot")  # actor.dist, once settled

# The network bodies compilation.compile_steps compiles: every body a preset builds. Heads and the
# actor compile through their MLP, the GRU cells through the RSSM's step functions.
COMPILED = (MLP, ConvEncoder, PooledConvEncoder, ConvDecoder, UpsampleConvDecoder)
