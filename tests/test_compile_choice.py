"""compile auto: the rule compilation.compile_choice against a hand computation, and what it settles
to for the presets (nothing is timed here)."""

import copy
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import compilation  # noqa: E402
import config as cfg  # noqa: E402
import dreamer  # noqa: E402
import tools  # noqa: E402

PRESETS = cfg.load_presets()
COUNTS = {"world_model": 1000, "rssm": 500, "actor": 100, "critic": 200}  # stand-in parameter counts


def make_config(*flags, configs=("debug",)):
    return cfg.parse(["--configs", *configs, "--device", "cpu", *flags], presets=copy.deepcopy(PRESETS))


def test_update_flops_and_predicted_updates_by_hand():
    config = make_config("--batch_size", "4", "--batch_length", "10", "--imag_horizon", "5", "--steps", "10000",
                         "--prefill", "2000", "--action_repeat", "2", "--train_ratio", "64", "--pretrain", "3")
    tokens = 4 * 10
    # world model forward + backward on each replayed step; per imagined step (H + 1 = 6 per start):
    # RSSM forward, actor forward + backward, critic forward + backward and slow critic forward.
    want = 6 * 1000 * tokens + tokens * 6 * (2 * 500 + 6 * 100 + 8 * 200)
    assert compilation.update_flops(config, COUNTS) == want
    # (10000 - 2000) frames / 2 = 4000 policy steps, x 64 / 40 replayed per update = 6400, + 3 pretrain.
    assert tools.total_updates(config) == 6403


@pytest.mark.parametrize("warmup_s, decision", [(100.0, "update"), (600.0, False)])
def test_compile_choice_compiles_the_whole_update_when_the_saved_time_repays_the_warm_up(warmup_s, decision):
    config = make_config("--batch_size", "4", "--batch_length", "10", "--imag_horizon", "5", "--steps", "10000",
                         "--prefill", "2000", "--action_repeat", "2", "--train_ratio", "64", "--pretrain", "3")
    flops = 6 * 1000 * 40 + 40 * 6 * (2 * 500 + 6 * 100 + 8 * 200)  # 1,008,000
    # 0.001 s per replayed step x 4 x 10 + 4e-8 s per FLOP = 0.04 + 0.04032 s; x 6403 updates = 514.3 s
    saved = 0.001 * 40 + 4e-8 * flops
    assert compilation.update_saving(config, COUNTS, (0.001, 4e-8)) == pytest.approx(saved)
    got, reason = compilation.compile_choice(config, COUNTS, costs=(0.001, 4e-8), warmup_s=warmup_s)
    assert got == decision and (6403 * saved > warmup_s) is bool(decision)
    assert reason == (f"on a CPU: 6,403 updates x ~0.0803 s saved each = 514 s, "
                      f"{'more' if decision else 'less'} than the ~{warmup_s:.0f} s warm-up of compiling the whole "
                      "update")


