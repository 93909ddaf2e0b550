"""Compilation: `compile True` (step by step), `compile update` (the whole update as a few graphs)
and the settling of every `auto` value before the agent is built (`resolve_auto`), with the CPU
cost model that decides `compile auto`.

The settling lives here, not in models.py, because `compile auto` needs the model's size: it builds
the world model and actor-critic on the meta device (parameter_counts), so this module imports
models and models knows nothing of compilation."""

import torch

import launch
import models
import networks
import tools

# ==================================================================================================
# Compilation: `compile True` (step by step) and `compile update` (the whole update)
# ==================================================================================================


class CompileError(RuntimeError):
    """A function that compile asked for cannot be compiled: the message names it and the
    fallbacks. The one compile-failure policy, of `compile True` (Compiled) and `compile update`
    (Region) alike: what was asked to compile never runs eagerly instead."""


# A compiler failure (no C++ compiler, an unsupported operator, a graph break where one graph is
# required) or more variants than dynamo's recompile limit (past which it would run eagerly).
COMPILE_FAILURES = (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)


def compile_failure(mode, name, error, fallbacks, how=""):
    """The CompileError for `error` raised while compiling `name` (`how`: as one graph) under compile `mode`."""
    reason = " ".join(str(error).split())[:200] or type(error).__name__
    return CompileError(f"compile {mode}: {name} cannot be compiled{how} ({reason}); {fallbacks}")


class Compiled:
    """torch.compile(fn), for `compile True`. Where compilation fails it is a CompileError naming
    the function (COMPILE_FAILURES); any other error is fn's own and keeps its traceback."""

    def __init__(self, fn, name):
        self.eager, self.name = fn, name
        self.compiled = torch.compile(fn)
        self.calls = 0  # calls that ran the compiled code

    def __call__(self, *args, **kwargs):
        try:
            result = self.compiled(*args, **kwargs)
        except COMPILE_FAILURES as e:
            raise compile_failure("True", self.name, e, "--compile False runs eagerly") from e
        self.calls += 1
        return result


class Region:
    """One function compiled whole as one graph (fullgraph: a graph break is an error, never a
    silent eager fallback), for compile 'update'. On CUDA the graph is captured as a CUDA graph
    (mode 'reduce-overhead', CUDA-graph trees), whose outputs live in memory that the replays of
    the next step overwrite. A step (an update, a policy call) is marked once, at its beginning
    (`Step`; a region that is a whole step, `step`, marks itself): never between a forward region
    and the backward pass that needs its activations. What outlives the step (metrics, latents,
    actions) is what the step returns, cloned out of that memory; a region keeps nothing else
    (no attribute is set inside one)."""

    def __init__(self, fn, name, cuda_graphs, step=False):
        self.eager, self.name, self.cuda_graphs, self.step = fn, name, cuda_graphs, step
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False, **compile_settings(cuda_graphs, name))
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if self.step:
            begin_step(self.cuda_graphs)
        try:
            result = self.compiled(*args, **kwargs)
        except COMPILE_FAILURES as e:
            raise compile_failure("'update'", self.name, e, "--compile True compiles step by step, "
                                  "--compile False runs eagerly", how=" as one graph") from e
        self.calls += 1
        return outlive(result, self.cuda_graphs) if self.step else result


# The regions of recurrent steps, each a long run of small kernels: the filter's chunks (batch_size
# rows per step, kernels of microseconds, about what calling each from Python costs) and the
# imagination's (about a hundred kernels per chunk, whose Python wrapper took 2.9 ms per call at
# recipe2024 size1m). Off CUDA they are compiled with Inductor's C++ wrapper, which calls their
# kernels from C++ (on CUDA a CUDA graph replays them): the filter alone went from 65.6 to 57.5 ms
# per update (benchmarks/README, rounds 27 and 28). The other regions, a few large kernels each,
# keep the Python wrapper: under the C++ wrapper a whole update compiled for over 12 minutes (round 24).
CPP_WRAPPED = ("RSSM.observe_chunk", "ActorCritic.imagine_steps")


