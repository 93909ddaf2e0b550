"""--logger back ends: metrics.csv equals metrics.jsonl, W&B (offline) holds the run's scalars and
config and keeps its id when resumed, and asking for wandb without the package is one line, exit 2."""

import csv
import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest
from ruamel.yaml import YAML

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import logs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEBUG = ["--configs", "debug", "--task", "dmc_cartpole_balance"]


def jsonl_rows(logdir):
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


def csv_rows(logdir):
    """metrics.csv as dicts of floats, the empty cells left out."""
    with (logdir / "metrics.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        rows = [{key: float(value) for key, value in row.items() if value != ""} for row in reader]
    return header, rows


def test_csv_rows_and_columns_equal_metrics_jsonl_as_metrics_appear_and_on_resume(tmp_path):
    logger = logs.Logger(tmp_path, 0, ["jsonl", "csv"])
    logged = [(10, {"train/return": 1.5, "perf/fps": 3.0}), (20, {"train/return": 2.25}),
              (30, {"train/return": 0.1, "eval/return": 7.0}),  # a metric that appears later widens the header
              (40, {"perf/fps": 1e-7, "eval/return": -2.0})]
    for step, values in logged:
        for name, value in values.items():
            logger.scalar(name, value)
            logger.scalar(name, value)  # the mean of a write's values, as in metrics.jsonl
        logger.write(step)
    logger.close()
    header, rows = csv_rows(tmp_path)
    assert header == ["step", "train/return", "perf/fps", "eval/return"]  # step first, then as they appeared
    assert rows == jsonl_rows(tmp_path) == [{"step": step, **values} for step, values in logged]
    assert not list(tmp_path.glob(".*.tmp"))
    # A resumed run drops what came after its checkpoint from both files, and goes on appending.
    logger = logs.Logger(tmp_path, 20, ["jsonl", "csv"])
    logger.scalar("train/return", 5.0)
    logger.write(30)
    logger.close()
    expected = [{"step": 10, "train/return": 1.5, "perf/fps": 3.0}, {"step": 20, "train/return": 2.25},
                {"step": 30, "train/return": 5.0}]
    header, rows = csv_rows(tmp_path)
    assert rows == jsonl_rows(tmp_path) == expected
    assert header == ["step", "train/return", "perf/fps", "eval/return"]


@pytest.mark.parametrize("names, message", [
    (["tensorbord"], "Invalid value 'tensorbord' for --logger; valid: one or more of tensorboard, jsonl, csv, wandb"),
    ([], "Invalid value '' for --logger"),
    (["jsonl", "mlflow"], "Invalid value 'mlflow' for --logger"),
])
def test_unknown_or_no_logger_is_refused_naming_the_valid_ones(tmp_path, names, message):
    with pytest.raises(ValueError) as error:
        logs.check_loggers(names)
    assert message in str(error.value)
    with pytest.raises(ValueError):
        logs.Logger(tmp_path / "run", 0, names)
    assert not (tmp_path / "run").exists()


def test_logger_default_is_tensorboard_and_jsonl():
    import config as cfg

    config = cfg.parse(["--configs", "debug"])
    assert config.logger == ["tensorboard", "jsonl"]
    assert cfg.parse(["--logger", "jsonl,csv", "--wandb.tags", "a,b"]).to_dict()["wandb"]["tags"] == ["a", "b"]


def test_wandb_without_the_package_is_one_line_exit_2_and_writes_nothing(tmp_path):
    logdir = tmp_path / "run"
    # The package made unimportable, as on a machine without it.
    code = ("import runpy, sys; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(logdir),
                             "--logger", "tensorboard,jsonl,wandb"], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl")))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: --logger wandb needs the wandb package, which is not installed: pip install wandb"]
    assert not logdir.exists()


# ----------------------------------------------------------------------------------------------
# W&B offline: a short debug run and its resumption
# ----------------------------------------------------------------------------------------------


