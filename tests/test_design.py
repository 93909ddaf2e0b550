"""The shape of the code that a researcher relies on when changing one thing: one loss-scale table
that no term escapes, one train step in the official three parts shared by both update modes (which
only choose the optimizers; their order recorded from a run), a read-only config, one schema of its keys
(config.SCHEMA: choices that are the dispatch tables' keys, ranges, the keys free on resume), the
train-ratio arithmetic in one place, and imports in one direction (compilation of every network a preset builds:
tests/test_compile.py)."""

import collections
import pathlib

import pytest
import torch
from helpers import batch_for, make_agent  # noqa: E402

import compilation
import config as cfg
import dreamer
import envs
import exploration
import models
import networks
import optim
import storage
import tools

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -- one loss table ---------------------------------------------------------------------------------


def test_loss_table_holds_every_term_with_its_configured_scale():
    """Every term of models.LOSS_TERMS (its `rec` row one term per decoded key) has the scale its config key says
    (each set here to a value of its own) or its fixed number, in the table's order, and each optimizer of the
    sequential update steps the terms the table gives it: read from the table, not from a list kept here."""
    given = {"reward_head.loss_scale": 0.5, "cont_head.loss_scale": 2.0, "dyn_scale": 0.7, "rep_scale": 0.2,
             "critic.repval": 0.3}
    agent, _ = make_agent(*[arg for key, value in given.items() for arg in (f"--{key}", str(value))])
    decoded = agent.wm.heads["decoder"].keys
    assert len(decoded) >= 2  # cartpole's image and vectors: a term each
    want, owner = {}, {}
    for term, (scale, optimizer) in models.LOSS_TERMS.items():
        for name in (decoded if term == "rec" else [term]):
            want[name] = given[scale] if isinstance(scale, str) else scale
            owner[name] = optimizer
    assert set(given) <= {scale for scale, _ in models.LOSS_TERMS.values()}  # every key set here is in the table
    assert list(agent.wm.scales.items()) == list(want.items())
    stepped = {name: set(terms) for name, (_, terms) in agent.update.optimizers.items()}
    assert stepped == {name: {t for t, o in owner.items() if o == name} for name in set(owner.values())}
    # Plan2Explore's actor-critic reads the same table: there is one.
    p2e, _ = make_agent("--expl_behavior", "plan2explore")
    assert p2e.expl_behavior.behavior.wm[0] is p2e.wm


def test_reward_scale_multiplies_its_term_in_the_world_model_loss():
    """loss = the sum of each term's mean over (B, T) times its scale: doubling the reward scale
    adds exactly the unscaled reward term's mean once more."""
    losses = {}
    for scale in (1.0, 2.0):
        agent, env = make_agent("--reward_head.loss_scale", str(scale))
        data = agent.wm.preprocess(batch_for(agent, env))
        torch.manual_seed(1)
        terms, _, _, metrics = agent.wm.loss(data)
        losses[scale] = (models.scaled_sum(terms, agent.wm.scales).item(), metrics["rew_loss"].item())
    assert losses[2.0][1] == pytest.approx(2 * losses[1.0][1], rel=1e-5)
    assert losses[2.0][0] - losses[1.0][0] == pytest.approx(losses[1.0][1], rel=1e-4, abs=1e-6)


def test_a_head_without_a_loss_fails_at_construction(monkeypatch):
    config = cfg.parse(["--configs", "debug", "--device", "cpu"])
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
    monkeypatch.undo()
    # A table without the decoded keys' scale fails the first update, naming a term.
    monkeypatch.setitem(models.LOSS_TERMS, "rec", ("no.such.key", "model"))
    with pytest.raises(KeyError, match="no.such.key"):
        make_agent()


