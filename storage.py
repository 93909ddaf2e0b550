"""Where the experience lives: episode files on disk, the replay in memory, and the learner's batches.

1. Episode files: each episode as an atomically written .npz, in chunks while it runs, loaded back
   (checked against the run's spaces) when a run resumes or trains offline.
2. The replay: one ring buffer of consecutive steps per environment, sampled uniformly as
   sequences, whose steps can be rewritten by id (the policy latents of models.ReplayContext).
3. The prefetcher: the learner's batches sampled ahead into pinned memory and copied to the device
   without a stall, with the replay context's write-back applied to a batch sampled ahead.
4. Checkpoint files: written so that a kill -9 at any instant leaves the newest complete one (the
   previous one kept, non-finite ones refused), recovered after a kill, loaded without running code
   from them (unsafe files refused), checked against the model; and the logdir's lock.
5. A run's stored episodes and its checkpoint: what a run loads from its episode folders, and what
   it saves, resumes and refuses (a checkpoint of another format).

Every file is written through the atomic writes at the top (a temporary file, synced, renamed), which
logs.py and the benchmarks use too; a write that fails is a WriteError naming the file.

Nothing here knows about the world model or the environments: the agent is a module with
optimizers, the spaces are the environments'.
"""

import collections
import contextlib
import datetime
import errno
import io
import os
import pathlib
import pickle
import re
import signal
import sys
import threading
import uuid
import warnings

import numpy as np
import torch

from launch import rng_state, set_rng_state
from tools import ConfigError, all_finite, total_updates

# ==================================================================================================
# File writes: atomic (through a temporary file, synced, renamed), and the error a failed one raises
# ==================================================================================================


class WriteError(OSError):
    """A file that cannot be written: a full disk (ENOSPC), a read-only folder (EROFS, EACCES), ...
    Its message names the file and the error in one line; nothing half-written is left behind."""

    def __init__(self, path, error, note=None):
        super().__init__(error.errno, error.strerror or str(error))
        self.path, self.note = pathlib.Path(path), note

    def __str__(self):
        note = f"; {self.note}" if self.note else ""
        return f"cannot write {self.path}: {self.strerror} (errno {self.errno}){note}"

    # What to do, by errno; anything else: the system's own words, in the message, say it.
    HINTS = {errno.ENOSPC: "free space", errno.EDQUOT: "free space or raise the disk quota",
             errno.EFBIG: "raise the file-size limit (ulimit -f) or use a file system that takes larger files",
             errno.EACCES: "make it writable", errno.EPERM: "make it writable",
             errno.EROFS: "the file system is read-only: remount it writable or use another --logdir",
             errno.ENAMETOOLONG: "use a shorter --logdir", errno.EIO: "check the disk (an I/O error)"}

    @property
    def hint(self):
        """What to do about it, fitting its errno."""
        return f"{self.HINTS.get(self.errno, 'fix the cause')} and rerun to resume"


def temp_path(path):
    """The temporary file a write of `path` goes through: `.<name>.<8 hex digits>.tmp` beside it,
    a name `temp_files` finds again after a kill."""
    path = pathlib.Path(path)
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


TEMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{8}\.tmp$")


def temp_files(folder, name=None):
    """The temporary files of `temp_path` in `folder` (those of files named `name`, or of any),
    with the file each was to become: [(temp, target)], oldest first."""
    found = []
    for temp in pathlib.Path(folder).glob(".*.tmp"):
        match = TEMP_PATTERN.match(temp.name)
        target = match and match["name"]
        while target and TEMP_PATTERN.match(target):  # a temp of a temp: how saves before issue 32 wrote
            target = TEMP_PATTERN.match(target)["name"]
        if target and (name is None or target == name) and temp.is_file():
            found.append((temp, temp.with_name(target)))
    return sorted(found, key=lambda item: item[0].stat().st_mtime)


def write_synced(path, data):
    """Write `data` to `path` and flush it to the disk."""
    with pathlib.Path(path).open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sync_folder(folder):
    """Make the renames in `folder` durable (a power cut after a rename otherwise may undo it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename itself is done
    finally:
        os.close(fd)


def atomic_write_bytes(path, data):
    """Write `data` to `path` through a temporary file (`temp_path`) and a rename, so readers never
    see half; a kill -9 may leave the temporary file, which the next start clears (episode files:
    `recover_episodes`; the logdir's: `resume_checkpoint`).

    On failure the temporary file is removed (a full disk gets its space back) and WriteError
    names `path`; `path` itself is untouched.
    """
    path = pathlib.Path(path)
    tmp = temp_path(path)
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException as e:  # Ctrl-C in a single process too: no temporary file stays behind
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only folder, where it was never written
            pass
        if isinstance(e, OSError):
            raise WriteError(path, e) from None
        raise


# ==================================================================================================
# Episode files: whole, and in chunks while an episode runs
# ==================================================================================================


def episode_name():
    """A new episode's name, `<time stamp>-<unique id>`: its files (the whole episode, or its
    chunks while it runs) all start with it, so names alone sort them by time and group them."""
    return f"{datetime.datetime.now().strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:8]}"


def save_episode(directory, episode, name=None):
    """Write one episode (dict of arrays, time first) as compressed .npz, atomically.

    The file name, `<name>-<length>.npz`, carries a time stamp, a unique id (`name`, by default a new
    `episode_name()`) and the length, so that the newest episodes can be found from names alone and
    a crash never leaves a half-written episode behind. Raises WriteError when the file cannot be
    written (full disk, read-only folder).
    """
    directory = pathlib.Path(directory)
    filename = directory / f"{name or episode_name()}-{len(episode['reward'])}.npz"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(filename, e) from None
    with io.BytesIO() as buffer:
        np.savez_compressed(buffer, **episode)
        atomic_write_bytes(filename, buffer.getvalue())
    return filename


# A chunk of a running episode: `<name>-c<index>-<length>.npz`, index from 0 (zero-padded, so that
# names sort in order). Chunk 0 holds the episode's first, action-less step; the chunks of an episode
# concatenated are the episode so far. Once its whole file `<name>-<length>.npz` exists they are stale.
CHUNK_DIGITS = 8


def parse_episode_file(path):
    """(episode name, chunk index or None for a whole episode, length) from a file name; a name of
    another form is a whole episode of unknown length (None), named by itself."""
    parts = pathlib.Path(path).stem.split("-")
    try:
        length = int(parts[-1])
    except ValueError:
        return pathlib.Path(path).stem, None, None
    if len(parts) >= 4 and parts[-2].startswith("c") and parts[-2][1:].isdigit():
        return "-".join(parts[:-2]), int(parts[-2][1:]), length
    if len(parts) < 2:
        return pathlib.Path(path).stem, None, None
    return "-".join(parts[:-1]), None, length


def episode_files(directory):
    """The episodes stored in a folder, newest first: [(name, [file, ...])], one file for a whole
    episode, the chunks in order for one that was still running (or cut short by a kill). Chunks
    of an episode whose whole file exists are left out: a kill between writing the whole episode and
    removing its chunks leaves both, and each step must count once."""
    whole, chunks = {}, collections.defaultdict(list)
    for path in pathlib.Path(directory).glob("*.npz"):
        name, index, _ = parse_episode_file(path)
        if index is None:
            whole[path.stem] = (name, [path])
        else:
            chunks[name].append((index, path))
    names = {name for name, _ in whole.values()}
    items = list(whole.values())
    for name, found in chunks.items():
        if name not in names:
            items.append((name, [path for _, path in sorted(found)]))
    return sorted(items, key=lambda item: item[0], reverse=True)


def read_episode(files, on_bad_chunk=None):
    """One episode from its file, or from its chunks (concatenated; a missing or unreadable chunk ends
    it there, so that no two steps that did not follow each other become neighbours, and the chunks
    before it stay). An unreadable chunk after the first is reported to `on_bad_chunk(path, problem,
    later)`, `later` the number of chunks after it that are dropped with it; an unreadable first
    chunk or whole file raises."""
    parts = []
    for position, path in enumerate(files):
        _, index, _ = parse_episode_file(path)
        if index is not None and index != position:
            break
        try:
            with path.open("rb") as f:
                data = np.load(f)
                parts.append({k: data[k] for k in data.keys()})
        except Exception as e:  # noqa: BLE001 - any unreadable chunk ends the episode there
            if not parts:
                raise
            if on_bad_chunk is not None:
                on_bad_chunk(path, f"unreadable ({e})", len(files) - position - 1)
            break
    if not parts:
        raise ValueError("its first chunk is missing")
    if len(parts) == 1:
        return parts[0]
    keys = set(parts[0])
    if any(set(part) != keys for part in parts):
        raise ValueError("its chunks hold different keys")
    return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}


class EpisodeWriter:
    """One environment's episodes on disk as they are collected, so that a kill loses at most one
    unfinished chunk: every `chunk_size` steps are written as a chunk file (atomically) once they are
    final, and the whole episode once it ends, which then replaces its chunks. chunk_size 0 writes
    whole episodes only.

    `add(steps)` takes the episode so far (a list of step dicts, newest last) after each new step.
    A chunk never holds the newest step: its stored policy latent (models.ReplayContext) is filled in
    only when the policy acts on it, so a chunk is written once chunk_size steps before the newest
    are unwritten. `finish(episode)` writes the whole episode first and removes the chunks after it:
    a kill in between leaves stale chunks that loading and counting ignore (`episode_files`), so no
    step is lost or read twice.
    """

    def __init__(self, directory, chunk_size):
        self.directory, self.chunk_size = pathlib.Path(directory), int(chunk_size)
        self._start()

    def _start(self):
        self.name, self.chunks, self.written = episode_name(), [], 0

    def add(self, steps):
        if len(steps) == 1 and self.written:  # a new episode (after a restarted worker): the old one's chunks stay
            self._start()
        if not self.chunk_size or len(steps) - 1 - self.written < self.chunk_size:
            return None
        part = steps[self.written:self.written + self.chunk_size]
        chunk = {k: np.stack([step[k] for step in part]) for k in part[0]}
        path = self.directory / f"{self.name}-c{len(self.chunks):0{CHUNK_DIGITS}d}-{len(part)}.npz"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WriteError(path, e) from None
        with io.BytesIO() as buffer:
            np.savez_compressed(buffer, **chunk)
            atomic_write_bytes(path, buffer.getvalue())
        self.chunks.append(path)
        self.written += len(part)
        return path

    def finish(self, episode):
        """Write the whole `episode` (dict of (T, ...) arrays), remove its chunks, and start the next one."""
        path = save_episode(self.directory, episode, self.name)
        for chunk in self.chunks:
            chunk.unlink(missing_ok=True)
        self._start()
        return path


# Keys an episode may lack: `task` (the step's index into the run's --task list) came with runs of
# several tasks; an episode stored before holds steps of a single task, index 0.
OPTIONAL_KEYS = ("task",)


def episode_spec(obs_space, act_space):
    """What every stored episode must hold: key -> (per-step shape, dtype), from the run's spaces."""
    spec = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in obs_space.items() if not k.startswith("log_")}
    spec["action"] = (tuple(act_space.shape), np.dtype(np.float32))
    spec["reward"] = ((), np.dtype(np.float32))
    spec["task"] = ((), np.dtype(np.int32))
    return spec


