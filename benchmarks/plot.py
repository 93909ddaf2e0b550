"""Learning curves of training runs beside the published DreamerV3 curves.

    python3 benchmarks/plot.py logdir/walker_s0 logdir/walker_s1 logdir/pong --output logdir/curves.png
    python3 benchmarks/plot.py logdir/walker_* --metric train/return --reference dmc_proprio --spread minmax

The figure goes to `--output`, by default `plot.png` in the first RUN's folder (never the current folder).
A RUN given twice (the same folder under the same name) counts once.

Each RUN is a logdir with `metrics.jsonl` (written by logs.Logger; `step` counts environment frames),
or a logdir of the official code (danijar/dreamerv3) with `scores.jsonl`, whose training-episode scores
(`episode/score`, at `step` frames) are read as train/return: plot it with --metric train/return.
Its task names atari100k_<game> are read as atari_<game>.
Runs of the same task are seeds of one experiment and share a panel: their mean over seeds, with the
standard deviation (or min-max) shaded. The task is `task` in RUN/config.yaml, or else the folder name
with a trailing seed suffix (`_seed3`, `-seed3`) removed. A RUN written NAME=PATH is a curve of its own,
named NAME, in its task's panel: runs with the same NAME and task are its seeds (to compare two
configurations, e.g. `v1=logdir/v1_s0 recipe2024=logdir/r24_s0`). A run of several tasks (`task: a,b,c`)
adds a curve to the panel of each of its tasks, from the task's own metric (`eval/a/return` for
--metric eval/return), drawn beside the single-task runs of that task and on that task's own frames (its
logged `train/<task>/frames`; runs that predate it: its round-robin share of `envs`), so that the curves
compare runs at the same frames per task.

Aggregation follows the reference files: the frames are cut into windows (f - bin, f]; a seed's value
in a window is the mean of its points there; mean, std (ddof=0), min and max are then taken over the
seeds that have a point there. The bin width is a round number near 1/50 of the longest run, and never
narrower than the runs' logging interval. The figure draws each window's value at the window's centre
(f - bin / 2), the paper's windows as well; `--table` labels each window by its range, `0-10K` for (0, 10K].

The published curves come from benchmarks/reference_curves.json (see "source" in it: the official
score files, danijar/dreamerv3 scores/); regenerate it with `python3 benchmarks/plot.py --write-reference DIR`
from per-suite summaries (DIR/{dmc_proprio,dmc_vision,atari100k}.json: frames, mean, std, seeds per task).
They are training-episode returns, so they are drawn only for metrics ending in `/return`.
`--reference auto` picks atari100k for atari_* tasks, and for dmc_* tasks dmc_proprio when the run's
config encodes no images (encoder.cnn_keys '$^'), dmc_vision otherwise or when there is no config.yaml.

Bad input (missing run folder, no metrics.jsonl or scores.jsonl, metric absent) ends with a one-line
error, exit status 2.
"""

import argparse
import json
import math
import pathlib
import re
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
REFERENCE_FILE = HERE / "reference_curves.json"
SUITES = ("dmc_proprio", "dmc_vision", "atari100k")
# Our task name -> the reference's, where they differ beyond case and underscores.
ALIASES = {"dmc_cup_catch": "dmc_ball_in_cup_catch"}


class PlotError(Exception):
    """Bad input from the user: reported in one line, exit status 2."""


# ==================================================================================================
# Runs
# ==================================================================================================


# The official code's (danijar/dreamerv3) logdirs hold scores.jsonl: one line per training episode,
# {"step": frames, "episode/score": return}. Its score is read as this project's train/return too.
OFFICIAL_FILE, OFFICIAL_KEY = "scores.jsonl", "episode/score"


def is_official(run):
    return (pathlib.Path(run) / OFFICIAL_FILE).is_file()


