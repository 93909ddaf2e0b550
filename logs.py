"""What a run reports: metrics to the logging back ends, progress and status lines, metric names.

1. Back ends: TensorBoard events, metrics.jsonl, metrics.csv and W&B behind one Logger, videos.
2. Progress and status lines: the tqdm bar or plain progress line, bounded phases (prefill,
   pretraining, compilation) that never pass a minute in silence, the environments' status line.
3. Metric names and episode statistics: the TensorBoard groups of the update's metrics, episode
   returns and lengths, per task, and the evaluation's scalars.
4. A run's log and its evaluation: the metrics averaged per log, the episodes since then and the
   end on a non-finite loss (RunLog), the evaluation during training (Evaluation) and the files
   of --eval_only (write_eval_only).

Nothing here knows about the world model: its open-loop predictions come as a callable.
"""

import collections
import datetime
import functools
import io
import itertools
import json
import os
import pathlib
import sys
import threading
import time
import uuid
import warnings

import numpy as np
import torch

import envs
from storage import NonFiniteError, WriteError, atomic_write_bytes, strip_logs
from tools import ConfigError, all_finite, replayed_per_update

# ==================================================================================================
# Back ends: TensorBoard, metrics.jsonl, metrics.csv, W&B
# ==================================================================================================


def video_frames(video):
    """video: (B, T, H, W, C) uint8 or float in [0, 1] -> (T, H, B * W, C) uint8, the batch entries
    laid side by side, as every back end shows it."""
    video = np.asarray(video)
    if np.issubdtype(video.dtype, np.floating):
        video = np.clip(255 * video, 0, 255).astype(np.uint8)
    batch, time, height, width, channels = video.shape
    return video.transpose(1, 2, 0, 3, 4).reshape(time, height, batch * width, channels)


def _video_warning(name, error):
    warnings.warn(f"Could not write video {name}: {error}", stacklevel=3)


def quiet_event_writer(args, default=threading.excepthook):
    """threading.excepthook: the event writer's thread re-raises a failed write (a full disk), which
    the next flush raises again in the run's thread, where it becomes one line (Logger); its own
    traceback is not printed."""
    if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
        return
    default(args)


class TensorBoardOutput:
    """Scalars, videos and text as TensorBoard events in the logdir."""

    def __init__(self, logdir, step, config):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run continues its curves: events written after the checkpoint are dropped.
        self.writer = SummaryWriter(str(logdir), purge_step=step if step else None, max_queue=1000)
        events = self.writer.file_writer.event_writer  # the file a failed write names (torch keeps it private)
        self.path = pathlib.Path(getattr(events, "_file_name", None) or self.writer.file_writer.get_logdir())
        if threading.excepthook is not quiet_event_writer:
            threading.excepthook = functools.partial(quiet_event_writer, default=threading.excepthook)

    def write(self, step, scalars, videos):
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        for name, frames in videos.items():  # frames: (T, H, W, C) uint8
            try:
                self.writer.add_video(name, frames[None].transpose(0, 1, 4, 2, 3), step, fps=16)
            except Exception as e:  # noqa: BLE001 - a missing video encoder must not end training
                _video_warning(name, e)
        self.writer.flush()

    def text(self, name, value, step):
        self.writer.add_text(name, value, step)

    def close(self):
        self.writer.close()


def set_aside(path, kept, damaged, problem):
    """A log file with `damaged` lines that cannot be read (the first: `problem`): the file as it was
    is kept as <name>.damaged (or .damaged.1, ...), `kept` (its readable lines, text) replaces it, and
    one warning line says so; the run goes on."""
    backup = path.with_name(path.name + ".damaged")
    for n in itertools.count(1):
        if not backup.exists():
            break
        backup = path.with_name(f"{path.name}.damaged.{n}")
    os.replace(path, backup)
    atomic_write_bytes(path, kept.encode())
    print(f"warning: {path}: {damaged} damaged line(s) left out ({problem}); the file as it was is kept as "
          f"{backup.name}", file=sys.stderr, flush=True)