def step_bytes(spec):
    """Bytes of one replayed step of `spec` (episode_spec, plus any stored latents): what the replay
    holds in memory per step, and what an episode file holds per step before compression."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in spec.values())


def available_memory(device="cpu"):
    """Bytes of memory free for new allocations: on a CUDA device its free memory, else the host's
    (Linux MemAvailable; elsewhere None: not known)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0] if torch.cuda.is_available() else None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def total_memory(device="cpu"):
    """Bytes of memory the device has in all (a CUDA device's, else the host's MemTotal; None where not
    known): more than this can never be allocated, however much is freed."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[1] if torch.cuda.is_available() else None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


LATENT = "latent_"  # prefix of the policy latents stored with each step (models.ReplayContext)


def fit_latents(episode, spec):
    """The episode with its stored policy latents (`latent_*` keys, see models.ReplayContext)
    made to fit `spec`: latents the spec wants but the episode lacks (written by a run without
    replay context), or holds in another shape (another model size), become zeros, which the
    replay context reads as the initial state; latents the spec does not want are dropped."""
    length = len(episode["reward"]) if "reward" in episode else 0
    fitted = {k: v for k, v in episode.items() if not k.startswith(LATENT) or k in spec}
    for key, (shape, dtype) in spec.items():
        value = fitted.get(key)
        if key.startswith(LATENT) and (value is None or value.shape != (length, *shape) or value.dtype != dtype):
            fitted[key] = np.zeros((length, *shape), dtype)
    return fitted


def episode_problem(episode, spec):
    """Why `episode` (dict of (T, ...) arrays) does not fit `spec`, or None when it does.

    `log_*` keys are free: they only feed the suite metrics.
    """
    keys = {k for k in episode if not k.startswith("log_")}
    if keys - set(spec):
        return f"unexpected keys {sorted(keys - set(spec))}"
    if set(spec) - keys - set(OPTIONAL_KEYS):
        return f"missing keys {sorted(set(spec) - keys - set(OPTIONAL_KEYS))}"
    lengths = {len(v) if np.ndim(v) else 0 for k, v in episode.items() if k in spec}
    if len(lengths) != 1 or 0 in lengths:
        return f"keys of different or zero lengths {sorted(lengths)}"
    for key, (shape, dtype) in spec.items():
        if key not in episode:  # optional
            continue
        value = episode[key]
        if value.shape[1:] != shape:
            return f"'{key}' has step shape {value.shape[1:]}, expected {shape}"
        if value.dtype != dtype:
            return f"'{key}' has dtype {value.dtype}, expected {dtype}"
    return None


def non_finite_problem(episode):
    """Why an episode's values cannot be trained on (NaN or infinite floats: every update that samples
    them would turn the weights non-finite), or None."""
    bad = [key for key, value in episode.items() if not key.startswith("log_") and np.asarray(value).dtype.kind == "f"
           and not np.isfinite(value).all()]
    return f"non-finite values in {', '.join(map(repr, bad))}" if bad else None


def skip_warning(filename, problem):
    """One line per skipped episode file."""
    print(f"warning: skipping episode {filename}: {problem}", file=sys.stderr, flush=True)


def load_episodes(directory, limit=None, spec=None, on_skip=skip_warning):
    """Load the newest episodes whose lengths sum to at most `limit` steps, oldest first.

    An episode is a whole file, or the chunks of one that was still running (`episode_files`): its
    steps so far, a partial episode. A corrupt or unreadable file, and with `spec` (see
    `episode_spec`) an episode that does not fit the run's spaces, is skipped and reported to
    `on_skip(filename, problem)`, never fatal. Stored policy latents are fitted to the spec first
    (`fit_latents`). With `spec`, an episode without `task` gets task 0 at every step (OPTIONAL_KEYS).
    """
    directory = pathlib.Path(directory)
    if not directory.exists():
        return []
    episodes, total = [], 0

    def bad_chunk(path, problem, later):
        on_skip(f"{path}" + (f" (and its {later} later chunks)" if later else ""),
                f"{problem}; the episode's chunks before it are kept")

    for _, files in episode_files(directory):
        try:
            episode = read_episode(files, bad_chunk)
            if spec is not None:
                episode = fit_latents(episode, spec)
            problem = episode_problem(episode, spec) if spec is not None else None
            if problem is None and "reward" not in episode:
                problem = "missing key 'reward'"
            if problem is None:
                problem = non_finite_problem(episode)
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, never fatal
            problem = f"unreadable ({e})"
        if problem is not None:
            on_skip(files[0] if len(files) == 1 else f"{files[0]} (and its {len(files) - 1} later chunks)", problem)
            continue
        length = len(episode["reward"])
        if limit is not None and total + length > limit:
            break
        total += length
        if spec is not None and "task" in spec and "task" not in episode:
            episode["task"] = np.zeros(length, np.int32)
        episodes.append(episode)
    return episodes[::-1]


def recover_episodes(directory):
    """After a kill -9: the temporary files that episode writes left in `directory` (atomic_write_bytes)
    become their file where complete (every array loads) and that file does not exist yet, and are
    deleted otherwise; the chunks of an episode whose whole file exists (a kill before they were
    removed) are deleted too. Only the run that holds the logdir may call it. Returns one line
    saying what it did, or None when there was nothing to do."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return None
    promoted, removed, size = 0, 0, 0
    for temp, target in temp_files(directory):
        if target.suffix != ".npz":
            continue
        complete = False
        if not target.exists():
            try:
                with np.load(temp) as data:
                    for key in data.files:
                        data[key]  # noqa: B018 - reads and checks every array
                complete = True
            except Exception:  # noqa: BLE001 - cut short by the kill
                pass
        if complete:
            os.replace(temp, target)
            promoted += 1
        else:
            size += temp.stat().st_size
            temp.unlink()
            removed += 1
    whole = {parse_episode_file(path)[0] for path in directory.glob("*.npz") if parse_episode_file(path)[1] is None}
    stale = [path for path in directory.glob("*.npz") if parse_episode_file(path)[1] is not None
             and parse_episode_file(path)[0] in whole]
    for path in stale:
        size += path.stat().st_size
        path.unlink()
    if not (promoted or removed or stale):
        return None
    sync_folder(directory)
    done = [f"{promoted} complete temporary file(s) became their episode file"] if promoted else []
    done += [f"removed {removed} incomplete temporary file(s)"] if removed else []
    done += [f"removed {len(stale)} chunk(s) of episodes stored whole"] if stale else []
    freed = f" ({size / 1e6:.3g} MB freed)" if size else ""
    return f"Recovered episode files in {directory} after a kill: {', '.join(done)}{freed}"


