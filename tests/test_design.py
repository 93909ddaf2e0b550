"""The shape of the code that a researcher relies on when changing one thing: one loss-scale table
that no term escapes, one train step in the official three parts shared by both update modes (which
only choose the optimizers), six calls from main, a read-only config, choices, ranges and the keys
free on resume declared once beside their readers, exhaustive dispatch, the train-ratio arithmetic in
one place, and imports in one direction (compilation of every network a preset builds:
tests/test_compile.py)."""

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
    """loss = the sum of each term's mean over (B, T) times its scale: doubling the reward scale
    adds exactly the unscaled reward term's mean once more."""
    losses = {}
    for scale in (1.0, 2.0):
        agent, env = make_agent("--reward_head.loss_scale", str(scale))
        data = agent.wm.preprocess(batch_for(agent, env))
        torch.manual_seed(1)
        terms, _, _, metrics = agent.wm.loss(data)
        losses[scale] = (models.scaled_sum(terms, agent.wm.scales).item(), metrics["reward_loss"].item())
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
    scales, ac_loss = models.loss_scales, models.ActorCritic.loss
    reward_loss = models.WorldModel.HEAD_LOSSES["reward"]

    def reward_with_term(self, pred, data):  # a new term of the world model: a head's loss and a scale
        extra = 1e3 * self.heads["reward"].out.bias.sum()  # pushes the reward head's bias down
        return {**reward_loss(self, pred, data), "extra": extra * torch.ones_like(data["reward"])}

    def ac_with_term(self, start, start_cont):
        terms, returns, metrics = ac_loss(self, start, start_cont)
        extra = 1e3 * self.critic.out.bias.sum()
        return {**terms, "critic": terms["critic"] + extra}, returns, {**metrics, "critic_extra_loss": extra.detach()}

    results = {}
    for name, patched in (("plain", False), ("patched", True)):
        if patched:
            monkeypatch.setattr(models, "loss_scales", lambda config, keys: {**scales(config, keys), "extra": 1.0})
            monkeypatch.setitem(models.WorldModel.HEAD_LOSSES, "reward", reward_with_term)
            monkeypatch.setattr(models.ActorCritic, "loss", ac_with_term)
        agent, env = make_agent(*flags)
        batch = batch_for(agent, env)
        torch.manual_seed(2)
        metrics = agent.update.train_step(batch)
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
    metrics = agent.update.train_step(batch_for(agent, env))
    assert "expl_actor_loss" in metrics and "actor_loss" in metrics
    assert int(agent.expl_behavior.behavior.updates) == 1 and int(agent.task_behavior.updates) == 1


def test_the_update_reads_in_the_official_three_parts():
    """models.Update.train_step holds the whole update, in danijar/dreamerv3's order (Agent.loss)."""
    import inspect

    source = inspect.getsource(models.Update.train_step)
    marks = [source.index(f"# {part}") for part in ("World model", "Imagination", "Replay")]
    assert marks == sorted(marks)
    assert "check_terms(losses" in source[marks[-1]:]


def test_the_world_model_loss_is_six_calls_from_main(tmp_path, monkeypatch):
    """A reader follows main -> run_processes -> Trainer.train, whose loop reads inline (the
    pretraining is one call deeper) -> Trainer.update -> models.Update.train_step -> WorldModel.loss:
    recorded from a real run, in the pretraining and in the synchronous loop."""
    import sys

    chains, loss = [], models.WorldModel.loss

    def recording(self, *args, **kwargs):
        frame, names = sys._getframe(1), []
        while frame.f_code.co_name != "main" or not frame.f_code.co_filename.endswith("dreamer.py"):
            names.append(frame.f_code.co_qualname)
            frame = frame.f_back
        chains.append(names[::-1])
        return loss(self, *args, **kwargs)

    monkeypatch.setattr(models.WorldModel, "loss", recording)
    dreamer.main(["--configs", "debug", "--device", "cpu", "--prefill", "50", "--pretrain", "1", "--steps", "80",
                  "--eval_episode_num", "0", "--video_pred_log", "False", "--compile", "False",
                  "--logdir", str(tmp_path / "run")])
    assert len(chains) >= 2
    loop = ["run_processes", "Trainer.train", "Trainer.update", "Update.train_step"]
    pretrain = ["run_processes", "Trainer.train", "prefill_and_pretrain", "Trainer.update", "Update.train_step"]
    assert chains[0] == pretrain, chains[0]
    assert all(chain == loop for chain in chains[1:]), chains