class JsonlOutput:
    """metrics.jsonl: one JSON object per write, {"step": frames, name: value, ...}. Damaged lines
    (a kill -9 mid-line, an edit) are left out at the start, the file as it was set aside (set_aside)."""

    def __init__(self, logdir, step, config):
        self.path = pathlib.Path(logdir) / "metrics.jsonl"
        self.last = None  # the step of the last row kept: a resumed run writes no second row at it
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        keep, damaged, problem = [], 0, None
        for number, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
                if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
                    raise ValueError("not an object with a step")
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                damaged += 1
                problem = problem or f"line {number}: {str(e)[:80]}"
                continue
            if not step or row["step"] <= step:  # a resumed run drops what came after its checkpoint
                keep.append(line.decode("utf-8"))
                self.last = row["step"] if self.last is None else max(self.last, row["step"])
        text = "".join(line + "\n" for line in keep)
        if damaged:
            set_aside(self.path, text, damaged, problem)
        elif text.encode() != data:
            atomic_write_bytes(self.path, text.encode())

    def write(self, step, scalars, videos):
        # A step logged already: a run resumed from an older checkpoint after a failed save reaches the
        # frame of its last log again (its stored episodes count), and the first row stays the one.
        if scalars and (self.last is None or step > self.last):
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **scalars}) + "\n")
            self.last = step

    def text(self, name, value, step):
        pass

    def close(self):
        pass


def _csv_step(row):
    try:
        return float(row.get("step"))
    except (TypeError, ValueError):
        return None


class CsvOutput:
    """metrics.csv: the rows of metrics.jsonl as one flat table, a column per metric (step first,
    then in the order metrics first appear), an empty cell where a row lacks a metric.

    A row is appended while the header holds all its metrics. A metric that appears later (eval/
    after the first evaluation) widens the header: the file is then rewritten whole, atomically,
    which happens only the few times a new name turns up.
    """

    def __init__(self, logdir, step, config):
        import csv

        self.csv = csv
        self.path = pathlib.Path(logdir) / "metrics.csv"
        self.columns, rows = ["step"], []
        self.last = None  # as JsonlOutput's
        if self.path.exists():
            try:
                with self.path.open(newline="") as f:
                    reader = csv.DictReader(f)
                    self.columns = list(reader.fieldnames or ["step"])
                    rows = list(reader)
            except (UnicodeDecodeError, csv.Error) as e:  # not text: nothing of it can be kept
                set_aside(self.path, "", "all", str(e)[:80])
                self.columns, rows = ["step"], []
            good = [row for row in rows if _csv_step(row) is not None]
            kept = [row for row in good if not step or _csv_step(row) <= step]  # a resumed run drops what came after
            self.last = max((_csv_step(row) for row in kept), default=None)
            if len(good) < len(rows):
                self._rewrite(kept, damaged=len(rows) - len(good))
            elif len(kept) < len(rows):
                self._rewrite(kept)

    def _rewrite(self, rows, damaged=0):
        buffer = io.StringIO()
        writer = self.csv.DictWriter(buffer, self.columns, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        if damaged:
            set_aside(self.path, buffer.getvalue(), damaged, "rows without a numeric step")
        else:
            atomic_write_bytes(self.path, buffer.getvalue().encode())

    def write(self, step, scalars, videos):
        if not scalars or (self.last is not None and step <= self.last):  # as JsonlOutput.write
            return
        self.last = step
        row = {"step": step, **{name: repr(float(value)) for name, value in scalars.items()}}
        new = [name for name in row if name not in self.columns]
        if new or not self.path.exists():
            rows = []
            if self.path.exists():
                with self.path.open(newline="") as f:
                    rows = list(self.csv.DictReader(f))
            self.columns += new
            self._rewrite([*rows, row])
            return
        with self.path.open("a", newline="") as f:
            self.csv.DictWriter(f, self.columns, restval="", lineterminator="\n").writerow(row)

    def text(self, name, value, step):
        pass

    def close(self):
        pass


WANDB_MISSING = "--logger wandb needs the wandb package, which is not installed: pip install wandb"


class WandbOutput:
    """A Weights & Biases run: the saved config as the run's config, scalars, videos (where
    video_pred_log is on) and text, against the frame count `step`.

    The run's id is kept in logdir/wandb_id.txt, so a resumed training run continues the same W&B
    run. W&B refuses steps that go backwards, and a resumed run repeats the frames between its
    checkpoint and the kill: every value is therefore logged with `step` as its x axis (the
    metric "step", defined as the step metric of all others) rather than as W&B's own step, so the
    repeated frames show up as a short overlap instead of being dropped. WANDB_MODE=offline keeps
    the run on disk (logdir/wandb/) for a later `wandb sync`.
    """

    ID_FILE = "wandb_id.txt"

    @staticmethod
    def check():
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(WANDB_MISSING) from None

    def __init__(self, logdir, step, config):
        import wandb

        self.wandb = wandb
        logdir = pathlib.Path(logdir)
        config = config or {}
        options = config.get("wandb") or {}
        id_file = logdir / self.ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits
            atomic_write_bytes(id_file, (run_id + "\n").encode())
        # --seeds N: N runs in this one process, named <logdir>-seed<k> and grouped by the logdir
        seeds = (config.get("seeds") or 1) > 1
        name = f"{logdir.resolve().parent.name}-{logdir.name}" if seeds else logdir.resolve().name
        group = options.get("group") or (logdir.resolve().parent.name if seeds else None)
        self.run = wandb.init(
            project=options.get("project") or None, entity=options.get("entity") or None,
            group=group, name=options.get("name") or name,
            tags=list(options.get("tags") or []) or None, id=run_id, resume="allow", dir=str(logdir),
            config=config, settings=wandb.Settings(console="off"), reinit="create_new" if seeds else None)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, step, scalars, videos):
        data = {"step": step, **scalars}
        for name, frames in videos.items():  # frames: (T, H, W, C) uint8; W&B takes (T, C, H, W)
            try:
                data[name] = self.wandb.Video(frames.transpose(0, 3, 1, 2), fps=16, format="mp4")
            except Exception as e:  # noqa: BLE001 - a missing video encoder must not end training
                _video_warning(name, e)
        self.run.log(data)

    def text(self, name, value, step):
        self.run.log({"step": step, name: self.wandb.Html(f"<pre>{value}</pre>")})

    def close(self):
        self.run.finish()