def stored_steps(directory):
    """Policy steps held in a folder's episode files, read from their names without opening them:
    a whole episode of `...-<length>.npz` holds length - 1 (its first step has no action), as does
    the first chunk of a running one; every later chunk holds its length. Chunks made stale by
    their episode's whole file count nothing (`episode_files`)."""
    total = 0
    for _, files in episode_files(directory):
        for path in files:
            _, index, length = parse_episode_file(path)
            if length is not None:
                total += max(0, length - 1) if not index else length
    return total


# ==================================================================================================
# The replay: streams of consecutive steps, sampled uniformly
# ==================================================================================================


def _alignment(stream, saved, least=16):
    """The shift d (saved position = the stream's logical position + d) at which a checkpoint's saved
    steps (Replay.context_state) lie on the held ones: 0 if they agree there, else a d found from the
    first held step with a non-zero action (reset steps all look alike) at which every overlapping
    step has the same action and reward, over at least `least` steps (or all that overlap); None if
    there is none."""
    held, count = len(stream), len(saved["reward"])
    if not held:
        return None
    phys = stream.indices(np.zeros(1, np.int64), held)[0]
    mine = {k: np.asarray(torch.as_tensor(stream.gather(stream.data[k], phys)).cpu()) for k in ("action", "reward")}
    theirs = {k: saved[k].numpy() for k in ("action", "reward")}

    def agree(shift):
        lo, hi = max(0, shift), min(count, held + shift)
        return hi - lo >= min(least, held, count) and all(
            np.array_equal(mine[k][lo - shift:hi - shift], theirs[k][lo:hi]) for k in mine)

    if agree(0):
        return 0
    moving = np.flatnonzero(np.abs(mine["action"].reshape(held, -1)).sum(1) > 0)
    if not len(moving):
        return None
    anchor = moving[0]
    same = (theirs["action"].reshape(count, -1) == mine["action"][anchor].reshape(1, -1)).all(1)
    same &= theirs["reward"] == mine["reward"][anchor]
    return next((int(j) - anchor for j in np.flatnonzero(same) if agree(int(j) - anchor)), None)


class Stream:
    """Ring buffer of consecutive steps from one environment, as growable arrays: numpy arrays in
    host memory, or with `device` torch tensors there (replay_device), which a batch is gathered
    from without a copy from the host. On the device, steps added and host values written are staged
    on the host (`staged`, `writes`) until the replay next reads its arrays, which moves them all in
    one copy that does not wait (Replay._move)."""

    def __init__(self, capacity, device=None):
        self.capacity, self.device = capacity, device
        self.data = {}
        self.count = 0  # steps ever written
        self.staged = {}  # on the device: slot -> step (host values) added since the last move
        self.writes = []  # on the device: (first id, {key: host (L, ...) array}) written since the last move

    def __len__(self):
        return min(self.count, self.capacity)

    def empty(self, shape, dtype):
        """An array to hold steps: dtype a numpy dtype (the first step's) or, when a tensor grows, a torch one."""
        if self.device is None:
            return np.empty(shape, dtype)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        return torch.empty(shape, dtype=dtype, device=self.device)

    def add(self, step):
        """Append one step; returns its index among all steps ever written (its id in this stream)."""
        if not self.data:
            size = min(self.capacity, 1024)
            self.data = {k: self.empty((size, *np.shape(v)), np.asarray(v).dtype) for k, v in step.items()}
        size = len(next(iter(self.data.values())))
        if self.count == size and size < self.capacity:
            new = min(self.capacity, 2 * size)
            for key, array in self.data.items():
                grown = self.empty((new, *array.shape[1:]), array.dtype)
                grown[:size] = array
                self.data[key] = grown
        index = self.count % self.capacity
        if self.device is None:
            for key, value in step.items():
                self.data[key][index] = value
        else:
            self.staged[index] = step  # a newer step in the same slot replaces it
        self.count += 1
        return self.count - 1

    def indices(self, starts, length):
        """Physical indices (len(starts), length) of logical positions (0 = oldest step)."""
        offset = self.count % self.capacity if self.count > self.capacity else 0
        return (offset + starts[:, None] + np.arange(length)[None]) % self.capacity

    def gather(self, array, phys):
        """array[phys] for numpy indices phys, on the array's device."""
        return array[phys] if self.device is None else array[torch.as_tensor(phys, device=array.device)]

    def first(self):
        """Id (index among all steps ever written) of the oldest step still held."""
        return self.count - len(self)

    def write(self, first, values):
        """Overwrite the steps with ids first, first + 1, ... by values (dict of (L, ...) arrays or
        tensors); steps no longer held (dropped for newer ones) are left out. On the device, tensors
        there are written at once (the replay moved what was staged first: Replay.update) and host
        values staged."""
        if self.device is not None:
            if not all(isinstance(v, torch.Tensor) for v in values.values()):
                self.writes.append((first, {k: host_array(v) for k, v in values.items()}))
                return
            for at, slot, n in self.runs(first, len(next(iter(values.values())))):
                for key, value in values.items():
                    self.data[key][slot:slot + n] = value[at:at + n].to(self.data[key].dtype)
            return
        ids = first + np.arange(len(next(iter(values.values()))))
        held = (ids >= self.first()) & (ids < self.count)
        phys = ids[held] % self.capacity  # a step's slot: its id modulo the capacity (see add)
        for key, value in values.items():
            self.data[key][phys] = host_array(value)[held]

    def runs(self, first, length):
        """The held steps among ids first .. first + length - 1 as runs of consecutive slots:
        (offset from first, first slot, count) each (at most two: the ring wraps once)."""
        low, high, out = max(first, self.first()), min(first + length, self.count), []
        while low < high:
            slot = low % self.capacity
            n = min(high - low, self.capacity - slot)
            out.append((low - first, slot, n))
            low += n
        return out

    def staged_blocks(self):
        """What is staged, as host arrays to move: ({name: array}, apply) where apply(moved) writes the
        moved tensors into the arrays (the steps first, then the writes, in the order they came)."""
        blocks, steps = {}, []
        if self.staged:
            slots = np.array(sorted(self.staged))
            breaks = np.flatnonzero(np.diff(slots) != 1) + 1  # runs of consecutive slots
            steps = [(int(run[0]), len(run), at) for run, at in zip(np.split(slots, breaks),
                                                                     np.concatenate([[0], breaks]))]
            for key in self.data:
                blocks[f"add/{key}"] = np.stack([np.asarray(self.staged[slot][key]) for slot in slots])
        writes = list(self.writes)
        for w, (_, values) in enumerate(writes):
            blocks.update({f"write{w}/{key}": value for key, value in values.items()})
        self.staged, self.writes = {}, []

        def apply(moved):
            for slot, n, at in steps:
                for key, array in self.data.items():
                    array[slot:slot + n] = moved[f"add/{key}"][at:at + n].to(array.dtype)
            for w, (first, values) in enumerate(writes):
                for at, slot, n in self.runs(first, len(next(iter(values.values())))):
                    for key in values:
                        self.data[key][slot:slot + n] = moved[f"write{w}/{key}"][at:at + n].to(self.data[key].dtype)

        return blocks, apply