def test_a_term_with_a_scale_but_no_optimizer_fails_the_update(monkeypatch):
    """A term computed and scaled that no optimizer of the sequential update steps would be dropped
    silently: the update refuses it, naming it."""
    agent, env = make_agent()
    monkeypatch.setitem(agent.wm.scales, "reward_aux", 1.0)  # scaled, but in no optimizer's terms
    reward_loss = models.WorldModel.HEAD_LOSSES["reward"]
    monkeypatch.setitem(models.WorldModel.HEAD_LOSSES, "reward",
                        lambda self, pred, data: {**reward_loss(self, pred, data), "reward_aux": data["reward"]})
    with pytest.raises(KeyError, match=r"\['reward_aux'\] are stepped by no optimizer"):
        agent.update.train_step(batch_for(agent, env))


# -- one loss per learner, both update modes -----------------------------------------------------------


@pytest.mark.parametrize("update", ["sequential", "joint"])
def test_a_term_added_to_a_loss_reaches_both_update_modes(update, monkeypatch):
    """A term added as the README says (its function and a row of models.LOSS_TERMS) and one added
    in ActorCritic.loss show up in the metrics and move the weights of either update mode: neither
    mode has a loss of its own."""
    flags = ["--update", update] + (["--imag_gradient", "reinforce"] if update == "joint" else [])
    ac_loss = models.ActorCritic.loss
    reward_loss = models.WorldModel.HEAD_LOSSES["reward"]

    def reward_with_term(self, pred, data):  # a new term of the world model: a head's loss and a scale
        extra = 1e3 * self.heads["reward"].out.bias.sum()  # pushes the reward head's bias down
        return {**reward_loss(self, pred, data), "extra": extra * torch.ones_like(data["reward"])}

    def ac_with_term(self, start, start_cont):
        terms, returns, metrics = ac_loss(self, start, start_cont)
        extra = 1e3 * self.critic.out.bias.sum()
        return {**terms, "value": terms["value"] + extra}, returns, {**metrics, "critic_extra_loss": extra.detach()}

    results = {}
    for name, patched in (("plain", False), ("patched", True)):
        if patched:
            monkeypatch.setitem(models.LOSS_TERMS, "extra", (1.0, "model"))
            monkeypatch.setitem(models.WorldModel.HEAD_LOSSES, "reward", reward_with_term)
            monkeypatch.setattr(models.ActorCritic, "loss", ac_with_term)
        agent, env = make_agent(*flags)
        batch = batch_for(agent, env)
        torch.manual_seed(2)
        metrics, _ = agent.update.train_step(batch)
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
        agent.update.train_step(batch)
        assert int(agent.task_behavior.updates) == before + 1, flags
    agent, env = make_agent("--expl_behavior", "plan2explore")
    metrics, _ = agent.update.train_step(batch_for(agent, env))
    assert "expl_actor_loss" in metrics and "actor_loss" in metrics
    assert int(agent.expl_behavior.behavior.updates) == 1 and int(agent.task_behavior.updates) == 1


@pytest.mark.parametrize("update", ["sequential", "joint"])
def test_the_update_runs_in_the_official_three_parts(update):
    """Recorded from one update of each mode by what the networks see, not by which functions are called: the
    world model (the encoder) runs first, then the imagination (the actor's rollout, then the critic on the
    imagined states), then the replay value loss (the critic on the replayed posteriors, (B, T - 1)); under
    'sequential' the world model has stepped before the imagination starts (the paper's order), under 'joint'
    every part runs at the starting weights."""
    agent, env = make_agent("--update", update, "--imag_gradient", "reinforce", "--critic.repval", "0.3")
    batch = batch_for(agent, env)
    start = {name: p.detach().clone() for name, p in agent.wm.named_parameters()}
    size, length = batch["is_first"].shape
    events = []

    def record(label):
        def hook(module, args):
            moved = any(not torch.equal(p, start[name]) for name, p in agent.wm.named_parameters())
            shape = tuple(args[0].shape[:-1]) if isinstance(args[0], torch.Tensor) else None  # the encoder: a dict
            part = "replay" if label == "critic" and shape == (size, length - 1) else label
            if not events or events[-1][0] != part:
                events.append((part, moved))
        return hook

    behavior = agent.task_behavior
    handles = [agent.wm.encoder.register_forward_pre_hook(record("world model")),
               behavior.actor.mlp.register_forward_pre_hook(record("imagination")),
               behavior.critic.mlp.register_forward_pre_hook(record("critic"))]
    try:
        agent.update.train_step(batch)
    finally:
        for handle in handles:
            handle.remove()
    sequential = update == "sequential"
    assert events == [("world model", False), ("imagination", sequential), ("critic", sequential),
                      ("replay", sequential)], events
    assert any(not torch.equal(p, start[name]) for name, p in agent.wm.named_parameters())