# --logger names -> back ends; tools.check_loggers validates a list of them.
LOGGERS = {"tensorboard": TensorBoardOutput, "jsonl": JsonlOutput, "csv": CsvOutput, "wandb": WandbOutput}


def check_loggers(names):
    """Raise ConfigError, in one line, for a --logger list that names an unknown back end, names
    none, or names one whose package is missing (wandb is optional). Writes nothing."""
    valid = ", ".join(LOGGERS)
    if isinstance(names, str) or not names:
        raise ConfigError(f"Invalid value '{names if isinstance(names, str) else ''}' for --logger; valid: one or "
                         f"more of {valid}, comma-separated")
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"Invalid value '{name}' for --logger; valid: one or more of {valid}, comma-separated")
    for name in dict.fromkeys(names):
        check = getattr(LOGGERS[name], "check", None)
        if check:
            check()


class Logger:
    """Scalars and videos, collected between writes and sent at `write()` to each back end of
    `outputs` (names of LOGGERS: TensorBoard events, metrics.jsonl, metrics.csv, W&B).

    Scalars may be tensors; they are converted to floats only when written, so the training step
    never waits on the device for logging. `config` is the run's config as a dict (W&B's run
    config and options).
    """

    def __init__(self, logdir, step=0, outputs=("tensorboard", "jsonl"), config=None):
        check_loggers(list(outputs))
        self.logdir = pathlib.Path(logdir)
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
            self.outputs = [LOGGERS[name](self.logdir, step, config) for name in dict.fromkeys(outputs)]
        except OSError as e:  # WriteError included: as a write (guarded)
            raise e if isinstance(e, WriteError) else WriteError(self.logdir, e) from None
        self.scalars = collections.defaultdict(list)
        self.videos = {}

    def scalar(self, name, value):
        self.scalars[name].append(value)

    def video(self, name, value):
        self.videos[name] = value

    def write(self, step):
        values = {}
        for name, items in self.scalars.items():
            values[name] = float(torch.as_tensor([float(v) for v in items], dtype=torch.float64).mean())
        videos = {name: video_frames(video) for name, video in self.videos.items()}
        self.scalars.clear()
        self.videos.clear()
        for output in self.outputs:
            self.guarded(output, output.write, step, values, videos)
        return values

    def text(self, name, value, step):
        for output in self.outputs:
            self.guarded(output, output.text, name, value, step)

    def close(self):
        """Close every back end, the others too when one fails; then raise the first failure."""
        failed = None
        for output in self.outputs:
            try:
                self.guarded(output, output.close)
            except WriteError as e:
                failed = failed or e
        if failed is not None:
            raise failed

    @staticmethod
    def guarded(output, call, *args):
        """A back end's write fails as every file of the run does: storage.WriteError, naming its file
        (one line in dreamer.main, with advice that fits the errno)."""
        try:
            return call(*args)
        except WriteError:
            raise
        except OSError as e:
            raise WriteError(getattr(output, "path", "the logdir"), e) from None


