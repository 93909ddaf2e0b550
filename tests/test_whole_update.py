"""compile 'update': the whole update as a few whole graphs, and what it rests on.

- the optimizers (Adam, AdamW against torch.optim's; LaProp is checked in test_recipe2024);
- one backward pass serves the actor and the critic without either loss reaching the other's
  weights (ActorCritic.loss, optim.optimize);
- the compiled update equals the eager one (losses, gradients, parameters after 3 updates) for v1
  and the 2024 recipe in both update modes, with Plan2Explore and the replay context; with zero
  graph breaks and no value read back to the host inside an update;
- a region that cannot be one graph is an error naming it, never an eager fallback; torchrun is
  refused; `compile auto` on CUDA is 'update'.

On the CPU the compiled regions use the aot_eager backend: dynamo captures every region as one
graph (fullgraph) and AOTAutograd derives its backward graph, as with Inductor, but the graphs run
as ATen operators instead of generated C++ (which takes minutes per agent on this 2-core machine).
benchmarks/train_speed.py runs the Inductor path, and benchmarks/gpu_check.sh runs this file with
DREAMER_TEST_DEVICE=cuda and DREAMER_TEST_BACKEND=inductor, with CUDA graphs.
"""

import copy
import os
import pickle
import types

import numpy as np
import pytest
import torch

import compilation
import config as cfg
import distributions
import dreamer
import envs
import launch
import models
import networks
import optim
import storage
import tools

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = os.environ.get("DREAMER_TEST_DEVICE", "cpu")
BACKEND = os.environ.get("DREAMER_TEST_BACKEND", "aot_eager")
# The debug preset with short unrolls, so that the graphs of 6 observe and 3 imagination steps
# compile in seconds.
SHORT = ("--configs", "debug", "--device", DEVICE, "--batch_length", "6", "--imag_horizon", "3")


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# The optimizers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt, reference, decay", [("adam", torch.optim.Adam, 0.0), ("adam", torch.optim.Adam, 0.1),
                                                   ("adamw", torch.optim.AdamW, 0.1)])
def test_adam_and_adamw_step_as_torch_optim_does(opt, reference, decay):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64)), torch.nn.Parameter(torch.randn(5))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    optimizer = optim.Optimizer("x", ours, lr=1e-2, eps=1e-8, clip=0, weight_decay=decay, opt=opt)
    torch_optimizer = reference(theirs, lr=1e-2, eps=1e-8, weight_decay=decay)
    for step in range(5):
        coeffs = [torch.randn(p.shape, generator=gen(step), dtype=p.dtype) for p in ours]
        optimizer(sum((c * p ** 2).sum() for c, p in zip(coeffs, ours)))
        torch_optimizer.zero_grad()
        sum((c * p ** 2).sum() for c, p in zip(coeffs, theirs)).backward()
        torch_optimizer.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    assert optimizer.updates == 5


def test_a_copied_optimizer_keeps_its_clipping_warmup_and_count():
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = optim.Optimizer("x", params, lr=0.1, eps=1e-8, clip=1.0, opt="laprop", agc=0.3, warmup=3)
    optimizer((params[0] * 2).sum())
    for copied in (copy.deepcopy(optimizer).opt, pickle.loads(pickle.dumps(optimizer.opt))):
        assert (copied.clip, copied.agc, copied.warmup, int(copied.updates)) == (1.0, 0.3, 3, 1)


# ----------------------------------------------------------------------------------------------
# One backward pass for the actor and the critic
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gradient", ["dynamics", "reinforce"])
def test_the_actor_and_critic_losses_reach_only_their_own_weights(spaces, gradient):
    config = cfg.parse([*SHORT, "--compile", "False", "--imag_gradient", gradient])
    torch.manual_seed(0)
    agent = dreamer.Dreamer(*spaces, config)
    behavior = agent.task_behavior
    with torch.no_grad():  # the critic starts at zero, which would hide a gradient through its values
        behavior.critic.out.weight.copy_(0.1 * torch.randn(behavior.critic.out.weight.shape, generator=gen(1)))
    start = agent.wm.rssm.initial(8)
    start = {k: v + 0.1 * torch.randn(v.shape, generator=gen(2)) for k, v in start.items()}
    with models.frozen(agent.wm):
        terms, _, _ = behavior.loss(start, torch.ones(8))
    actor_loss, critic_loss = terms["policy"].mean(), terms["value"].mean()
    actor, critic = list(behavior.actor.parameters()), list(behavior.critic.parameters())
    into_critic = torch.autograd.grad(actor_loss, critic, retain_graph=True, allow_unused=True)
    into_actor = torch.autograd.grad(critic_loss, actor, retain_graph=True, allow_unused=True)
    assert all(g is None or not g.any() for g in into_critic + into_actor)
    own = torch.autograd.grad(actor_loss, actor, retain_graph=True) + torch.autograd.grad(critic_loss, critic)
    assert all(g.abs().sum() > 0 for g in own[:1] + own[-2:-1])  # each loss does train its own network


