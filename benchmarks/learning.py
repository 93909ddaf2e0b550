"""Side-by-side learning runs: this project and the official DreamerV3 on the same settings.

    python3 benchmarks/learning.py --tasks dmc_cheetah_run,dmc_walker_walk,dmc_reacher_easy --seeds 0,1,2 \\
        --official ~/dreamerv3 --official-python ~/dreamerv3/venv/bin/python --out ./logdir/learning \\
        --parallel 2 -- --configs dmc_proprio recipe2024 size1m --steps 2e4 --train_ratio 256 \\
        --batch_size 16 --batch_length 32 --envs 1 --eval_episode_num 0 --device cpu

Runs tasks x seeds x codes (`--codes project,official`), each one process at `--threads` threads (1 by
default), `--parallel` at once. Both codes get the same flags: everything after `--` plus `--task`,
`--seed` and `--logdir OUT/TASK/CODE_sSEED`; `dreamer.py` takes them as they are, and
`benchmarks/official.py` translates them to the official code's flags (see its docstring: recipe2024's
start, the untrained agent acting until the replay holds one batch, is the official code's).

Resumable: a run that finished (exit status 0; `OUT/TASK/CODE_sSEED/runner.json` records it) is not
started again; an unfinished one is rerun with the same command, and both codes resume from their
checkpoints. A run still going after `--hours` (3 by default) is stopped and marked as timed out;
rerunning the runner continues it. `--report` only writes the report of what is there.

The report (also written after the runs): `OUT/learning.md`, one table per task (train return per
`--bin`-frame window, each column headed by its range, mean and min-max over seeds, per code, and the paper's curve from
benchmarks/reference_curves.json, whose setting is train ratio 512, batch 16 x 64, action repeat 2, so
it matches only runs at that setting; under it each code's last-quarter mean and sd over seeds and
Welch's t of the two, and how often the rule would say below or above for two equal codes at those seed
counts, which the rule below does not use but a reader of three seeds needs, and Levene's test, median-centred,
that the two codes' seeds spread alike), and
`OUT/learning.png` (plot.py's figure: mean and min-max band per code). The verdict per task, by this
rule: take each seed's mean training return over the last quarter of the frames, the quarter that ends at the
last episode every run reaches (the official step counter counts each episode's reset step, so its runs end
one episode earlier in frames: official.frames_of); the task MATCHES when
this project's mean over seeds lies within the range (min to max) of the official seeds; it is BELOW or
ABOVE otherwise; and it is NO LEARNING TO COMPARE unless, for most official seeds, the last-quarter mean
lies above the best single episode of the first quarter (what luck reaches before learning; a mean above
the first quarter's mean is not enough: at a budget where neither code learns, noise passes it, and
agreement then says nothing).

A session's logdirs do not outlive it, so finished runs are kept in the repository:
`--kept benchmarks/learning_rounds.json --keep ROUND` writes every finished run under OUT into that file (its
training episodes, the round, the commit that runner.json recorded, the date), and `--kept FILE` alone lets a seed of
either code with no run under OUT take its kept run, so a task's seeds can be run over several sessions and
reported together (the report names the kept seeds). The file holds one setting: `--keep` refuses flags after `--`
other than the file's. Runs of rounds 3-5, whose logs were not kept, are there as their published last-quarter
mean (with the frames it covered) and best first-quarter episode only (no curve). Before anything starts, every
task and code is checked as its run checks itself (the flags, the task and the device for this project; for the
official code also official.py's translation: recipe2024, one model size, one DMC task); `--dry-run` does only that
and prints every command. `--device cuda` after `--` runs both codes on a GPU (the official one needs its CUDA wheels
in `--official-python`). Bad input: one line, exit 2. A run that fails or times out prints the last lines of its log
on stderr, and the runner, after writing the report, exits 1.
"""

import argparse
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.append(str(HERE))  # last: benchmarks/envs.py must not shadow the envs package

import plot  # noqa: E402

CODES = ("project", "official")


class RunnerError(ValueError):
    """A user mistake: one line, exit status 2."""


# ==================================================================================================
# Runs
# ==================================================================================================


BATCHED = "project_seeds"  # --batched: the project's seeds of a task in one process, OUT/TASK/project_seeds/seed<k>