class NullLogger:
    """What every process but the main one logs to under torchrun: nothing."""

    def scalar(self, name, value):
        pass

    def video(self, name, value):
        pass

    def text(self, name, value, step):
        pass

    def write(self, step):
        return {}

    def close(self):
        pass


# ==================================================================================================
# Progress and status lines
# ==================================================================================================


class Progress:
    """One updating line (tqdm) in a terminal; a plain line at every log when stdout is a file."""

    def __init__(self, total, initial, interactive=None):
        from tqdm import tqdm

        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self.total = total
        self.bar = tqdm(total=total, initial=initial, unit="frame", dynamic_ncols=True, disable=not self.interactive)
        self.stats, self.eta = {}, None

    def update(self, frames, **stats):
        self.stats.update({k: v for k, v in stats.items() if v is not None})
        if self.interactive:
            self.bar.update(frames - self.bar.n)
            self.bar.set_postfix({k: self.format(k, v) for k, v in self.stats.items()}, refresh=False)

    @staticmethod
    def format(key, value):
        return f"{value:.0%}" if key.endswith("_busy") else f"{value:.1f}"

    def line(self, frames):
        """The plain progress line: frames, rates, last returns and ETA (`eta` seconds where the run's log
        set it, eta_seconds; else from the fps)."""
        fps = self.stats.get("fps", 0.0)
        # capped at what a timedelta holds: a long --steps at a slow first rate would overflow it
        most = datetime.timedelta.max // datetime.timedelta(seconds=1)
        left = self.eta if self.eta is not None else max(self.total - frames, 0) / fps if fps > 0 else None
        eta = datetime.timedelta(seconds=int(min(max(left, 0), most))) if left is not None else "?"
        done = min(frames / self.total, 1.0) if self.total else 1.0  # a few frames past --steps (or of --steps 0)
        parts = [f"frames {frames}/{self.total} ({100 * done:.1f}%)"]
        parts += [f"{k} {self.format(k, v)}" for k, v in self.stats.items()]
        return " | ".join(parts + [f"ETA {eta}"])

    def log(self, frames):
        if not self.interactive:
            print(self.line(frames), flush=True)

    def close(self):
        self.bar.close()


def eta_seconds(frames_left, frames, seconds, evaluations):
    """The seconds left: `frames_left` at the training pace of the last log (`frames` in `seconds` of
    training, its evaluations' time left out), plus the evaluations still due (`evaluations`: their
    seconds). a682c18 divided by the first log's fps, evaluation included: 10-50x too long."""
    if frames <= 0 or seconds <= 0:
        return None
    return max(frames_left, 0) * seconds / frames + evaluations