class Replay:
    """Uniform sequence replay over one stream of consecutive steps per environment.

    Sequences may cross episode boundaries inside a stream; `is_first` marks where the world
    model must reset its latent state, as in the official implementation. The oldest steps are
    dropped once `capacity` steps are held in total.

    Every step has an id (stream, index among the stream's steps) by which `update` rewrites it
    (the policy's latents, the replay context's write-back, models.ReplayContext).

    With `online` = L > 0 (config replay_online), the official replay's online queue: each time a
    stream's newest L steps form a sequence that shares no step with the stream's previous queued
    one, that sequence is queued, and batches of length L take queued sequences first, oldest first,
    each once, before uniform ones; so every step is trained on soon after it arrives. Steps loaded
    from files (add_episode) are not queued; a checkpoint keeps the queue (context_state).

    Thread-safe: an actor thread may add while the learner samples (a sample copies its steps out
    under the lock, so a later add never changes a batch already taken).
    """

    def __init__(self, capacity, streams, seed=0, device=None, online=0):
        per_stream = max(1, int(np.ceil(capacity / streams)))
        self.online = online
        self.queue = collections.deque()  # (stream, first step id) of sequences not yet trained on
        self.device = None if device is None else torch.device(device)  # replay_device: None is host memory
        self.streams = [Stream(per_stream, self.device) for _ in range(streams)]
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()

    @property
    def nbytes(self):
        """Bytes the stored steps' arrays take now (they grow to capacity as steps come in)."""
        with self.lock:
            return sum(array.nbytes for stream in self.streams for array in stream.data.values())

    def __len__(self):
        with self.lock:
            return sum(len(s) for s in self.streams)

    @property
    def on_host(self):
        """Whether the steps are numpy arrays in host memory (not replay_device)."""
        return self.device is None

    def add(self, step, stream=0):
        """Append one step to a stream; returns its id (stream, index among the stream's steps)."""
        with self.lock:
            index = self.streams[stream].add(step)
            # As the official replay: a sequence of the newest L steps once L steps came before this one,
            # then every L steps.
            if self.online and index >= self.online and index % self.online == 0:
                self.queue.append((stream, index - self.online + 1))
            return stream, index

    def add_episode(self, episode, stream=0):
        length = len(episode["reward"])
        with self.lock:
            for t in range(length):
                self.streams[stream].add({k: v[t] for k, v in episode.items()})

    def _move(self, extra=None):
        """On the device: move every stream's staged steps and writes (Stream.staged_blocks) and the
        host arrays `extra` ({name: array}) there in one copy (to_device); returns the moved `extra`."""
        extra = extra or {}
        if self.device is None:
            return extra
        blocks, appliers = dict(extra), []
        for index, stream in enumerate(self.streams):
            staged, apply = stream.staged_blocks()
            blocks.update({f"{index}/{name}": array for name, array in staged.items()})
            appliers.append((index, apply))
        if not blocks:
            return {}
        moved = to_device(blocks, self.device)
        for index, apply in appliers:
            apply({name[len(f"{index}/"):]: value for name, value in moved.items() if name.startswith(f"{index}/")})
        return {name: moved[name] for name in extra}

    def context_state(self, keys):
        """What a checkpoint keeps of the replay beyond its episode files, so that a resumed run samples
        what the straight one would: per stream the held steps' `keys` (the replay context's latents,
        written back after every update: the files hold the policy's) with their actions and rewards,
        which place them again after a reload (`load_context_state`), and the online queue. Tensors
        and plain data, for a checkpoint that loads with weights_only."""
        with self.lock:
            self._move()
            streams = []
            for stream in self.streams:
                held = len(stream)
                phys = stream.indices(np.zeros(1, np.int64), held)[0]
                streams.append({key: torch.as_tensor(stream.gather(stream.data[key], phys)).cpu()
                                for key in (*keys, "action", "reward")} if held else {})
            # Queued sequences by their logical start (0 = the oldest step held), which survives a reload.
            queue = [[stream, first - self.streams[stream].first()] for stream, first in self.queue
                     if first >= self.streams[stream].first()]
            return {"streams": streams, "queue": queue}

    def load_context_state(self, state):
        """Put a checkpoint's `context_state` back into the replay reloaded from the episode files. Each
        stream's saved steps are placed on the reloaded ones by their actions and rewards: the files
        hold the saved steps but those of episodes still running at the save (which a resumed run
        starts afresh), and after a kill -9 the steps stored since; a replay that had dropped steps at
        its capacity reloads a later window. Returns the number of streams whose steps were not found
        (their latents stay the files' and their queued sequences are dropped)."""
        missed = 0
        with self.lock:
            self._move()
            self.queue.clear()
            for index, (stream, saved) in enumerate(zip(self.streams, state["streams"])):
                shift = _alignment(stream, saved) if saved else 0  # saved position = reloaded position + shift
                if shift is None:
                    missed += 1
                    continue
                if saved:
                    count = len(saved["reward"])
                    lo, hi = max(0, shift), min(count, len(stream) + shift)  # the saved steps reloaded
                    latents = {k: v[lo:hi].numpy() for k, v in saved.items() if k not in ("action", "reward")}
                    if latents and hi > lo:
                        stream.write(stream.first() + lo - shift, latents)
                for queued, start in state["queue"]:
                    if queued == index and 0 <= start - shift <= len(stream) - 1:
                        self.queue.append((index, stream.first() + start - shift))
        return missed

    def ready(self, length):
        with self.lock:
            return any(len(s) >= length for s in self.streams)

    def sample(self, batch, length, ids=False, alloc=np.empty):
        """A batch of sequences: dict of arrays (batch, length, ...), tensors on the device for a
        replay there; with `ids` also the id of each sequence's first step, (batch, 2) int64 of
        (stream, index), for `update`. `alloc(shape, dtype)` makes each array the batch is copied
        into (Prefetcher: pinned memory; a replay on the device allocates there)."""
        with self.lock:
            data, first = self._sample(batch, length, alloc)
        return (data, first) if ids else data

    def update(self, ids, values):
        """Overwrite stored steps: row b of values (dict of (batch, L, ...) arrays) goes to the L
        steps from id ids[b] (as `sample` gives them) on; steps dropped meanwhile are left out."""
        with self.lock:
            if any(isinstance(v, torch.Tensor) for v in values.values()):
                self._move()  # tensors are written at once: over the staged steps, not under them
            for row, (stream, first) in enumerate(np.asarray(ids)):
                self.streams[stream].write(int(first), {k: v[row] for k, v in values.items()})

    def _queued(self, batch):
        """Up to `batch` queued sequences still held, as (streams, logical starts); taken off the queue."""
        which, starts = [], []
        while self.queue and len(which) < batch:
            stream, first = self.queue.popleft()
            if first >= self.streams[stream].first():  # else dropped for newer steps before its turn
                which.append(stream)
                starts.append(first - self.streams[stream].first())
        return np.array(which, np.int64), np.array(starts, np.int64)

    def _sample(self, batch, length, alloc=np.empty):
        counts = np.array([max(0, len(s) - length + 1) for s in self.streams], np.float64)
        if counts.sum() == 0:
            raise RuntimeError(f"Replay holds no sequence of length {length} yet.")
        which, start = self._queued(batch) if self.online == length else (np.zeros(0, np.int64),) * 2
        uniform = self.rng.choice(len(self.streams), size=batch - len(which), p=counts / counts.sum())
        which = np.concatenate([which, uniform])
        start = np.concatenate([start, np.zeros(len(uniform), np.int64)])
        out, gathers = {}, []
        first = np.stack([which, np.zeros(batch, np.int64)], 1).astype(np.int64)
        for index in np.unique(which):
            stream = self.streams[index]
            rows = np.nonzero(which == index)[0]
            drawn = rows[rows >= batch - len(uniform)]  # the uniform rows of this stream
            start[drawn] = self.rng.integers(0, counts[index], size=len(drawn))
            phys = stream.indices(start[rows], length)
            first[rows, 1] = stream.first() + start[rows]
            if self.device is not None:  # gathered below, once the indices are on the device
                gathers.append((stream, f"{index}/rows", rows, f"{index}/phys", phys))
                continue
            for key, array in stream.data.items():
                if key not in out:
                    out[key] = alloc((batch, length, *array.shape[1:]), array.dtype)
                out[key][rows] = array[phys]
        if self.device is not None:
            # The steps staged since the last batch and this batch's indices: one copy that does not wait.
            moved = self._move({name: value for _, rows_name, rows, phys_name, phys in gathers
                                for name, value in ((rows_name, rows), (phys_name, phys))})
            for stream, rows_name, _, phys_name, _ in gathers:
                rows, phys = moved[rows_name], moved[phys_name]
                for key, array in stream.data.items():
                    if key not in out:
                        out[key] = torch.empty((batch, length, *array.shape[1:]), dtype=array.dtype,
                                               device=self.device)
                    out[key][rows] = array[phys]
        return out, first