def read_metrics(run):
    """All records of RUN/metrics.jsonl, or of RUN/scores.jsonl for a logdir of the official code
    (each with both "episode/score" and "train/return"). A torn last line (a run still writing) is
    ignored."""
    run = pathlib.Path(run)
    if not run.is_dir():
        raise PlotError(f"run folder not found: {run}")
    official = is_official(run)
    path = run / (OFFICIAL_FILE if official else "metrics.jsonl")
    if not path.is_file():
        raise PlotError(f"no metrics.jsonl in {run} (nor the official code's {OFFICIAL_FILE}; is it a training "
                        "logdir?)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise PlotError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise PlotError(f"{path}:{number}: a record without 'step'")
        if official and OFFICIAL_KEY in record:
            record["train/return"] = record[OFFICIAL_KEY]
        records.append(record)
    return records


def series(records, metric, where="run"):
    """(steps, values) of one metric, sorted by step, non-finite values dropped."""
    points = sorted((float(r["step"]), float(r[metric])) for r in records
                    if metric in r and isinstance(r[metric], (int, float)) and math.isfinite(r[metric]))
    if not points:
        keys = sorted({k for r in records for k in r if k != "step"})
        shown = [k for k in keys if k.endswith("return")] or keys
        raise PlotError(f"metric '{metric}' not in {where}/metrics.jsonl; it has: {', '.join(shown[:8]) or 'nothing'}")
    steps, values = zip(*points)
    return np.array(steps), np.array(values)


def read_config(run):
    path = pathlib.Path(run) / "config.yaml"
    if not path.is_file():
        return {}
    from ruamel.yaml import YAML

    try:
        config = YAML(typ="safe", pure=True).load(path.read_text())
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file, reported in one line
        raise PlotError(f"{path}: not readable YAML ({type(e).__name__})") from None
    return config if isinstance(config, dict) else {}


def canonical_task(task):
    """This project's name of a task: the official code names Atari 100k games atari100k_<game>."""
    return re.sub(r"^atari100k_", "atari_", task.strip())


def task_of(run, config):
    if config.get("task"):
        return ",".join(canonical_task(task) for task in str(config["task"]).split(","))
    return canonical_task(re.sub(r"[_-]seed[_-]?\d+$", "", pathlib.Path(run).resolve().name))


def task_share(records, tasks, task, config):
    """The fraction of a run of several tasks' frames that were `task`'s: the last logged
    train/<task>/frames over its step, else the task's round-robin share of the config's envs."""
    key = f"train/{task}/frames"
    logged = [(float(r["step"]), float(r[key])) for r in records if key in r and r["step"] > 0]
    if logged:
        step, frames = logged[-1]
        return frames / step
    envs, index = config.get("envs"), tasks.index(task)
    if isinstance(envs, int) and envs >= len(tasks):
        return sum(1 for i in range(envs) if i % len(tasks) == index) / envs
    return 1 / len(tasks)


def task_metric(metric, task):
    """A run of several tasks logs each task's metric under the task: eval/return -> eval/<task>/return."""
    head, _, tail = metric.rpartition("/")
    return f"{head}/{task}/{tail}" if head else f"{task}/{tail}"


# ==================================================================================================
# Aggregation over seeds
# ==================================================================================================


def nice_ceil(x):
    """Smallest of 1, 2, 2.5, 5 times a power of ten that is >= x."""
    if x <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(x))
    for factor in (1, 2, 2.5, 5, 10):
        if factor * power >= x * (1 - 1e-9):
            return factor * power
    return 10 * power


def choose_bin(seeds, points=50):
    """A round window width: about `points` windows over the longest run, never narrower than the
    median interval at which any seed logged (so every seed has a point in most windows)."""
    span = max(float(steps.max()) for steps, _ in seeds)
    interval = max((float(np.median(np.diff(np.unique(steps)))) for steps, _ in seeds if len(np.unique(steps)) > 1),
                   default=0.0)
    return nice_ceil(max(span / points, interval, 1.0))


def aggregate(seeds, bin_frames):
    """Mean and spread over seeds on windows (f - bin_frames, f].

    seeds: list of (steps, values) arrays, one pair per seed.
    Returns a dict of arrays: frames (window ends), mean, std (ddof=0), min, max, count (seeds with
    a point in the window). A seed's value in a window is the mean of its points there.
    """
    per_seed = []
    for steps, values in seeds:
        ends = np.ceil(np.asarray(steps, float) / bin_frames) * bin_frames
        windows = {}
        for end, value in zip(ends, np.asarray(values, float)):
            windows.setdefault(float(end), []).append(value)
        per_seed.append({end: float(np.mean(vs)) for end, vs in windows.items()})
    frames = sorted(set().union(*per_seed))
    out = {key: [] for key in ("frames", "mean", "std", "min", "max", "count")}
    for end in frames:
        vals = np.array([seed[end] for seed in per_seed if end in seed])
        out["frames"].append(end)
        out["mean"].append(vals.mean())
        out["std"].append(vals.std())
        out["min"].append(vals.min())
        out["max"].append(vals.max())
        out["count"].append(len(vals))
    return {key: np.array(value) for key, value in out.items()}