# ----------------------------------------------------------------------------------------------
# The compiled update equals the eager one
# ----------------------------------------------------------------------------------------------

# v1 with its sequential update and Plan2Explore; v1 in the joint update; the 2024 recipe (joint,
# replay context 1); the 2024 recipe in the sequential update.
CASES = {
    "v1-sequential-plan2explore": ("--expl_behavior", "plan2explore", "--imag_gradient", "dynamics"),
    "v1-joint": ("--update", "joint", "--imag_gradient", "reinforce"),
    "recipe2024-joint": ("--configs", "recipe2024", "debug"),
    "recipe2024-sequential": ("--configs", "recipe2024", "debug", "--update", "sequential"),
}
UPDATES = 3


def batches(env, config, count):
    """`count` replayed batches (B, K + T, ...) of one random episode stream, with zero latents for
    the replay context."""
    replay = storage.Replay(1000, 1, seed=0)
    obs, action = env.reset(), np.zeros(env.act_space.shape, np.float32)
    rng = np.random.default_rng(0)
    context = models.ReplayContext(config)
    for _ in range(60):
        replay.add({**obs, "action": action, "reward": np.float32(rng.normal()), **{
            k: v[0] for k, v in context.entries(None, 1).items()}})
        action = rng.uniform(-1, 1, env.act_space.shape).astype(np.float32)
        obs, _, done, _ = env.step(action)
        if done:
            obs = env.reset()
    length = config.batch_length + config.replay_context
    return [replay.sample(config.batch_size, length) for _ in range(count)]


def run_updates(agent, batches):
    """Each update's metrics (floats), then the gradients and parameters after the last."""
    metrics = []
    for batch in batches:
        torch.manual_seed(len(metrics))  # both agents draw the same latents and actions
        values, _ = agent.update.train_step(copy.deepcopy(batch))
        metrics.append({k: float(v) for k, v in values.items()})
    grads = {name: p.grad.clone() for name, p in agent.named_parameters() if p.grad is not None}
    params = {name: p.detach().clone() for name, p in agent.named_parameters()}
    return metrics, grads, params


@pytest.fixture(scope="module")
def backend():
    """Compile the regions with BACKEND, counting dynamo's graph breaks and graphs from here on."""
    original = compilation.Region.__init__

    def init(self, fn, name, cuda_graphs, step=False):
        original(self, fn, name, cuda_graphs, step)
        if BACKEND != "inductor":
            self.compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=BACKEND)

    compilation.Region.__init__ = init
    torch._inductor.config.fallback_random = True  # Inductor draws eager's random numbers (on CUDA)
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    compilation.Region.__init__ = original


@pytest.fixture(scope="module", params=list(CASES))
def compared(request, backend):
    flags = CASES[request.param]
    configs = [cfg.parse([*SHORT, *flags, "--compile", mode]) for mode in ("False", "update")]
    env = envs.make_env(configs[0], "train", 0)
    data = batches(env, configs[0], UPDATES)
    torch.manual_seed(0)
    eager = dreamer.Dreamer(env.obs_space, env.act_space, configs[0]).to(DEVICE)
    torch.manual_seed(0)
    compiled = dreamer.Dreamer(env.obs_space, env.act_space, configs[1]).to(DEVICE)
    with torch.no_grad():  # heads that start at zero would hide errors in the gradients through them
        for layer in (eager.wm.heads["reward"].out, eager.task_behavior.critic.out):
            layer.weight.copy_(0.1 * torch.randn(layer.weight.shape, generator=gen(3)))
    compiled.load_state_dict(eager.state_dict())
    breaks = sum(backend["graph_break"].values())
    results = run_updates(eager, data), run_updates(compiled, data)
    return request.param, compiled, results, sum(backend["graph_break"].values()) - breaks


