"""benchmarks/plot.py: learning curves of runs beside the published DreamerV3 curves."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "plot.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

_spec = importlib.util.spec_from_file_location("benchmarks_plot", SCRIPT)
plot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot)


def fake_run(folder, task=None, seed=0, frames=100_000, every=10_000, metrics=("eval/return", "train/return")):
    """A logdir as logs.Logger writes it: one JSON line per log step; config.yaml when task is given."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    with (folder / "metrics.jsonl").open("w") as f:
        for step in range(every, frames + 1, every):
            values = {m: float(900 * step / frames + rng.normal(0, 20)) for m in metrics}
            f.write(json.dumps({"step": step, **values, "perf/fps": 100.0}) + "\n")
    if task:
        (folder / "config.yaml").write_text(f"task: {task}\nseed: {seed}\nencoder:\n  cnn_keys: image\n")
    return folder


def run_cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def assert_png(path):
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # a drawn figure, not an empty canvas


def test_png_for_task_with_and_without_reference(tmp_path):
    walker = [fake_run(tmp_path / f"w{s}", task="dmc_walker_walk", seed=s) for s in range(3)]
    crafter = fake_run(tmp_path / "crafter_reward_seed0", seed=7)  # no config.yaml: task from the folder name
    out = tmp_path / "figs" / "curves.png"
    result = run_cli(*walker, crafter, "--output", out)
    assert result.returncode == 0, result.stderr
    assert_png(out)
    lines = result.stdout.splitlines()
    walker_line = next(line for line in lines if "dmc_walker_walk:" in line)
    assert "3 seeds" in walker_line and "reference dmc_vision:dmc_walker_walk" in walker_line
    crafter_line = next(line for line in lines if "crafter_reward:" in line)
    assert "1 seed," in crafter_line and "no published curve" in crafter_line


def test_train_return_minmax_and_single_task(tmp_path):
    run = fake_run(tmp_path / "pong", task="atari_pong", frames=400_000, every=4_000)
    out = tmp_path / "pong.png"
    result = run_cli(run, "--output", out, "--metric", "train/return", "--spread", "minmax", "--reference", "atari100k")
    assert result.returncode == 0, result.stderr
    assert_png(out)
    assert "reference atari100k:atari_pong" in result.stdout


def test_aggregate_matches_hand_computation():
    seed_a = (np.array([5, 10, 12, 20, 30]), np.array([1.0, 3.0, 5.0, 7.0, 9.0]))
    seed_b = (np.array([8, 19, 20]), np.array([2.0, 4.0, 6.0]))
    agg = plot.aggregate([seed_a, seed_b], bin_frames=10)
    # Windows (0,10], (10,20], (20,30]. Seed a: mean(1,3)=2, mean(5,7)=6, 9. Seed b: 2, mean(4,6)=5, none.
    np.testing.assert_allclose(agg["frames"], [10, 20, 30])
    np.testing.assert_allclose(agg["mean"], [2.0, 5.5, 9.0])
    np.testing.assert_allclose(agg["std"], [0.0, 0.5, 0.0])  # ddof=0: |6 - 5| / 2
    np.testing.assert_allclose(agg["min"], [2.0, 5.0, 9.0])
    np.testing.assert_allclose(agg["max"], [2.0, 6.0, 9.0])
    np.testing.assert_array_equal(agg["count"], [2, 2, 1])


def test_runs_of_one_task_are_seeds_of_one_panel(tmp_path):
    runs = [fake_run(tmp_path / f"walker_seed{s}", seed=s) for s in range(2)]  # task from folder names
    runs.append(fake_run(tmp_path / "x", task="dmc_cheetah_run"))
    groups = plot.collect(runs, "eval/return", "auto", plot.load_reference())
    assert list(groups) == ["walker", "dmc_cheetah_run"]
    assert len(groups["walker"]["seeds"]) == 2 and groups["walker"]["reference"] is None
    assert groups["dmc_cheetah_run"]["reference"]["task"] == "dmc_cheetah_run"


def test_choose_bin_is_round_and_not_below_logging_interval():
    assert plot.choose_bin([(np.arange(10_000, 500_001, 2_000), None)]) == 10_000
    assert plot.choose_bin([(np.arange(10_000, 1_000_001, 10_000), None)]) == 20_000
    assert plot.choose_bin([(np.array([15_000, 30_000, 45_000]), None)]) == 20_000  # interval 15K -> 20K


