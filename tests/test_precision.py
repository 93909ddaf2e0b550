"""precision 32 | 16 | bf16: the compute dtype, the gradient scaler, what stays float32, and a
bf16 debug run on the CPU."""

import json
import pathlib
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import envs  # noqa: E402
import models  # noqa: E402
import networks  # noqa: E402
import precision  # noqa: E402
import storage  # noqa: E402
import tools  # noqa: E402


def config(*flags):
    return cfg.parse(["--configs", "debug", *flags])


@pytest.mark.parametrize("setting, device, dtype, scaler", [
    ("32", "cpu", None, False),
    ("32", "cuda:0", None, False),
    ("16", "cpu", torch.bfloat16, False),  # float16 is slow on a CPU; bfloat16 needs no scaler
    ("16", "cuda:0", torch.float16, True),
    ("bf16", "cpu", torch.bfloat16, False),
    ("bf16", "cuda:0", torch.bfloat16, False),
])
def test_precision_sets_compute_dtype_and_scaler(setting, device, dtype, scaler):
    c = config("--precision", setting, "--device", device)
    assert c.precision == (setting if setting == "bf16" else int(setting))
    assert precision.compute_dtype(c) is dtype
    assert precision.use_scaler(c) is scaler


def test_precision_notes_name_what_runs():
    assert precision.precision_note(config("--precision", "32")) == "32 (float32)"
    assert (precision.precision_note(config("--precision", "bf16", "--device", "cuda:0"))
            == "bf16 (bfloat16 autocast, no scaler; parameters float32)")
    assert (precision.precision_note(config("--precision", "16", "--device", "cuda:0"))
            == "16 (float16 autocast, gradient scaler; parameters float32)")
    assert (precision.precision_note(config("--precision", "16"))
            == "16 (bfloat16 autocast on a CPU, no scaler; parameters float32)")


@pytest.mark.parametrize("value", ["bf8", "fp16", "-1", "8"])
def test_bad_precision_names_the_value_and_the_choices(value):
    with pytest.raises(tools.ConfigError, match=f"Invalid value '{value}' for --precision; valid: 16, 32, bf16"):
        config("--precision", value)


def make_agent_and_batch(*flags):
    c = config("--device", "cpu", *flags)
    env = envs.make_env(c, "train", 0)
    replay = storage.Replay(1000, 1, seed=0)
    obs, action = env.reset(), np.zeros(env.act_space.shape, np.float32)
    rng = np.random.default_rng(0)
    for _ in range(40):
        replay.add({**obs, "action": action, "reward": np.float32(rng.normal())})
        action = rng.uniform(-1, 1, env.act_space.shape).astype(np.float32)
        obs, _, _, _ = env.step(action)
    torch.manual_seed(0)
    agent = dreamer.Dreamer(env.obs_space, env.act_space, c)
    return agent, replay.sample(c.batch_size, c.batch_length)


