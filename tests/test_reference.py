"""The product's update against the reference written out in tests/reference.py, for both recipes.

The reference shares nothing with the product but the networks' weights (it imports no product module: the
first test checks that). The data are such that a slip shows: every step's observation, reward and continue
flag differ, episodes start mid-sequence (after an episode's last step, terminal or truncated), the reward, critic
and slow-critic heads have weights (they start at zero), the continue head predicts both outcomes, the return
normalisation starts from EMAs whose scale exceeds 1 and the clipping thresholds lie below the gradients' norms.
One update of each recipe is compared: every loss term and metric, every network's clipped gradient, every
parameter after the step, the return normaliser's EMAs, the slow critic and the posterior latents.
"""

import ast
import copy
import importlib.util
import pathlib
import sys

import gymnasium
import numpy as np
import pytest
import torch

import config as cfg
import dreamer

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
PRODUCT = {p.stem for p in ROOT.glob("*.py")} | {"envs"}

sys.path.insert(0, str(HERE))
import reference  # noqa: E402

ACTIONS = 3
# Each recipe on the debug sizes. v1's clipping thresholds are set below its gradients' norms so that the clip
# acts; recipe2024's warm-up is off so that its first step moves the weights (its ramp has its own test,
# test_recipe2024.py's LaProp reference).
RECIPES = {
    "v1": ("--configs", "debug", "--grad_clip", "3", "--actor.grad_clip", "0.05", "--critic.grad_clip", "1"),
    "recipe2024": ("--configs", "recipe2024", "debug", "--warmup", "0", "--decoder.cnn_depth", "8"),
}
NORM_START = (-3.0, 5.0)  # the return normaliser's EMAs before the update: scale ~8, offset -3


# -- the reference is not the product ----------------------------------------------------------------------


def test_the_reference_imports_no_product_module():
    """Its imports, read from its source, are outside the product; and loading it afresh, with every product
    module hidden and any import of one refused, works."""
    source = (HERE / "reference.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported and not imported & PRODUCT, sorted(imported & PRODUCT)

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in PRODUCT:
                raise ImportError(f"the reference imports the product module {name}")
            return None

    hidden = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in PRODUCT}
    sys.meta_path.insert(0, Refuse())
    try:
        spec = importlib.util.spec_from_file_location("reference_alone", HERE / "reference.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert not any(name.split(".")[0] in PRODUCT for name in sys.modules)
    finally:
        sys.meta_path.pop(0)
        sys.modules.update(hidden)
    assert hasattr(module, "update")
    # Nothing it names at module level comes from the product either.
    assert not {getattr(v, "__module__", "") for v in vars(module).values()} & PRODUCT


# -- the data -----------------------------------------------------------------------------------------------


def spaces():
    obs = {"image": gymnasium.spaces.Box(0, 255, (16, 16, 3), dtype=np.uint8),
           "vec": gymnasium.spaces.Box(-np.inf, np.inf, (5,), dtype=np.float32)}
    obs.update({k: gymnasium.spaces.Box(0, 1, (), dtype=bool) for k in ("is_first", "is_last", "is_terminal")})
    return obs, gymnasium.spaces.Box(-1, 1, (ACTIONS,), dtype=np.float32)


def make_batch(config, batch=3, length=7, seed=0):
    """(B, K + T) steps where every step differs: images and vectors drawn afresh, rewards spread over several
    units and apart at every step, actions in the box; episodes start mid-sequence in every row, each after a
    last step (row 0: terminal, row 1: truncated, row 2: terminal and then truncated); the replay context's
    stored latents (K steps) random."""
    rng = np.random.default_rng(seed)
    k = config.replay_context
    steps = k + length
    data = {"image": rng.integers(0, 256, (batch, steps, 16, 16, 3), dtype=np.uint8),
            "vec": (rng.normal(size=(batch, steps, 5)) * 2 + np.arange(steps)[None, :, None]).astype(np.float32),
            "action": rng.uniform(-1, 1, (batch, steps, ACTIONS)).astype(np.float32),
            "reward": (rng.normal(size=(batch, steps)) * 3 + np.linspace(-4, 4, steps)).astype(np.float32)}
    is_first, is_last, is_terminal = (np.zeros((batch, steps), bool) for _ in range(3))
    for row, ends in enumerate([[(3, True)], [(2, False)], [(1, True), (4, False)]]):
        for end, terminal in ends:
            is_last[row, k + end] = True
            is_terminal[row, k + end] = terminal
            is_first[row, k + end + 1] = True
    is_first[0, k] = True  # and one row starts an episode at its first trained step
    data.update(is_first=is_first, is_last=is_last, is_terminal=is_terminal)
    if k:
        data["latent_deter"] = rng.normal(size=(batch, steps, config.dyn_deter)).astype(np.float32)
        stoch = np.eye(config.dyn_discrete, dtype=np.float32)[
            rng.integers(0, config.dyn_discrete, (batch, steps, config.dyn_stoch))]
        data["latent_stoch"] = stoch
    return data


def make_agent(flags):
    config = cfg.parse([*flags, "--device", "cpu", "--compile", "False"])
    torch.manual_seed(0)
    agent = dreamer.Dreamer(*spaces(), config)
    gen = torch.Generator().manual_seed(1)
    behavior = agent.task_behavior
    with torch.no_grad():  # heads that start at zero would hide every error in what flows through them
        for layer, scale in ((agent.wm.heads["reward"].out, 0.3), (behavior.critic.out, 0.3),
                             (behavior.slow_critic.out, 0.3), (agent.wm.heads["cont"].out, 3.0)):
            layer.weight.copy_(scale * torch.randn(layer.weight.shape, generator=gen))
            layer.bias.copy_(scale * torch.randn(layer.bias.shape, generator=gen))
        behavior.return_norm.low.fill_(NORM_START[0])
        behavior.return_norm.high.fill_(NORM_START[1])
    return agent


@pytest.fixture(scope="module", params=list(RECIPES))
def compared(request):
    """One product update and the reference's, from the same weights, data and random numbers."""
    agent = make_agent(RECIPES[request.param])
    twin = copy.deepcopy(agent)
    before = {name: p.detach().clone() for name, p in agent.named_parameters()}
    batch = make_batch(agent.config)
    torch.manual_seed(7)
    metrics, latents = agent.update.train_step(copy.deepcopy(batch))
    torch.manual_seed(7)
    norm = tuple(torch.tensor(v) for v in NORM_START)
    want = reference.update(twin, batch, norm)
    return request.param, agent, twin, before, {k: float(v) for k, v in metrics.items()}, latents, want


def product_grads(agent):
    groups = {"wm": agent.wm, "actor": agent.task_behavior.actor, "critic": agent.task_behavior.critic}
    return {f"{group}.{name}": p.grad for group, module in groups.items() for name, p in module.named_parameters()}


# -- the comparisons ----------------------------------------------------------------------------------------


def test_the_data_make_slips_visible(compared):
    """Every replayed reward differs, the continue flags differ, and the imagined continue flags, the clipping
    and the return normalisation all act (otherwise the comparisons below could not see their slips)."""
    recipe, agent, _, _, metrics, _, (want, grads, _, norm) = compared
    batch = make_batch(agent.config)
    assert len(np.unique(batch["reward"])) == batch["reward"].size
    assert 0 < batch["is_terminal"].mean() < 1 and batch["is_first"][:, 1:].any(axis=1).all()
    assert want["return_scale"] > 1.5
    if recipe == "v1":
        assert want["model_grad_norm"] > agent.config.grad_clip
        assert want["actor_grad_norm"] > agent.config.actor.grad_clip
        assert want["critic_grad_norm"] > agent.config.critic.grad_clip


def test_every_loss_term_and_metric_equals_the_reference(compared):
    recipe, _, _, _, metrics, _, (want, _, _, _) = compared
    keys = {"image_loss", "vec_loss", "rew_loss", "con_loss", "kl_loss", "dyn_loss", "rep_loss", "model_loss",
            "actor_loss", "critic_loss", "return_scale"}
    keys |= {"critic_repval_loss"} if recipe == "recipe2024" else {"model_grad_norm", "actor_grad_norm",
                                                                    "critic_grad_norm"}
    assert keys <= set(want) and keys <= set(metrics), sorted(keys - set(metrics))
    for key in sorted(keys, key=lambda k: (k.endswith("grad_norm"), k)):  # the losses first
        assert metrics[key] == pytest.approx(want[key], rel=2e-5, abs=1e-6), (recipe, key)


def test_every_gradient_equals_the_reference(compared):
    """The gradient each parameter received (after clipping) is the reference's: none missing, none extra."""
    recipe, agent, _, _, _, _, (_, grads, _, _) = compared
    got = product_grads(agent)
    missing = sorted(name for name in grads if got[name] is None)
    assert not missing, f"{recipe}: no gradient for {missing[:5]}"
    extra = sorted(name for name, g in got.items() if g is not None and name not in grads and g.any())
    assert not extra, f"{recipe}: gradients the reference has not: {extra[:5]}"
    for name, want in grads.items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-10,
                                   msg=lambda m, name=name: f"{recipe} {name}: {m}")


