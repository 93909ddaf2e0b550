"""A suite's aggregate score from training runs, computed the way the DreamerV3 paper reports it.

    python3 benchmarks/scores.py logdir/atari_*                 # Atari 100k: human-normalised mean, median
    python3 benchmarks/scores.py logdir/dmc_* --frames 500000   # DMC: mean over tasks at a frame budget
    python3 benchmarks/scores.py logdir/crafter_*               # Crafter: success rates and score
    python3 benchmarks/scores.py logdir/* --table               # also every task and seed
    python3 benchmarks/scores.py logdir/* --json                # one JSON object, for scripts
    python3 benchmarks/scores.py --reference atari100k          # the paper's own curves (see below)

Each RUN is a logdir of this project (metrics.jsonl, config.yaml with `task`) or of the official code
(danijar/dreamerv3: scores.jsonl, one line per training episode with `step` and `episode/score`);
benchmarks/plot.py reads both. Runs of the same task are its seeds; the suite comes from the task's
prefix. `step` counts environment frames (action repeat included) in both.

- Atari 100k (atari_<game>): per seed, the mean return of the episodes that ended in the last window,
  (frames - window, frames] = (390K, 400K] by default (how the authors computed the paper's table,
  danijar/dreamerv3 issue 177); per game, the mean over seeds, human-normalised with the random and
  human scores of benchmarks/atari_human_random.json (source named there); then the mean and the
  median over games, in percent.
- DMC (dmc_<task>) and other suites: per seed the mean return in (frames - window, frames], per task
  the mean over seeds, then the mean over tasks. --frames defaults to the paper's budgets: 500K for
  proprioceptive runs (config encoder.cnn_keys '$^'), 1M for runs from images; other suites: the
  frames the runs reached. DMC Proprio and DMC Vision are separate aggregates.
- A run shorter than its suite's budget (without --frames) is scored at the frames every run of the suite
  reached, and the line says so (SHORT RUN; "short_of" in --json): a number to compare runs of one
  length, not the paper's. A window reaching below frame 0 starts at 0.
- Crafter (crafter_<task>): per seed, each achievement's success rate, the percent of all training
  episodes up to --frames (default 1M) that unlocked it, and the Crafter score
  S = exp(mean_i ln(1 + s_i)) - 1 over the achievements (Hafner 2021, "Benchmarking the Spectrum of
  Agent Capabilities"; 22 in Crafter); then the mean over seeds. Read from this project's
  train/achievement_<name> rows (envs/crafter.py); official logdirs hold no success rates here.

Returns are --metric, train/return by default: the official scores.jsonl holds training episodes,
and the paper's numbers are computed from them. This project's metrics.jsonl holds one row per
log_every frames, with the mean of the episodes finished since the previous row: a row counts when its
step lies in the window, weighted by its number of episodes (the increase of train/episodes; eval/
rows: eval/episodes), so a window that is a multiple of log_every (eval_every for eval/return)
takes exactly the episodes that ended in it.

--reference SUITE scores the published DreamerV3 curves in benchmarks/reference_curves.json (suites
atari100k, dmc_proprio, dmc_vision) as runs of one seed each. They differ from the paper's window in
one way: they hold, per task, the mean over seeds of each seed's mean of the episodes in each 10K-frame
window (f - 10K, f], not the per-seed values, so the mean over seeds comes before human normalisation
(which is linear, so the mean over games is the same) and seeds without an episode in a window are
left out of that window's mean (each of the paper's seeds counts equally in its table). For Atari 100k
the window (390K, 400K] is exactly the file's point at 400K. The per-game curves there are those of
the official code's current scores/atari100k-dreamerv3.json.gz, and give a human-normalised mean of
124.7% and median of 49.4% (that file's own per-seed episodes, scored as above, give the same); the
paper's first version reported 112% / 49%, from the earlier runs that file replaced (their Pong, for
one, reached about 18 at 400K frames where these reach -4): the median agrees, the mean does not.

Bad input (no run, a run without the metric in the window, an Atari game without human and random
scores) ends with a one-line error, exit status 2.
"""

import argparse
import importlib.util
import json
import math
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent


def _load_plot():
    """benchmarks/plot.py, the shared reader of both kinds of logdir, loaded by path: putting this
    folder on sys.path would let benchmarks/envs.py shadow the project's envs package."""
    spec = importlib.util.spec_from_file_location("benchmarks_plot", HERE / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot = _load_plot()

ATARI_FILE = HERE / "atari_human_random.json"
ATARI_FRAMES = 400_000
CRAFTER_FRAMES = 1_000_000
DMC_FRAMES = {"dmc_proprio": 500_000, "dmc_vision": 1_000_000}


class ScoreError(Exception):
    """Bad input from the user: reported in one line, exit status 2."""


# ==================================================================================================
# Formulas
# ==================================================================================================


def window_mean(steps, values, weights, low, high):
    """The weighted mean of the points with low < step <= high; None when there are none."""
    steps, values, weights = (np.asarray(a, float) for a in (steps, values, weights))
    inside = (steps > low) & (steps <= high) & (weights > 0)
    if not inside.any():
        return None
    return float(np.sum(values[inside] * weights[inside]) / np.sum(weights[inside]))


def load_atari_table(path=ATARI_FILE):
    """{game: (random, human)}."""
    games = json.loads(pathlib.Path(path).read_text())["games"]
    return {game: (float(entry["random"]), float(entry["human"])) for game, entry in games.items()}


def game_of(task):
    return plot.canonical_task(task).removeprefix("atari_")


def human_normalised(task, score, table):
    """(score - random) / (human - random) of an Atari game; 0 is random play, 1 the human tester."""
    game = game_of(task)
    if game not in table:
        raise ScoreError(f"no human and random scores for Atari game '{game}' ({task}); known: "
                         f"{', '.join(sorted(table))} (benchmarks/atari_human_random.json)")
    random, human = table[game]
    return (score - random) / (human - random)


def atari_aggregate(scores, table):
    """scores: {task: [score per seed]} -> human-normalised mean and median over games (fractions)
    of the per-game means over seeds, and the normalised score of each game."""
    normalised = {task: human_normalised(task, float(np.mean(seeds)), table) for task, seeds in scores.items()}
    values = np.array(list(normalised.values()))
    return {"mean": float(values.mean()), "median": float(np.median(values)), "games": normalised}


def crafter_score(rates):
    """The Crafter score of success rates in percent: S = exp(mean_i ln(1 + s_i)) - 1, a geometric
    mean offset by one so that achievements never unlocked count without making the score zero."""
    rates = np.asarray(list(rates.values()) if isinstance(rates, dict) else rates, float)
    return float(np.exp(np.mean(np.log1p(rates))) - 1.0)


# ==================================================================================================
# Runs
# ==================================================================================================


def count_key(metric):
    """The metric whose rows count the episodes behind a row of `metric`, and whether it is a
    running total: train/episodes grows over the run, eval/episodes is each evaluation's count."""
    head = metric.split("/", 1)[0]
    if head == "train":
        return "train/episodes", True
    if head == "eval":
        return "eval/episodes", False
    return None, False


def episode_weights(records, metric):
    """A weight per record: the number of episodes its values average (1 where unknown)."""
    key, cumulative = count_key(metric)
    weights, total = [], 0.0
    for record in records:
        count = record.get(key) if key else None
        if not isinstance(count, (int, float)):
            weights.append(1.0)
            continue
        weights.append(float(count) - total if cumulative else float(count))
        total = float(count) if cumulative else total
    return weights


def run_points(run, records, metric, official):
    """(steps, values, weights) of `metric`: one point per episode of an official logdir, one per
    row (weighted by its episodes) of this project's."""
    if official and metric not in ("train/return", plot.OFFICIAL_KEY):
        raise ScoreError(f"{run} is a logdir of the official code: its scores.jsonl holds training episodes "
                         "only; use --metric train/return")
    weights = [1.0] * len(records) if official else episode_weights(records, metric)
    points = [(float(r["step"]), float(r[metric]), w) for r, w in zip(records, weights)
              if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]
    if not points:
        raise ScoreError(f"metric '{metric}' not in {run}")
    return tuple(np.array(a) for a in zip(*points))


def load_runs(paths):
    """[{path, task, suite, records, official, config}] of single-task runs."""
    runs = []
    for path in paths:
        try:
            records = plot.read_metrics(path)
            config = plot.read_config(path)
        except plot.PlotError as e:
            raise ScoreError(str(e)) from None
        task = plot.task_of(path, config)
        if "," in task:
            raise ScoreError(f"{path} is a run of several tasks ({task}); scores.py takes runs of one task")
        runs.append({"path": str(path), "task": task, "suite": suite_of(task, config), "records": records,
                     "official": plot.is_official(path), "config": config})
    return runs


def suite_of(task, config):
    if task.startswith("atari_"):
        return "atari100k"
    if task.startswith("crafter"):
        return "crafter"
    if task.startswith("dmc_"):
        return plot.reference_suite(task, "auto", config)
    return task.split("_", 1)[0]


def reached(run):
    """The last frame a run logged."""
    return max(float(r["step"]) for r in run["records"])


def frame_budget(suite, runs, frames):
    """(the frames to score at, the paper's budget it falls short of or None). Without --frames: the
    paper's budget, or, where a run stopped short of it, the frames every run reached (so that each
    seed is scored at the same frames), which the output names as short of the budget."""
    if frames:
        return frames, None
    budget = {"atari100k": ATARI_FRAMES, "crafter": CRAFTER_FRAMES, **DMC_FRAMES}.get(suite)
    common = min(reached(run) for run in runs)
    if budget is None:
        return max(reached(run) for run in runs), None
    return (budget, None) if common >= budget else (common, budget)


def seed_returns(runs, metric, frames, window):
    """{task: {run path: mean return in (frames - window, frames]}}."""
    out = {}
    for run in runs:
        steps, values, weights = run_points(run["path"], run["records"], metric, run["official"])
        value = window_mean(steps, values, weights, max(frames - window, 0), frames)
        if value is None:
            raise ScoreError(f"{run['path']}: no {metric} in the window ({fmt(max(frames - window, 0))}, "
                             f"{fmt(frames)}] frames (it reached {fmt(steps.max())}); give --frames or --window")
        out.setdefault(run["task"], {})[run["path"]] = value
    return dict(sorted(out.items()))


def crafter_rates(run, metric, frames):
    """{achievement: success rate in percent} over the training episodes up to `frames`: each row's
    rates (over the episodes since the previous row) weighted by its episode count."""
    if run["official"]:
        raise ScoreError(f"{run['path']} is a logdir of the official code: Crafter success rates are read from "
                         "this project's train/achievement_<name> rows")
    prefix = metric.split("/", 1)[0] + "/achievement_"
    records = run["records"]
    weights = episode_weights(records, metric)
    sums, totals = {}, {}
    for record, weight in zip(records, weights):
        if float(record["step"]) > frames:
            continue
        for key, value in record.items():
            if key.startswith(prefix) and isinstance(value, (int, float)):
                name = key[len(prefix):]
                sums[name] = sums.get(name, 0.0) + weight * value
                totals[name] = totals.get(name, 0.0) + weight
    if not sums:
        raise ScoreError(f"{run['path']}: no {prefix}<name> rows up to {fmt(frames)} frames")
    return {name: sums[name] / totals[name] for name in sorted(sums)}


def score_suite(suite, runs, metric, frames, window, table):
    """One suite's aggregate as a dict (see main for its printed form)."""
    frames, short_of = frame_budget(suite, runs, frames)
    out = {"suite": suite, "metric": metric, "frames": frames}
    if short_of is not None:
        out["short_of"] = short_of
    published = sorted({run["published_seeds"] for run in runs if "published_seeds" in run})
    if published:
        out["published_seeds"] = published
    if suite == "crafter":
        per_seed = {run["path"]: crafter_rates(run, metric, frames) for run in runs}
        scores = {path: crafter_score(rates) for path, rates in per_seed.items()}
        names = sorted(set().union(*per_seed.values()))
        out.update(score=float(np.mean(list(scores.values()))), score_std=float(np.std(list(scores.values()))),
                   seeds=len(runs), achievements=len(names), seed_scores=scores,
                   success_rates={n: float(np.mean([r.get(n, 0.0) for r in per_seed.values()])) for n in names},
                   seed_success_rates=per_seed)
        return out
    returns = seed_returns(runs, metric, frames, window)
    out.update(window=[max(frames - window, 0), frames], tasks={task: {"seeds": seeds, "mean": float(np.mean(list(
        seeds.values())))} for task, seeds in returns.items()})
    if suite == "atari100k":
        agg = atari_aggregate({task: list(seeds.values()) for task, seeds in returns.items()}, table)
        for task, value in agg["games"].items():
            out["tasks"][task]["human_normalised"] = value
        out.update(human_normalised_mean=agg["mean"], human_normalised_median=agg["median"], games=len(returns))
    else:
        out["mean"] = float(np.mean([task["mean"] for task in out["tasks"].values()]))
    return out


def reference_runs(suite):
    """The published curves of a suite as runs of one seed each, their points at the bin ends."""
    reference = plot.load_reference()
    if suite not in reference["suites"]:
        raise ScoreError(f"no reference suite '{suite}'; valid: {', '.join(reference['suites'])}")
    runs = []
    for task, curve in reference["suites"][suite]["tasks"].items():
        records = [{"step": f, "train/return": m} for f, m in zip(curve["frames"], curve["mean"]) if m is not None]
        runs.append({"path": f"reference:{suite}:{task} ({curve['seeds']} seeds)", "task": task, "suite": suite,
                     "records": records, "official": True, "config": {}, "published_seeds": curve["seeds"]})
    return runs, reference["suites"][suite]["budget_frames"]


# ==================================================================================================
# Output
# ==================================================================================================


def fmt(frames):
    return plot.format_frames(float(frames))


def seeds_text(result):
    if "published_seeds" in result:
        counts = result["published_seeds"]
        return f"the published curves' means over {counts[0]}{f'-{counts[-1]}' * (len(counts) > 1)} seeds"
    counts = sorted({len(task["seeds"]) for task in result["tasks"].values()})
    text = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{text} seed{'s' * (counts[-1] > 1)} each"


def short_note(result):
    """What a score of runs short of the paper's budget is, in words; '' at the budget."""
    if "short_of" not in result:
        return ""
    return (f"; SHORT RUN: scored at {fmt(result['frames'])} frames, the most every run reached, not the paper's "
            f"{fmt(result['short_of'])}, so not comparable with its number")


def summary(result):
    return summary_line(result) + short_note(result)


def summary_line(result):
    suite, metric = result["suite"], result["metric"]
    if suite == "crafter":
        rates = ", ".join(f"{name} {rate:.1f}" for name, rate in result["success_rates"].items())
        return (f"crafter ({result['seeds']} seed{'s' * (result['seeds'] > 1)}, {result['achievements']} "
                f"achievements; {metric.split('/')[0]} episodes up to {fmt(result['frames'])} frames): score "
                f"{result['score']:.1f}% (std over seeds {result['score_std']:.1f}); success rates (%): {rates}")
    low, high = result["window"]
    where = f"{metric} of the episodes in ({fmt(low)}, {fmt(high)}] frames"
    tasks = result["tasks"]
    if suite == "atari100k":
        return (f"atari100k ({result['games']} of 26 games, {seeds_text(result)}; {where}): human-normalised "
                f"mean {100 * result['human_normalised_mean']:.1f}%, median "
                f"{100 * result['human_normalised_median']:.1f}%")
    count = f"{len(tasks)} task{'s' * (len(tasks) > 1)}"
    return f"{suite} ({count}, {seeds_text(result)}; {where}): mean over tasks {result['mean']:.1f}"


def table_lines(result):
    lines = []
    if result["suite"] == "crafter":
        for path, score in result["seed_scores"].items():
            lines.append(f"  {path}: score {score:.2f}%")
        return lines
    for task, entry in result["tasks"].items():
        for path, value in entry["seeds"].items():
            lines.append(f"  {task}  {path}: {value:.1f}")
        normalised = (f", human-normalised {100 * entry['human_normalised']:.1f}%"
                      if "human_normalised" in entry else "")
        lines.append(f"  {task}  mean over {len(entry['seeds'])} seed{'s' * (len(entry['seeds']) > 1)}: "
                     f"{entry['mean']:.1f}{normalised}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", metavar="RUN", help="logdirs (this project's or the official code's)")
    parser.add_argument("--metric", default="train/return", help="episode return to score (default train/return)")
    parser.add_argument("--frames", type=float, default=None,
                        help="frame budget (default: 400K Atari 100k, 500K DMC proprio, 1M DMC vision and Crafter)")
    parser.add_argument("--window", type=float, default=10_000,
                        help="frames before the budget whose episodes count (default 10000: (390K, 400K] on Atari)")
    parser.add_argument("--reference", choices=plot.SUITES, help="score the published DreamerV3 curves instead")
    parser.add_argument("--table", action="store_true", help="also print every task and seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    try:
        if args.window <= 0 or (args.frames is not None and args.frames <= 0):
            raise ScoreError("--frames and --window must be positive numbers of frames")
        if args.reference:
            if args.runs:
                raise ScoreError("give RUN folders or --reference, not both")
            runs, budget = reference_runs(args.reference)
            frames = args.frames or budget
        elif not args.runs:
            raise ScoreError("give at least one RUN folder, or --reference SUITE")
        else:
            runs, frames = load_runs(args.runs), args.frames
        table = load_atari_table()
        suites = {}
        for run in runs:
            suites.setdefault(run["suite"], []).append(run)
        results = [score_suite(suite, group, args.metric, frames, args.window, table)
                   for suite, group in suites.items()]
    except (ScoreError, OSError) as e:
        print(f"scores.py: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"suites": {r["suite"]: r for r in results}}, indent=1))
        return 0
    for result in results:
        print(summary(result))
        if args.table:
            for line in table_lines(result):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
