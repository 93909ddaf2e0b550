"""The shape of the code that a researcher relies on when changing one thing: one loss-scale table
that no term escapes, one loss function per learner shared by both update modes, a read-only
config, choices declared once, and imports in one direction (compilation of every network a preset
builds: tests/test_compile.py)."""

import ast
import pathlib

import numpy as np
import pytest
import torch

import dreamer
import envs
import exploration
import models
import networks
import storage
import tools

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_agent(*flags):
    config = dreamer.parse(["--configs", "debug", "--device", "cpu", *flags])
    env = envs.make_env(config, "train", 0)
    torch.manual_seed(0)
    return dreamer.Dreamer(env.obs_space, env.act_space, config), env


def batch_for(agent, env, length=None, seed=0):
    config = agent.config
    replay = storage.Replay(1000, 1, seed=seed)
    obs, action = env.reset(), np.zeros(env.act_space.shape, np.float32)
    rng = np.random.default_rng(seed)
    for _ in range(3 * config.batch_length):
        step = {**obs, "action": action, "reward": np.float32(rng.normal())}
        step.update({k: v[0] for k, v in agent.context.entries(None, 1).items()})
        replay.add(step)
        action = rng.uniform(-1, 1, env.act_space.shape).astype(np.float32)
        obs, _, done, _ = env.step(action)
        if done:
            obs = env.reset()
    return replay.sample(config.batch_size, length or config.batch_length + agent.context.steps)


# -- one loss table ---------------------------------------------------------------------------------


def test_loss_table_holds_every_term_with_its_configured_scale():
    agent, _ = make_agent("--reward_head.loss_scale", "0.5", "--cont_head.loss_scale", "2.0", "--dyn_scale",
                          "0.7", "--rep_scale", "0.2", "--critic.repval", "0.3")
    scales = agent.wm.scales
    # cartpole's image and its two vectors are decoded: a term each
    assert scales == {"image": 1.0, "position": 1.0, "velocity": 1.0, "reward": 0.5, "cont": 2.0, "dyn": 0.7,
                      "rep": 0.2, "actor": 1.0, "critic": 1.0, "repval": 0.3}
    assert agent.wm.terms == {"image", "position", "velocity", "reward", "cont", "dyn", "rep"}
    # Plan2Explore's actor-critic reads the same table: there is one.
    p2e, _ = make_agent("--expl_behavior", "plan2explore")
    assert p2e.expl_behavior.behavior.wm[0] is p2e.wm


def test_reward_scale_multiplies_its_term_in_the_world_model_loss():
    """loss = mean over (B, T) of the sum of the scaled terms and the KL: doubling the reward scale
    adds exactly the unscaled reward term's mean once more."""
    losses = {}
    for scale in (1.0, 2.0):
        agent, env = make_agent("--reward_head.loss_scale", str(scale))
        data = agent.wm.preprocess(batch_for(agent, env))
        torch.manual_seed(1)
        loss, _, _, metrics = agent.wm.loss(data)
        losses[scale] = (loss.item(), metrics["reward_loss"].item())
    assert losses[2.0][1] == pytest.approx(2 * losses[1.0][1], rel=1e-5)
    assert losses[2.0][0] - losses[1.0][0] == pytest.approx(losses[1.0][1], rel=1e-4, abs=1e-6)


def test_a_head_without_a_loss_fails_at_construction(monkeypatch):
    config = dreamer.parse(["--configs", "debug", "--device", "cpu"])
    env = envs.make_env(config, "train", 0)
    real_init = torch.nn.ModuleDict.__init__

    def with_extra(self, modules=None):  # the world model's heads, with one more
        if modules is not None and "reward" in modules:
            modules = {**modules, "value_prefix": torch.nn.Linear(1, 1)}
        real_init(self, modules)

    monkeypatch.setattr(torch.nn.ModuleDict, "__init__", with_extra)
    with pytest.raises(ValueError, match="head 'value_prefix' has no loss in WorldModel.HEAD_LOSSES"):
        models.WorldModel(env.obs_space, env.act_space, config)