@pytest.mark.parametrize("update", ["sequential", "joint"])
def test_a_term_of_the_wrong_shape_or_without_a_scale_fails_the_update(update, monkeypatch):
    flags = ["--update", update, "--imag_gradient", "reinforce"]
    agent, env = make_agent(*flags, "--critic.repval", "0.3")
    batch = batch_for(agent, env)
    ac_loss = models.ActorCritic.loss

    def per_step(self, start, start_cont):  # the actor term left (N, 1): not one value per start state
        terms, returns, metrics = ac_loss(self, start, start_cont)
        return {**terms, "policy": terms["policy"][:, None]}, returns, metrics

    monkeypatch.setattr(models.ActorCritic, "loss", per_step)
    with pytest.raises((AssertionError, RuntimeError), match="policy|shape"):
        agent.update.train_step(batch)
    monkeypatch.undo()

    def extra(self, start, start_cont):
        terms, returns, metrics = ac_loss(self, start, start_cont)
        return {**terms, "entropy": terms["policy"]}, returns, metrics

    monkeypatch.setattr(models.ActorCritic, "loss", extra)
    with pytest.raises(KeyError, match=r"loss terms \['entropy'\] have no scale"):
        agent.update.train_step(batch_for(agent, env))


def test_optimizers_follow_the_update_mode():
    """sequential: one optimizer per network; joint: one, and no per-network optimizer is built,
    saved or loaded; Plan2Explore's actor-critic keeps its own under both."""
    agent, _ = make_agent()
    assert set(agent.optimizers()) == {"model", "task/actor", "task/critic"}
    assert set(agent.optimizer_state()) == {"model", "task"}
    joint, _ = make_agent("--update", "joint", "--imag_gradient", "reinforce")
    assert set(joint.optimizers()) == {"update"}
    assert set(joint.optimizer_state()) == {"update"}
    # every parameter of the world model, actor and critic is stepped by the one optimizer
    stepped = {id(p) for p in joint.optimizers()["update"].params}
    learners = [joint.wm, joint.task_behavior.actor, joint.task_behavior.critic]
    assert stepped == {id(p) for m in learners for p in m.parameters()}
    # A joint checkpoint written while the per-network optimizers were still built holds them too: not read.
    sequential_state = agent.optimizer_state()
    assert joint.load_optimizer_state({**joint.optimizer_state(), **sequential_state}) == []
    p2e, _ = make_agent("--update", "joint", "--imag_gradient", "reinforce", "--expl_behavior", "plan2explore")
    assert set(p2e.optimizers()) == {"update", "expl/ensemble", "expl/behavior/actor", "expl/behavior/critic"}


@pytest.mark.parametrize("saved, resumed", [("joint", "sequential"), ("sequential", "joint")])
def test_optimizer_state_of_another_update_mode_is_refused_in_one_line(saved, resumed):
    """A checkpoint of one update mode resumed under the other has no state for some optimizer: a
    CheckpointError naming it (one line and exit 2 in a run), not a KeyError."""
    state = make_agent("--update", saved, "--imag_gradient", "reinforce")[0].optimizer_state()
    agent, _ = make_agent("--update", resumed, "--imag_gradient", "reinforce")
    missing = "update" if resumed == "joint" else "model"
    with pytest.raises(storage.CheckpointError, match=f"no state for the optimizer '{missing}'.*another --update"):
        agent.load_optimizer_state(state)