def wandb_records(path):
    """The protobuf records of a W&B run file (run-<id>.wandb): W&B's header (':W&B', magic,
    version; 7 bytes), then LevelDB-log framed chunks in 32 KiB blocks (crc32c, length, type),
    which a record may span (first, middle..., last)."""
    from wandb.proto import wandb_internal_pb2

    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def items(updates):
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}


def read_wandb_run(folder):
    """(run id, config, history rows) of one offline run folder."""
    (path,) = folder.glob("run-*.wandb")
    run_id, config, history = None, {}, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update(items(record.run.config.update))
        elif kind == "config":
            config.update(items(record.config.update))
        elif kind == "history":
            history.append(items(record.history.item))
    return run_id, config, history


def train(logdir, steps, tmp_path):
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"), WANDB_MODE="offline",
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb_data"))
    command = [sys.executable, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(logdir), "--steps", str(steps),
               "--logger", "tensorboard,jsonl,csv,wandb", "--wandb.project", "issue24", "--wandb.group", "seeds",
               "--wandb.tags", "debug,cartpole"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def test_wandb_offline_run_holds_scalars_and_config_and_resumes_with_its_id(tmp_path):
    logdir = tmp_path / "run"
    train(logdir, 400, tmp_path)
    (first,) = sorted((logdir / "wandb").glob("offline-run-*"))
    run_id, config, history = read_wandb_run(first)
    assert run_id == (logdir / "wandb_id.txt").read_text().strip()
    saved = YAML(typ="safe", pure=True).load((logdir / "config.yaml").read_text())
    assert {key: config[key] for key in saved} == saved  # the saved config is the run's config
    assert saved["wandb"] == {"project": "issue24", "entity": "", "group": "seeds", "name": "", "tags": [
        "debug", "cartpole"]}
    # Every metrics.jsonl row is a W&B history row at the same frames, with the same values.
    scalars = {}
    for row in history:
        scalars.setdefault(row.get("step"), {}).update(
            {k: v for k, v in row.items() if isinstance(v, (int, float)) and not k.startswith("_")})
    for row in jsonl_rows(logdir):
        assert {k: scalars[row["step"]][k] for k in row} == pytest.approx(row)
    videos = {k.rsplit("/", 1)[0] for row in history for k, v in row.items() if v == "video-file"}
    assert videos == {"eval/policy", "train/openl", "eval/openl"}  # video_pred_log is on in debug
    header, rows = csv_rows(logdir)
    assert rows == jsonl_rows(logdir) and header[0] == "step"

    train(logdir, 600, tmp_path)  # rerun: resumes the run, and with it the W&B run
    folders = sorted((logdir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    resumed_id, _, resumed = read_wandb_run(folders[1])
    assert resumed_id == run_id
    assert max(row["step"] for row in resumed if "step" in row) == 600
    assert csv_rows(logdir)[1] == jsonl_rows(logdir)


def test_wandb_with_seeds_makes_a_run_per_seed_grouped_by_the_logdir(tmp_path):
    """--seeds 2: two W&B runs in one process (reinit create_new), each with its seed's own id,
    history and name <logdir>-seed<k>, grouped under the logdir's name when no group is given."""
    logdir = tmp_path / "walker"
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"), WANDB_MODE="offline",
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb_data"))
    command = [sys.executable, str(ROOT / "dreamer.py"), *DEBUG, "--logdir", str(logdir), "--steps", "200",
               "--seeds", "2", "--video_pred_log", "False", "--logger", "jsonl,wandb", "--wandb.project", "seeds"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    ids = []
    for k in range(2):
        run = logdir / f"seed{k}"
        (folder,) = sorted((run / "wandb").glob("offline-run-*"))
        run_id, config, history = read_wandb_run(folder)
        assert run_id == (run / "wandb_id.txt").read_text().strip()
        assert config["seed"] == k
        returns = [row["train/return"] for row in history if "train/return" in row]
        assert returns == [row["train/return"] for row in jsonl_rows(run) if "train/return" in row] and returns
        ids.append(run_id)
        records = wandb_records(next(folder.glob("run-*.wandb")))
        (record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (record.display_name, record.run_group) == (f"walker-seed{k}", "walker")
    assert ids[0] != ids[1]