def run_dir(out, task, code, seed, batched=None):
    """The logdir of one seed's run; with `batched` (the first seed of --batched) the project's seed
    is seed<k> of the one process of the task's seeds (dreamer.py --seeds)."""
    if batched is not None and code == "project":
        return pathlib.Path(out) / task / BATCHED / f"seed{seed - batched}"
    return pathlib.Path(out) / task / f"{code}_s{seed}"


def command(code, task, seed, flags, logdir, args):
    """(argv, environment) of one run."""
    own = [*flags, "--task", task, "--seed", str(seed), "--logdir", str(logdir)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    env.setdefault("MUJOCO_GL", "egl")
    if code == "project":
        return [sys.executable, str(ROOT / "dreamer.py"), *own], env
    if code == "official":
        return [sys.executable, str(HERE / "official.py"), "--official", str(args.official), "--python",
                args.official_python, "--threads", str(args.threads), *own], env
    raise AssertionError(code)  # validated in parse_args


def runner_dir(logdir):
    """The folder of the runner.json that records a seed's process: a seed of --batched shares its task's."""
    logdir = pathlib.Path(logdir)
    return logdir.parent if logdir.parent.name == BATCHED and logdir.name.startswith("seed") else logdir


def finished(logdir):
    path = runner_dir(logdir) / "runner.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("status") == "finished"
    except (json.JSONDecodeError, OSError):
        return False


def commit_of(code, args):
    """The commit a run of `code` runs (of this repository, or of the --official checkout), or None."""
    where = ROOT if code == "project" else args.official
    if where is None:  # --codes project, or a dry run without --official
        return None
    try:
        found = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True, check=False)
    except OSError:
        return None
    return found.stdout.strip() or None


def record(logdir, status, argv, started, code, commit):
    data = {"status": status, "exit": code, "seconds": round(time.time() - started, 1), "command": shlex.join(argv),
            "commit": commit}
    path = pathlib.Path(logdir) / "runner.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def run_all(jobs, args):
    """Start the jobs `args.parallel` at a time; each gets `args.hours` of wall clock. Returns the jobs
    that failed or timed out, each of whose log's last lines have been printed on stderr."""
    pending = [job for job in jobs if not finished(job["logdir"])]
    for job in jobs:
        if job not in pending:
            print(f"learning.py: finished before, not rerun: {job['logdir']}")
    running = []
    for job in jobs:
        job.pop("status", None)
    while pending or running:
        while pending and len(running) < args.parallel:
            job = pending.pop(0)
            job["logdir"].mkdir(parents=True, exist_ok=True)
            log = open(job["logdir"].parent / f"{job['logdir'].name}.log", "a")
            job["process"] = subprocess.Popen(job["argv"], env=job["env"], stdout=log, stderr=subprocess.STDOUT,
                                              cwd=ROOT, start_new_session=True)
            job["started"], job["log"] = time.time(), log
            print(f"learning.py: started {job['logdir']} (log {log.name})", flush=True)
            running.append(job)
        time.sleep(5)
        for job in list(running):
            code = job["process"].poll()
            over = time.time() - job["started"] > args.hours * 3600
            if code is None and over:
                # this project saves and stops on SIGTERM; the official code resumes from its last save (5 minutes)
                os.killpg(job["process"].pid, signal.SIGTERM)
                code = job["process"].wait()
                status = "timed out"
            elif code is None:
                continue
            else:
                status = "finished" if code == 0 else "failed"
            job["log"].close()
            record(job["logdir"], status, job["argv"], job["started"], code, job["commit"])
            print(f"learning.py: {status} (exit {code}) after {time.time() - job['started']:.0f} s: {job['logdir']}",
                  flush=True)
            if status != "finished":
                job["status"] = status
                tail = "\n".join(f"  | {line}" for line in log_tail(job["log"].name))
                print(f"learning.py: the last lines of {job['log'].name}:\n{tail}", file=sys.stderr, flush=True)
            running.remove(job)
    return [job for job in jobs if job.get("status") in ("failed", "timed out")]


def log_tail(path, lines=20):
    """The last `lines` lines of a run's log, where its reason for failing is."""
    try:
        text = pathlib.Path(path).read_text(errors="replace")
    except OSError as e:
        return [f"(cannot read it: {e.strerror or e})"]
    return text.rstrip("\n").splitlines()[-lines:] or ["(empty)"]


# ==================================================================================================
# Report
# ==================================================================================================


def returns(logdir):
    """(frames, train returns) of a run, or None before its first episode."""
    try:
        return plot.series(plot.read_metrics(logdir), "train/return", where=str(logdir))
    except plot.PlotError:
        return None