def compile_settings(cuda_graphs, name):
    """torch.compile's mode or options for the region `name`: on CUDA its CUDA-graph mode;
    elsewhere the random numbers drawn by torch.rand, not by Inductor's own generator
    (`fallback_random`), whose CPU code computes a Philox draw per element, unvectorised, at about
    three times torch.rand's cost (the RSSM's samples, benchmarks/README round 27): the draws are
    then exactly those an eager run makes from the same generator state (on CUDA Inductor's
    generator runs fused in its kernels); and Inductor's C++ wrapper for CPP_WRAPPED."""
    if cuda_graphs:
        return {"mode": "reduce-overhead"}
    return {"options": {"fallback_random": True, "cpp_wrapper": name in CPP_WRAPPED}}


class Step:
    """A step of several regions (an update: forward regions, one backward pass, the optimizers'
    steps), marked and cloned as Region describes."""

    def __init__(self, fn, cuda_graphs):
        self.fn, self.cuda_graphs = fn, cuda_graphs

    def __call__(self, *args, **kwargs):
        begin_step(self.cuda_graphs)
        return outlive(self.fn(*args, **kwargs), self.cuda_graphs)


def begin_step(cuda_graphs):
    """Mark the beginning of a step for CUDA-graph trees: the outputs of the last step's replays
    may be overwritten from here on."""
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()


def outlive(result, cuda_graphs):
    """The tensors of a step's `result`, cloned out of the CUDA graphs' memory (on CUDA)."""
    if not cuda_graphs:
        return result
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, result)


def compile_steps(agent, bodies):
    """compile True: the functions that do the work of every update and every policy step, each
    compiled on its own: the RSSM transitions (run once per time step) and the bodies of every
    network a preset builds (`bodies`: networks.COMPILED and exploration.COMPILED). Between them
    the update runs eagerly, one kernel per operator. Returns the compiled functions."""
    # One MLP.forward serves every MLP, each seen with and without gradients and with its own
    # input shapes: about twenty variants, beyond dynamo's default limit of 8 per function
    # (past which the rest would silently run eagerly).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # past it: a CompileError, never eager
    networks.lower_onednn_linear()
    rssm = agent.wm.rssm
    rssm.img_step = Compiled(rssm.img_step, "rssm.img_step")
    rssm.obs_step = Compiled(rssm.obs_step, "rssm.obs_step")
    compiled = [rssm.img_step, rssm.obs_step]
    for name, module in agent.named_modules():
        # The critic runs under torch.func.functional_call for the actor's values (its weights
        # detached, ActorCritic.loss), which swaps its parameters on every call.
        if name.endswith(".critic.mlp"):  # not slow_critic.mlp: that one only runs forward
            continue
        if isinstance(module, bodies):
            module.forward = Compiled(module.forward, name)
            compiled.append(module.forward)
    return compiled


def captures_cuda_graphs(config):
    """Whether compile 'update' captures its regions as CUDA graphs: on CUDA."""
    return torch.device(config.device).type == "cuda"


def compile_update(agent, bodies=None):
    """compile 'update': every update as a few whole graphs, as few as its autograd structure
    allows. Each loss region (the world model's, the actor-critic's, their sum in update 'joint',
    Plan2Explore's ensemble; `agent.regions()`) is compiled forward and, by AOTAutograd, backward;
    the backward pass between them is one call of the compiled backward graph; every optimizer's
    step (clipping, adaptive clipping, warm-up and the update, ClippedOptimizer) and every slow
    critic's EMA is a region too, and so is the policy step. The observe and the imagination are
    regions of one chunk of at most networks.UNROLL steps, called length / chunk times, so that no
    graph grows with batch_length or imag_horizon. Nothing inside reads a value back to the host,
    so that on CUDA each region is captured as a CUDA graph; each update (Step) and each policy
    call is one CUDA-graph step. Returns the regions."""
    cuda_graphs = captures_cuda_graphs(agent.config)
    # An update's regions run each with one set of shapes; a few variants (the policy's batch of
    # training and evaluation environments, with and without gradients) stay within the limit.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # past it: a CompileError, never eager
    networks.lower_onednn_linear()
    regions = []
    for owner, method in agent.regions():
        name = f"{type(owner).__name__}.{method}"
        # The policy step is one region, a step of its own; an update is a Step of many.
        region = Region(getattr(owner, method), name, cuda_graphs, step=(owner, method) == (agent, "act"))
        setattr(owner, method, region)  # an instance attribute: the class's method stays eager
        regions.append(region)
    agent.update.train_step = Step(agent.update.train_step, cuda_graphs)
    return regions