@pytest.mark.parametrize("recipe", ["v1", "recipe2024"])
def test_bf16_update_computes_in_bfloat16_and_keeps_float32_state(monkeypatch, recipe):
    """Inside a bf16 update on the CPU the layers compute in bfloat16, while every parameter,
    optimizer moment, normalisation statistic and distribution parameter stays float32."""
    # recipe2024 at debug size, without the replay context (its latents are another test's topic) and without
    # the learning-rate warm-up (whose first update has rate 0).
    recipe2024 = ("--configs", "debug", "recipe2024", "--replay_context", "0", "--warmup", "0")
    flags = recipe2024 if recipe == "recipe2024" else ()
    agent, batch = make_agent_and_batch(*flags, "--precision", "bf16")
    linear_out, norm_in, dist_in = set(), [], []
    handles = [m.register_forward_hook(lambda m, i, o: linear_out.add(o.dtype))
               for m in agent.modules() if isinstance(m, torch.nn.Linear)]
    layer_norm = torch.nn.functional.layer_norm

    def recording_layer_norm(x, *args, **kwargs):
        norm_in.append((x.dtype, torch.is_autocast_enabled("cpu")))
        return layer_norm(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "layer_norm", recording_layer_norm)
    log_softmax = torch.log_softmax

    def recording_log_softmax(x, *args, **kwargs):
        dist_in.append(x.dtype)
        return log_softmax(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", recording_log_softmax)
    before = {k: v.clone() for k, v in agent.state_dict().items()}
    metrics, _ = agent.update.train_step(batch)
    for handle in handles:
        handle.remove()
    assert torch.bfloat16 in linear_out  # autocast is on inside the update
    if recipe == "v1":  # LayerNorm everywhere (recipe2024's RMSNorm: test_norms_compute_in_float32_under_autocast)
        assert norm_in
    assert all(dtype == torch.float32 and not enabled for dtype, enabled in norm_in)
    assert dist_in and set(dist_in) == {torch.float32}  # two-hot, one-hot and latent logits
    assert {p.dtype for p in agent.parameters()} == {torch.float32}
    assert {v.dtype for v in agent.task_behavior.return_norm.state_dict().values()} == {torch.float32}
    for opt in agent.optimizers().values():
        assert not opt.scaler.is_enabled()
        moments = [t for state in opt.opt.state.values() for t in state.values()
                   if torch.is_tensor(t) and t.is_floating_point() and t.dim()]
        assert {t.dtype for t in moments} <= {torch.float32}
    assert all(torch.isfinite(v).all() for v in metrics.values())
    changed = [k for k, v in agent.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert any(k.startswith("wm.") for k in changed) and any(".actor." in k for k in changed)


def test_norms_compute_in_float32_under_autocast():
    """The norms' statistics against a float32 reference computed in the test."""
    torch.manual_seed(0)
    x = (torch.randn(6, 32) * 3 + 1).bfloat16()
    layer, rms = networks.LayerNorm(32, eps=1e-3), networks.RMSNorm(32)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
        rms.weight.uniform_(0.5, 1.5)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got_layer, got_rms = layer(x), rms(x)
    xf = x.float()
    mean, var = xf.mean(-1, keepdim=True), xf.var(-1, unbiased=False, keepdim=True)
    ref_layer = ((xf - mean) / torch.sqrt(var + 1e-3) * layer.weight + layer.bias).bfloat16()
    ref_rms = (xf / torch.sqrt(xf.square().mean(-1, keepdim=True) + 1e-4) * rms.weight).bfloat16()
    assert got_layer.dtype == got_rms.dtype == torch.bfloat16
    torch.testing.assert_close(got_layer, ref_layer, rtol=0, atol=0)
    torch.testing.assert_close(got_rms, ref_rms, rtol=0, atol=0)


def test_return_norm_statistics_stay_float32_from_bfloat16_returns():
    torch.manual_seed(0)
    returns = (torch.randn(15, 64) * 10).bfloat16()
    norm = models.ReturnNorm()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        offset, scale = norm(returns)
    q = torch.quantile(returns.float().flatten(), torch.tensor([0.05, 0.95]))
    assert norm.low.dtype == norm.high.dtype == offset.dtype == scale.dtype == torch.float32
    torch.testing.assert_close(norm.low, 0.01 * q[0])
    torch.testing.assert_close(norm.high, 0.01 * q[1])


@pytest.mark.slow  # an in-process training run
def test_bf16_debug_run_trains_on_the_cpu(tmp_path, capsys):
    logdir = tmp_path / "run"
    dreamer.main(["--configs", "debug", "--precision", "bf16", "--logdir", str(logdir), "--steps", "120",
                  "--eval_every", "0", "--eval_episode_num", "0", "--log_every", "60", "--time_limit", "40"])
    out = capsys.readouterr().out
    assert "Precision: bf16 (bfloat16 autocast, no scaler; parameters float32)" in out
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["world_model/model_loss"] for r in records if "world_model/model_loss" in r]
    assert losses and all(np.isfinite(losses))
    assert max(r.get("perf/updates", 0) for r in records) > 1
    assert (logdir / "latest.pt").exists()
