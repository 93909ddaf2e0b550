"""compile 'update' under CUDA-graph trees, checked on the CPU, and its graphs' size.

CUDA-graph trees (torch.compile mode 'reduce-overhead') reuse a graph's output memory after the next
`torch.compiler.cudagraph_mark_step_begin()`, skip the graph of a region that mutates an input whose
address is not static, and replay a region's attribute side effects with values that the next replay
overwrites. Without a GPU these tests check what the CUDA path rests on: one mark per update and per
policy call, first, and never between a forward region and its backward pass (the mark is recorded
with compile_update's CUDA-graph decision forced on); no region sets an attribute; every input a
region mutates is static or a gradient (which on CUDA is the backward graph's own output), read from
AOTAutograd's metadata as Inductor's check for CUDA graphs reads it. And the chunked recurrences:
the compiled graphs do not grow with batch_length and imag_horizon, and the update compiled in
chunks equals the eager one.

The regions run as AOTAutograd graphs of ATen operators (no code generation), as in
tests/test_whole_update.py.
"""

import copy

import numpy as np
import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._guards import TracingContext

import compilation
import config as cfg
import dreamer
import envs
import models
import networks
import storage

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo caches a graph per optimizer (it guards on the optimizer's identity) under one code
    object, whose recompile limit the many agents of these tests would otherwise reach together."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()

SHORT = ("--configs", "debug", "--device", "cpu", "--batch_length", "6", "--imag_horizon", "3")


def batches(config, count, seed=0):
    """`count` replayed batches (B, K + T, ...) of one random episode stream."""
    env = envs.make_env(config, "train", 0)
    replay = storage.Replay(1000, 1, seed=seed)
    obs, action = env.reset(), np.zeros(env.act_space.shape, np.float32)
    rng = np.random.default_rng(seed)
    context = models.ReplayContext(config)
    for _ in range(80):
        replay.add({**obs, "action": action, "reward": np.float32(rng.normal()),
                    **{k: v[0] for k, v in context.entries(None, 1).items()}})
        action = rng.uniform(-1, 1, env.act_space.shape).astype(np.float32)
        obs, _, done, _ = env.step(action)
        if done:
            obs = env.reset()
    return env, [replay.sample(config.batch_size, config.batch_length + config.replay_context)
                 for _ in range(count)]


def compiled_with(monkeypatch, backend, cuda_graphs=False):
    """Make every region compile with `backend`; with `cuda_graphs`, compile_update decides as on CUDA."""
    original = compilation.Region.__init__

    def init(self, fn, name, *args, **kwargs):
        original(self, fn, name, *args, **kwargs)
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
        if cuda_graphs:
            self.cuda_graphs = True

    monkeypatch.setattr(compilation.Region, "__init__", init)
    if cuda_graphs:
        monkeypatch.setattr(compilation, "captures_cuda_graphs", lambda config: True, raising=False)


def make_agent(*flags, compile_="update"):
    config = cfg.parse([*SHORT, *flags, "--compile", compile_])
    env, data = batches(config, 3)
    torch.manual_seed(0)
    return dreamer.Dreamer(env.obs_space, env.act_space, config), data


# ----------------------------------------------------------------------------------------------
# Step marks
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [("--configs", "recipe2024", "debug"),  # joint: every forward before one backward
                                   ("--expl_behavior", "plan2explore", "--imag_gradient", "dynamics")])
def test_one_step_mark_per_update_and_per_policy_call_and_none_between_a_forward_and_its_backward(
        monkeypatch, flags):
    compiled_with(monkeypatch, "aot_eager", cuda_graphs=True)
    agent, data = make_agent(*flags)
    events = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("mark"))
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: events.append("backward") or backward(*a, **k))
    region_call = compilation.Region.__call__
    monkeypatch.setattr(compilation.Region, "__call__",
                        lambda self, *a, **k: events.append(self.name) or region_call(self, *a, **k))
    train_step = agent.update.train_step
    agent.update.train_step = lambda *a, **k: events.append("update") or train_step(*a, **k)
    obs = {k: v[:, 0] for k, v in data[0].items()}
    _, state = agent.policy(obs, None, "train")
    for batch in data[:2]:
        agent.update.train_step(batch)
        events.append("policy")
        _, state = agent.policy(obs, state, "train")
    # Split into steps: each update, then each policy call.
    steps, current = [], None
    for event in events:
        if event in ("update", "policy"):
            current = [event]
            steps.append(current)
        elif current is not None:
            current.append(event)
    assert [step[0] for step in steps] == ["update", "policy"] * 2
    for step in steps:
        kind, rest = step[0], step[1:]
        assert rest.count("mark") == 1, (kind, rest)
        if kind == "update":
            # The mark begins the update, before its first region: no mark between a forward and its backward.
            assert rest[0] == "mark" and "backward" in rest, rest
            forwards = rest.index("backward")
            assert len([e for e in rest[:forwards] if e != "mark"]) > 1, rest  # several forward regions first
        else:  # the policy step is the one region, which marks as it is called (recorded before it)
            assert rest == ["Dreamer.act", "mark"], rest