def test_compile_choice_on_a_cpu_under_torchrun_compiles_step_by_step(monkeypatch):
    """compile_update refuses torchrun: there the rule weighs the per-step compile's own costs."""
    config = make_config("--batch_size", "4", "--batch_length", "10", "--imag_horizon", "5", "--steps", "10000",
                         "--prefill", "2000", "--action_repeat", "2", "--train_ratio", "64", "--pretrain", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    got, reason = compilation.compile_choice(config, COUNTS, costs=(0.001, 4e-8), warmup_s=100.0)
    assert got is True and reason.endswith("than the ~100 s warm-up of compiling step by step (torchrun)")
    *_, warmup = compilation.COMPILE_COSTS[True]
    assert compilation.compile_choice(config, COUNTS)[1].endswith(f"the ~{warmup:.0f} s warm-up of compiling step "
                                                                  "by step (torchrun)")


def test_compile_choice_always_compiles_the_whole_update_on_cuda():
    config = make_config("--device", "cuda:0", "--steps", "0")
    assert compilation.compile_choice(config, COUNTS)[0] == "update"


def test_the_rule_follows_its_measurements():
    """The constants are fitted to the measurements the comment beside them states: at batch 16 x 64 (1,024
    replayed steps) the saving per replayed step x 1,024 + the saving per FLOP x the update's FLOPs gives each
    measured size's saving. The whole update (benchmarks/README, 2026-12-05): recipe2024 size1m (2.868e10
    FLOPs) eager 1.027 s, compiled 0.561 s; v1 default size (4.978e11 FLOPs) eager 6.037 s, compiled 5.321 s;
    warm-up of the first 2 updates 2.3 s eager and 289.3 s compiled (size1m's, the larger). The check at 16 x 32
    (512 steps, 1.434e10 FLOPs; 2026-12-06): eager 0.503 s, compiled 0.282 s, within 6% of the fit. Step by
    step: size1m eager 1.69 s, compiled 1.07 s; v1 eager 11.61 s, compiled 10.58 s; warm-up 4.7 s and 377 s."""
    sizes = (2.868e10, 4.978e11)
    per_step, per_flop, warmup = compilation.COMPILE_COSTS["update"]
    for flops, saved in zip(sizes, (1.027 - 0.561, 6.037 - 5.321)):
        assert per_step * 1024 + per_flop * flops == pytest.approx(saved, rel=0.01)
    assert per_step * 512 + per_flop * 1.434e10 == pytest.approx(0.503 - 0.282, rel=0.06)
    assert warmup == pytest.approx(289.3 - 2.3, abs=5)
    per_step, per_flop, warmup = compilation.COMPILE_COSTS[True]
    for flops, saved in zip(sizes, (1.69 - 1.07, 11.61 - 10.58)):
        assert per_step * 1024 + per_flop * flops == pytest.approx(saved, rel=0.01)
    assert warmup == pytest.approx(377 - 4.7, abs=5)
    assert set(compilation.COMPILE_COSTS) == {"update", True}  # what auto may choose on a CPU, besides eager


def test_a_20k_frame_size1m_run_compiles_the_whole_update_and_a_2k_frame_one_stays_eager():
    """The issue's default: recipe2024 size1m on a DMC proprio task for 20K frames makes ~4,500 updates of
    ~0.47 s saved each, far over the warm-up; for 2K frames ~300 updates, under it."""
    counts = {"world_model": 521669, "rssm": 364096, "actor": 49666, "critic": 66111}  # size1m, cartpole
    flags = ("--task", "dmc_cartpole_balance", "--actor.dist", "normal", "--imag_gradient", "dynamics")
    run = make_config(*flags, "--steps", "2e4", configs=("dmc_proprio", "recipe2024", "size1m"))
    assert (run.batch_size, run.batch_length, run.imag_horizon) == (16, 64, 15)
    assert compilation.update_flops(run, counts) == pytest.approx(2.868e10, rel=1e-3)
    assert tools.total_updates(run) == 4489
    decision, reason = compilation.compile_choice(run, counts)
    assert decision == "update" and reason.startswith("on a CPU: 4,489 updates x ~0.466 s saved each")
    short = make_config(*flags, "--steps", "2e3", configs=("dmc_proprio", "recipe2024", "size1m"))
    assert compilation.compile_choice(short, counts)[0] is False


def test_parameter_counts_match_the_built_model_and_draw_no_random_numbers(spaces):
    config, _ = compilation.resolve_auto(make_config(), spaces[1])
    state = torch.get_rng_state()
    counts = compilation.parameter_counts(*spaces, config)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(0)
    agent = dreamer.Dreamer(*spaces, config)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert counts == {"world_model": count(agent.wm), "rssm": count(agent.wm.rssm),
                      "actor": count(agent.task_behavior.actor), "critic": count(agent.task_behavior.critic)}


def test_compile_auto_stays_eager_for_the_debug_preset_and_compiles_a_long_cpu_run(spaces):
    short, notes = compilation.resolve_auto(make_config("--compile", "auto"), spaces[1], spaces[0])
    assert "compile" in notes and short.compile is False
    assert cfg.compile_note(short, notes["compile"]).startswith("off (auto: on a CPU: ")
    # The debug model at the measured batch for a million frames: ~10^5 updates of ~1e9 FLOPs each.
    long = make_config("--compile", "auto", "--steps", "1000000", "--train_ratio", "512", "--batch_size", "16",
                       "--batch_length", "64")
    long, notes = compilation.resolve_auto(long, spaces[1], spaces[0])
    assert long.compile == "update" and "more than the ~290 s warm-up of compiling the whole update" in notes["compile"]
    assert cfg.compile_note(long, notes["compile"]).endswith(
        "; --compile False turns it off; a failure to compile stops the run)")
    # Without the observation space the model is unknown: eager on a CPU.
    unknown, notes = compilation.resolve_auto(make_config("--compile", "auto", "--steps", "1000000"), spaces[1])
    assert "compile" in notes and unknown.compile is False