def test_the_compiled_update_equals_the_eager_update(compared):
    case, compiled, (eager, ours), _ = compared
    (eager_metrics, eager_grads, eager_params), (metrics, grads, params) = eager, ours
    for step, (want, got) in enumerate(zip(eager_metrics, metrics)):
        assert set(got) == set(want), case
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (case, step, key)
    assert set(grads) == set(eager_grads) and len(grads) > 10, case
    for name in eager_grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=named(name))
    for name in eager_params:
        torch.testing.assert_close(params[name], eager_params[name], rtol=1e-4, atol=1e-6, msg=named(name))


def named(name):
    return lambda message: f"{name}: {message}"


def test_every_region_ran_compiled_with_no_graph_break(compared):
    case, compiled, _, breaks = compared
    assert breaks == 0, case
    names = {region.name for region in compiled.compiled}
    assert names >= {"Dreamer.act", "ActorCritic.update_slow_critic", "WorldModel.embed", "RSSM.observe_chunk",
                     "WorldModel.loss_terms", "ActorCritic.imagine_steps", "ActorCritic.imagined_loss"}, case
    assert all(region.calls >= 1 for region in compiled.compiled if region.name != "Dreamer.act"), case
    # The optimizers that step are regions: each network's own in the sequential update, the one
    # joint optimizer otherwise; Plan2Explore's ensemble, actor and critic in both.
    used = 3 if compiled.config.update == "sequential" else 1
    used += 3 if compiled.expl_behavior is not None else 0
    steps = [region for region in compiled.compiled if region.name.endswith(".step")]
    assert len(steps) == used, case
    assert {id(region) for region in steps} == {id(opt.opt.step) for opt in optimizers(compiled)
                                               if isinstance(opt.opt.step, compilation.Region)}


def optimizers(agent):
    return list(agent.optimizers().values())


def agent_and_graph_count(config, function):
    """An agent for config, and a count of the graphs dynamo compiles for function from now on."""
    env = envs.make_env(config, "train", 0)
    torch.manual_seed(0)
    agent = dreamer.Dreamer(env.obs_space, env.act_space, config).to(DEVICE)
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list
    before = len(entries(function.__code__))
    return env, agent, lambda: len(entries(function.__code__)) - before


def test_every_chunk_of_a_reinforce_imagination_runs_one_compiled_graph(backend):
    """imag_horizon 10 runs in two chunks of 5. The second starts from the first's last state,
    which must have the strides of the replayed start states; else dynamo compiles the chunk a
    second time (Inductor: a minute more of warm-up on a CPU). The RSSM's latents are drawn
    class-major and read through transposed views, which a chunk hands on contiguous. (With the
    dynamics gradient the second chunk is a graph of its own by right: its start carries one.)"""
    config = cfg.parse([*SHORT, "--configs", "recipe2024", "debug", "--imag_horizon", "10", "--compile", "update"])
    assert config.imag_gradient == "reinforce"
    env, agent, graphs = agent_and_graph_count(config, models.ActorCritic.imagine_steps)
    calls = []
    original = agent.task_behavior.imagine_steps
    agent.task_behavior.imagine_steps = lambda *args: calls.append(1) or original(*args)
    run_updates(agent, batches(env, config, 2))
    assert len(calls) == 2 * 2  # two chunks per update
    assert graphs() == 1