# ==================================================================================================
# Reference curves
# ==================================================================================================


def _key(task):
    return re.sub(r"[^a-z0-9]", "", task.lower())


def load_reference(path=REFERENCE_FILE):
    return json.loads(pathlib.Path(path).read_text())


def reference_suite(task, choice, config):
    """Which reference suite a run's task is compared with; None when there is none."""
    if choice != "auto":
        return choice
    if task.startswith("atari"):
        return "atari100k"
    if task.startswith("dmc"):
        encoder = config.get("encoder") or {}
        cnn_keys = encoder.get("cnn_keys", config.get("encoder.cnn_keys")) if isinstance(encoder, dict) else None
        return "dmc_proprio" if cnn_keys == "$^" else "dmc_vision"
    return None


def find_reference(reference, suite, task):
    """The reference curve {frames, mean, std, seeds} of our task name in a suite, or None."""
    if suite is None or suite not in reference["suites"]:
        return None
    tasks = reference["suites"][suite]["tasks"]
    wanted = _key(ALIASES.get(task, task))
    for name, curve in tasks.items():
        if _key(name) == wanted:
            # Windows in which no seed logged are null in the source; they are left out.
            keep = [i for i, (m, s) in enumerate(zip(curve["mean"], curve["std"])) if m is not None and s is not None]
            return {"task": name, "suite": suite, "seeds": curve["seeds"],
                    **{key: np.array([curve[key][i] for i in keep], float) for key in ("frames", "mean", "std")}}
    return None


def _round(value):
    """One decimal; null (a window in which no seed logged) stays null."""
    return None if value is None else round(float(value), 1)


def build_reference(source_dir):
    """The content of reference_curves.json from the per-suite summaries in `source_dir`."""
    source_dir = pathlib.Path(source_dir)
    suites = {}
    first = None
    for suite in SUITES:
        data = json.loads((source_dir / f"{suite}.json").read_text())
        first = first or data
        suites[suite] = {
            "source": data["source"],
            "budget_frames": int(data["budget_frames"]),
            "tasks": {
                task: {
                    "frames": [int(f) for f in curve["frames"]],
                    "mean": [_round(v) for v in curve["mean"]],
                    "std": [_round(v) for v in curve["std"]],
                    "seeds": int(curve["seeds"]),
                }
                for task, curve in data["tasks"].items()
            },
        }
    return {
        "source": ("Published DreamerV3 learning curves: the score files behind the DreamerV3 paper's curves "
                   "(github.com/danijar/dreamerv3, scores/), summarised per task as "
                   "{dmc_proprio,dmc_vision,atari100k}.json (frames, mean, std and seeds of each task) and "
                   "copied here with values rounded to 1 decimal by `python3 benchmarks/plot.py "
                   "--write-reference DIR`, DIR the folder of those summaries."),
        "metric": first["metric"],
        "x": first["x"],
        "suites": suites,
    }


def write_reference(source_dir, path=REFERENCE_FILE):
    """Write reference_curves.json with one task per line, so it stays small and diffs well."""
    data = build_reference(source_dir)
    head = {k: v for k, v in data.items() if k != "suites"}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + ['  "suites": {']
    for i, (suite, body) in enumerate(data["suites"].items()):
        lines.append(f"    {json.dumps(suite)}: {{")
        lines.append(f'      "source": {json.dumps(body["source"])},')
        lines.append(f'      "budget_frames": {body["budget_frames"]},')
        lines.append('      "tasks": {')
        tasks = list(body["tasks"].items())
        for j, (task, curve) in enumerate(tasks):
            lines.append(f"        {json.dumps(task)}: {json.dumps(curve, separators=(',', ':'))}"
                         + ("," if j < len(tasks) - 1 else ""))
        lines.append("      }")
        lines.append("    }" + ("," if i < len(data["suites"]) - 1 else ""))
    lines += ["  }", "}"]
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == data
    pathlib.Path(path).write_text(text)


# ==================================================================================================
# Plot
# ==================================================================================================