def test_reference_lookup_maps_task_names():
    ref = plot.load_reference()
    assert plot.reference_suite("dmc_walker_walk", "auto", {}) == "dmc_vision"
    assert plot.reference_suite("dmc_walker_walk", "auto", {"encoder": {"cnn_keys": "$^"}}) == "dmc_proprio"
    assert plot.reference_suite("atari_pong", "auto", {}) == "atari100k"
    assert plot.reference_suite("crafter_reward", "auto", {}) is None
    assert plot.find_reference(ref, "dmc_proprio", "dmc_walker_walk")["seeds"] == 5
    assert plot.find_reference(ref, "dmc_vision", "dmc_cup_catch")["task"] == "dmc_ball_in_cup_catch"
    assert plot.find_reference(ref, "atari100k", "atari_MsPacman")["task"] == "atari_ms_pacman"
    assert plot.find_reference(ref, "atari100k", "dmc_walker_walk") is None
    # Null windows in the source (no seed logged there) are dropped, not drawn as NaN.
    curve = plot.find_reference(ref, "dmc_proprio", "dmc_walker_walk")
    assert len(curve["frames"]) == 49 and np.isfinite(curve["mean"]).all()


def test_reference_is_built_from_the_source_files_rounded(tmp_path):
    """build_reference on source files written here (the repository reads nothing outside itself)."""
    for i, suite in enumerate(plot.SUITES):
        curve = {"frames": [10_000.0, 20_000.0], "mean": [1.04 + i, 250.96], "std": [0.349, 12.0], "seeds": 5.0}
        (tmp_path / f"{suite}.json").write_text(json.dumps({
            "source": f"scores of {suite}", "budget_frames": 1e6, "metric": "episode return", "x": "frames",
            "tasks": {"dmc_walker_walk": curve}}))
    built = plot.build_reference(tmp_path)
    assert built["metric"] == "episode return" and "danijar/dreamerv3" in built["source"]
    for i, suite in enumerate(plot.SUITES):
        body = built["suites"][suite]
        assert body["source"] == f"scores of {suite}" and body["budget_frames"] == 1_000_000
        assert body["tasks"]["dmc_walker_walk"] == {"frames": [10_000, 20_000], "mean": [round(1.04 + i, 1), 251.0],
                                                    "std": [0.3, 12.0], "seeds": 5}


def test_copied_reference_file_names_its_source_and_is_rounded():
    copied = json.loads((ROOT / "benchmarks" / "reference_curves.json").read_text())
    assert "danijar/dreamerv3" in copied["source"]
    assert set(copied["suites"]) == set(plot.SUITES)
    for body in copied["suites"].values():
        assert body["source"] and body["budget_frames"] > 0 and body["tasks"]
        for curve in body["tasks"].values():
            assert np.all(np.diff(curve["frames"]) > 0) and curve["seeds"] >= 1
            values = [v for v in curve["mean"] + curve["std"] if v is not None]
            assert all(round(v, 1) == v for v in values)