class Phase:
    """A bounded phase before training proper (prefill, pretraining, compilation): its own tqdm bar
    in a terminal; in a log file a plain line when it starts, after its first step and then every
    `every` seconds with its rate and ETA, and when it ends, so that no minute passes in silence.
    A heartbeat thread keeps the lines (and the bar's clock) coming while one step takes long, such
    as a full-size update on a loaded CPU or a compilation."""

    def __init__(self, name, total, unit, interactive, every=10.0):
        from tqdm import tqdm

        self.name, self.total, self.unit, self.interactive, self.every = name, total, unit, interactive, every
        self.done, self.start = 0, time.time()
        self.last = self.start
        self.bar = tqdm(total=total, desc=name, unit=unit, dynamic_ncols=True, leave=False, disable=not interactive)
        if not interactive:
            print(f"{name}: 0/{total} {unit}s", flush=True)
        self.stopped = threading.Event()
        if every > 0:
            threading.Thread(target=self.heartbeat, daemon=True).start()

    def heartbeat(self):
        while not self.stopped.wait(self.every):
            if self.interactive:
                self.bar.refresh()
            elif time.time() - self.last >= self.every:
                self.last = time.time()
                print(self.line(self.last), flush=True)

    def update(self, done):
        self.bar.update(done - self.done)
        self.done = done
        now = time.time()
        # The first step gives the rate (and ETA) as soon as it is known; then every `every` seconds.
        if not self.interactive and (self.last == self.start or now - self.last >= self.every):
            self.last = now
            print(self.line(now), flush=True)

    def line(self, now):
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = datetime.timedelta(seconds=int((self.total - self.done) / rate)) if rate > 0 else "?"
        percent = 100 * self.done / max(self.total, 1)
        return (f"{self.name}: {self.done}/{self.total} {self.unit}s ({percent:.0f}%) | "
                f"{rate:.2f} {self.unit}s/s | elapsed {datetime.timedelta(seconds=int(elapsed))} | ETA {eta}")

    def __enter__(self):
        return self

    def __exit__(self, error, *_):
        self.close(finished=error is None)

    def close(self, finished=True):
        self.stopped.set()
        self.bar.close()
        if not finished:  # an error is on its way up; no "done" line
            return
        seconds = time.time() - self.start
        message = f"{self.name}: done, {self.done} {self.unit}s in {seconds:.1f} s"
        if self.interactive:
            self.bar.write(message)
        else:
            print(message, flush=True)


class FirstCalls:
    """Calls of a kind that is slow the first time (a compiling update: minutes on a CPU): the first
    call of each `name` is a Phase of its own, a bar in a terminal or log lines, so that the wait is
    not silent; later ones run plainly. `interactive()` says whether stdout is a terminal."""

    def __init__(self, label, interactive):
        self.label, self.interactive, self.seen = label, interactive, set()

    def __call__(self, name, fn, *args):
        if name in self.seen:
            return fn(*args)
        self.seen.add(name)
        with Phase(f"{self.label} ({name})", 1, "call", self.interactive()) as phase:
            out = fn(*args)
            phase.update(1)
        return out


def env_status_line(rows):
    """One line for the environments' status rows (parallel.Collector.status), however many there
    are: steps, episodes, fps and step time as min/median/max, and the environments whose worker
    was restarted."""
    def spread(key, digits=1):
        values = np.array([row[key] for row in rows], float)
        values = values[np.isfinite(values)]
        if not len(values):
            return "-"
        low, mid, high = np.min(values), np.median(values), np.max(values)
        return f"{low:.{digits}f}/{mid:.{digits}f}/{high:.{digits}f}"

    restarted = [f"{i} ({row['restarts']}x)" for i, row in enumerate(rows) if row.get("restarts")]
    return (f"  envs {len(rows)} (min/median/max): steps {spread('steps', 0)} | episodes "
            f"{sum(row['episodes'] for row in rows)} | fps {spread('fps')} | step {spread('step_ms')} ms"
            + (f" | restarted: env {', '.join(restarted)}" if restarted else ""))


def write_mp4(path, frames, fps=30):
    import imageio.v2 as imageio

    tmp = path.with_name(f".{path.stem}.tmp.mp4")
    imageio.mimwrite(tmp, list(frames), fps=fps, format="FFMPEG", macro_block_size=1)
    os.replace(tmp, path)


# ==================================================================================================
# Metric names and episode statistics
# ==================================================================================================


def episode_stats(episode):
    return {"return": float(episode["reward"].sum()), "length": len(episode["reward"]) - 1}


def by_task(tasks, episodes):
    """{task name: its episodes}, in the order of `tasks`, for the tasks that have any. An episode
    without a `task` key (stored before runs of several tasks existed) is of the first task."""
    groups = {}
    for episode in episodes:
        index = int(episode["task"][0]) if "task" in episode else 0
        groups.setdefault(index, []).append(episode)
    return {tasks[i]: groups[i] for i in sorted(groups)}


def log_episode_metrics(logger, prefix, tasks, episodes):
    """The suites' own scalars (envs.episode_metrics) of each task: <prefix>/<key> with one task,
    <prefix>/<task>/<key> with several."""
    for task, group in by_task(tasks, episodes).items():
        scope = f"{prefix}/{task}" if len(tasks) > 1 else prefix
        for key, value in envs.episode_metrics(task, group).items():
            logger.scalar(f"{scope}/{key}", value)