def test_the_keys_the_joint_update_ignores_are_named_with_the_reason():
    """Under update 'joint' one optimizer with the world model's settings steps everything: the
    actor's and critic's optimizer keys that differ from them are named in one start-up warning
    (run_processes prints models.ignored_keys); none when they agree or another mode reads them."""
    config = cfg.parse(["--configs", "debug", "--update", "joint", "--imag_gradient", "reinforce", "--actor.lr",
                        "1e-3", "--actor.eps", "1e-8", "--actor.grad_clip", "1000", "--critic.lr", "1e-4",
                        "--critic.eps", "1e-8", "--critic.grad_clip", "1000"])  # all but actor.lr agree
    assert models.ignored_keys(config) == [
        "--actor.lr 0.001 ignored: under --update joint one optimizer steps the world model, actor and critic with "
        "--model_lr 0.0001, --opt_eps 1e-08, --grad_clip 1000; use --update sequential for an optimizer per network"]
    # recipe2024 sets the actor's and critic's keys to the world model's: nothing is lost
    assert models.ignored_keys(cfg.parse(["--configs", "recipe2024", "debug"])) == []
    assert models.ignored_keys(config.replace(update="sequential")) == []  # every key is read
    # Plan2Explore's actor-critic steps with the actor's and critic's keys under 'joint' too
    assert models.ignored_keys(config.replace(expl_behavior="plan2explore")) == []


# -- the read-only config --------------------------------------------------------------------------


def test_the_settled_config_is_read_only():
    config = cfg.parse(["--configs", "debug"])
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
    config = cfg.parse(["--configs", "debug", "--device", "cpu", "--compile", "auto"])
    env = envs.make_env(config, "train", 0)
    settled, resolved = compilation.resolve_auto(config, env.act_space)
    assert set(resolved) == {"actor.dist", "imag_gradient", "compile"}
    assert (settled.actor.dist, settled.imag_gradient, settled.compile) == ("normal", "dynamics", False)
    assert config.actor.dist == "auto"  # parse's config stays as it was
    again, resolved = compilation.resolve_auto(settled, env.act_space)
    assert again is settled and resolved == {}  # a settled config settles to itself
    agent = dreamer.Dreamer(env.obs_space, env.act_space, settled)
    assert agent.config is settled


def test_a_normal_actor_refuses_std_none():
    config = cfg.parse(["--configs", "debug", "--device", "cpu", "--actor.std", "none"])
    env = envs.make_env(config, "train", 0)
    with pytest.raises(tools.ConfigError, match="Invalid value 'none' for --actor.std"):
        compilation.resolve_auto(config, env.act_space)


# Each key whose value a module dispatches on, and the table it dispatches with: the schema's
# choices are that table's keys ('auto' besides, for the keys resolve_auto settles), so that a choice
# added to either is added to both.
DISPATCH = {
    "act": networks.ACTIVATIONS, "encoder.act": networks.ACTIVATIONS, "decoder.act": networks.ACTIVATIONS,
    "dyn_std_act": networks.STD_ACTS, "encoder.cnn": networks.IMAGE_ENCODERS,
    "decoder.vector_dist": networks.VECTOR_DISTS, "actor.dist": networks.ACTOR_DISTS, "opt": optim.OPTIMIZERS,
    "update": models.UPDATES, "compile": compilation.COMPILERS, "expl_behavior": exploration.BEHAVIORS,
    "disag_target": exploration.Plan2Explore.TARGETS, "prefill_policy": dreamer.PREFILLS,
}


