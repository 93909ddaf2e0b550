"""Changing the algorithm without traps: a new prediction head in three table rows (README's
"Changing the algorithm"), every sample drawn through the helpers --seeds relies on, and every
parameter reached by a compiled region under compile True."""

import ast
import pathlib

import numpy as np
import pytest
import torch
from helpers import batch_for, make_agent  # noqa: E402

import compilation
import config as cfg
import distributions
import dreamer
import envs
import exploration
import models
import networks

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -- a new prediction head, as README's "Changing the algorithm" adds one ------------------------------


@pytest.mark.parametrize("update", ["sequential", "joint"])
def test_a_prediction_head_is_three_table_rows(update, monkeypatch):
    """The README's three edits, each one row: the head's network (WorldModel.HEADS), its loss
    (WorldModel.HEAD_LOSSES) and its term's scale and optimizer (LOSS_TERMS). The update then
    computes, checks, logs and steps the term, the head learns, and its loss trains the
    representation (heads do unless named in stop_grad_heads), under either update mode."""
    flags = ["--update", update] + (["--imag_gradient", "reinforce"] if update == "joint" else [])
    # 1. the network: here the next step's reward from this step's features.
    monkeypatch.setitem(models.WorldModel.HEADS, "next_reward", lambda feat, obs_space, config: networks.Head(
        feat, (), 1, config.units, config.act, config.norm, "symlog_mse", 1.0))
    # 2. its loss terms, (B, T) per replayed step.
    monkeypatch.setitem(models.WorldModel.HEAD_LOSSES, "next_reward", lambda self, pred, data: {
        "next_rew": -pred.log_prob(torch.cat([data["reward"][:, 1:], data["reward"][:, -1:]], 1))})
    # 3. its scale and the optimizer that steps it under update sequential.
    monkeypatch.setitem(models.LOSS_TERMS, "next_rew", (0.5, "model"))

    agent, env = make_agent(*flags)
    head = agent.wm.heads["next_reward"]
    before = [p.detach().clone() for p in head.parameters()]
    data = agent.wm.preprocess(batch_for(agent, env))
    losses, _, _, metrics = models.loss(agent.task_behavior, data, part="world_model")
    assert losses["next_rew"].shape == data["reward"].shape
    representation = [*agent.wm.encoder.parameters(), *agent.wm.rssm.parameters()]
    grads = torch.autograd.grad(losses["next_rew"].mean(), representation, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)  # it trains the representation
    assert float(metrics["next_rew_loss"]) == pytest.approx(float(0.5 * losses["next_rew"].detach().mean()), rel=1e-6)

    metrics, _ = agent.update.train_step(batch_for(agent, env))
    assert "next_rew_loss" in metrics and bool(torch.isfinite(metrics["next_rew_loss"]))
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, head.parameters()))  # it learned


def test_a_head_named_in_stop_grad_heads_keeps_off_the_representation(monkeypatch):
    monkeypatch.setitem(models.WorldModel.HEADS, "aux", lambda feat, obs_space, config: networks.Head(
        feat, (), 1, config.units, config.act, config.norm, "symlog_mse", 1.0))
    monkeypatch.setitem(models.WorldModel.HEAD_LOSSES, "aux", lambda self, pred, data: {
        "aux": -pred.log_prob(data["reward"])})
    monkeypatch.setitem(models.LOSS_TERMS, "aux", (1.0, "model"))
    agent, env = make_agent("--stop_grad_heads", "aux")
    data = agent.wm.preprocess(batch_for(agent, env))
    losses = agent.wm.loss(data)[0]
    representation = [*agent.wm.encoder.parameters(), *agent.wm.rssm.parameters()]
    grads = torch.autograd.grad(losses["aux"].mean(), representation, allow_unused=True)
    assert all(g is None or not g.abs().sum() for g in grads)


# -- every sample through the helpers that --seeds relies on -----------------------------------------


@pytest.mark.parametrize("flags", [[], ["--configs", "debug", "recipe2024"], ["--expl_behavior", "plan2explore"],
                                   ["--expl_behavior", "random"]])
def test_the_update_and_the_policy_draw_only_through_the_sampling_helpers(flags):
    """Under a generator of their own (distributions.generator, as each seed's thread of --seeds
    draws) an update and every policy mode leave torch's global generator where it was: a sample
    that bypasses distributions.uniform / normal (torch.randn, a torch.distributions sample,
    dropout) would draw from it, and under --seeds would fail or repeat another seed's noise."""
    agent, env = make_agent(*flags)
    batch = batch_for(agent, env)
    obs = {k: np.stack([v, v]) for k, v in env.reset().items()}
    own = torch.Generator().manual_seed(5)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with distributions.generator(own):
        agent.update.train_step(batch)
        for mode in ("train", "explore", "eval"):
            agent.policy(obs, None, mode)
    assert torch.equal(torch.get_rng_state(), state)
    # and the helpers did draw from the generator given
    assert not torch.equal(own.get_state(), torch.Generator().manual_seed(5).get_state())


# Calls that draw random numbers, by name: torch's functions and the in-place tensor methods.
RANDOM_FUNCTIONS = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
                    "bernoulli", "multinomial", "poisson"}
