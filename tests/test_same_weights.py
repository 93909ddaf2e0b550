"""benchmarks/same_weights.py: the official checkpoint's names and layouts mapped onto this project's networks,
the project's side of the comparison (the update's own loss terms), the table's statistics and the command line.
The official code cannot run here; its layouts are written out below from its source (danijar/dreamerv3
e3f0224): the heads read [deter, stoch] (agent.py feat2tensor), the decoder [stoch, deter] (rssm.py Decoder),
the encoder the vector keys sorted (nets.DictConcat), kernels are (in, out)."""

import pathlib
import sys

import gymnasium
import numpy as np
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # last: worker processes inherit the path, and benchmarks/envs.py is not envs
sys.path.insert(0, str(ROOT))  # first: benchmarks/envs.py is not the envs package

import same_weights  # noqa: E402

import compilation  # noqa: E402
import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import models  # noqa: E402

VECTOR_ONLY = ["--encoder.cnn_keys", "$^", "--decoder.cnn_keys", "$^"]


def make_agent(seed, *flags):
    config = cfg.parse(["--configs", "debug", "recipe2024", "--device", "cpu", *VECTOR_ONLY, *flags])
    box = lambda n: gymnasium.spaces.Box(-np.inf, np.inf, (n,), np.float32)  # noqa: E731
    flag = gymnasium.spaces.Box(0, 1, (), bool)
    # Keys out of sorted order, so that the encoder's input order differs from the official one.
    obs_space = {"velocity": box(2), "position": box(3), "is_first": flag, "is_last": flag, "is_terminal": flag}
    act_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    config, _ = compilation.resolve_auto(config, act_space, obs_space)
    torch.manual_seed(seed)
    return dreamer.Dreamer(obs_space, act_space, config), config


def official_params(agent, config):
    """The agent's weights written in the official names and layouts (the inverse of the tool's mapping)."""
    params = {}
    state = agent.state_dict()
    for name, (source, how) in same_weights.official_names(agent, config).items():
        value = state[name].double().numpy()
        if isinstance(how, np.ndarray):
            kernel = np.zeros((value.shape[1], value.shape[0]))
            kernel[how] = value.T
            value = kernel
        elif how == "linear":
            value = value.T
        params[source] = value
    return params