def quarter_means(steps, values, total, end=None):
    """Mean return of the first quarter of `total` frames and of the last quarter before frame `end` (the
    window (end - total / 4, end]; `end` defaults to `total`), None where empty."""
    end = total if end is None else end
    first = values[steps <= total / 4]
    last = values[(steps > end - total / 4) & (steps <= end)]
    return (float(first.mean()) if len(first) else None, float(last.mean()) if len(last) else None)


def window_end(runs, total):
    """The last frame of a task's last-quarter window: the last episode's end that every finished run
    reaches (the official code's step budget counts its reset steps, so its last episode ends a whole
    episode before this project's: comparing the codes' own last quarters would compare different frames).
    `runs`: (steps or None, the frame a kept summary's window ends at or None) per finished run."""
    ends = [float(steps[-1]) if steps is not None else window for steps, window in runs
            if steps is not None and len(steps) or window is not None]
    return min(ends) if ends else total


def first_quarter_best(steps, values, total):
    """The highest single episode return in the first quarter of `total` frames (None where empty): what
    the policy reaches by luck before it has learned much, which a learned policy's mean must pass."""
    first = values[steps <= total / 4]
    return float(first.max()) if len(first) else None


def verdict(project_last, official_last, official_first_best):
    """The rule of the module docstring."""
    if not project_last or not official_last:
        return "incomplete"
    learned = [last > best for best, last in zip(official_first_best, official_last) if best is not None]
    if sum(learned) * 2 <= len(official_last):
        return "no learning to compare"
    mean = float(np.mean(project_last))
    low, high = min(official_last), max(official_last)
    return "matches" if low <= mean <= high else ("below" if mean < low else "above")


def welch_t(project_last, official_last):
    """Welch's t of the official mean minus this project's (positive: the official code ahead), or None
    with fewer than two seeds on a side: how far apart the two means are in units of their spread."""
    if len(project_last) < 2 or len(official_last) < 2:
        return None
    a, b = np.asarray(project_last, float), np.asarray(official_last, float)
    error = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return float((b.mean() - a.mean()) / error) if error > 0 else None


def chance_outside(n_project, n_official, draws=200_000):
    """How often the range rule says BELOW or ABOVE for two codes that are the same: the probability that
    the mean of `n_project` draws lies outside the min-max of `n_official` draws of one normal distribution
    (by simulation, fixed seed). With few seeds the official range is narrow, so a verdict outside it is
    weak evidence: about 0.37 at three seeds a side."""
    rng = np.random.default_rng(0)
    mean = rng.standard_normal((draws, n_project)).mean(1)
    official = rng.standard_normal((draws, n_official))
    return float(np.mean((mean < official.min(1)) | (mean > official.max(1))))


def equal_spread(project_last, official_last):
    """Levene's test (Brown-Forsythe: deviations from the median) that the two codes' seeds spread
    alike: (W, p), or None with fewer than three seeds on a side (two seeds lie equally far from their
    median, so the test's within-code spread is zero and W meaningless). scipy comes with dm_control."""
    if len(project_last) < 3 or len(official_last) < 3:
        return None
    from scipy import stats

    result = stats.levene(project_last, official_last, center="median")
    return float(result.statistic), float(result.pvalue)


def spread(stats):
    """One line under a task's verdict: each code's last-quarter mean and sd over seeds, Welch's t,
    Levene's test of equal spread, how often equal codes would fall outside the range at these seed
    counts (`chance_outside`), and each seed's best first-quarter episode (the bar its last quarter
    must pass to count as learning)."""
    parts = []
    for code, values in stats.items():
        last = values["last"]
        if last:
            sd = f"sd {np.std(last, ddof=1):.1f}, " if len(last) > 1 else ""
            parts.append(f"{code} {np.mean(last):.1f} ({sd}{len(last)} seed{'s' * (len(last) > 1)})")
    t = welch_t(stats.get("project", {}).get("last", []), stats.get("official", {}).get("last", []))
    levene = equal_spread(stats.get("project", {}).get("last", []), stats.get("official", {}).get("last", []))
    bars = "; ".join(f"{code} " + ", ".join("-" if v is None else f"{v:.1f}" for v in values["first"])
                     for code, values in stats.items() if values["first"])
    n_project, n_official = (len(stats.get(code, {}).get("last", [])) for code in CODES)
    chance = (f"; equal codes fall outside the official range by chance {chance_outside(n_project, n_official):.0%}"
              " of the time at these seed counts" if n_project and n_official > 1 else "")
    return ("Last quarter: " + (", ".join(parts) or "none finished")
            + (f"; Welch t {t:.2f}" if t is not None else "")
            + (f"; Levene W {levene[0]:.2f}, p {levene[1]:.2f} (equal spread)" if levene is not None else "") + chance
            + (f". Best first-quarter episode per seed: {bars}." if bars else "."))