def format_frames(x, _=None):
    if x == 0:
        return "0"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def split_run(run):
    """(NAME, path) of a RUN argument: NAME=PATH names its curve; a plain path has the name ''."""
    named = "=" in str(run) and not pathlib.Path(run).exists()
    label, _, path = str(run).partition("=") if named else ("", "", str(run))
    return label, pathlib.Path(path)


def distinct(runs):
    """(the runs, each folder once per name, in order; those given again): a seed given twice would
    count twice in the mean and spread."""
    kept, again, seen = [], [], set()
    for run in runs:
        label, path = split_run(run)
        key = (label, path.resolve())
        (again if key in seen else kept).append(run)
        seen.add(key)
    return kept, again


def collect(runs, metric, reference_choice, reference):
    """Runs grouped by task: {task: {"seeds": [(steps, values), ...], "several": [...],
    "named": {name: [...]}, "reference": curve or None}}; "several" holds the task's curves from
    runs of several tasks, "named" those of NAME=PATH runs. A run given twice counts once."""
    groups = {}
    for run in distinct(runs)[0]:
        label, run = split_run(run)
        config = read_config(run)
        tasks = [task.strip() for task in task_of(run, config).split(",")]
        records = read_metrics(run)
        for task in tasks:
            name = metric if len(tasks) == 1 else task_metric(metric, task)
            steps, values = series(records, name, where=str(run))
            steps_values = (steps, values) if len(tasks) == 1 else (steps * task_share(records, tasks, task, config),
                                                                    values)
            group = groups.setdefault(task, {"seeds": [], "several": [], "named": {}, "suites": set()})
            if label:
                group["named"].setdefault(label, []).append(steps_values)
            else:
                group["seeds" if len(tasks) == 1 else "several"].append(steps_values)
            group["suites"].add(reference_suite(task, reference_choice, config))
    for task, group in groups.items():
        suites = sorted(s for s in group.pop("suites") if s)
        if len(suites) > 1:
            raise PlotError(f"runs of {task} need different reference suites ({', '.join(suites)}); "
                            "give --reference explicitly")
        is_return = metric.endswith("/return")
        group["reference"] = find_reference(reference, suites[0], task) if suites and is_return else None
    return groups


def window_label(end, width):
    """A window (end - width, end] by its range: 0-10K, 10K-20K."""
    return f"{format_frames(max(end - width, 0))}-{format_frames(end)}"