def test_the_schema_names_real_keys_and_each_dispatch_table_is_its_choices():
    defaults = tools.flatten(cfg.load_presets()["defaults"])
    assert set(cfg.SCHEMA) <= set(defaults), set(cfg.SCHEMA) - set(defaults)
    for key, table in DISPATCH.items():
        assert set(cfg.SCHEMA[key].choices) - {"auto"} == set(table), key
    for key, row in cfg.SCHEMA.items():
        assert not (row.choices and row.range), f"{key}: choices and a range"
        assert not row.auto or row.whole, f"{key}: 'auto' or a whole number, but not whole"
        assert not row.size or row.range, f"{key}: a size without a range"
    # every whole number and every size is an integer in the parsed defaults (1e6 in YAML is a float)
    parsed = tools.flatten(cfg.parse([]).to_dict())
    assert all(isinstance(parsed[key], int) or parsed[key] == "auto" and row.auto
               for key, row in cfg.SCHEMA.items() if row.whole or row.size)
    # Plan2Explore's disagreement is a variance over members: one member is refused at parse, not later.
    with pytest.raises(tools.ConfigError, match="for --disag_models; valid: a whole number >= 2"):
        cfg.parse(["--configs", "debug", "--disag_models", "1"])


def bad_values():
    """(key, a bad value, what the error names): a choice, a range, a fraction of a whole number and
    a word for a count, for every key that has one."""
    for key, row in cfg.SCHEMA.items():
        if row.choices:
            yield key, "bogus", "valid: " + ", ".join(map(str, row.choices))
        elif row.range and row.range[1].startswith("a whole number >= 1"):
            yield key, "0", "valid: " + row.range[1]
        if row.whole and not row.auto:
            yield key, "2.5", "expected a whole number"
        if row.auto:
            yield key, "many", "expected a whole number or auto"