ACTOR_METRICS = ("return_scale", "advantage", "imag_reward", "imag_return")


def metric_name(key):
    """Group metrics in TensorBoard: expl/, actor/, critic/ or world_model/."""
    if key.startswith("expl_"):
        return f"expl/{key[5:]}"
    if key.startswith("actor") or key in ACTOR_METRICS:
        return f"actor/{key}"
    if key.startswith("critic") or key == "imag_value":
        return f"critic/{key}"
    return f"world_model/{key}"


def log_evaluation(logger, episodes, config):
    """eval/return, return_std, length and episodes over all episodes; with several tasks the same
    for each task as eval/<task>/..., and the suites' own metrics per task."""
    tasks = envs.parse_tasks(config.task)
    groups = {"eval": episodes}
    if len(tasks) > 1:
        groups.update({f"eval/{task}": group for task, group in by_task(tasks, episodes).items()})
    for scope, group in groups.items():
        returns = [episode_stats(e)["return"] for e in group]
        logger.scalar(f"{scope}/return", float(np.mean(returns)))
        logger.scalar(f"{scope}/return_std", float(np.std(returns)))
        logger.scalar(f"{scope}/length", float(np.mean([episode_stats(e)["length"] for e in group])))
        logger.scalar(f"{scope}/episodes", len(group))
    log_episode_metrics(logger, "eval", tasks, episodes)
    returns = [episode_stats(e)["return"] for e in episodes]
    if config.video_pred_log and "image" in episodes[0]:
        logger.video("eval/policy", episodes[0]["image"][None])
    return returns


# ==================================================================================================
# A run's log and its evaluation
# ==================================================================================================


def film_predictions(logger, name, predict, replay, length):
    """The open-loop video `name`: `predict` (the world model's, on a batch of the replay; None where
    none is filmed: no image decoder, video_pred_log off, or not the main process, which alone writes
    videos) on 6 sequences of `length` steps of `replay`, once it holds one to show."""
    if predict is not None and replay.ready(length):
        logger.video(name, predict(replay.sample(6, length)))