@pytest.fixture
def fresh_dynamo():
    """Dynamo caches a graph per optimizer (it guards on the optimizer's identity) under torch.optim's
    one code object: the agents a test makes beside the module's would bring the later tests to its
    recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("preset", ["recipe2024", "v1"])
def test_every_chunk_of_the_observe_runs_one_compiled_graph(backend, preset):
    """batch_length 12 runs in two chunks of 6. recipe2024's first chunk starts from the replay
    context's latents (deter and stoch, no gradient), v1's from the initial state (with its logits),
    and every later chunk from the last one's posterior (with a gradient); each key set and each
    requires_grad was a graph of its own (Inductor: over a minute more of warm-up at recipe2024
    size1m on a CPU). Only deter and stoch are carried, and the first start needs a gradient too."""
    flags = ("--configs", "recipe2024", "debug") if preset == "recipe2024" else ()
    config = cfg.parse([*SHORT, *flags, "--batch_length", "12", "--compile", "update"])
    assert (config.replay_context > 0) == (preset == "recipe2024")
    env, agent, graphs = agent_and_graph_count(config, networks.RSSM.observe_chunk)
    keys = []
    original = agent.wm.rssm.observe_chunk
    agent.wm.rssm.observe_chunk = lambda state, *args: keys.append(sorted(state)) or original(state, *args)
    run_updates(agent, batches(env, config, 2))
    assert keys == [["deter", "stoch"]] * (2 * 2)  # two chunks per update
    assert graphs() == 1


def test_the_compiled_policy_acts_as_the_eager_one(compared):
    case, compiled, _, _ = compared
    obs_space, act_space = spaces_of(compiled)
    eager = dreamer.Dreamer(obs_space, act_space, compiled.config.replace(compile=False)).to(DEVICE)
    eager.load_state_dict(compiled.state_dict())
    obs = {k: np.stack([space.sample() for _ in range(3)]) for k, space in obs_space.items()}  # 3 environments
    for mode in ("train", "eval"):
        actions = []
        for agent in (eager, compiled):
            torch.manual_seed(5)
            action, state = agent.policy(obs, None, mode)
            action, _ = agent.policy(obs, state, mode)  # from a latent, not the initial state
            actions.append(action)
        np.testing.assert_allclose(actions[1], actions[0], rtol=1e-4, atol=1e-5, err_msg=f"{case} {mode}")
    assert compiled.act.calls == 4, case


def spaces_of(agent):
    env = envs.make_env(agent.config, "train", 0)
    return env.obs_space, env.act_space


def test_a_run_trains_saves_and_resumes_with_the_whole_update_compiled(backend, tmp_path, capsys):
    logdir = tmp_path / "run"
    # debug's one-frame random prefill: recipe2024's own start would act until one batch (200 steps) is held.
    flags = ["--configs", "debug", "recipe2024", *SHORT[2:], "--compile", "update", "--eval_episode_num", "1",
             "--prefill_policy", "random", "--logdir", str(logdir)]
    dreamer.main([*flags, "--steps", "60"])
    out = capsys.readouterr().out
    assert "Compile: on, the whole update" in out and "compile warm-up (first update)" in out
    dreamer.main([*flags, "--steps", "80"])  # resumed: the optimizers' loaded state recompiles their steps once
    rows = [line for line in (logdir / "metrics.jsonl").read_text().splitlines() if "world_model/model_loss" in line]
    assert len(rows) >= 2 and "Run: resumed from frame 60" in capsys.readouterr().out


class HostReads:
    """Counts the Tensor methods that read a value back to the host (on CUDA: a synchronisation)."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                self.calls.append(_name)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_no_value_is_read_back_to_the_host_inside_an_update(compared, monkeypatch):
    case, compiled, _, _ = compared
    env = envs.make_env(compiled.config, "train", 0)
    batch = {k: torch.as_tensor(np.asarray(v), device=DEVICE) for k, v in batches(env, compiled.config, 1)[0].items()}
    data = compiled.wm.preprocess(batch)
    reads = HostReads(monkeypatch)
    torch.tensor(1.0).item()  # the counter sees a read
    assert reads.calls == ["item"]
    reads.calls.clear()
    # A batch of tensors, as a replay on the device gives it: the replay context's latents for the
    # write-back stay tensors too (a host replay's batch takes them back as numpy arrays).
    compiled.update.train_step(batch, data)
    assert reads.calls == [], case


# ----------------------------------------------------------------------------------------------
# Errors, refusals and the auto choice
# ----------------------------------------------------------------------------------------------


def test_a_region_that_is_not_one_graph_is_an_error_naming_it():
    def reads_a_value(x):
        return x * 2 if x.sum().item() > 0 else x

    region = compilation.Region(reads_a_value, "Example.loss", cuda_graphs=False)
    with pytest.raises(compilation.CompileError,
                       match=r"Example\.loss cannot be compiled as one graph.*--compile True"):
        region(torch.ones(3))
    assert region.calls == 0