def strip_logs(episode):
    """Replay keeps what the model trains on; `log_*` keys only feed the suite metrics."""
    return {k: v for k, v in episode.items() if not k.startswith("log_")}


def replay_steps(config):
    """Steps the training replay will hold by the end of the run: one per policy step (steps /
    action_repeat, each process its own under torchrun) up to its capacity, dataset_size."""
    return min(config.dataset_size, -(-config.steps // config.action_repeat))


def cost_lines(config, spec, free=None):
    """What the run will cost: its updates, the replay's memory once it holds what the run will
    store (replay_steps; the device's with replay_device) and at capacity, the episode files' disk
    per million steps; a WARNING when what the run will store cannot fit in the memory free now
    (`free`, bytes; by default available_memory())."""
    step = step_bytes(spec)
    steps = replay_steps(config)
    replay, capacity = step * steps, step * config.dataset_size
    device = config.device if config.replay_device else "cpu"
    free = available_memory(device) if free is None else free
    where = f"{torch.device(device).type.upper()} memory" if config.replay_device else "memory"
    gb = lambda n: f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"  # noqa: E731
    lines = [f"Cost: {total_updates(config):,} updates to {config.steps:,} frames; replay {gb(replay)} of {where} by "
             f"the end ({steps:,} steps x {step:,} bytes; at its capacity of {config.dataset_size:,} steps "
             f"{gb(capacity)}); episode files at most {gb(step * 1e6)} per million steps on disk (compressed .npz, "
             "images usually less)"]
    kept = {k: v for k, v in spec.items() if k.startswith(LATENT) or k in ("action", "reward")}
    if any(k.startswith(LATENT) for k in kept):  # Replay.context_state: the written-back latents, saved
        lines[0] += (f"; checkpoints {gb(step_bytes(kept) * steps)} by the end (the replay's latents, actions "
                     "and rewards, which a resumed run needs to sample as the straight one)")
    if free is not None and replay > free:
        fix = "lower --dataset_size" + (", or --replay_device False" if config.replay_device else "")
        lines.append(f"WARNING: the replay will hold {gb(replay)} by the end ({steps:,} steps) and {gb(free)} of "
                     f"{where} is free; the run will run out of memory as the replay fills: {fix}")
    return lines


# ==================================================================================================
# The prefetcher: the learner's batches, sampled ahead
# ==================================================================================================


class Prefetcher:
    """The learner's replay batches, without a stall on the device: on CUDA each batch is sampled
    into pinned host memory and copied with non_blocking=True, and while an update runs the next
    batch of the same run of updates is sampled on a background thread (`ahead`; on a CPU the
    thread would compete with the update for the cores, so there it samples on demand).

    The batches and their order are those of plain Replay.sample calls with the same random
    stream: a batch sampled ahead is taken before anything else samples, and the write-back of the
    update before it (models.ReplayContext.write_back, which calls `update` here) is applied to it
    too, as if it had been sampled after. Only within one run of updates (`next(more=True)`): the
    steps the environments add between runs reach the next batch as without prefetching.
    """

    def __init__(self, replay, batch, length, device="cpu", ahead=None):
        self.replay, self.batch, self.length = replay, batch, length
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # A replay on the device gathers its batch there, in no time worth a thread.
        self.ahead = (self.cuda and replay.device is None) if ahead is None else ahead
        self.pending = None  # (thread, result dict) of the batch being sampled ahead

    on_host = property(lambda self: self.replay.on_host)

    def host_array(self, shape, dtype):
        """Where a batch is sampled into: pinned memory on CUDA (an asynchronous copy needs it),
        plain numpy otherwise."""
        if not self.cuda:
            return np.empty(shape, dtype)
        like = torch.from_numpy(np.empty(0, dtype)).dtype
        return torch.empty(shape, dtype=like, pin_memory=True).numpy()  # the array keeps the tensor alive

    def sample(self):
        return self.replay.sample(self.batch, self.length, ids=True, alloc=self.host_array)

    def next(self, more=False):
        """The next batch: (batch, ids, data): batch a dict of host arrays (B, L, ...), ids (B, 2)
        as Replay.sample gives them, data the batch as tensors on the device (on CUDA, copied
        asynchronously) or None (on a CPU: preprocess converts the host arrays). `more`: another
        batch follows in this run of updates; it is sampled ahead while this one trains."""
        batch, ids = self._take() if self.pending is not None else self.sample()
        if self.replay.device is not None:  # replay_device: the batch is on the device already
            return batch, ids, batch
        data = self.to_device(batch) if self.cuda else None
        if more and self.ahead:
            result = {}

            def work():
                try:
                    result["value"] = self.sample()
                except BaseException as e:  # noqa: BLE001 - raised in the learner's thread by _take
                    result["error"] = e

            thread = threading.Thread(target=work, name="prefetch", daemon=True)
            thread.start()
            self.pending = (thread, result)
        return batch, ids, data

    def _take(self):
        thread, result = self.pending
        thread.join()
        self.pending = None
        if "error" in result:
            raise result["error"]
        return result["value"]

    def to_device(self, batch):
        """dict of host arrays -> dict of tensors on the device, copied without waiting. The copy
        is made from the pinned tensor behind each array (host_array), so that the caching host
        allocator keeps its memory until the copy is done."""
        return {k: host_tensor(v).to(self.device, non_blocking=True) for k, v in batch.items()}

    def update(self, ids, values):
        """Replay.update, also applied to a batch sampled ahead of it (see the class)."""
        if self.pending is not None:
            thread, result = self.pending
            thread.join()
            if "value" in result:
                batch, pending_ids = result["value"]
                overlay(batch, pending_ids, self.length, ids, values)
        self.replay.update(ids, values)


def host_array(value):
    """A numpy array of `value` (an array, or a tensor on any device: the written-back latents)."""
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def host_tensor(array):
    """The tensor a numpy array was made from by Tensor.numpy() (a pinned buffer), else a tensor
    sharing the array's memory."""
    base = array.base
    if isinstance(base, torch.Tensor) and base.data_ptr() == array.ctypes.data and base.shape == array.shape:
        return base
    return torch.from_numpy(array)


class Fetch:
    """Tensors (dict of float (B, ...) tensors) brought to the host with one copy that does not wait:
    on CUDA copied together into pinned memory with non_blocking=True, an event recorded after the
    copy; `result()` waits on that event (by then long done: models.ReplayContext.write_back reads it
    one update later) and gives numpy views of the copy. On a CPU the values are in host memory
    already. With `on_host` False (a replay on the device) the tensors stay where they are."""

    def __init__(self, tensors, on_host=True):
        self.shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        self.tensors, self.host, self.event = None, None, None
        if not on_host:
            self.tensors = {k: v.detach() for k, v in tensors.items()}
            return
        flat = torch.cat([v.detach().float().reshape(len(v), -1) for v in tensors.values()], 1)
        if flat.device.type == "cuda":
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat

    def result(self):
        if self.tensors is not None:
            return self.tensors
        if self.event is not None:
            self.event.synchronize()
        array, out, at = self.host.numpy(), {}, 0
        for key, shape in self.shapes.items():
            size = int(np.prod(shape[1:], dtype=np.int64))
            out[key] = array[:, at:at + size].reshape(shape)
            at += size
        return out


def to_device(arrays, device):
    """dict of numpy arrays -> dict of tensors on `device`, moved with one host-to-device copy: the
    arrays' bytes packed into one buffer (each at an offset aligned to 8 bytes; on CUDA pinned, so that
    the copy does not make the host wait), viewed back as their dtypes and shapes on the device (the
    policy's observations: one copy per environment step, not one per key; a replay on the device:
    its staged steps and a batch's indices, one copy per batch)."""
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    offsets, total = {}, 0
    for key, array in arrays.items():
        offsets[key] = total
        total += -(-array.nbytes // 8) * 8
    cuda = torch.device(device).type == "cuda"
    flat = torch.zeros(total, dtype=torch.uint8, pin_memory=cuda)  # pinned: a copy that does not wait
    buffer = flat.numpy()
    for key, array in arrays.items():
        buffer[offsets[key]:offsets[key] + array.nbytes] = array.reshape(-1).view(np.uint8)
    flat = flat.to(device, non_blocking=True)  # on a CPU: the buffer itself
    out = {}
    for key, array in arrays.items():
        dtype = torch.from_numpy(np.empty(0, array.dtype)).dtype
        out[key] = flat[offsets[key]:offsets[key] + array.nbytes].view(dtype).view(array.shape)
    return out


def to_host(tensors):
    """dict of (N, ...) tensors -> dict of float32 numpy arrays, moved with one device-to-host copy
    (the policy's action and latents: one copy per environment step, not one per tensor)."""
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    flat = torch.cat([v.detach().float().reshape(len(v), -1) for v in tensors.values()], 1).cpu().numpy()
    out, at = {}, 0
    for key, shape in shapes.items():
        size = int(np.prod(shape[1:], dtype=np.int64))
        out[key] = flat[:, at:at + size].reshape(shape)
        at += size
    return out


def overlay(batch, ids, length, written_ids, values):
    """Write `values` (dict of (B', L', ...) arrays, row q for the L' steps from written_ids[q], as
    Replay.update takes them) into `batch` (dict of (B, length, ...) arrays sampled from ids (B, 2))
    wherever the same steps of the same stream are in both; later rows win, as in Replay.update."""
    ids, written_ids = np.asarray(ids), np.asarray(written_ids)
    span = len(next(iter(values.values()))[0])
    for q, (stream, first) in enumerate(written_ids):
        for r in np.nonzero(ids[:, 0] == stream)[0]:
            start = ids[r, 1]
            low, high = max(start, first), min(start + length, first + span)
            if low < high:
                for key, value in values.items():
                    value = value if isinstance(batch[key], torch.Tensor) else host_array(value)
                    batch[key][r, low - start:high - start] = value[q, low - first:high - first]


# ==================================================================================================
# Checkpoint files: written so that a kill leaves one whole, loaded without running code
# ==================================================================================================


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, unsafe to unpickle (`unsafe`), or with non-finite values."""

    def __init__(self, message, unsafe=False):
        super().__init__(message)
        self.unsafe = unsafe


def previous_path(path):
    """Where `save_checkpoint` keeps the checkpoint it replaced: latest.pt -> previous.pt."""
    return pathlib.Path(path).with_name("previous.pt")


def save_checkpoint(path, state):
    """Write `state` to `path` and keep the checkpoint it replaces as previous.pt, so that a kill -9
    at any instant leaves the newest complete checkpoint findable: the state goes to a temporary
    file (`temp_path`, flushed to disk), then latest.pt becomes previous.pt and the temporary file
    latest.pt. A kill before the first rename leaves latest.pt as it was, after it only previous.pt
    and the complete temporary file; `resume_checkpoint` promotes that one at the next start.
    Non-finite weights are refused: they would replace the last good checkpoint.
    """
    if not all_finite(state):
        raise CheckpointError("the state to save holds non-finite values")
    path = pathlib.Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    tmp = temp_path(path)
    try:
        write_synced(tmp, buffer.getbuffer())
    except BaseException as e:  # a full disk gets its space back; Ctrl-C leaves nothing either
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # named as the checkpoint, not its temporary file; nothing was replaced
            raise WriteError(path, e) from None
        raise
    # Ctrl-C or SIGTERM between the renames would leave latest.pt in the temporary file; hold them until done.
    signals = {signal.SIGINT, signal.SIGTERM}
    blocked = threading.current_thread() is threading.main_thread()
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        if path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
        sync_folder(path.parent)
    except OSError as e:  # renames need no space; a folder turned read-only can refuse them
        raise WriteError(path, e) from None
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def _torch_reason(error):
    """The line of a torch.load error that says what is wrong, without torch's advice around it
    (which suggests weights_only=False, the one thing never to do with a refused file)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    advice = ("Weights only load failed", "(1)", "(2)", "In PyTorch", "Re-running", "Check the documentation",
              "Please file an issue", "Please use", "This file can still be loaded")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(advice)] or lines
    reason = lines[0] if lines else type(error).__name__
    return reason.split(". ")[0].rstrip(".")[:200]  # its first sentence: what follows is advice again


def pickle_globals(path):
    """(the globals, as module.name, that the pickles of a checkpoint file ask to call or build,
    whether every pickle was read to its end), found with pickletools, which runs nothing: the
    .pkl members of a torch.save zip archive, or the file as one plain pickle."""
    import pickletools
    import zipfile

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                streams = [archive.read(name) for name in archive.namelist() if name.endswith(".pkl")]
        else:
            streams = [pathlib.Path(path).read_bytes()]
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return [], False
    found, complete = [], bool(streams)
    for data in streams:
        strings, memo = [], {}
        try:
            for opcode, arg, _ in pickletools.genops(data):
                name = opcode.name
                if name in ("GLOBAL", "INST"):
                    found.append(arg.replace(" ", "."))
                elif name == "STACK_GLOBAL":
                    found.append(".".join(map(str, strings[-2:])))
                elif name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                    memo[len(memo) if name == "MEMOIZE" else arg] = strings[-1] if strings else None
                elif name in ("GET", "BINGET", "LONG_BINGET"):
                    strings.append(memo.get(arg))
                elif isinstance(arg, str):
                    strings.append(arg)
        except Exception:  # noqa: BLE001 - a damaged or cut pickle: what was read so far is what it asked for
            complete = False
    return found, complete


def _unsafe_globals(found):
    """The globals among `found` that torch's weights-only loading does not allow."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed = set(_get_allowed_globals())
    except ImportError:  # another torch: its own message still decides (load_checkpoint)
        allowed = {name for name in found if name.startswith(("torch.", "collections.OrderedDict"))}
    return sorted({name for name in found if name not in allowed})


def load_checkpoint(path, device="cpu", keys=(), mmap=False):
    """Load a checkpoint without running code from it (`weights_only`: tensors and plain data).

    Raises CheckpointError with the reason in one line: `unsafe` set for a file that asks to call
    or build anything else (os.system, exec, eval, any class: someone made it so, and it is never
    skipped), unset for a damaged one (empty, cut short, not a checkpoint, or a state without one
    of `keys`).
    """
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols of files it then refuses
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        reason = _torch_reason(e)
        found, complete = pickle_globals(path)
        unsafe = _unsafe_globals(found)
        if unsafe or "global" in reason.lower():  # either sign: torch's wording changes between versions
            asks = f" ({', '.join(unsafe)})" if unsafe else ""
            raise CheckpointError(f"refusing to load {path}: it holds objects other than tensors and plain "
                                  f"data{asks}, which could run code; torch: {reason}", unsafe=True) from None
        what = "cut short or damaged" if not complete else "not a checkpoint"
        raise CheckpointError(f"cannot read {path}: {what} ({reason})") from None
    except EOFError:
        raise CheckpointError(f"cannot read {path}: empty or cut short (it ends early)") from None
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {_torch_reason(e)}") from None
    missing = [key for key in keys if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(f"cannot read {path}: incomplete, without {', '.join(map(repr, missing))}")
    return state


def load_checkpoint_or_previous(path, device="cpu", keys=(), mmap=False):
    """(state, path it came from, notes) from `path`, or from previous.pt when `path` is missing,
    damaged (load_checkpoint, with `keys`) or non-finite; (None, None, notes) when neither exists.
    Reads only: a run beside training (--eval_only) uses it too.

    A checkpoint that is unsafe to unpickle is an error, never skipped: someone changed the file.
    """
    path, notes = pathlib.Path(path), []
    for candidate in (path, previous_path(path)):
        if not candidate.exists():
            if candidate == path and previous_path(path).exists():
                notes.append(f"{path} is missing")
            continue
        try:
            state = load_checkpoint(candidate, device, keys, mmap)
        except CheckpointError as e:
            if e.unsafe:  # never skipped: someone changed a file of the run, which must not go unnoticed
                then = " to resume from previous.pt" if candidate == path and previous_path(path).exists() else ""
                raise CheckpointError(f"{e}. It is never skipped: move it out of the logdir (keep it to inspect) and "
                                      f"rerun{then}", unsafe=True) from None
            notes.append(str(e))
            continue
        if not all_finite(state):
            notes.append(f"{candidate} holds non-finite values")
            continue
        if candidate != path:
            notes.append(f"using the previous checkpoint {candidate}")
        return state, candidate, notes
    if notes:
        raise CheckpointError("no usable checkpoint: " + "; ".join(notes) + f". Move {path.name} and "
                              f"{previous_path(path).name} out of {path.parent} to train from fresh weights (the "
                              "stored episodes are kept and counted), or use another --logdir")
    return None, None, notes


def recover_checkpoint(path, device="cpu", keys=()):
    """After a kill -9 in `save_checkpoint`: promote the newest complete temporary file of `path`
    (verified by loading it) to `path`, keeping the one it replaces as previous.pt as a save would,
    and delete every other temporary file of `path`. Only the run that holds the logdir may call
    it. Returns one line saying what it did, or None when there was nothing to do."""
    path = pathlib.Path(path)
    temps = [temp for temp, _ in temp_files(path.parent, path.name)]
    if not temps:
        return None
    promoted, removed, size = None, 0, 0
    for temp in reversed(temps):  # newest first: the first complete one is the save the kill cut short
        if promoted is None:
            try:
                state = load_checkpoint(temp, device, keys)
            except CheckpointError:
                state = None
            if state is not None and all_finite(state):
                # Complete means written after latest.pt (the save writes it first): it replaces latest.pt.
                if path.exists():
                    os.replace(path, previous_path(path))
                os.replace(temp, path)
                promoted = temp
                continue
        size += temp.stat().st_size
        temp.unlink()
        removed += 1
    sync_folder(path.parent)
    done = [f"promoted the complete {promoted.name} to {path.name}"] if promoted else []
    if removed:
        done.append(f"removed {removed} incomplete or older temporary checkpoint file(s) ({size / 1e6:.3g} MB)")
    return f"Recovered from a kill during a checkpoint write: {' and '.join(done)}"


def remove_temp_files(folder, but=()):
    """Delete the temporary files (`temp_files`) in `folder` of every file but those named in `but`:
    what a kill -9 left of rewrites such as config.yaml or metrics.jsonl, whose old version the
    rename never replaced. Only the run that holds the logdir may call it. Returns one line, or None."""
    found = [(temp, target) for temp, target in temp_files(folder) if target.name not in but]
    for temp, _ in found:
        temp.unlink()
    if not found:
        return None
    names = sorted({target.name for _, target in found})
    return (f"Removed {len(found)} temporary file(s) a kill left in {folder} (of {', '.join(names)}; each is as it "
            "was before)")


def resume_checkpoint(path, device="cpu", keys=()):
    """What a training run resumes from: `recover_checkpoint` (and `remove_temp_files` for the other
    files beside it), then `load_checkpoint_or_previous`. A damaged latest.pt is kept aside as
    latest.pt.damaged, so that the next save does not make it previous.pt in place of the good one.
    Returns (state, path it came from, notes)."""
    path = pathlib.Path(path)
    recovered = [line for line in (recover_checkpoint(path, device, keys),
                                   remove_temp_files(path.parent, but=(path.name,))) if line]
    state, used, notes = load_checkpoint_or_previous(path, device, keys)
    if used is not None and used != path and path.exists():
        damaged = path.with_name(path.name + ".damaged")
        os.replace(path, damaged)
        notes.append(f"kept the damaged {path.name} aside as {damaged.name}")
    if notes:
        notes = ["; ".join(notes)]  # one line
    return state, used, recovered + notes


class LogdirBusy(RuntimeError):
    """Another live process holds the run's logdir."""


def lock_logdir(logdir):
    """Hold an exclusive lock on `logdir` for as long as the returned file stays open.

    flock locks belong to the open file, so the kernel releases them when the holder exits in any
    way, kill -9 included: a dead run never leaves its logdir locked. The holder's pid and host
    are written into the file so a second run can name it.
    """
    import fcntl
    import socket

    f = (pathlib.Path(logdir) / "run.lock").open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown process"
        f.close()
        raise LogdirBusy(f"{logdir} is in use by another run ({holder}); wait for it to end or use another "
                         "--logdir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


class LogdirLock:
    """The run's hold on `logdir` (lock_logdir), taken before anything in it is read or cleaned: the
    folder is created first where it does not exist (a name the file system refuses is a ConfigError
    of one line, before any environment is built), and `abandon()` removes it again, if this start
    created it, when the run is refused before it wrote anything."""

    def __init__(self, logdir):
        self.logdir = pathlib.Path(logdir)
        self.created = not self.logdir.exists()
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"Invalid value '{logdir}' for --logdir: the folder cannot be created "
                              f"({e.strerror or e}); choose a shorter or writable path") from None
        self.file = lock_logdir(self.logdir)

    def abandon(self):
        self.file.close()
        if self.created:
            (self.logdir / "run.lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # something else was written there meanwhile: keep it
                self.logdir.rmdir()


def finished_frames(path, steps, action_repeat):
    """The frames of a run whose checkpoint at `path` (or previous.pt) completed --steps `steps`
    (counters.completed), read without building anything; None when it did not, or cannot be read
    here (resuming says why)."""
    try:
        state, _, _ = load_checkpoint_or_previous(path, "cpu", ("counters",), mmap=True)
    except CheckpointError:
        return None
    if state is None or state["counters"].get("completed", 0) < steps:
        return None
    return state["counters"]["policy_steps"] * action_repeat


def check_fits(agent, saved, path):
    """A checkpoint whose tensors do not fit this config's model ends the run before anything loads."""
    current = agent.state_dict()
    differ = [k for k in current if k in saved and tuple(saved[k].shape) != tuple(current[k].shape)]
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if not (differ or missing or unexpected):
        return
    if differ:
        key = differ[0]
        example = f"{key} is {tuple(saved[key].shape)} there, {tuple(current[key].shape)} here"
    else:
        example = f"{(missing or unexpected)[0]} is only {'here' if missing else 'there'}"
    raise ConfigError(f"{path} does not fit this config ({len(differ)} shapes differ, {len(missing)} tensors "
                      f"missing, {len(unexpected)} unexpected; e.g. {example}): restore the size keys of the "
                      "saved config.yaml or use another --logdir")


# ==================================================================================================
# A run's stored episodes and its checkpoint
# ==================================================================================================


class NonFiniteError(RuntimeError):
    """A loss or weight went NaN or infinite: the run stops without saving."""


class StoredEpisodes:
    """A run's episode folders and what is loaded from them at the start: the training replay (from
    traindir, or offline_traindir) and the evaluation replay (evaldir, or offline_evaldir, which
    eval_openl samples). Files that do not fit the run's spaces (those of `env`; without one they
    are taken on trust) are skipped with a warning and counted in `note`."""

    def __init__(self, config, logdir, rank, env, context_spec):
        self.traindir = pathlib.Path(config.traindir or logdir / "train_eps").expanduser()
        if rank:  # rank 0 keeps the single-process folder, so its runs resume alike
            self.traindir = self.traindir / f"rank{rank}"
        self.evaldir = pathlib.Path(config.evaldir or logdir / "eval_eps").expanduser()
        self.skipped = 0
        # What a kill -9 left in the folders this run writes (the main process alone writes evaldir).
        own = ([] if config.offline_traindir else [self.traindir]) + ([self.evaldir] if not rank else [])
        self.recovered = [f"WARNING: {line}" for line in map(recover_episodes, own) if line]
        spec = episode_spec(env.obs_space, env.act_space) if env is not None else None
        # Each rank samples its own batches: seeds seed + 1 + rank * 1000 for ranks > 0 (seed + 1
        # is the evaluation replay's).
        self.replay = Replay(config.dataset_size, max(1, config.envs), config.seed + (1 + 1000 * rank if rank else 0),
                             device=config.device if config.replay_device else None,
                             online=config.batch_length + config.replay_context if config.replay_online else 0)
        source = pathlib.Path(config.offline_traindir).expanduser() if config.offline_traindir else self.traindir
        # Training episodes hold the policy's latents too when the replay context wants them.
        train_spec = {**spec, **context_spec} if spec is not None else None
        loaded_steps = 0
        for i, episode in enumerate(load_episodes(source, config.dataset_size, train_spec, self.skip)):
            self.replay.add_episode(strip_logs(episode), i % len(self.replay.streams))
            loaded_steps += len(episode["reward"]) - 1
        self.eval_replay = Replay(100 * config.batch_length, 1, config.seed + 1)
        source = pathlib.Path(config.offline_evaldir).expanduser() if config.offline_evaldir else self.evaldir
        for episode in load_episodes(source, 100 * config.batch_length, spec, self.skip):
            self.eval_replay.add_episode(strip_logs(episode))
        self.note = f"Episodes: {loaded_steps} replay steps loaded, {self.skipped} files skipped"
        if self.skipped == 1:
            skip_warning(*self.first_skipped)
        elif self.skipped:  # one line, not one per file (a logdir resumed with another suite's preset)
            name, problem = self.first_skipped
            print(f"warning: skipping {self.skipped} episode files that do not load or fit this run, the first "
                  f"{name}: {problem}", file=sys.stderr, flush=True)

    def skip(self, filename, problem):
        if not self.skipped:
            self.first_skipped = (filename, problem)
        self.skipped += 1


# The layout of what Checkpoints saves. A checkpoint of another one is refused, not migrated: raise
# it whenever a key is added, removed or changes its meaning.
CHECKPOINT_FORMAT = 1


def check_format(state, path):
    """A checkpoint of another format than this version's (CHECKPOINT_FORMAT) ends the run in one line."""
    found = state.get("format")
    if found != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is a checkpoint of format {found if found is not None else 'none (older)'} and "
                          f"this version reads format {CHECKPOINT_FORMAT} only: resume it with the version that "
                          "saved it or use another --logdir")


def own_tensors(state):
    """A state dict whose tensors hold their own storage: torch.save writes a view's whole storage,
    and the weights of a seed of --seeds N are views of the stack of all seeds' (seeds.Stack)."""
    return {key: value.clone() if isinstance(value, torch.Tensor)
            and value.untyped_storage().nbytes() > value.numel() * value.element_size() else value
            for key, value in state.items()}


class Checkpoints:
    """A run's checkpoint at `path`: resuming from it (or from previous.pt), saving it.

    A save holds the agent and its optimizers, the counters, the schedules ({"train", "log",
    "eval"}) and the random state of every rank (`ranks`), the replay's sampler and context state
    included (gathered on the main process, which alone writes). Non-finite values are never saved.
    """

    # What a loaded state must hold, or it is damaged and previous.pt is used (a format is checked after).
    KEYS = ("agent", "optimizers", "counters", "schedules", "rng")

    def __init__(self, path, config, agent, counters, schedules, replay, ranks):
        self.path, self.config, self.agent, self.counters = path, config, agent, counters
        self.schedules, self.replay, self.ranks = schedules, replay, ranks
        self.saved_frames = None  # frame of the checkpoint on disk
        self.saved_at = None  # (frames, updates) of the last save of this run

    @property
    def frames(self):
        return self.counters.policy_steps * self.config.action_repeat

    def kept(self):
        """What a refused save leaves on disk, for its error message."""
        return f"latest.pt keeps frame {self.saved_frames}" if self.saved_frames is not None else "nothing saved"

    def resume(self, traindir):
        """Load the checkpoint (or the previous one) and count every frame stored in `traindir` (None:
        offline, nothing stored). Returns (whether it resumed, lines for the start-up summary)."""
        config, counters, ranks = self.config, self.counters, self.ranks
        if ranks.is_main:  # it alone writes checkpoints, and recovers what a kill -9 left (resume_checkpoint)
            state, path, found = resume_checkpoint(self.path, config.device, self.KEYS)
        ranks.barrier()
        if not ranks.is_main:
            state, path, found = load_checkpoint_or_previous(self.path, config.device, self.KEYS)
        notes = [f"WARNING: {note}" for note in found]
        stored = 0 if traindir is None else stored_steps(traindir)
        if state is None:
            counters.stored_steps = stored
            # Episodes of a run killed before its first checkpoint count towards the budget.
            counters.policy_steps = stored
            if stored:
                notes.append(f"WARNING: no checkpoint in {self.path.parent}, but {traindir} holds "
                             f"{stored * config.action_repeat} frames of episodes: training starts from "
                             "fresh weights and the frame count continues from them")
            return False, notes
        check_format(state, path)
        check_fits(self.agent, state["agent"], path)
        saved_ranks = state["world_size"]
        if saved_ranks != ranks.world_size:
            raise ConfigError(f"{path} was saved by {saved_ranks} process(es) and this run has "
                              f"{ranks.world_size}: resuming with another number of processes is not "
                              f"supported (each holds its own replay); use --nproc_per_node {saved_ranks} "
                              "or another --logdir")
        changes = self.restore(state)
        notes += self.restore_replay(state)
        self.saved_frames = self.frames
        if changes:
            notes.append("Optimizer settings from this config replace the saved ones: " + ", ".join(changes))
        # After a kill -9, episodes and chunks written after the checkpoint are in replay; their
        # frames were spent, so the budget counts them (the steps of a running episode not yet in a
        # chunk at the save, at most chunk_size per environment, may count twice).
        rank = ranks.rank
        saved = state["ranks"][rank - 1]["stored_steps"] if rank else state["counters"]["stored_steps"]
        if traindir is not None and saved and not stored:
            notes.append(f"WARNING: episode files missing: {traindir} holds none, and the checkpoint counted "
                         f"{saved * config.action_repeat} frames of them (moved or deleted?); the replay starts empty")
        extra = stored - saved
        counters.stored_steps = stored
        if extra > 0:
            counters.policy_steps += extra
            notes.append(f"Counted {extra * config.action_repeat} frames of episodes stored after the "
                         f"checkpoint (frame {self.saved_frames})")
        return True, notes

    def state(self):
        """What a save writes, gathered from every rank (call it on all of them at once): the state on
        the main process, None on the others, which write nothing."""
        counters, schedules, ranks = self.counters, self.schedules, self.ranks
        # Every rank's own state, gathered on the main one: [rank 0, rank 1, ...].
        own = ranks.gather_object({"rng": rng_state(self.replay.rng), "stored_steps": counters.stored_steps,
                                   "replay": self.replay.context_state(list(self.agent.context.spec))})
        if not ranks.is_main:
            self.saved_frames, self.saved_at = self.frames, (self.frames, counters.updates)
            return None
        return {
            "format": CHECKPOINT_FORMAT,
            "agent": own_tensors(self.agent.state_dict()),
            "optimizers": self.agent.optimizer_state(),
            "counters": dict(vars(counters)),
            "schedules": {"train": schedules["train"].state_dict(), "log": schedules["log"].last,
                          "eval": schedules["eval"].last},
            "rng": own[0]["rng"],
            "replay": own[0]["replay"],  # the written-back latents and the online queue (Replay.context_state)
            "ranks": own[1:],  # ranks 1, 2, ... of a torchrun run: their rng, stored_steps and replay
            "world_size": ranks.world_size,
        }

    def write(self, state):
        """Write `state` (from state(); None on a rank other than the main one: nothing to do)."""
        if state is None:
            return
        try:
            save_checkpoint(self.path, state)  # refuses non-finite values
        except CheckpointError:
            raise NonFiniteError(f"non-finite weights or optimizer state at update {self.counters.updates}; "
                                 f"the run stops without saving ({self.kept()})") from None
        self.saved_frames = self.frames
        self.saved_at = (self.frames, self.counters.updates)

    def restore(self, state):
        """Returns the optimizer settings of this config that replaced differing saved ones."""
        self.agent.load_state_dict(state["agent"])
        changes = self.agent.load_optimizer_state(state["optimizers"])
        vars(self.counters).update(state["counters"])
        self.schedules["train"].load_state_dict(state["schedules"]["train"])
        self.schedules["log"].last = state["schedules"]["log"]
        self.schedules["eval"].last = state["schedules"]["eval"]
        rank = self.ranks.rank
        own = state["ranks"][rank - 1] if rank else state
        set_rng_state(own["rng"], self.replay.rng)
        return changes

    def restore_replay(self, state):
        """The replay's latents and online queue (Replay.context_state) over the steps the episode files
        reloaded; a line for the summary when some could not be placed."""
        rank = self.ranks.rank
        missed = self.replay.load_context_state((state["ranks"][rank - 1] if rank else state)["replay"])
        # What this run keeps beyond the files: the v1 update neither writes latents back nor queues.
        kept = [name for name, used in (("written-back latents", bool(self.agent.context.spec)),
                                        ("online queue", bool(self.config.replay_online))) if used]
        if not missed or not kept:
            return []
        stand_in = " (the files' latents, the policy's, stand in)" if self.agent.context.spec else ""
        return [f"WARNING: the replay's {' and '.join(kept)} of {missed} environment stream(s) were not restored: "
                f"the episode files do not hold their steps as saved{stand_in}"]