class RunLog:
    """A run's logs: the logger and progress display, the update metrics averaged per log, the
    episodes finished since then, and the end on a non-finite loss. Only the main process writes
    logs (the others get a NullLogger). It reads the run's `counters` (dreamer.Counters), the
    `collector`'s status (parallel.Collector; None offline), `kept` says what the checkpoint on disk
    holds (storage.Checkpoints.kept) and `predict` films the open-loop video (film_predictions)."""

    def __init__(self, config, logdir, counters, ranks, tasks, replay, collector, kept, predict):
        self.config, self.logdir, self.counters, self.ranks = config, logdir, counters, ranks
        self.tasks, self.replay, self.collector, self.kept, self.predict = tasks, replay, collector, kept, predict
        self.metrics = {}  # name: [value per update since the last log]
        self.recent_episodes = []
        self.logger = self.progress = None  # made by open(), at the start of training
        self.last_log = (time.time(), counters.policy_steps, counters.updates)
        # Evaluations: seconds since the last log, and in all with their count (the ETA's).
        self.eval_seconds, self.eval_total, self.evaluations = 0.0, 0.0, 0

    def evaluated(self, seconds):
        """An evaluation took `seconds` (Evaluation.run): left out of the training pace, counted apart."""
        self.eval_seconds += seconds
        self.eval_total += seconds
        self.evaluations += 1

    @property
    def frames(self):
        return self.counters.policy_steps * self.config.action_repeat

    def open(self):
        config = self.config
        self.logger = (Logger(self.logdir, self.frames, config.logger, config.to_dict())
                       if self.ranks.is_main else NullLogger())
        self.logger.text("config", "```\n" + json.dumps(config.to_dict(), indent=2) + "\n```", self.frames)
        self.progress = Progress(config.steps, self.frames)

    def close(self, quiet=False):
        """`quiet`: the run ends on an error already, which a failing close must not replace."""
        self.progress.close()
        try:
            self.logger.close()
        except WriteError:
            if not quiet:
                raise

    def record(self, metrics):
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append(value)

    def add_episode(self, episode):
        self.recent_episodes.append(episode)
        stats = episode_stats(episode)
        self.logger.scalar("train/return", stats["return"])
        self.logger.scalar("train/length", stats["length"])
        if len(self.tasks) > 1:  # beside the mean over all tasks
            task = next(iter(by_task(self.tasks, [episode])))
            self.logger.scalar(f"train/{task}/return", stats["return"])
            self.logger.scalar(f"train/{task}/length", stats["length"])
        self.progress.update(self.frames, train_return=stats["return"])

    def log(self, busy, policy_lag=None):
        """Write the metrics since the last log, with the loop's own figures under perf/: `busy`
        ({name: fraction}, tools.Stopwatch.fractions: the learner's and the environments' busy time,
        and the waits), and the collector thread's `policy_lag` in updates (asynchronous)."""
        perf = {f"{name}_busy" if name in ("learner", "env") else name: value for name, value in busy.items()}
        if policy_lag is not None:
            perf["policy_lag"] = policy_lag
        config, counters = self.config, self.counters
        now, steps, frames = time.time(), counters.policy_steps, self.frames
        for key, values in self.metrics.items():
            self.logger.scalar(metric_name(key), torch.stack(values).float().mean())
        self.metrics.clear()
        seconds = max(now - self.last_log[0], 1e-9)
        fps = (steps - self.last_log[1]) * config.action_repeat / seconds
        updates_per_s = (counters.updates - self.last_log[2]) / seconds
        for key, value in (("fps", fps), ("updates_per_s", updates_per_s), ("updates", counters.updates),
                           ("replay_steps", len(self.replay))):
            self.logger.scalar(f"perf/{key}", value)
        if steps > self.last_log[1]:  # replayed steps per policy step since the last log
            ratio = (counters.updates - self.last_log[2]) * replayed_per_update(config)
            self.logger.scalar("perf/train_ratio", ratio / (steps - self.last_log[1]))
        for key, value in perf.items():
            self.logger.scalar(f"perf/{key}", value)
        self.logger.scalar("train/episodes", counters.episodes)
        if self.collector is not None:
            self.logger.scalar("train/dropped_episodes", self.collector.dropped)
            self.log_env_status()
        log_episode_metrics(self.logger, "train", self.tasks, self.recent_episodes)
        self.log_task_frames(frames)
        self.recent_episodes.clear()
        film_predictions(self.logger, "train/openl", self.predict, self.replay, config.batch_length)
        self.logger.write(frames)
        self.progress.update(frames, fps=fps, updates_per_s=updates_per_s, learner_busy=perf["learner_busy"],
                             env_busy=perf["env_busy"])
        evals_left = max(config.steps - frames, 0) / config.eval_every if self.evaluations and config.eval_every else 0
        self.progress.eta = eta_seconds(config.steps - frames, (steps - self.last_log[1]) * config.action_repeat,
                                        seconds - self.eval_seconds,
                                        evals_left * self.eval_total / max(self.evaluations, 1))
        self.progress.log(frames)
        self.last_log, self.eval_seconds = (now, steps, counters.updates), 0.0

    def log_task_frames(self, frames):
        """train/<task>/frames: each task's share of the frames, so that a run of several tasks can be
        read against single-task runs at the same frames per task (benchmarks/plot.py does). Exact:
        every environment steps once per policy step, and every rank spreads its environments alike."""
        if len(self.tasks) < 2 or self.collector is None:
            return
        counts = collections.Counter(self.collector.tasks)
        for index, task in enumerate(self.tasks):
            self.logger.scalar(f"train/{task}/frames", frames * counts[index] / len(self.collector.tasks))

    def log_env_status(self):
        """What each environment is doing: scalars env/<i>/... in the metrics, and, when the progress
        goes to a log file, one line for all of them (env_status_line)."""
        rows = self.collector.status()
        for i, row in enumerate(rows):
            for key, value in row.items():
                if np.isfinite(value):
                    self.logger.scalar(f"env/{i}/{key}", value)
        if not self.progress.interactive:
            print(env_status_line(rows), flush=True)

    def check_losses(self):
        """End the run on a non-finite loss among the updates since the last log. Checked here and
        before every save, not per update: one device sync per log instead of one per update."""
        losses = {key: torch.stack(values) for key, values in self.metrics.items() if key.endswith("_loss")}
        if not losses or all_finite(losses):
            return
        first = {}
        for key, values in losses.items():
            bad = (~torch.isfinite(values.float())).nonzero()
            if len(bad):
                index = int(bad[0])
                first[key] = (self.counters.updates - len(values) + index + 1, float(values[index]))
        key = min(first, key=lambda k: first[k][0])
        update, value = first[key]
        raise NonFiniteError(f"non-finite {metric_name(key)} ({value}) at update {update}; the run stops "
                             f"without saving ({self.kept()})")