def test_a_term_without_a_scale_fails_loudly(monkeypatch):
    agent, env = make_agent()
    data = agent.wm.preprocess(batch_for(agent, env))
    reward_loss = models.WorldModel.HEAD_LOSSES["reward"]
    monkeypatch.setitem(models.WorldModel.HEAD_LOSSES, "reward",
                        lambda self, pred, data: {**reward_loss(self, pred, data), "reward_aux": data["reward"]})
    with pytest.raises(KeyError, match="reward_aux"):
        agent.wm.loss(data)
    # A table without an entry the model computes is refused when the model is built.
    monkeypatch.setattr(models, "loss_scales", lambda config, keys: {"reward": 1.0, "cont": 1.0, "dyn": 1.0,
                                                                      "rep": 1.0})
    with pytest.raises(ValueError, match="without a scale in models.loss_scales: image, position, velocity"):
        make_agent()


def test_a_term_computed_but_not_in_the_model_terms_fails(monkeypatch):
    agent, env = make_agent()
    data = agent.wm.preprocess(batch_for(agent, env))
    monkeypatch.setitem(agent.wm.scales, "reward_aux", 1.0)
    reward_loss = models.WorldModel.HEAD_LOSSES["reward"]
    monkeypatch.setitem(models.WorldModel.HEAD_LOSSES, "reward",
                        lambda self, pred, data: {**reward_loss(self, pred, data), "reward_aux": data["reward"]})
    with pytest.raises(ValueError, match="differ from the scaled ones"):
        agent.wm.loss(data)


# -- one loss per learner, both update modes -----------------------------------------------------------


@pytest.mark.parametrize("update", ["sequential", "joint"])
def test_a_term_added_to_a_loss_reaches_both_update_modes(update, monkeypatch):
    """A term added in WorldModel.loss and one added in ActorCritic.loss show up in the metrics and
    move the weights of either update mode: neither mode has a loss of its own."""
    flags = ["--update", update] + (["--imag_gradient", "reinforce"] if update == "joint" else [])
    wm_loss, ac_loss = models.WorldModel.loss, models.ActorCritic.loss

    def wm_with_term(self, data, start=None):
        loss, post, embed, metrics = wm_loss(self, data, start)
        extra = 1e3 * self.heads["reward"].out.bias.sum()  # pushes the reward head's bias down
        return loss + extra, post, embed, {**metrics, "extra_loss": extra.detach()}

    def ac_with_term(self, start, start_cont, replay=None):
        actor, critic, metrics = ac_loss(self, start, start_cont, replay)
        extra = 1e3 * self.critic.out.bias.sum()
        return actor, critic + extra, {**metrics, "critic_extra_loss": extra.detach()}

    results = {}
    for name, patched in (("plain", False), ("patched", True)):
        if patched:
            monkeypatch.setattr(models.WorldModel, "loss", wm_with_term)
            monkeypatch.setattr(models.ActorCritic, "loss", ac_with_term)
        agent, env = make_agent(*flags)
        batch = batch_for(agent, env)
        torch.manual_seed(2)
        metrics = agent.train_step(batch)
        results[name] = (metrics, agent.wm.heads["reward"].out.bias.detach().clone(),
                         agent.task_behavior.critic.out.bias.detach().clone())
    metrics = results["patched"][0]
    assert "extra_loss" in metrics and "critic_extra_loss" in metrics
    assert "extra_loss" not in results["plain"][0]
    for index in (1, 2):  # the reward head's and the critic's bias moved by the added terms' gradients
        assert (results["patched"][index] < results["plain"][index]).all()


def test_slow_critic_and_prefix_are_applied_once_per_update_in_both_modes():
    for flags in ([], ["--update", "joint", "--imag_gradient", "reinforce"]):
        agent, env = make_agent(*flags)
        batch = batch_for(agent, env)
        before = int(agent.task_behavior.updates)
        agent.train_step(batch)
        assert int(agent.task_behavior.updates) == before + 1, flags
    agent, env = make_agent("--expl_behavior", "plan2explore")
    metrics = agent.train_step(batch_for(agent, env))
    assert "expl_actor_loss" in metrics and "actor_loss" in metrics
    assert int(agent.expl_behavior.behavior.updates) == 1 and int(agent.task_behavior.updates) == 1