@pytest.mark.parametrize("update", ["sequential", "joint"])
def test_a_term_of_the_wrong_shape_or_without_a_scale_fails_the_update(update, monkeypatch):
    flags = ["--update", update, "--imag_gradient", "reinforce"]
    agent, env = make_agent(*flags, "--critic.repval", "0.3")
    batch = batch_for(agent, env)
    ac_loss = models.ActorCritic.loss

    def per_step(self, start, start_cont):  # the actor term left (N, 1): not one value per start state
        terms, returns, metrics = ac_loss(self, start, start_cont)
        return {**terms, "actor": terms["actor"][:, None]}, returns, metrics

    monkeypatch.setattr(models.ActorCritic, "loss", per_step)
    with pytest.raises((AssertionError, RuntimeError), match="actor|shape"):
        agent.update.train_step(batch)
    monkeypatch.undo()

    def extra(self, start, start_cont):
        terms, returns, metrics = ac_loss(self, start, start_cont)
        return {**terms, "entropy": terms["actor"]}, returns, metrics

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
    config = dreamer.parse(["--configs", "debug", "--update", "joint", "--imag_gradient", "reinforce", "--actor.lr",
                            "1e-3", "--actor.eps", "1e-8", "--actor.grad_clip", "1000", "--critic.lr", "1e-4",
                            "--critic.eps", "1e-8", "--critic.grad_clip", "1000"])  # all but actor.lr agree
    assert models.ignored_keys(config) == [
        "--actor.lr 0.001 ignored: under --update joint one optimizer steps the world model, actor and critic with "
        "--model_lr 0.0001, --opt_eps 1e-08, --grad_clip 1000; use --update sequential for an optimizer per network"]
    # recipe2024 sets the actor's and critic's keys to the world model's: nothing is lost
    assert models.ignored_keys(dreamer.parse(["--configs", "recipe2024", "debug"])) == []
    assert models.ignored_keys(config.replace(update="sequential")) == []  # every key is read
    # Plan2Explore's actor-critic steps with the actor's and critic's keys under 'joint' too
    assert models.ignored_keys(config.replace(expl_behavior="plan2explore")) == []


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

    tables += [parallel.CHOICES, dreamer.RUN_CHOICES]  # the run's own: the prefill, which dreamer.py runs
    keys = [key for table in tables for key in table]
    assert len(keys) == len(set(keys)), "a choice declared twice"
    assert set(keys) == set(dreamer.CHOICES)
    defaults = tools.flatten(tools.load_presets()["defaults"])
    assert set(keys) <= set(defaults), set(keys) - set(defaults)


def test_every_range_is_declared_by_one_module():
    """Each module declares the ranges of the keys it reads (networks, models, exploration; the
    run's own in dreamer.RUN_RANGES); parse checks the one merged table."""
    tables = [networks.RANGES, models.RANGES, exploration.RANGES, dreamer.RUN_RANGES]
    keys = [key for table in tables for key in table]
    assert len(keys) == len(set(keys)), "a range declared twice"
    assert set(keys) == set(dreamer.RANGES)
    defaults = tools.flatten(tools.load_presets()["defaults"])
    assert set(keys) <= set(defaults), set(keys) - set(defaults)
    assert set(models.RANGES) >= {"model_lr", "actor.lr", "critic.repval", "discount", "imag_horizon"}
    assert set(networks.RANGES) >= {"dyn_deter", "units", "encoder.cnn_keys"}


def test_every_key_free_on_resume_is_declared_by_one_module(tmp_path, capsys):
    """The keys that may change when a run resumes are declared beside their readers (parallel,
    models, logs; the run's own in dreamer.RUN_FREE_ON_RESUME), each once, each a key of the defaults;
    a free key changed is silent, another is a warning naming it."""
    import logs
    import parallel

    tables = [parallel.FREE_ON_RESUME, models.FREE_ON_RESUME, logs.FREE_ON_RESUME, dreamer.RUN_FREE_ON_RESUME]
    keys = [key for table in tables for key in table]
    assert len(keys) == len(set(keys)) and set(keys) == set(dreamer.FREE_ON_RESUME)
    assert set(keys) <= set(tools.flatten(tools.load_presets()["defaults"])), set(keys)
    config = dreamer.parse(["--configs", "debug", "--logdir", str(tmp_path)])
    tools.save_config(config, tmp_path / "config.yaml")
    changed = config.replace({"env_timeout": 60.0, "compile": "update", "logger": ["jsonl"], "save_every": 5.0,
                              "units": 7})
    assert tools.compare_saved_config(changed, tmp_path / "config.yaml", dreamer.FREE_ON_RESUME) == ["units: 32 -> 7"]