# compile: what each value does to an agent; False runs eagerly.
COMPILERS = {True: compile_steps, False: None, "update": compile_update}



# ==================================================================================================
# The `auto` values
# ==================================================================================================

# -- compile auto: whether compiling pays for the run at hand ----------------------------------------
#
# On a CPU `compile auto` compiles the whole update (under torchrun, which refuses it: step by step)
# when the run is predicted to make enough updates for the time compile saves to repay its warm-up:
# predicted updates x saved seconds per update > warm-up seconds. The saving is estimated as
#     seconds per replayed step x batch_size x batch_length + seconds per FLOP x update_flops,
# the two constants fitted to the two measured model sizes: a part that grows with the replayed steps
# whatever the model's width (the operators' per-call overhead and the elementwise passes over memory
# that compiling fuses away: the small model's update is mostly these) and a part that grows with
# the arithmetic. Measured with benchmarks/train_speed.py --compare on the 2-core CPU (AVX2), one
# torch thread, float32, Inductor's cache emptied first, the other core running one single-threaded
# job (benchmarks/README, train_speed.py):
#   the whole update (--compile update, recurrences compiled in chunks; 2026-12-05/06, torch 2.13):
#     recipe2024 size1m, dmc_cartpole_balance, batch 16x64 (2.868e10 FLOPs): eager 1.027 s/update,
#       compiled 0.561 s (0.466 s saved); warm-up of the first 2 updates 2.3 s eager, 289.3 s compiled;
#     v1 default size, dmc_proprio walker, 16x64 (4.978e11 FLOPs): eager 6.037 s, compiled 5.321 s
#       (0.716 s saved); warm-up 18.2 s eager, 289.7 s compiled.
#     Fit: 0.250 s / 4.691e11 FLOPs = 5.33e-13 s per FLOP; (0.466 - 0.0153) s / 1024 = 4.40e-4 s per step.
#     Check: size1m at 16x32 (1.434e10 FLOPs) saved 0.221 s (eager 0.503, compiled 0.282); the fit
#       predicts 0.233 s (+5%); its warm-up was 286.6 s.
#   step by step (--compile True; 2026-12-01, an older commit, a more loaded machine, 16x64):
#     recipe2024 size1m: eager 1.69 s, compiled 1.07 s (0.62 s saved), warm-up 4.7 s and 377 s;
#     v1 default size: eager 11.61 s, compiled 10.58 s (1.03 s saved).
#     Fit: 0.41 s / 4.691e11 = 8.74e-13 s per FLOP; (0.62 - 0.0251) s / 1024 = 5.81e-4 s per step.
# Not measured: other imagination horizons than 15, more threads, vision models (update_flops counts a
# conv layer's weights once, an underestimate) and Plan2Explore's ensemble.
COMPILE_COSTS = {  # what compile auto may choose on a CPU:
    # (seconds saved per replayed step, seconds saved per FLOP, warm-up seconds)
    "update": (4.40e-4, 5.33e-13, 290.0),  # warm-up: size1m's at 16x64 (289.3 - 2.3, the largest)
    True: (5.81e-4, 8.74e-13, 370.0),  # under torchrun only; warm-up: size1m's (377 - 4.7)
}