class Evaluation:
    """Evaluation during training, every eval_every frames: `run_episodes()` plays eval_episode_num
    episodes of the evaluation policy on the main process's evaluation environments (None where it
    has none) and stores them; they go into the evaluation replay (`replay`, which the open-loop
    video of `predict` samples: film_predictions)."""

    def __init__(self, config, run_episodes, replay, is_main, predict):
        self.config, self.run_episodes, self.replay = config, run_episodes, replay
        self.is_main, self.predict = is_main, predict

    @property
    def enabled(self):
        """Whether the run evaluates (the same on every rank; only the main one has evaluation environments)."""
        return self.config.eval_episode_num > 0 and (self.run_episodes is not None or not self.is_main)

    def run(self, run_log):
        """The episodes, logged to `run_log` (RunLog, which gets their time apart: RunLog.evaluated);
        returns their mean return (None on another rank than the main one, which waits at the save
        that follows)."""
        if self.run_episodes is None:
            return None
        start, logger = time.time(), run_log.logger
        episodes = self.run_episodes()
        for episode in episodes:
            self.replay.add_episode(strip_logs(episode))
        returns = log_evaluation(logger, episodes, self.config)
        film_predictions(logger, "eval/openl", self.predict, self.replay, self.config.batch_length)
        run_log.evaluated(time.time() - start)
        return float(np.mean(returns))


def closing_line(runs, logdir, seconds):
    """What a finished run prints last: each run's (frames, final evaluation return or None, logdir)
    of `runs`, the wall time, and the commands that read its results (`logdir`: the run's --logdir,
    which holds every seed's folder under --seeds)."""
    frames = " and ".join(sorted({f"{f:,}" for f, _, _ in runs}))
    returns = [r for _, r, _ in runs if r is not None]
    if not returns:
        result = "no evaluation (--eval_episode_num 0)"
    elif len(runs) == 1:
        result = f"final evaluation return {returns[0]:.1f}"
    else:
        result = "final evaluation returns " + ", ".join("-" if r is None else f"{r:.1f}" for _, r, _ in runs)
    runs_at = " ".join(str(d) for _, _, d in runs)
    return (f"Finished: {frames} frames in {datetime.timedelta(seconds=int(seconds))}, {result}; results in "
            f"{logdir}\nNext: tensorboard --logdir {logdir} | the same command with --eval_only True "
            f"--eval_episode_num 10 | python3 benchmarks/plot.py {runs_at}")


def write_eval_only(out, episodes, frame, tasks):
    """--eval_only's files in `out`: returns.json (each return, their mean and std, per task with
    several `tasks`) and the first episode's episode.mp4; one line says so. Returns what returns.json holds."""
    returns = [episode_stats(e)["return"] for e in episodes]
    out.mkdir(exist_ok=True)
    result = {"frame": frame, "returns": returns, "mean": float(np.mean(returns)), "std": float(np.std(returns))}
    if len(tasks) > 1:
        result["tasks"] = {}
        for task, group in by_task(tasks, episodes).items():
            task_returns = [episode_stats(e)["return"] for e in group]
            result["tasks"][task] = {"returns": task_returns, "mean": float(np.mean(task_returns)),
                                     "std": float(np.std(task_returns))}
    atomic_write_bytes(out / "returns.json", json.dumps(result, indent=2).encode())
    if "image" in episodes[0]:
        write_mp4(out / "episode.mp4", episodes[0]["image"])
    print(f"Evaluated {len(returns)} episodes at frame {frame}: "
          f"return {result['mean']:.1f} ± {result['std']:.1f}; wrote {out}")
    return result