def plot(groups, metric, output, spread="std", bin_frames=None, table=False):
    """Write the figure; returns a summary line per panel (and, with `table`, one per curve with its
    binned means by window, the figure's numbers). Each window is drawn at its centre."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    cols = min(3, len(groups))
    rows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    lines = []
    for ax, (task, group) in zip(axes.flat, groups.items()):
        curves = [(group["seeds"], "C0", ""), (group["several"], "C2", " in runs of several tasks")]
        curves += [(seeds, f"C{3 + i}", f" {name}") for i, (name, seeds) in enumerate(group["named"].items())]
        width = bin_frames or choose_bin([seed for seeds, _, _ in curves for seed in seeds])
        x_max, counts, numbers = 0.0, [], []
        for seeds, color, where in curves:
            if not seeds:
                continue
            agg = aggregate(seeds, width)
            n = len(seeds)
            counts.append(f"{n} seed{'s' * (n > 1)}{where}")
            low, high = ((agg["mean"] - agg["std"], agg["mean"] + agg["std"]) if spread == "std"
                         else (agg["min"], agg["max"]))
            spread_name = "mean ± std" if spread == "std" else "mean, min-max band"
            head = where.strip() if where.strip() in group["named"] else f"this project{where}"  # NAME=PATH: NAME
            label = f"{head}: {metric} " + (f"({n} seeds, {spread_name})" if n > 1 else "(1 seed)")
            marker = "o" if len(agg["frames"]) < 20 else None
            centres = agg["frames"] - width / 2
            ax.plot(centres, agg["mean"], color=color, lw=1.8, marker=marker, ms=3, label=label)
            if n > 1:
                ax.fill_between(centres, low, high, color=color, alpha=0.25, lw=0)
            x_max = max(x_max, float(agg["frames"].max()))
            numbers.append(f"{task}, this project{where}: " + ", ".join(
                f"{window_label(f, width)} {m:.1f}" for f, m in zip(agg["frames"], agg["mean"])))
        ref = group["reference"]
        if ref is not None:
            frames, mean, std = ref["frames"], ref["mean"], ref["std"]
            ref_width = float(np.min(np.diff(frames))) if len(frames) > 1 else float(frames[0])
            # Draw the paper's curve over the span of our runs (one more point so it reaches the edge).
            shown = frames <= x_max + ref_width
            shown[0] = True
            ref_label = (f"DreamerV3 paper, {ref['suite']} ({ref['seeds']} seeds, mean ± std, train return)\n"
                         f"paper at {format_frames(frames[-1])} frames: {mean[-1]:.0f} ± {std[-1]:.0f}")
            ax.plot(frames[shown] - ref_width / 2, mean[shown], color="C1", lw=1.5, ls="--", label=ref_label)
            ax.fill_between(frames[shown] - ref_width / 2, (mean - std)[shown], (mean + std)[shown], color="C1",
                            alpha=0.18, lw=0)
            note = f"reference {ref['suite']}:{ref['task']}"
        else:
            note = "no published curve"
        lines.append(f"{task}: {', '.join(counts)}, up to {format_frames(x_max)} frames, "
                     f"bin {format_frames(width)} frames, {note}")
        if table:
            lines.extend(numbers)
            if ref is not None:
                points = [f"{window_label(f, ref_width)} {m:.1f}" for f, m in zip(ref["frames"], ref["mean"])
                          if f <= x_max + width]
                lines.append(f"{task}, DreamerV3 paper: " + (", ".join(points) or (
                    f"no window within the runs' {format_frames(x_max)} frames (its first ends at "
                    f"{format_frames(ref['frames'][0])})")))
        ax.set_title(f"{task}  ({', '.join(counts)}{'' if ref is not None else ', no published curve'})",
                     fontsize=10)
        ax.set_xlabel(f"the task's environment frames (action repeat included); each point: the mean over a "
                      f"{format_frames(width)}-frame window, at its centre", fontsize=8)
        ax.set_ylabel("episode return" if metric.endswith("/return") else metric)
        ax.set_xlim(0, x_max * 1.02 if x_max > 0 else 1)
        ax.xaxis.set_major_formatter(FuncFormatter(format_frames))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best", framealpha=0.85)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.tight_layout()
    output = pathlib.Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=110)
    plt.close(fig)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", metavar="RUN",
                        help="logdirs with metrics.jsonl (same task = seeds), or NAME=PATH for a named curve")
    parser.add_argument("--output", default=None, help="PNG file to write (default: plot.png in the first RUN)")
    parser.add_argument("--metric", default="eval/return", help="key in metrics.jsonl, e.g. eval/return, train/return")
    parser.add_argument("--reference", default="auto", choices=("auto", *SUITES),
                        help="published curves to draw beside the runs (default auto, described above)")
    parser.add_argument("--spread", default="std", choices=("std", "minmax"), help="shaded spread over seeds")
    parser.add_argument("--bin", type=float, default=None, metavar="FRAMES",
                        help="window width in frames for averaging (default: about 1/50 of the run)")
    parser.add_argument("--table", action="store_true",
                        help="also print every curve's binned means (frames value, ...), the figure's numbers")
    parser.add_argument("--write-reference", metavar="DIR",
                        help="rebuild benchmarks/reference_curves.json from the per-suite summaries in DIR and exit")
    args = parser.parse_args(argv)
    try:
        if args.write_reference:
            write_reference(args.write_reference)
            print(f"wrote {REFERENCE_FILE}")
            return 0
        if not args.runs:
            raise PlotError("give at least one RUN folder")
        args.runs, again = distinct(args.runs)
        if args.output is None:
            args.output = str(split_run(args.runs[0])[1] / "plot.png")
        if pathlib.Path(args.output).suffix.lower() != ".png":
            raise PlotError(f"--output must be a .png file, got {args.output}")
        if args.bin is not None and args.bin <= 0:
            raise PlotError("--bin must be a positive number of frames")
        groups = collect(args.runs, args.metric, args.reference, load_reference())
        lines = plot(groups, args.metric, args.output, args.spread, args.bin, args.table)
    except (PlotError, OSError) as e:
        print(f"plot.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    if again:
        print(f"  given more than once, counted once: {', '.join(map(str, again))}")
    for line in lines:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