def test_every_parameter_after_the_update_equals_the_reference(compared):
    recipe, agent, twin, before, _, _, _ = compared
    want = dict(twin.named_parameters())
    config, moved = agent.config, 0
    for name, p in agent.named_parameters():
        # An Adam or LaProp step of a gradient near its epsilon turns on the gradient's last bits: a tolerance of
        # a few percent of the learning rate (every step is about the rate).
        lr = config.actor.lr if ".actor." in name else config.critic.lr if ".critic." in name else config.model_lr
        torch.testing.assert_close(p.detach(), want[name].detach(), rtol=1e-5, atol=0.05 * lr,
                                   msg=lambda m, name=name: f"{recipe} {name}: {m}")
        moved += int(not torch.equal(p.detach(), before[name]))
    assert moved > 0.9 * len(before), (recipe, moved, len(before))


def test_the_return_normalisation_and_the_slow_critic_after_the_update_equal_the_reference(compared):
    recipe, agent, twin, _, _, _, (_, _, _, norm) = compared
    behavior = agent.task_behavior
    assert float(behavior.return_norm.low) == pytest.approx(float(norm[0]), rel=1e-5), recipe
    assert float(behavior.return_norm.high) == pytest.approx(float(norm[1]), rel=1e-5), recipe
    for (name, p), q in zip(behavior.slow_critic.named_parameters(), twin.task_behavior.slow_critic.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{recipe} {name}: {m}")


def test_the_posterior_latents_equal_the_reference(compared):
    """The posteriors the update filtered (recipe2024 writes them back into the replay) are the reference's,
    resets at the episode starts included."""
    recipe, agent, _, _, _, latents, (_, _, posterior, _) = compared
    if latents is None:  # v1 keeps no latents; its losses above depend on the same filtering
        assert agent.config.replay_context == 0
        return
    torch.testing.assert_close(latents["latent_deter"], posterior["deter"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(latents["latent_stoch"], posterior["stoch"])
