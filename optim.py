"""The optimizers: Adam, AdamW and LaProp with global-norm and adaptive gradient clipping and a
learning-rate warm-up (ClippedOptimizer), and `Optimizer`, one learner's optimizer with its
float16 gradient scaler; `optimize` steps several learners on one backward pass."""

import torch

import launch


class ClippedOptimizer(torch.optim.Optimizer):
    """The base of Adam, AdamW and LaProp here: each `step` clips the gradients (a global norm
    `clip`, 0 for none, and/or adaptive clipping `agc`, 0 for none), ramps the learning rate up
    over `warmup` updates (the first update has rate 0, as in the official code) and then updates
    every parameter with a gradient, all in a few multi-tensor (`torch._foreach_*`) operations.

    Every number that changes between updates is a tensor on the parameters' device: the count of
    steps taken (`updates`, which the bias corrections and the warm-up read) and `grad_norm`, the
    last step's norm before clipping. So a compiled `step` (compile 'update') is one graph that
    neither reads a value back to the host nor recompiles. The moments are kept per parameter
    under torch.optim.Adam's names; the step count is one for all (torch keeps one per parameter,
    equal for parameters that get a gradient at every step, as all of these do).
    """

    STATE = ()  # the moment buffers per parameter

    def __init__(self, params, lr, eps, betas, weight_decay, clip=0.0, agc=0.0, warmup=0):
        super().__init__(params, dict(lr=lr, eps=eps, betas=betas, weight_decay=weight_decay))
        self.clip, self.agc, self.warmup = clip, agc, warmup
        self.updates = torch.zeros((), dtype=torch.int64)  # moved to the parameters' device by init_state
        self.grad_norm = torch.zeros(())
        self.ready = False  # whether init_state ran since construction or loading

    def __getstate__(self):  # torch.optim.Optimizer's keeps only its own attributes: a copy would lose these
        return dict(self.__dict__)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.ready = False

    def init_state(self):
        """Create the moments of every parameter and move the counters to the parameters' device,
        before the first step and outside any compiled region; a loaded state is kept."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                for key in self.STATE:
                    if key not in state:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        device = self.param_groups[0]["params"][0].device
        self.updates, self.grad_norm = self.updates.to(device), self.grad_norm.to(device)
        # Static addresses: a compiled step (compile 'update') updates them in place inside its CUDA
        # graph. CUDA-graph trees would skip the graph of a step that mutates any other input.
        for tensor in self.state_tensors():
            torch._dynamo.mark_static_address(tensor)
        self.ready = True

    def state_tensors(self):
        """Every tensor a step updates in place besides the parameters and their gradients: the
        moments, the count and the last gradient norm."""
        moments = [state[key] for state in self.state.values() for key in self.STATE if key in state]
        return [*moments, self.updates, self.grad_norm]

    def rate(self, group):
        """The learning rate of this update: lr, times min(1, updates / warmup) in the warm-up."""
        if not self.warmup:
            return group["lr"]
        return group["lr"] * torch.clamp(self.updates.float() / self.warmup, max=1.0)

    @torch.no_grad()
    def step(self, closure=None):
        if not self.ready:  # compile 'update' runs it before the first compiled step
            self.init_state()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        # In place: a compiled step mutates its inputs, and sets no attributes.
        if grads:
            self.grad_norm.copy_(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        else:
            self.grad_norm.zero_()
        if self.clip:  # torch.nn.utils.clip_grad_norm_'s rule
            torch._foreach_mul_(grads, torch.clamp(self.clip / (self.grad_norm + 1e-6), max=1.0))
        if self.agc:
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            agc_(params, grads, self.agc)
        count = (self.updates + 1).double()  # this step's number, t = 1, 2, ...
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                state = [self.state[p] for p in params]
                self.update(group, self.rate(group), count, params, [p.grad for p in params],
                            *[[s[key] for s in state] for key in self.STATE])
        self.updates.add_(1)

    @staticmethod
    def bias_correction(beta, count):
        """1 - beta ** t as a float64 tensor, so that it loses nothing (a 0-dim tensor does not
        change the dtype of the moments it scales)."""
        return 1 - torch.pow(beta, count)


def agc_(params, grads, clip, floor=1e-3):
    """Adaptive gradient clipping, per tensor: scale each gradient down to at most
    clip * max(floor, |param|) in L2 norm (the 2024 recipe, with clip 0.3)."""
    upper = clip * torch.clamp(torch.stack(torch._foreach_norm(params)), min=floor)
    scale = 1 / torch.clamp(torch.stack(torch._foreach_norm(grads)) / upper, min=1.0)
    torch._foreach_mul_(grads, list(scale.unbind()))


class Adam(ClippedOptimizer):
    """Adam (Kingma and Ba 2015), as torch.optim.Adam computes it; `decoupled` weight decay makes
    it AdamW (Loshchilov and Hutter 2019)."""

    STATE = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def update(self, group, lr, count, params, grads, exp_avg, exp_avg_sq):
        beta1, beta2 = group["betas"]
        if group["weight_decay"] and self.decoupled:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        elif group["weight_decay"]:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)
        # p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, torch.sqrt(self.bias_correction(beta2, count)))
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_mul_(denom, self.bias_correction(beta1, count) / lr)  # divided by the step size
        torch._foreach_addcdiv_(params, exp_avg, denom, value=-1.0)


class AdamW(Adam):
    decoupled = True


class LaProp(ClippedOptimizer):
    """LaProp (Ziyin et al. 2020), the 2024 recipe's optimizer: each gradient is divided by the
    root of its bias-corrected second-moment EMA first, and the momentum averages these
    normalised steps (Adam averages the raw gradients, then divides):

        nu = b2 nu + (1 - b2) g^2,   u = g / (sqrt(nu / (1 - b2^t)) + eps),
        mu = b1 mu + (1 - b1) u,     p -= lr (mu / (1 - b1^t) + weight_decay p).
    """

    STATE = ("nu", "mu")

    def update(self, group, lr, count, params, grads, nu, mu):
        beta1, beta2 = group["betas"]
        torch._foreach_mul_(nu, beta2)
        torch._foreach_addcmul_(nu, grads, grads, 1 - beta2)
        denom = torch._foreach_div(nu, self.bias_correction(beta2, count))
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_lerp_(mu, torch._foreach_div(grads, denom), 1 - beta1)
        update = torch._foreach_div(mu, self.bias_correction(beta1, count))
        if group["weight_decay"]:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
        torch._foreach_mul_(update, lr)
        torch._foreach_sub_(params, update)


OPTIMIZERS = {"adam": Adam, "adamw": AdamW, "laprop": LaProp}


class Optimizer:
    """One learner's optimizer (config `opt`: Adam, AdamW or LaProp) with its clipping, warm-up
    (see ClippedOptimizer) and, for float16, a gradient scaler.

    `optimize({optimizer: loss, ...})` steps several learners on one backward pass; calling an
    Optimizer on a loss steps it alone. Metrics stay tensors so that an update never waits on the
    device.

    Under torchrun `ranks` (see Dreamer.distribute) averages the gradients over processes between
    the backward pass and the clipping: an explicit all-reduce of the flattened gradients rather than
    DistributedDataParallel, because the losses backpropagate into chosen parameters only
    (`backward(inputs=...)`), which DDP's hooks on whole modules do not model. Clipping and the
    scaler then see the averaged gradient.
    """

    ranks = launch.SingleProcess()

    SETTINGS = ("lr", "eps", "weight_decay")  # taken from the config, also on resume

    def __init__(self, name, params, lr, eps, clip, weight_decay=0.0, opt="adam", use_scaler=False, agc=0.0,
                 warmup=0):
        self.name, self.clip, self.agc, self.warmup = name, clip, agc, warmup
        self.params = [p for p in params if p.requires_grad]
        self.opt = OPTIMIZERS[opt](self.params, lr, eps, (0.9, 0.999), weight_decay, clip, agc, warmup)
        self.scaler = torch.amp.GradScaler(enabled=use_scaler)

    @property
    def updates(self):  # for the warm-up; saved in state_dict
        return int(self.opt.updates)

    def __call__(self, loss):
        """Backpropagate `loss` into this optimizer's parameters only (no gradient is computed for
        any other module the loss depends on), clip and step."""
        return optimize({self: loss})

    def step(self, loss):
        """After the backward pass: average over processes, unscale, clip and step; metrics."""
        if not self.opt.ready:
            self.opt.init_state()
        self.ranks.average_(p.grad for p in self.params if p.grad is not None)
        self.scaler.unscale_(self.opt)
        self.scaler.step(self.opt)  # opt.step, skipped by the float16 scaler on an overflow
        self.scaler.update()
        return {f"{self.name}_loss": loss.detach(), f"{self.name}_grad_norm": self.opt.grad_norm.clone()}

    def state_dict(self):
        return {"opt": self.opt.state_dict(), "scaler": self.scaler.state_dict(), "updates": self.updates}

    def load_state_dict(self, state):
        """Load the moments and step counts, but keep this run's settings (lr, eps, weight decay):
        a user who changed them on resume means them. Returns one line per setting that differs
        from the saved one."""
        settings = [{k: group[k] for k in self.SETTINGS} for group in self.opt.param_groups]
        self.opt.load_state_dict(state["opt"])
        self.scaler.load_state_dict(state["scaler"])
        self.opt.updates = torch.tensor(state["updates"])
        changes = []
        for group, current in zip(self.opt.param_groups, settings):
            for key, value in current.items():
                if group[key] != value:
                    changes.append(f"{self.name} {key} {group[key]:g} -> {value:g}")
                group[key] = value
        return changes


def optimize(losses):
    """One backward pass of the sum of `losses` ({Optimizer: loss}) into the parameters of their
    optimizers only, then each optimizer's step. The losses must not send gradients into each
    other's parameters (ActorCritic.loss keeps the actor's and the critic's apart), since
    each optimizer takes every gradient its parameters receive. Returns the metrics of all."""
    params = [p for opt in losses for p in opt.params]
    for opt in losses:
        opt.opt.zero_grad(set_to_none=True)
    sum(opt.scaler.scale(loss) for opt, loss in losses.items()).backward(inputs=params)
    metrics = {}
    for opt, loss in losses.items():
        metrics.update(opt.step(loss))
    return metrics