KEPT_SOURCE = ("Finished runs of benchmarks/learning.py kept across sessions (a session's logdirs do not outlive it), "
               "written by `learning.py --keep ROUND`: per task, code and seed the training episodes "
               "[frames, return] of metrics.jsonl, or, for runs whose logs were not kept, only the last-quarter mean "
               "('last') over the frames ('window': (start, end]) of the episodes it averaged and the best "
               "first-quarter episode ('first_best') as benchmarks/README.md published them.")


def load_kept(path, missing_ok=False):
    """{"flags": str, "runs": {(task, code, seed): record}} of a `--kept` file (None, or a missing file with
    `missing_ok`: no runs). A record has "round", "commit", "date" (the run's end) and either "episodes"
    ([[frames, return], ...]) or "last" and "first_best"."""
    if path is None or (missing_ok and not pathlib.Path(path).exists()):
        return {"flags": None, "runs": {}}
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
        runs = {}
        for row in data["runs"]:
            if row["code"] not in CODES or not ("episodes" in row or {"last", "first_best", "window"} <= set(row)):
                raise ValueError(f"a run of {row['task']} without episodes or summary, or of code {row['code']}")
            runs[(row["task"], row["code"], int(row["seed"]))] = row
        return {"flags": data["flags"], "runs": runs}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunnerError(f"--kept {path}: not a file of kept runs ({e})") from None


def kept_stats(row, total):
    """(steps, values) or None, and (first-quarter best, the last-quarter mean of a summary or None, the frame
    that summary's window ends at or None) of a kept run."""
    if "episodes" not in row:
        return None, (float(row["first_best"]), float(row["last"]), float(row["window"][1]))
    steps, values = (np.array(column, float) for column in zip(*row["episodes"]))
    return (steps, values), (first_quarter_best(steps, values, total), None, None)