def test_every_parameter_has_one_official_name_and_a_reloaded_agent_equals_the_original():
    agent, config = make_agent(0)
    names = same_weights.official_names(agent, config)
    assert set(agent.state_dict()) - set(names) == {"task_behavior.updates"}
    sources = [source for source, _ in names.values()]
    assert len(sources) == len(set(sources)), "two project tensors read one official parameter"
    other, _ = make_agent(1)
    same_weights.load_official(other, config, official_params(agent, config))
    for name, value in agent.state_dict().items():
        torch.testing.assert_close(other.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_official_layouts_compute_what_the_project_layers_compute():
    agent, config = make_agent(0)
    params = official_params(agent, config)
    rssm, wm, behavior = agent.wm.rssm, agent.wm, agent.task_behavior
    generator = torch.Generator().manual_seed(2)
    deter = torch.randn(4, rssm.deter, generator=generator)
    stoch = torch.randn(4, rssm.feat_size - rssm.deter, generator=generator)
    feat = torch.cat([stoch, deter], -1)  # this project's feature
    with torch.no_grad():
        for project, official in ((wm.heads["reward"].mlp.net[0], "rew/mlp/linear0"),
                                  (behavior.critic.mlp.net[0], "val/mlp/linear0"),
                                  (behavior.actor.mlp.net[0], "pol/mlp/linear0")):
            want = np.concatenate([deter, stoch], -1) @ params[f"{official}/kernel"] + params[f"{official}/bias"]
            np.testing.assert_allclose(project(feat).double().numpy(), want, rtol=1e-5, atol=1e-5, err_msg=official)
        want = np.concatenate([stoch, deter], -1) @ params["dec/mlp/linear0/kernel"] + params["dec/mlp/linear0/bias"]
        np.testing.assert_allclose(wm.heads["decoder"].mlp.net[0](feat).double().numpy(), want, rtol=1e-5, atol=1e-5)
        position, velocity = torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)
        inputs = torch.cat([velocity, position], -1)  # the project's order: the observation space's
        sorted_inputs = np.concatenate([position, velocity], -1)  # the official order: the keys sorted
        want = sorted_inputs @ params["enc/mlp0/kernel"] + params["enc/mlp0/bias"]
        np.testing.assert_allclose(wm.encoder.mlp.net[0](inputs).double().numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_missing_or_misfitting_official_parameter_is_one_line():
    agent, config = make_agent(0)
    params = official_params(agent, config)
    params["rew/head/logits/kernel"] = params["rew/head/logits/kernel"][:, :5]
    with pytest.raises(same_weights.SameWeightsError, match="does not fit wm.heads.reward.out.weight"):
        same_weights.load_official(agent, config, params)


def test_the_batch_takes_the_context_latent_and_the_action_that_led_to_each_step():
    rng = np.random.default_rng(0)
    windows = {"reward": rng.normal(size=(2, 5)).astype(np.float32), "position": rng.normal(size=(2, 5, 3)),
               "action": rng.normal(size=(2, 5, 2)), "is_first": np.zeros((2, 5), bool),
               "is_last": np.zeros((2, 5), bool), "is_terminal": np.zeros((2, 5), bool),
               "consec": np.zeros((2, 5), np.int32), "stepid": np.zeros((2, 5, 20), np.uint8),
               "dyn/deter": rng.normal(size=(2, 5, 8)), "dyn/stoch": rng.normal(size=(2, 5, 4, 3))}
    batch, start = same_weights.project_batch(windows, 1)
    assert sorted(batch) == ["action", "is_first", "is_last", "is_terminal", "position", "reward"]
    np.testing.assert_array_equal(batch["position"], windows["position"][:, 1:])
    np.testing.assert_array_equal(batch["action"][:, 0], windows["action"][:, 0])  # taken at the context step
    np.testing.assert_array_equal(batch["action"][:, 3], windows["action"][:, 3])
    assert batch["action"].shape == (2, 4, 2)
    np.testing.assert_array_equal(start["deter"].numpy(), windows["dyn/deter"][:, 0])
    np.testing.assert_array_equal(start["stoch"].numpy(), windows["dyn/stoch"][:, 0])


def test_the_project_side_computes_the_terms_the_update_steps_on():
    agent, config = make_agent(0, "--replay_context", "0")
    rng = np.random.default_rng(1)
    batch = {"velocity": rng.normal(size=(3, 6, 2)).astype(np.float32),
             "position": rng.normal(size=(3, 6, 3)).astype(np.float32),
             "action": rng.uniform(-1, 1, (3, 6, 2)).astype(np.float32),
             "reward": rng.normal(size=(3, 6)).astype(np.float32), "is_first": np.eye(6, dtype=bool)[[0, 0, 2]],
             "is_last": np.zeros((3, 6), bool), "is_terminal": np.zeros((3, 6), bool)}
    torch.manual_seed(5)
    losses = same_weights.project_losses(agent, batch, None)
    scales = agent.wm.scales
    losses = {k: v.detach() for k, v in losses.items()}
    mine = {"model": float(models.scaled_sum(losses, scales, agent.wm.terms)),
            "actor": float(models.scaled_sum(losses, scales, ("policy",))),
            "critic": float(models.scaled_sum(losses, scales, ("value", "repval")))}
    torch.manual_seed(5)
    metrics, _ = agent.update.train_step(batch)
    for name, value in mine.items():
        assert float(metrics[f"{name}_loss"]) == value, name


def official_layout(value, how):
    """A project array in the official layout (the inverse of same_weights.to_project)."""
    value = value.double().numpy() if isinstance(value, torch.Tensor) else value
    if isinstance(how, np.ndarray):
        kernel = np.zeros((value.shape[1], value.shape[0]))
        kernel[how] = value.T
        return kernel
    return value.T if how == "linear" else value


def test_the_optimizer_step_reads_the_official_state_and_gradients_in_their_layouts():
    """A stand-in for the official side: the optimizer state, gradients and resulting weights of this
    project's own step, written in the official layouts; read back, the tool's step lands on them."""
    agent, config = make_agent(0)
    names = same_weights.official_names(agent, config)
    reference, _ = make_agent(0)
    joint = reference.update.optimizers["joint"][0].opt
    joint.init_state()
    generator = torch.Generator().manual_seed(3)
    saved = {f"param/{k}": v for k, v in official_params(agent, config).items()}
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, (source, how) in names.items():
            if name not in params or "slow_critic" in name:
                continue
            param, state = params[name], joint.state[params[name]]
            state["nu"].copy_(torch.rand(param.shape, generator=generator) * 1e-4)
            state["mu"].copy_(torch.randn(param.shape, generator=generator) * 1e-3)
            param.grad = torch.randn(param.shape, generator=generator) * 1e-2
            saved[f"param/opt/state/1/1/{source}"] = official_layout(state["nu"], how)
            saved[f"param/opt/state/2/1/{source}"] = official_layout(state["mu"], how)
            saved[f"grad/0/{source}"] = official_layout(param.grad, how)
        for key in ("param/opt/state/1/0", "param/opt/state/2/0", "param/opt/state/3/count"):
            saved[key] = np.array(1500)
        joint.updates.fill_(1500)
        joint.step()
        reference.task_behavior.update_slow_critic()
    for name, value in reference.state_dict().items():
        if name in names:
            saved[f"after/{names[name][0]}"] = official_layout(value, names[name][1])
    count, rows = same_weights.optimizer_step(agent, names, saved)
    assert count == 1500
    assert [r["group"] for r in rows][-1] == "slow critic"
    for row in rows:
        assert row["official_change"] > 0 and row["difference"] < 1e-6, row


def test_compare_agrees_within_one_distribution_and_differs_for_the_opposite_gradient():
    rng = np.random.default_rng(0)
    groups = [prefix + "w" for _, prefix in same_weights.GROUPS]
    mean = {k: rng.normal(size=50) for k in groups}
    draw = lambda sign: [{k: sign * mean[k] + 0.3 * rng.normal(size=50) for k in groups}  # noqa: E731
                         for _ in range(16)]
    rows = same_weights.compare(draw(1), draw(1))
    assert [r["verdict"] for r in rows] == ["AGREES"] * len(groups)
    assert all(r["cosine"] > 0.9 for r in rows)
    rows = same_weights.compare(draw(1), draw(-1))
    assert [r["verdict"] for r in rows] == ["DIFFERS"] * len(groups)
    assert all(r["cosine"] < -0.9 for r in rows)


@pytest.mark.parametrize("argv, words", [
    (["--seeds", "1"], "--seeds 1: give at least 2"),
    ([], "Missing --logdir"),
    (["--replay_context", "0", "--logdir", "x"], "replay_context 1 only"),
    (["--logdir", "x", "--official", "/nonexistent"], "no dreamerv3/main.py there"),
])
def test_mistakes_are_one_line_and_exit_2(argv, words, capsys):
    flags = ["--configs", "dmc_proprio", "recipe2024", "size1m", "--task", "dmc_cheetah_run", "--device", "cpu"]
    assert same_weights.main([*flags, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_the_dry_run_prints_the_official_side_on_the_runs_checkpoint(tmp_path, capsys):
    flags = ["--configs", "dmc_proprio", "recipe2024", "size1m", "--task", "dmc_cheetah_run", "--device", "cpu"]
    assert same_weights.main([*flags, "--dry-run", "--seeds", "4", "--logdir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "<official side>" in out and str(tmp_path / "run" / "official") in out and " 4 0 " in out