# -- the read-only config --------------------------------------------------------------------------


def test_the_settled_config_is_read_only():
    config = dreamer.parse(["--configs", "debug"])
    with pytest.raises(AttributeError, match="read-only"):
        config.batch_size = 3
    with pytest.raises(AttributeError, match="read-only"):
        config.actor.lr = 1.0
    with pytest.raises(AttributeError, match="read-only"):
        del config.task
    changed = config.replace({"actor.lr": 1.0}, batch_size=3)
    assert (changed.actor.lr, changed.batch_size) == (1.0, 3)
    assert (config.actor.lr, config.batch_size) != (1.0, 3)  # the original is untouched
    with pytest.raises(KeyError, match="no config key 'actor.nope'"):
        config.replace({"actor.nope": 1})
    # Lists handed out by to_dict are copies: editing one changes nothing.
    config.to_dict()["size"].append(7)
    assert len(config.size) == 2


def test_auto_keys_are_settled_once_into_a_new_config():
    config = dreamer.parse(["--configs", "debug", "--device", "cpu", "--compile", "auto"])
    env = envs.make_env(config, "train", 0)
    settled, resolved = models.resolve_auto(config, env.act_space)
    assert set(resolved) == {"actor.dist", "imag_gradient", "compile"}
    assert (settled.actor.dist, settled.imag_gradient, settled.compile) == ("normal", "dynamics", False)
    assert config.actor.dist == "auto"  # parse's config stays as it was
    again, resolved = models.resolve_auto(settled, env.act_space)
    assert again is settled and resolved == {}  # a settled config settles to itself
    agent = dreamer.Dreamer(env.obs_space, env.act_space, settled)
    assert agent.config is settled


def test_a_normal_actor_refuses_std_none():
    config = dreamer.parse(["--configs", "debug", "--device", "cpu", "--actor.std", "none"])
    env = envs.make_env(config, "train", 0)
    with pytest.raises(tools.ConfigError, match="Invalid value 'none' for --actor.std"):
        models.resolve_auto(config, env.act_space)


def test_every_choice_is_declared_by_one_module():
    tables = [networks.CHOICES, models.CHOICES, exploration.CHOICES, envs.CHOICES]
    import parallel

    tables.append(parallel.CHOICES)
    keys = [key for table in tables for key in table]
    assert len(keys) == len(set(keys)), "a choice declared twice"
    assert set(keys) == set(dreamer.CHOICES)
    defaults = tools.flatten(tools.load_presets()["defaults"])
    assert set(keys) <= set(defaults), set(keys) - set(defaults)


# -- imports in one direction ----------------------------------------------------------------------

# What each module may import of the project: dreamer.py -> exploration -> models -> networks ->
# storage, logs -> tools; parallel.py and envs/ know nothing about models; logs.py reads the suites'
# metrics of envs/; tools.py imports nothing of the project; nothing imports dreamer.
ALLOWED = {
    "dreamer": {"exploration", "models", "networks", "storage", "logs", "tools", "parallel", "envs"},
    "exploration": {"models", "networks", "tools"},
    "models": {"networks", "storage", "tools"},
    "networks": {"tools"},
    "storage": {"tools"},
    "logs": {"tools", "envs"},
    "tools": set(),
    "parallel": {"storage", "logs", "tools", "envs"},
}
PROJECT = set(ALLOWED) | {"envs"}


def imports_of(path):
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names & PROJECT


def test_imports_go_one_way_and_nothing_imports_dreamer():
    for name, allowed in ALLOWED.items():
        found = imports_of(ROOT / f"{name}.py") - {name}
        assert found <= allowed, f"{name}.py imports {sorted(found - allowed)}"
    for path in sorted((ROOT / "envs").glob("*.py")):
        assert imports_of(path) <= {"envs"}, f"envs/{path.name} imports {sorted(imports_of(path) - {'envs'})}"