def keep(out, tasks, seeds, codes, batched, kept_path, round_, flags):
    """Write each finished run under OUT into the `--kept` file (replacing a kept run of the same task, code
    and seed), with its episodes, `round_`, the commit runner.json recorded and today's date; returns how
    many. The file holds runs of one setting: its flags must be `flags`, which every kept run's command holds."""
    kept = load_kept(kept_path, missing_ok=True)
    flags = shlex.join(flags)
    if kept["flags"] is not None and kept["flags"] != flags:
        raise RunnerError(f"--keep: the flags after -- are not those of {kept_path} ({kept['flags']})")
    rows, count = dict(kept["runs"]), 0
    for task in tasks:
        for code in codes:
            for seed in seeds:
                logdir = run_dir(out, task, code, seed, batched)
                data = returns(logdir)
                if data is None or not finished(logdir):
                    continue
                path = runner_dir(logdir) / "runner.json"
                record = json.loads(path.read_text())
                if flags not in record.get("command", "") or not record.get("commit"):
                    raise RunnerError(f"--keep: {logdir} ran with other flags or records no commit "
                                      f"(runner.json: {record.get('command')!r}, commit {record.get('commit')!r})")
                steps, values = data
                rows[(task, code, seed)] = {
                    "task": task, "code": code, "seed": seed, "round": round_, "commit": record["commit"],
                    "date": time.strftime("%Y-%m-%d", time.localtime(path.stat().st_mtime)),
                    "episodes": [[int(f), round(float(v), 2)] for f, v in zip(steps, values)]}
                count += 1
    text = json.dumps({"source": KEPT_SOURCE, "flags": flags, "runs": []}, indent=1)
    body = ",\n".join("  " + json.dumps(row) for _, row in sorted(rows.items()))
    text = text.replace('"runs": []', '"runs": [\n' + body + "\n ]")
    tmp = pathlib.Path(f"{kept_path}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, kept_path)
    return count


def report(out, tasks, seeds, codes, total, bin_frames, kept=None, batched=None):
    """learning.md and learning.png under OUT; returns the markdown. `kept` (load_kept): a seed of either
    code with no run under OUT (or of a code not in `codes`) takes its kept run; `batched`: the project's
    seeds ran as one process from this first seed (run_dir)."""
    reference = plot.load_reference()
    lines, runs = [], []
    kept = (kept or {"runs": {}})["runs"]
    extra = {}  # task -> {code: [(steps, values)]}: kept curves for the figure
    for task in tasks:
        stats = {code: {"first": [], "last": [], "seeds": [], "kept": []} for code in CODES}
        curves, found, apart = {}, [], []
        for code in CODES:
            for seed in seeds:
                logdir = run_dir(out, task, code, seed, batched)
                data = returns(logdir) if code in codes else None
                summary = window = None
                if data is not None:
                    runs.append(f"{code}={logdir}")
                    first, done = first_quarter_best(*data, total), finished(logdir)
                elif (task, code, seed) in kept:
                    row = kept[(task, code, seed)]
                    data, (first, summary, window) = kept_stats(row, total)
                    done = True
                    stats[code]["kept"].append(f"{seed} (round {row['round']}, {row['commit']})")
                    if data is not None:
                        extra.setdefault(task, {}).setdefault(code, []).append(data)
                else:
                    continue
                if data is not None:
                    curves.setdefault(code, []).append(data)
                stats[code]["seeds"].append(seed)
                stats[code]["first"].append(first)
                # A run still going (or stopped) says nothing about its last quarter.
                found.append((code, seed, data if done else None, summary, window))
        end = window_end([(None if data is None else data[0], window) for _, _, data, summary, window in found
                          if data is not None or summary is not None], total)
        for code, seed, data, summary, window in found:
            last = None if data is None else quarter_means(*data, total, end)[1]
            if last is not None:  # None: no episode of this run ends in the window
                stats[code]["last"].append(last)
            elif summary is not None:
                stats[code]["last"].append(summary)
                if window != end:
                    apart.append(f"{code} seed {seed} (kept as a mean over frames ending at {window:,.0f})")
        stats = {code: values for code, values in stats.items() if values["seeds"]}
        frames = np.arange(bin_frames, total + bin_frames / 2, bin_frames)
        lines += [f"### {task}", "", "| code | seeds | " + " | ".join(plot.window_label(f, bin_frames) for f in frames)
                  + " | last quarter, per seed |", "|---" * (len(frames) + 3) + "|"]
        for code, values in stats.items():
            cells = [""] * len(frames)
            if code in curves:
                agg = plot.aggregate(curves[code], bin_frames)
                for i, f in enumerate(frames):
                    hit = np.flatnonzero(agg["frames"] == f)
                    if len(hit):
                        cells[i] = f"{agg['mean'][hit[0]]:.0f} ({agg['min'][hit[0]]:.0f}-{agg['max'][hit[0]]:.0f})"
            without = len(values["seeds"]) - len(curves.get(code, []))
            count = f"{len(values['seeds'])}" + (f" ({without} without a curve)" if without else "")
            last = ", ".join(f"{v:.0f}" for v in values["last"]) or "unfinished"
            lines.append(f"| {code} | {count} | " + " | ".join(cells) + f" | {last} |")
        curve = plot.find_reference(reference, "dmc_proprio" if task.startswith("dmc") else None, task)
        if curve is not None:
            cells = [f"{curve['mean'][np.flatnonzero(curve['frames'] == f)[0]]:.0f}"
                     if np.any(curve["frames"] == f) else "" for f in frames]
            if any(cells):  # no empty row where the paper has no window at these frames
                lines.append(f"| paper (ratio 512, 16 x 64) | {curve['seeds']} | " + " | ".join(cells) + " | |")
        decision = verdict(stats.get("project", {}).get("last", []), stats.get("official", {}).get("last", []),
                           stats.get("official", {}).get("first", []))
        lines += ["", f"Verdict: **{decision}**", "",
                  f"Last quarter: frames ({end - total / 4:,.0f}, {end:,.0f}], the last episode every run reaches"
                  + (f"; not recomputable: {', '.join(apart)}" if apart else "") + ".", "", spread(stats)]
        kept_lines = [f"{code} seeds {', '.join(values['kept'])}" for code, values in stats.items() if values["kept"]]
        lines += ([f"Kept from earlier rounds: {'; '.join(kept_lines)}."] if kept_lines else []) + [""]
    text = "\n".join(lines) + "\n"
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)  # a report of kept runs alone may have no runs folder yet
    pathlib.Path(out, "learning.md").write_text(text)
    if runs or extra:
        groups = plot.collect(runs, "train/return", "dmc_proprio", reference) if runs else {}
        for task, by_code in extra.items():
            group = groups.setdefault(task, {"seeds": [], "several": [], "named": {},
                                             "reference": plot.find_reference(reference, "dmc_proprio", task)})
            for code, data in by_code.items():
                group["named"].setdefault(code, []).extend(data)
        plot.plot(groups, "train/return", pathlib.Path(out, "learning.png"), spread="minmax", bin_frames=bin_frames)
    return text