@pytest.mark.parametrize("key, value", [("encoder.act", "Swish"), ("decoder.act", "Swish")])
def test_the_encoder_and_decoder_activations_are_validated(key, value):
    with pytest.raises(tools.ConfigError, match=rf"Invalid value '{value}' for --{key}; valid: SiLU, ELU"):
        dreamer.parse(["--configs", "debug", f"--{key}", value])


# Each validated string key and how to build what dispatches on it: a value that parse would have
# refused (here slipped past it with Config.replace) is an error naming the key, never a silent default.
DISPATCH = {
    "winit": lambda config, env: models.WorldModel(env.obs_space, env.act_space, config),
    "decoder.cnn": lambda config, env: models.WorldModel(env.obs_space, env.act_space, config),
    "dyn_cell": lambda config, env: models.WorldModel(env.obs_space, env.act_space, config),
    "initial": lambda config, env: models.WorldModel(env.obs_space, env.act_space, config),
    "expl_behavior": lambda config, env: exploration.make_behavior(
        config, models.WorldModel(env.obs_space, env.act_space, config), env.act_space),
    "disag_target": lambda config, env: exploration.Plan2Explore(
        config, models.WorldModel(env.obs_space, env.act_space, config), env.act_space),
    "update": lambda config, env: dreamer.Dreamer(env.obs_space, env.act_space, config),
    "dyn_mean_act": lambda config, env: models.WorldModel(env.obs_space, env.act_space, config),
    "actor.dist": lambda config, env: dreamer.Dreamer(env.obs_space, env.act_space, config),
}


@pytest.mark.parametrize("key", list(DISPATCH))
def test_every_dispatch_on_a_validated_string_is_exhaustive(key):
    config = dreamer.parse(["--configs", "debug", "--device", "cpu", "--expl_behavior", "plan2explore"])
    config, _ = models.resolve_auto(config, envs.make_env(config, "train", 0).act_space)
    env = envs.make_env(config, "train", 0)
    with pytest.raises((ValueError, KeyError), match=rf"{key.split('.')[-1]}|bogus"):
        DISPATCH[key](config.replace({key: "bogus"}), env)


def test_an_unsettled_imag_gradient_never_reaches_the_actor_loss_silently():
    agent, env = make_agent()
    behavior = agent.task_behavior
    behavior.config = behavior.config.replace(imag_gradient="bogus")
    start = agent.wm.rssm.initial(4)
    with pytest.raises(ValueError, match="imag_gradient 'bogus' reached the actor loss unsettled"):
        behavior.loss(start, torch.ones(4))


def ratio_divisions(path):
    """The functions of a module that divide a train ratio (a name ending in `ratio`)."""
    found = set()
    for func in ast.walk(ast.parse(path.read_text())):
        if not isinstance(func, ast.FunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                names = [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.left)
                         if isinstance(n, (ast.Name, ast.Attribute))]
                if any(name.endswith("ratio") for name in names):
                    found.add(func.name)
    return found


def test_the_train_ratio_arithmetic_is_written_once():
    """Updates owed = steps x train_ratio / replayed steps per update, in tools.updates_owed alone:
    the loops' schedules, the rate limiter, the run's total and the resource sizing call it."""
    found = {f"{path.stem}.{name}" for path in sorted(ROOT.glob("*.py")) for name in ratio_divisions(path)}
    # RunLog.log divides the other way: the train ratio measured since the last log, for perf/train_ratio.
    assert found == {"tools.updates_owed", "logs.log"}, found
    config = dreamer.parse(["--configs", "debug", "--train_ratio", "3", "--batch_size", "2", "--batch_length", "5",
                            "--steps", "100", "--prefill", "10", "--pretrain", "4", "--action_repeat", "2"])
    assert tools.replayed_per_update(config) == 10
    assert tools.Ratio(3, 10).owed(7) == int(tools.updates_owed(7, 3, 10)) == 2
    assert tools.total_updates(config) == 4 + int(90 / 2 * 3 / 10)  # 45 policy steps after the prefill


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
    "logs": {"storage", "tools", "envs"},
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