@pytest.mark.parametrize("case, message", [
    ("missing", "run folder not found"),
    ("no_metrics", "no metrics.jsonl in"),
    ("no_metric", "metric 'eval/return' not in"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, message):
    run = tmp_path / "run"
    if case == "no_metrics":
        run.mkdir()
    elif case == "no_metric":
        fake_run(run, task="dmc_walker_walk", metrics=("train/return",))
    result = run_cli(run, "--output", tmp_path / "out.png")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("plot.py: error: ")
    assert message in result.stderr
    if case == "no_metric":
        assert "train/return" in result.stderr  # names what the run does have
    assert not (tmp_path / "out.png").exists()


def test_run_of_several_tasks_plots_each_task_beside_single_task_runs(tmp_path):
    several = fake_run(tmp_path / "mt", task="dmc_walker_walk,dmc_cheetah_run",
                       metrics=("eval/return", "eval/dmc_walker_walk/return", "eval/dmc_cheetah_run/return"))
    single = fake_run(tmp_path / "walker", task="dmc_walker_walk", seed=1)
    groups = plot.collect([several, single], "eval/return", "auto", plot.load_reference())
    assert list(groups) == ["dmc_walker_walk", "dmc_cheetah_run"]
    assert len(groups["dmc_walker_walk"]["seeds"]) == 1 and len(groups["dmc_walker_walk"]["several"]) == 1
    assert groups["dmc_cheetah_run"]["seeds"] == [] and groups["dmc_cheetah_run"]["reference"]["task"] == \
        "dmc_cheetah_run"
    # The multi-task run's walker curve is its eval/dmc_walker_walk/return, not the mean over tasks.
    records = plot.read_metrics(several)
    np.testing.assert_array_equal(groups["dmc_walker_walk"]["several"][0][1],
                                  [r["eval/dmc_walker_walk/return"] for r in records])
    assert plot.task_metric("train/return", "a") == "train/a/return"
    out = tmp_path / "mt.png"
    result = run_cli(several, single, "--output", out)
    assert result.returncode == 0, result.stderr
    assert_png(out)
    assert "dmc_walker_walk: 1 seed, 1 seed in runs of several tasks, up to" in result.stdout
    assert "dmc_cheetah_run: 1 seed in runs of several tasks, up to" in result.stdout


def test_named_runs_are_curves_of_their_own_and_table_prints_their_means(tmp_path):
    """NAME=PATH runs (two configurations of one task) get a curve per name; --table prints each
    curve's binned means, checked against a plain mean of the points in each window."""
    a = [fake_run(tmp_path / f"a{s}", task="dmc_walker_walk", seed=s, frames=40_000, every=5_000) for s in range(2)]
    b = fake_run(tmp_path / "b", task="dmc_walker_walk", seed=5, frames=40_000, every=5_000)
    groups = plot.collect([f"v1={a[0]}", f"v1={a[1]}", f"new={b}"], "eval/return", "auto", plot.load_reference())
    walker = groups["dmc_walker_walk"]
    assert walker["seeds"] == [] and sorted(walker["named"]) == ["new", "v1"] and len(walker["named"]["v1"]) == 2
    out = tmp_path / "named.png"
    result = run_cli(f"v1={a[0]}", f"v1={a[1]}", f"new={b}", "--output", out, "--table", "--bin", 10_000)
    assert result.returncode == 0, result.stderr
    assert_png(out)
    assert "dmc_walker_walk: 2 seeds v1, 1 seed new, up to" in result.stdout
    values = [[json.loads(line)["eval/return"] for line in (run / "metrics.jsonl").read_text().splitlines()]
              for run in a]
    # windows (0, 10K], (10K, 20K], ...: points at 5K and 10K, then 15K and 20K, ...; mean over seeds
    expected = [np.mean([np.mean(v[2 * i:2 * i + 2]) for v in values]) for i in range(4)]
    line = next(line for line in result.stdout.splitlines() if "this project v1:" in line)
    ranges = ("0-10K", "10K-20K", "20K-30K", "30K-40K")  # each window by its range, not its upper edge
    assert line.split(": ", 1)[1] == ", ".join(f"{k} {m:.1f}" for k, m in zip(ranges, expected))
    # the paper's dmc_vision windows are 20K wide: (0, 20K] is its first
    paper = next(line.strip() for line in result.stdout.splitlines() if "DreamerV3 paper:" in line)
    assert paper.startswith("dmc_walker_walk, DreamerV3 paper: 0-20K ")


def test_windows_are_drawn_at_their_centres(tmp_path, monkeypatch):
    """A window (f - bin, f] is drawn at f - bin / 2, the paper's windows (20K wide in dmc_vision) likewise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.axes

    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, x, y, *a, **k: drawn.append(
        (k.get("label", ""), np.asarray(x, float), np.asarray(y, float))) or real(ax, x, y, *a, **k))
    run = fake_run(tmp_path / "w", task="dmc_walker_walk", frames=40_000, every=5_000)
    groups = plot.collect([run], "eval/return", "auto", plot.load_reference())
    plot.plot(groups, "eval/return", tmp_path / "w.png", bin_frames=10_000)
    ours = next(x for label, x, _ in drawn if label.startswith("this project"))
    np.testing.assert_allclose(ours, [5_000, 15_000, 25_000, 35_000])
    paper = next(x for label, x, _ in drawn if label.startswith("DreamerV3 paper"))
    assert paper[0] == 10_000 and np.all(np.diff(paper) == 20_000)  # dmc_vision's (0, 20K] at 10K, ...


def test_the_figure_goes_into_the_first_run_not_the_current_folder(tmp_path):
    runs = [fake_run(tmp_path / f"w{s}", task="dmc_walker_walk", seed=s) for s in range(2)]
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    result = subprocess.run([sys.executable, str(SCRIPT), *map(str, runs)], capture_output=True, text=True,
                            cwd=elsewhere, timeout=120)
    assert result.returncode == 0, result.stderr
    assert list(elsewhere.iterdir()) == []
    assert_png(runs[0] / "plot.png") and not (runs[1] / "plot.png").exists()
    assert result.stdout.splitlines()[0] == f"wrote {runs[0] / 'plot.png'}"
    named = run_cli(f"a={runs[1]}", f"b={runs[0]}")  # NAME=PATH: the path's folder
    assert named.returncode == 0 and (runs[1] / "plot.png").exists()


def test_a_run_given_twice_counts_once(tmp_path):
    runs = [fake_run(tmp_path / f"w{s}", task="dmc_walker_walk", seed=s) for s in range(2)]
    again = tmp_path / "w0" / ".." / "w0"  # the same folder, spelt otherwise
    groups = plot.collect([*runs, again], "eval/return", "auto", plot.load_reference())
    assert len(groups["dmc_walker_walk"]["seeds"]) == 2
    result = run_cli(*runs, again, "--output", tmp_path / "out.png")
    assert result.returncode == 0, result.stderr
    assert f"given more than once, counted once: {again}" in result.stdout
    assert "dmc_walker_walk: 2 seeds, up to" in result.stdout
    named = plot.collect([f"a={runs[0]}", f"b={runs[0]}"], "eval/return", "auto", plot.load_reference())
    assert sorted(named["dmc_walker_walk"]["named"]) == ["a", "b"]  # two names are two curves


def test_a_run_shorter_than_the_papers_first_window_prints_no_empty_paper_row(tmp_path):
    run = fake_run(tmp_path / "w", task="dmc_walker_walk", frames=4_000, every=1_000)
    result = run_cli(run, "--output", tmp_path / "out.png", "--table", "--bin", 1_000)
    assert result.returncode == 0, result.stderr
    row = next(line.strip() for line in result.stdout.splitlines() if "DreamerV3 paper:" in line)
    assert row == "dmc_walker_walk, DreamerV3 paper: no window within the runs' 4K frames (its first ends at 20K)"


def test_runs_of_several_tasks_are_drawn_on_each_task_s_own_frames(tmp_path):
    """A task's curve in a run of several tasks is at its frames: the logged train/<task>/frames
    share of the step, or, in runs without it, the task's round-robin share of envs."""
    tasks = "dmc_walker_walk,dmc_cheetah_run"
    logged = fake_run(tmp_path / "logged", task=tasks, metrics=("train/dmc_walker_walk/return",
                                                                   "train/dmc_cheetah_run/return"))
    rows = [json.loads(line) for line in (logged / "metrics.jsonl").read_text().splitlines()]
    with (logged / "metrics.jsonl").open("w") as f:  # 3 of 4 environments walker, 1 cheetah
        for row in rows:
            row.update({"train/dmc_walker_walk/frames": 0.75 * row["step"], "train/dmc_cheetah_run/frames":
                        0.25 * row["step"]})
            f.write(json.dumps(row) + "\n")
    older = fake_run(tmp_path / "older", task=tasks, metrics=("train/dmc_walker_walk/return",
                                                                 "train/dmc_cheetah_run/return"))
    (older / "config.yaml").write_text(f"task: {tasks}\nenvs: 5\n")  # round-robin: walker 3 of 5
    steps = np.arange(10_000, 100_001, 10_000, dtype=float)
    for run, walker, cheetah in ((logged, 0.75, 0.25), (older, 0.6, 0.4)):
        groups = plot.collect([run], "train/return", "auto", plot.load_reference())
        np.testing.assert_allclose(groups["dmc_walker_walk"]["several"][0][0], steps * walker)
        np.testing.assert_allclose(groups["dmc_cheetah_run"]["several"][0][0], steps * cheetah)
    single = fake_run(tmp_path / "single", task="dmc_walker_walk")
    groups = plot.collect([single], "train/return", "auto", plot.load_reference())
    np.testing.assert_array_equal(groups["dmc_walker_walk"]["seeds"][0][0], steps)  # one task: frames as logged