# ==================================================================================================
# Command line
# ==================================================================================================


def parse_args(argv):
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", required=True, help="comma-separated task names")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--codes", default=",".join(CODES), help="project, official or both")
    parser.add_argument("--official", type=pathlib.Path, help="a checkout of danijar/dreamerv3")
    parser.add_argument("--official-python", default=sys.executable, help="its interpreter")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="folder of the runs and the report")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="threads per run")
    parser.add_argument("--hours", type=float, default=3.0, help="wall clock per run before it is stopped")
    parser.add_argument("--bin", type=float, default=2500, help="frames per window of the report's table")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")
    parser.add_argument("--report", action="store_true", help="only write the report")
    parser.add_argument("--batched", action="store_true", help="run the project's seeds of a task as one "
                        "process, one batched update (dreamer.py --seeds N); the seeds must be consecutive")
    parser.add_argument("--kept", type=pathlib.Path, help="runs kept from earlier rounds (e.g. "
                        "benchmarks/learning_rounds.json): a seed without a run under --out takes its kept run")
    parser.add_argument("--keep", type=int, metavar="ROUND", help="write the finished runs under --out into the "
                        "--kept file as round ROUND (the flags after -- must be the file's)")
    args = parser.parse_args(own)
    given, args.tasks = args.tasks, [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks:
        raise RunnerError(f"--tasks {given!r}: name at least one task, e.g. dmc_cheetah_run,dmc_walker_walk")
    args.codes = [c for c in args.codes.split(",") if c]
    bad = [c for c in args.codes if c not in CODES] or ([""] if not args.codes else [])
    if bad:
        raise RunnerError(f"--codes {','.join(bad)}: valid: {', '.join(CODES)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise RunnerError(f"--seeds {args.seeds}: give whole numbers, e.g. 0,1,2") from None
    if not args.seeds:
        raise RunnerError("--seeds '': give whole numbers, e.g. 0,1,2")
    if args.batched and args.seeds != list(range(args.seeds[0], args.seeds[0] + len(args.seeds))):
        raise RunnerError(f"--batched needs consecutive seeds (dreamer.py --seeds N trains seed .. seed + N - 1), "
                          f"not {','.join(map(str, args.seeds))}")
    args.first = args.seeds[0] if args.batched else None
    for name in ("parallel", "threads"):
        if getattr(args, name) < 1:
            raise RunnerError(f"--{name} {getattr(args, name)}: give a whole number >= 1")
    if "official" in args.codes and not args.report and not args.dry_run and not (
            args.official and (args.official / "dreamerv3" / "main.py").is_file()):
        raise RunnerError(f"--official {args.official}: needs a checkout of danijar/dreamerv3 (with "
                          "dreamerv3/main.py), or --codes project")
    for key in ("--task", "--seed", "--seeds", "--logdir"):
        if key in flags:
            raise RunnerError(f"{key} after --: the runner sets it for each run")
    args.flags = flags
    args.total = steps_of(flags)
    if args.keep is not None and args.kept is None:
        raise RunnerError(f"--keep {args.keep}: name the file to keep the runs in with --kept")
    args.kept_runs = load_kept(args.kept, missing_ok=args.keep is not None)  # --keep starts a new file
    return args


def steps_of(flags):
    """The frames each run trains for, as dreamer.py settles them (presets and --steps)."""
    sys.path.insert(0, str(ROOT))
    import config as cfg
    import tools

    try:
        return float(cfg.parse([*flags, "--task", "dmc_cartpole_balance"]).steps)
    except tools.ConfigError as e:
        raise RunnerError(f"the flags after --: {e}") from None


def gpu_problem():
    """Why the official code could not run on a GPU here (None when nvidia-smi lists one): JAX's CUDA
    wheels live in another interpreter, so the machine's driver is asked, not torch."""
    try:
        found = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi cannot be run ({getattr(e, 'strerror', None) or type(e).__name__}): no NVIDIA driver here"
    return None if found.returncode == 0 and "GPU" in found.stdout else "nvidia-smi lists no GPU"


def check_runs(args):
    """Check every task and code the runner would start as that run checks itself before it writes
    anything (dreamer.py's setup: the flags, the task, the device; official.py's translation: recipe2024,
    a model size, one DMC task, the start), so that a mistake is one line before any run starts, not a
    failed run hours later. Raises RunnerError naming the code and task."""
    sys.path.insert(0, str(ROOT))
    import official

    import config as cfg
    import envs
    import launch
    import logs
    import seeds
    import tools

    for task in args.tasks:
        for code in args.codes:
            flags = [*args.flags, "--task", task, "--seed", str(args.seeds[0]), "--logdir", "unused"]
            if code == "project" and args.batched:
                flags += ["--seeds", str(len(args.seeds))]
            try:
                if code == "project":
                    config = cfg.parse(flags)
                    cfg.check_text(config)
                    cfg.check_processes(config)
                    logs.check_loggers(config.logger)
                    config = cfg.check_tasks(config)
                    config, _ = launch.resolve_device(config)
                    seeds.check(config, 1)
                elif code == "official":
                    config, suite, size = official.settle(flags)
                    envs.check_task(task)
                    official.check_start(config)
                    official.official_flags(config, suite, size, pathlib.Path("unused"))
                    if config.device.startswith("cuda") and (problem := gpu_problem()) is not None:
                        raise RunnerError(f"--device {config.device} cannot be used: {problem}")
                    if not args.dry_run:
                        official.check_interpreter(args.official_python)
                else:
                    raise AssertionError(code)  # validated in parse_args
            except (tools.ConfigError, envs.TaskError, official.OfficialError, RunnerError) as e:
                raise RunnerError(f"{code} run of {task}: {e}") from None


def main(argv=None):
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if not args.report:
            check_runs(args)
    except RunnerError as e:
        print(f"learning.py: {e}", file=sys.stderr)
        return 2
    jobs = []
    for task in args.tasks:
        if args.batched and "project" in args.codes:
            logdir = pathlib.Path(args.out) / task / BATCHED
            argv_, env = command("project", task, args.first, [*args.flags, "--seeds", str(len(args.seeds))],
                                 logdir, args)
            jobs.append({"logdir": logdir, "argv": argv_, "env": env, "commit": commit_of("project", args)})
        for seed in args.seeds:
            for code in args.codes:
                if args.batched and code == "project":
                    continue
                logdir = run_dir(args.out, task, code, seed)
                argv_, env = command(code, task, seed, args.flags, logdir, args)
                jobs.append({"logdir": logdir, "argv": argv_, "env": env, "commit": commit_of(code, args)})
    if args.dry_run:
        for job in jobs:
            state = "finished, skipped" if finished(job["logdir"]) else "to run"
            print(f"OMP_NUM_THREADS={args.threads} {shlex.join(job['argv'])}  # {state}")
        return 0
    seed_dirs = [run_dir(args.out, task, code, seed, args.first) for task in args.tasks for code in args.codes
                 for seed in args.seeds]
    kept = any(key[0] in args.tasks and key[2] in args.seeds for key in args.kept_runs["runs"])
    if args.report and not kept and not any(returns(logdir) is not None for logdir in seed_dirs):
        # a mistyped --out or task would otherwise write an empty report over nothing
        print(f"learning.py: --report: no run of {','.join(args.tasks)} with an episode under --out {args.out}",
              file=sys.stderr)
        return 2
    failed = run_all(jobs, args) if not args.report else []
    if args.keep is not None:
        try:
            count = keep(args.out, args.tasks, args.seeds, args.codes, args.first, args.kept, args.keep, args.flags)
        except RunnerError as e:
            print(f"learning.py: {e}", file=sys.stderr)
            return 2
        print(f"learning.py: kept {count} finished run(s) in {args.kept} as round {args.keep}")
        args.kept_runs = load_kept(args.kept)
    print(report(args.out, args.tasks, args.seeds, args.codes, args.total, args.bin, args.kept_runs, args.first))
    if failed:
        print(f"learning.py: {len(failed)} run(s) did not finish (their logs' last lines are above; rerun to "
              f"resume them): " + ", ".join(str(job["logdir"]) for job in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