def test_what_an_update_and_a_policy_call_return_is_copied_out_of_the_graphs_outputs(monkeypatch):
    """Metrics, latents and actions outlive their step: on CUDA the memory of a graph's outputs is
    overwritten by the next step's replay, so what a step returns is a copy."""
    compiled_with(monkeypatch, "aot_eager", cuda_graphs=True)
    agent, data = make_agent("--configs", "recipe2024", "debug")
    outputs = []
    for region in agent.compiled:
        def recorded(*args, _compiled=region.compiled, **kwargs):
            result = _compiled(*args, **kwargs)
            outputs.extend(torch.utils._pytree.tree_leaves(result))
            return result

        region.compiled = recorded
    metrics, latents = agent.update.train_step(data[0])
    obs = {k: v[:, 0] for k, v in data[0].items()}
    _, (latent, action, _) = agent.policy(obs, None, "train")
    returned = [*metrics.values(), *latents.values(), *latent.values(), action]
    assert len(outputs) > len(returned)
    graph_outputs = {id(t) for t in outputs if isinstance(t, torch.Tensor)}
    assert not [t for t in returned if id(t) in graph_outputs]


# ----------------------------------------------------------------------------------------------
# No side effect, static state
# ----------------------------------------------------------------------------------------------


def attributes(agent):
    """Every attribute of the agent's modules and optimizers, by identity."""
    owners = [*agent.modules(), *agent.optimizers().values(), *[opt.opt for opt in agent.optimizers().values()]]
    return {(id(owner), name): id(value) for owner in owners for name, value in vars(owner).items()}


def test_a_region_sets_no_attribute_of_any_module_or_optimizer(monkeypatch):
    """Plan2Explore's intrinsic reward statistics are returned with the loss's metrics: an attribute
    set inside a CUDA graph would hold tensors that the next replay overwrites."""
    compiled_with(monkeypatch, "aot_eager")
    agent, data = make_agent("--expl_behavior", "plan2explore", "--imag_gradient", "dynamics")
    agent.update.train_step(data[0])  # the first update creates the optimizers' state
    changed = []
    region_call = compilation.Region.__call__

    def call(self, *args, **kwargs):
        before = attributes(agent)
        result = region_call(self, *args, **kwargs)
        after = attributes(agent)
        changed.extend((self.name, key) for key in after if before.get(key) != after[key])
        return result

    monkeypatch.setattr(compilation.Region, "__call__", call)
    metrics, _ = agent.update.train_step(data[1])
    assert not changed, changed
    assert {"expl_intr_reward_mean", "expl_intr_reward_std", "expl_intr_reward_max"} <= set(metrics)


def test_every_input_a_region_mutates_is_static_or_a_gradient(monkeypatch):
    """The optimizers' moments, counts and gradient norms, the slow critics and the return
    normalisation are updated in place at static addresses, so that CUDA-graph trees capture the
    optimizer steps rather than skip them; the only other mutated inputs are the gradients (clipped
    in place), which on CUDA are outputs of the backward graph's replay, as Inductor allows."""
    found = {}

    def backend(gm, example_inputs):
        def forward(graph, inputs):
            meta = TracingContext.get().fw_metadata
            lifted = len(inputs) - len(example_inputs)  # parameters and buffers first
            grads = {id(p.grad) for p in agent.parameters() if p.grad is not None}
            for index in meta.mutated_inp_runtime_indices:
                if index < lifted or index in meta.static_input_indices:
                    continue
                example = example_inputs[index - lifted]
                if id(example) not in grads:
                    found.setdefault(name[0], []).append(tuple(example.shape))
            return graph

        name[0] = current[-1]
        return aot_autograd(fw_compiler=forward, bw_compiler=lambda graph, inputs: graph)(gm, example_inputs)

    name, current = [None], []
    compiled_with(monkeypatch, backend)
    agent, data = make_agent("--expl_behavior", "plan2explore", "--imag_gradient", "dynamics", "--critic.repval",
                             "0.3", "--agc", "0.3", "--warmup", "5", "--opt", "laprop")
    region_call = compilation.Region.__call__

    def call(self, *args, **kwargs):
        current.append(self.name)
        return region_call(self, *args, **kwargs)

    monkeypatch.setattr(compilation.Region, "__call__", call)
    for batch in data[:2]:
        agent.update.train_step(batch)
    steps = [region for region in agent.compiled if region.name.endswith(".step")]
    assert len(steps) == 6 and all(region.calls == 2 for region in steps)
    assert not found, f"regions that mutate inputs at addresses that are not static: {found}"


# ----------------------------------------------------------------------------------------------
# The chunked recurrences
# ----------------------------------------------------------------------------------------------


def test_chunk_length_is_the_longest_divisor_up_to_the_unroll():
    assert networks.UNROLL == 8
    want = {64: 8, 15: 5, 16: 8, 6: 6, 3: 3, 7: 7, 11: 1, 24: 8, 50: 5, 1: 1}
    assert {steps: networks.chunk_length(steps) for steps in want} == want