@pytest.mark.parametrize("key, value, named", list(bad_values()))
def test_a_bad_value_of_each_kind_is_one_line_naming_the_valid_ones_and_exit_2(key, value, named, capsys):
    with pytest.raises(SystemExit) as stop:
        dreamer.main(["--configs", "debug", "--logdir", "unused", f"--{key}", value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: Invalid value '{value}' for --{key}") and named in err, err


def test_keys_free_on_resume_change_silently_and_others_warn(tmp_path):
    config = cfg.parse(["--configs", "debug", "--logdir", str(tmp_path)])
    cfg.save_config(config, tmp_path / "config.yaml")
    changed = config.replace({"env_timeout": 60.0, "compile": "update", "logger": ["jsonl"], "save_every": 5.0,
                              "units": 7})
    assert cfg.compare_saved_config(changed, tmp_path / "config.yaml") == ["units: 32 -> 7"]


@pytest.mark.parametrize("key, value", [("encoder.act", "Swish"), ("decoder.act", "Swish")])
def test_the_encoder_and_decoder_activations_are_validated(key, value):
    with pytest.raises(tools.ConfigError, match=rf"Invalid value '{value}' for --{key}; valid: SiLU, ELU"):
        cfg.parse(["--configs", "debug", f"--{key}", value])


def test_the_train_ratio_arithmetic_agrees_across_the_schedule_and_the_run_total():
    """Updates owed = steps x train_ratio / replayed steps per update: the loop's schedule and the
    run's total (the summary's and the resource sizing's) give the same counts."""
    config = cfg.parse(["--configs", "debug", "--train_ratio", "3", "--batch_size", "2", "--batch_length", "5",
                        "--steps", "100", "--prefill", "10", "--pretrain", "4", "--action_repeat", "2"])
    assert tools.replayed_per_update(config) == 10
    assert tools.Ratio(3, 10).owed(7) == int(tools.updates_owed(7, 3, 10)) == 2
    assert tools.total_updates(config) == 4 + int(90 / 2 * 3 / 10)  # 45 policy steps after the prefill


# -- imports in one direction ----------------------------------------------------------------------

# What each module may import of the project: dreamer.py -> config -> exploration -> models ->
# networks -> distributions; models -> storage, launch -> tools (config.py names the dispatch tables of
# the modules below it, which raise tools.ConfigError and never import config); logs.py writes through
# storage and reads the suites' metrics of envs/; resources.py sizes a run on parallel.py's
# environments; parallel.py and envs/ know nothing about models; distributions.py and tools.py import
# nothing of the project; nothing imports dreamer.
ALLOWED = {
    "dreamer": {"config", "exploration", "models", "networks", "storage", "logs", "launch", "tools", "parallel",
                "resources", "envs", "seeds", "distributions"},
    "seeds": {"distributions", "models", "networks", "tools"},
    "config": {"exploration", "models", "networks", "storage", "launch", "tools", "parallel", "logs", "envs"},
    "exploration": {"distributions", "models", "networks", "launch", "tools"},
    "models": {"networks", "storage", "launch", "tools"},
    "networks": {"distributions", "tools"},
    "distributions": set(),
    "storage": {"launch", "tools"},
    "logs": {"storage", "tools", "envs"},
    "launch": {"distributions", "tools"},
    "tools": set(),
    "parallel": {"storage", "logs", "tools", "envs"},
    "resources": {"parallel", "storage", "launch", "tools", "envs"},
}
PROJECT = set(ALLOWED) | {"envs"}


def import_graph():
    """{module: the project modules it imports}, recorded by importing every project module afresh
    (module-level imports; the modules already loaded are put back afterwards, so that the other
    tests keep patching the objects the code uses)."""
    import builtins
    import importlib
    import sys

    names = sorted(set(ALLOWED) | {f"envs.{p.stem}" for p in (ROOT / "envs").glob("*.py") if p.stem != "__init__"})
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] in PROJECT}
    edges, real_import = collections.defaultdict(set), builtins.__import__

    def recording(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__", "")
        if level == 0 and importer.split(".")[0] in PROJECT and name.split(".")[0] in PROJECT:
            edges[importer].add(name.split(".")[0])
            edges[importer].update(f"{name}.{item}" for item in fromlist or () if f"{name}.{item}" in names)
        return real_import(name, globals, locals, fromlist, level)

    for name in saved:
        del sys.modules[name]
    builtins.__import__ = recording
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        builtins.__import__ = real_import
        for name in [n for n in sys.modules if n.split(".")[0] in PROJECT]:
            del sys.modules[name]
        sys.modules.update(saved)
    return {name: {target for target in edges[name] if target != name} for name in names}


def check_import_graph(graph):
    """Every import ALLOWED, envs/ importing only envs, and no circle (every module can be ordered
    after all it imports)."""
    for name, allowed in ALLOWED.items():
        found = {target.split(".")[0] for target in graph[name]} - {name}
        assert found <= allowed, f"{name}.py imports {sorted(found - allowed)}"
    for name in graph:
        if name.startswith("envs."):
            assert {t.split(".")[0] for t in graph[name]} <= {"envs"}, f"{name} imports {sorted(graph[name])}"
    order, left = set(), {name: {t.split(".")[0] for t in targets} - {name} for name, targets in graph.items()
                          if "." not in name}
    while left:
        ready = [name for name, targets in left.items() if targets <= order | {"envs"}]
        assert ready, f"an import circle among {sorted(left)}"
        order.update(ready)
        for name in ready:
            del left[name]


def test_imports_go_one_way_and_nothing_imports_dreamer():
    check_import_graph(import_graph())


def test_the_import_check_sees_a_forbidden_import_and_a_circle(tmp_path, monkeypatch):
    """The recorder is not blind: stand-in modules where tools imports dreamer and dreamer imports
    tools are recorded so, and refused."""
    import sys

    for name in ALLOWED:
        (tmp_path / f"{name}.py").write_text({"tools": "import dreamer\n", "dreamer": "import tools\n"}.get(name, ""))
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph()
    assert graph["tools"] == {"dreamer"} and graph["dreamer"] == {"tools"}
    with pytest.raises(AssertionError, match=r"tools.py imports \['dreamer'\]"):
        check_import_graph(graph)
    # A circle that a table allowing it would let pass is still refused.
    monkeypatch.setattr(sys.modules[__name__], "ALLOWED", {"storage": {"logs"}, "logs": {"storage"}})
    with pytest.raises(AssertionError, match=r"an import circle among \['logs', 'storage'\]"):
        check_import_graph({"storage": {"logs"}, "logs": {"storage"}})
    assert sys.modules["tools"] is tools  # the real modules are back