def parameter_counts(obs_space, act_space, config):
    """The parameters of the world model, its RSSM and the task actor and critic that `config`
    builds, counted on the meta device (no memory, no random numbers drawn)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        wm = models.WorldModel(obs_space, act_space, config)
        behavior = models.ActorCritic(config, wm, act_space, reward_fn=None)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    return {"world_model": count(wm), "rssm": count(wm.rssm), "actor": count(behavior.actor),
            "critic": count(behavior.critic)}


def update_flops(config, counts):
    """Estimated floating-point operations of one update from the parameter counts: 2 per weight
    and token forward, 4 backward. The world model runs forward and backward on the B x T replayed
    steps; imagination starts from each of them and runs H + 1 steps of the RSSM (forward), the
    actor (forward and backward), the critic (forward and backward) and the slow critic (forward)."""
    tokens = config.batch_size * config.batch_length
    imagined = tokens * (config.imag_horizon + 1)
    return (6 * counts["world_model"] * tokens
            + imagined * (2 * counts["rssm"] + 6 * counts["actor"] + 8 * counts["critic"]))


def update_saving(config, counts, costs):
    """Estimated seconds one compiled update saves on a CPU, by the rule above: (seconds per replayed
    step, seconds per FLOP) = costs."""
    per_step, per_flop = costs
    return per_step * config.batch_size * config.batch_length + per_flop * update_flops(config, counts)


def compile_choice(config, counts, costs=None, warmup_s=None):
    """What `compile auto` settles to, and why: (decision, reason). On CUDA always the whole update
    (fused kernels, fewer launches; step by step under torchrun); on a CPU by the rule above, for the
    parameter counts `counts` (None: the model is not known, eager). `costs` ((seconds per replayed
    step, seconds per FLOP)) and `warmup_s` replace the measured COMPILE_COSTS."""
    found = launch.torchrun_rank()
    ranks = found is not None and found[1] > 1  # compile_update refuses to run under torchrun
    if torch.device(config.device).type == "cuda":
        if ranks:
            return True, "on CUDA under torchrun the steps are compiled, with fewer launches per update"
        return "update", "on CUDA the whole update runs as a few CUDA graphs, with the fewest launches"
    if counts is None:
        return False, "on a CPU without the model to estimate its gain"
    kind = True if ranks else "update"
    *measured_costs, measured_warmup = COMPILE_COSTS[kind]
    costs = measured_costs if costs is None else costs
    warmup_s = measured_warmup if warmup_s is None else warmup_s
    updates = tools.total_updates(config)
    saved = update_saving(config, counts, costs)
    decision = kind if updates * saved > warmup_s else False
    what = "step by step (torchrun)" if kind is True else "the whole update"
    verdict = "more" if decision else "less"
    return decision, (f"on a CPU: {updates:,} updates x ~{saved:.3g} s saved each = {updates * saved:,.0f} s, "
                      f"{verdict} than the ~{warmup_s:.0f} s warm-up of compiling {what}")


def resolve_auto(config, act_space, obs_space=None):
    """Settle the 'auto' keys this module owns: the actor's distribution and gradient from the
    action space (v1's actor_dist_disc/cont and actor_grad_disc/cont: discrete -> onehot +
    reinforce, continuous -> normal + dynamics) and compile by compile_choice (for the model that
    `obs_space` gives). Explicit values stay; an actor distribution that contradicts the action
    space is a ConfigError. Returns the settled config (a new one) and {key that was 'auto': why it
    settled so ('' when the reason is the key's own rule)}, for the start-up summary. A settled
    config settles to itself."""
    discrete = bool(getattr(act_space, "discrete", False))
    dist, gradient = ("onehot", "reinforce") if discrete else ("normal", "dynamics")
    changes, resolved = {}, {}
    if config.actor.dist == "auto":
        changes["actor.dist"], resolved["actor.dist"] = dist, "from the action space"
    if config.imag_gradient == "auto":
        changes["imag_gradient"], resolved["imag_gradient"] = gradient, "from the action space"
    chosen = changes.get("actor.dist", config.actor.dist)
    if chosen != dist:
        kind = "discrete" if discrete else "continuous"
        raise tools.ConfigError(f"Invalid value '{chosen}' for --actor.dist: task '{config.task}' has {kind} "
                                f"actions; use --actor.dist {dist} (or auto)")
    if chosen == "normal" and config.actor.std != "learned":
        try:
            valid = float(config.actor.std) > 0
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise tools.ConfigError(f"Invalid value '{config.actor.std}' for --actor.std: the normal actor takes "
                                    "'learned' or a fixed standard deviation > 0 ('none' is for onehot actors)")
    if config.compile == "auto":
        provisional = config.replace(changes) if changes else config
        counts = parameter_counts(obs_space, act_space, provisional) if obs_space is not None else None
        changes["compile"], resolved["compile"] = compile_choice(provisional, counts)
    return (config.replace(changes) if changes else config), resolved