@pytest.mark.parametrize("name", ["Example.sample", "RSSM.observe_chunk"])  # Python and C++ wrappers
def test_a_cpu_region_draws_the_random_numbers_an_eager_run_draws(name):
    """Inductor itself with its own generator, the global switch back off (this module's fixture
    turns fallback_random on for every compile): a region off CUDA still draws the samples' noise by torch.rand and
    normal_, from the generator an eager run draws from, in the same order, also the filter's
    chunk, which Inductor's C++ wrapper calls (compilation.CPP_WRAPPED)."""
    def noisy(x):
        return x * distributions.uniform(x.shape, x.device) + distributions.normal(x.shape, x.device)

    x = torch.linspace(-1.0, 1.0, 4096)
    torch.manual_seed(3)
    want = noisy(x)
    with torch._inductor.config.patch(fallback_random=False):
        region = compilation.Region(noisy, name, cuda_graphs=False)
        torch.manual_seed(3)
        got = region(x)
    assert region.calls == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_only_the_recurrent_chunks_are_compiled_with_inductors_cpp_wrapper_and_only_off_cuda(monkeypatch):
    """The regions of recurrent steps (the filter's and the imagination's chunks) call their kernels
    from C++ on the CPU; every other region keeps the Python wrapper; on CUDA every region is a CUDA
    graph."""
    calls = []  # not the `backend` fixture's own compile of each region, where a test before set it up
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: "backend" in kwargs or calls.append(kwargs) or fn)
    names = ["RSSM.observe_chunk", "ActorCritic.imagine_steps", "WorldModel.loss_terms", "Dreamer.act"]
    for name in names:
        compilation.Region(lambda x: x, name, cuda_graphs=False)
    assert [kwargs["options"]["cpp_wrapper"] for kwargs in calls] == [True, True, False, False]
    assert all(kwargs["options"]["fallback_random"] and "mode" not in kwargs for kwargs in calls)
    calls.clear()
    for name in names:
        compilation.Region(lambda x: x, name, cuda_graphs=True)
    assert calls == [{"fullgraph": True, "dynamic": False, "mode": "reduce-overhead"}] * len(names)


def test_a_region_reports_dynamos_recompile_limit_error_as_a_compile_error(backend):
    region = compilation.Region(lambda x: x * 2, "Example.step", cuda_graphs=False)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        region(torch.ones(3))
        with pytest.raises(compilation.CompileError, match=r"Example\.step cannot be compiled as one graph"):
            region(torch.ones(4))  # another shape: a second variant
    assert region.calls == 1


def test_compile_update_makes_a_region_past_the_recompile_limit_an_error_not_an_eager_fallback(backend):
    """compile_update's own settings, from dynamo's defaults (which would run the extra variants
    eagerly): a region may take up to recompile_limit variants, and the next is a CompileError."""
    owner = types.SimpleNamespace(step=lambda x: x * 2)
    agent = types.SimpleNamespace(config=types.SimpleNamespace(device=DEVICE), regions=lambda: [(owner, "step")],
                                  update=types.SimpleNamespace(train_step=lambda batch: None))
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=False):
        [region] = compilation.compile_update(agent)
        assert owner.step is region
        limit = torch._dynamo.config.recompile_limit
        assert limit >= 8 and torch._dynamo.config.fail_on_recompile_limit_hit
        for n in range(1, limit + 1):
            region(torch.ones(n, device=DEVICE))
        with pytest.raises(compilation.CompileError, match=r"SimpleNamespace\.step cannot be compiled as one graph"):
            region(torch.ones(limit + 1, device=DEVICE))
    assert region.calls == limit


def test_compile_update_is_refused_under_torchrun(spaces):
    config = cfg.parse([*SHORT, "--compile", "update"])
    agent = dreamer.Dreamer(*spaces, config)

    class TwoRanks(launch.SingleProcess):
        world_size = 2

    with pytest.raises(tools.ConfigError, match="--compile update does not run under torchrun.*--compile True"):
        agent.distribute(TwoRanks())


def test_compile_auto_is_the_whole_update_on_cuda_and_per_step_under_torchrun(monkeypatch):
    config = cfg.parse(["--configs", "debug", "--device", "cuda"])
    decision, reason = compilation.compile_choice(config, counts=None)
    assert decision == "update" and "CUDA graphs" in reason
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert compilation.compile_choice(config, counts=None)[0] is True


def test_compile_update_parses_and_the_summary_names_it():
    config = cfg.parse(["--configs", "debug", "--compile", "update"])
    assert config.compile == "update"
    assert cfg.compile_note(config).startswith("on, the whole update (on a CPU measured 1.83x faster")
    cuda = cfg.parse(["--configs", "debug", "--compile", "update", "--device", "cuda"])
    assert cfg.compile_note(cuda).startswith("on, the whole update as CUDA graphs (the first updates")
    with pytest.raises(tools.ConfigError, match="update"):  # the error lists the valid values
        cfg.parse(["--configs", "debug", "--compile", "whole"])