RANDOM_METHODS = {"normal_", "uniform_", "bernoulli_", "exponential_", "random_", "geometric_", "cauchy_",
                  "log_normal_", "rsample"}
# Where drawing directly is the point: the helpers themselves, each seed's noise tape (drawn from
# the seed's generator before vmap), and weight initialisation at construction (each seed's agent
# is built under its own seed, outside any update).
DRAWS_ALLOWED = {("distributions.py", "uniform"), ("distributions.py", "normal"), ("seeds.py", "<module>"),
                 ("networks.py", "init_")}


def test_no_product_code_draws_outside_the_sampling_helpers():
    """A static complement of the test above for code it does not run: no product module draws
    random numbers with torch directly outside DRAWS_ALLOWED, and only distributions.py wraps
    torch.distributions (whose samples it takes through the helpers, never .rsample)."""
    found = []
    for path in sorted(ROOT.glob("*.py")):
        tree = ast.parse(path.read_text())
        scopes = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for child in ast.walk(node):
                    scopes.setdefault(id(child), node.name)  # the outermost function: ast.walk goes outer first
        for node in ast.walk(tree):
            scope = (path.name, scopes.get(id(node), "<module>"))
            if isinstance(node, ast.Attribute) and node.attr == "distributions" and path.name != "distributions.py":
                if isinstance(node.value, ast.Name) and node.value.id == "torch":
                    found.append(f"{path.name}:{node.lineno} torch.distributions")
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name, owner = node.func.attr, node.func.value
            direct = name in RANDOM_FUNCTIONS and isinstance(owner, ast.Name) and owner.id == "torch"
            if (direct or name in RANDOM_METHODS) and scope not in DRAWS_ALLOWED:
                found.append(f"{path.name}:{node.lineno} {name} in {scope[1]}")
    assert not found, found


# -- every parameter reached by a compiled region ----------------------------------------------------


# The wrappers of compile True and compile 'update'. The test below builds agents with them and
# calls none, so that it compiles nothing and stays in the fast tier (conftest marks a test that
# names them slow).
STEP_WRAPPER, REGION = compilation.Compiled, compilation.Region

# Parameters that compile True leaves eager on purpose, by the end of their name, and why.
EAGER = {
    ".out.weight": "a head's output layer after its compiled MLP body",
    ".out.bias": "a head's output layer after its compiled MLP body",
    ".out.parts.": "the actor's and decoder's split output layers after a compiled MLP body",
    ".mlp_out.parts.": "the decoder's split output layers after its compiled MLP",
    "task_behavior.critic.mlp.": "run under torch.func.functional_call for the actor's values (compile_steps)",
    "expl_behavior.behavior.critic.mlp.": "as the task's critic",
}


@pytest.mark.parametrize("flags", [
    [],
    ["--configs", "debug", "recipe2024"],
    ["--expl_behavior", "plan2explore"],
])
def test_every_parameter_is_reached_by_a_compiled_region(flags):
    """Under compile True every parameter belongs to a module whose forward is compiled, to the
    RSSM (its obs_step and img_step are), or is eager for a reason in EAGER; a network of any
    class a change adds and compile_steps does not reach fails here, with its name. Under
    compile 'update' the regions are the whole losses and optimizer steps, so every parameter
    that the update trains is inside one: checked by their optimizers' parameters."""
    if flags[:1] != ["--configs"]:
        flags = ["--configs", "debug", *flags]
    config = cfg.parse([*flags, "--device", "cpu", "--compile", "True"])
    env = envs.make_env(config, "train", 0)
    agent = dreamer.Dreamer(env.obs_space, env.act_space, config)
    compiled = {name for name, module in agent.named_modules()
                if isinstance(module.forward, STEP_WRAPPER)}
    compiled |= {name for name, module in agent.named_modules() if isinstance(module, networks.RSSM)
                 and isinstance(module.obs_step, STEP_WRAPPER)}
    missed = []
    for name, _ in agent.named_parameters():
        inside = any(name.startswith(prefix + ".") for prefix in compiled)
        if not inside and not any(part in name or name.endswith(part) for part in EAGER):
            missed.append(name)
    assert not missed, f"parameters no compiled region reaches under --compile True: {missed}"

    update = cfg.parse([*flags, "--device", "cpu", "--compile", "update"])
    agent = dreamer.Dreamer(env.obs_space, env.act_space, update)
    regions = {id(owner): method for owner, method in agent.regions()}
    for optimizer in agent.optimizers().values():
        assert regions.get(id(optimizer.opt)) == "step", optimizer.name
    for owner, name in ((agent.update.wm, "embed"), (agent.update.wm.rssm, "observe_chunk"),
                        (agent.update.wm, "loss_terms")):  # the world model's part, its recurrence in chunks
        assert isinstance(getattr(owner, name), REGION), name
    stepped = {id(p) for optimizer in agent.optimizers().values() for p in optimizer.params}
    unstepped = [name for name, p in agent.named_parameters() if p.requires_grad and id(p) not in stepped]
    assert not unstepped, unstepped
    assert exploration.COMPILED  # the exploration's networks are offered to compile True too