def test_observe_in_chunks_is_bitwise_the_step_by_step_filter(spaces, monkeypatch):
    """The eager path computes what it computed one step at a time: the same draws, bit for bit."""
    monkeypatch.setattr(networks, "UNROLL", 3)
    config = cfg.parse([*SHORT, "--batch_length", "12", "--compile", "False"])
    torch.manual_seed(0)
    agent = dreamer.Dreamer(*spaces, config)
    rssm = agent.wm.rssm
    gen = torch.Generator().manual_seed(1)
    embed = torch.randn(4, 12, agent.wm.encoder.outdim, generator=gen, requires_grad=True)
    action = torch.rand(4, 12, spaces[1].shape[0], generator=gen)
    is_first = (torch.rand(4, 12, generator=gen) < 0.2).float()
    torch.manual_seed(2)
    post = rssm.observe(embed, action, is_first)
    (post["deter"].sum() + post["logit" if "logit" in post else "mean"].sum()).backward()
    grad, embed.grad = embed.grad, None
    torch.manual_seed(2)
    init = rssm.initial(4)
    state, posts = dict(init), []
    for t in range(12):
        state = rssm.obs_step(state, action[:, t], embed[:, t], is_first[:, t], init=init)
        posts.append(state)
    want_post = networks.stack_steps(posts, 1)
    (want_post["deter"].sum() + want_post["logit" if "logit" in post else "mean"].sum()).backward()
    for key in post:
        assert torch.equal(post[key], want_post[key]), key
    assert torch.equal(grad, embed.grad)


def graph_sizes(monkeypatch, *flags):
    """{region name: FX nodes of every graph dynamo captured for it} over one update."""
    sizes, current = {}, []

    def backend(gm, example_inputs):
        sizes.setdefault(current[-1], []).append(len(gm.graph.nodes))
        return gm.forward

    monkeypatch.setattr(networks, "UNROLL", 4)
    compiled_with(monkeypatch, backend)
    region_call = compilation.Region.__call__

    def call(self, *args, **kwargs):
        current.append(self.name)
        return region_call(self, *args, **kwargs)

    monkeypatch.setattr(compilation.Region, "__call__", call)
    agent, data = make_agent(*flags)
    agent.update.train_step(data[0])
    torch._dynamo.reset()  # the next configuration's graphs are counted afresh
    return sizes


def test_the_compiled_graphs_do_not_grow_with_the_sequence_and_the_horizon(monkeypatch):
    """Twice the batch_length and imag_horizon (8 and 4 -> 16 and 8): every region's graphs keep
    their nodes, the recurrences being graphs of one chunk (networks.UNROLL steps) called
    length / chunk times (the imagination's first chunk, from detached starts, is a graph of its
    own). The one exception, stated: the imagined λ-returns (lambda_return, a few elementwise
    operators per step) stay unrolled in the imagined loss."""
    short = graph_sizes(monkeypatch, "--batch_length", "8", "--imag_horizon", "4")
    long = graph_sizes(monkeypatch, "--batch_length", "16", "--imag_horizon", "8")
    assert "RSSM.observe_chunk" in short and "ActorCritic.imagine_steps" in short
    assert set(long) == set(short)
    for name in short:
        if name == "ActorCritic.imagined_loss":
            assert len(long[name]) == len(short[name]) == 1
            assert 0 < long[name][0] - short[name][0] <= 12 * 4, (short[name], long[name])  # 4 more λ-steps
        else:
            assert set(long[name]) == set(short[name]), (name, short[name], long[name])


@pytest.mark.parametrize("flags", [("--configs", "recipe2024", "debug"),
                                   ("--expl_behavior", "plan2explore", "--imag_gradient", "dynamics")])
def test_the_update_compiled_in_chunks_equals_the_eager_update(monkeypatch, flags):
    """Several chunks each (observe 12 steps in 3 of 4, imagination 6 steps in 2 of 3) over 2
    updates: the same metrics, gradients and weights as eager, to float32 tolerance."""
    monkeypatch.setattr(networks, "UNROLL", 4)
    compiled_with(monkeypatch, "aot_eager")
    flags = (*flags, "--batch_length", "12", "--imag_horizon", "6")
    eager, data = make_agent(*flags, compile_="False")
    with torch.no_grad():  # heads that start at zero would hide errors in the gradients through them
        for layer in (eager.wm.heads["reward"].out, eager.task_behavior.critic.out):
            layer.weight.copy_(0.1 * torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(3)))
    compiled, _ = make_agent(*flags)
    compiled.load_state_dict(eager.state_dict())
    results = []
    for agent in (eager, compiled):
        metrics = []
        for step, batch in enumerate(data[:2]):
            torch.manual_seed(step)
            values, _ = agent.update.train_step(copy.deepcopy(batch))
            metrics.append({k: float(v) for k, v in values.items()})
        results.append(metrics)
    for want, got in zip(*results):
        assert set(got) == set(want)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    chunks = {region.name: region.calls for region in compiled.compiled}
    assert chunks["RSSM.observe_chunk"] == 2 * 3 and chunks["ActorCritic.imagine_steps"] >= 2 * 2
