"""configs.yaml, the file users edit, read by one loader (config.load_presets): every YAML or schema
mistake in it is one line, `configs.yaml:LINE: what is wrong`, exit 2, nothing written (issue 54,
items 2 and 4); presets given in several --configs stack in order (item 1)."""

import pathlib

import pytest

import config as cfg
import dreamer
import tools

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = (ROOT / "configs.yaml").read_text()


def line_of(text, fragment):
    """1-based line of the first line of `text` that starts with `fragment`, found without the loader."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(fragment))


def replaced(old, new):
    assert TEXT.count(old) >= 1, old
    return TEXT.replace(old, new, 1)


def cut_before(marker):
    lines = TEXT.splitlines(keepends=True)
    return "".join(lines[:next(i for i, line in enumerate(lines) if marker in line)])


# name: (the edited file's text, or None for no file; the line the message names, found in that text;
#        what else the message says)
CASES = {
    "a tab-indented key": (replaced("  batch_size: 10\n", "\tbatch_size: 10\n"), "\tbatch_size: 10", "tab"),
    "a missing space after a colon": (replaced("  batch_size: 10\n", "  batch_size:10\n"), "  batch_size:10",
                                      "a key without ': '"),
    "a duplicate key": (replaced("  batch_size: 10\n", "  batch_size: 10\n  batch_size: 12\n"),
                        "  batch_size: 12", "duplicate key 'batch_size'"),
    "an empty file": ("", None, "the file is empty"),
    "a comment only": ("# nothing\n", None, "the file is empty"),
    "a value of the wrong type in defaults": (replaced("  discount: 0.997 ", "  discount: high "), "  discount: high",
                                              "Invalid value 'high' for --discount; valid: a number in (0, 1]"),
    "a value of the wrong type in a preset": (replaced("  discount: 0.996997 ", "  discount: high "),
                                              "  discount: high", "'discount' in preset 'recipe2024': expected a "
                                                                  "number (its default is 0.997)"),
    "a preset that is not a mapping": (TEXT + "\nmine: 5\n", "mine: 5", "preset 'mine' is not a mapping"),
    "a misspelt key in a preset": (replaced("  batch_size: 10\n", "  batchsize: 10\n"), "  batchsize: 10",
                                   "unknown key 'batchsize' in preset 'debug' (closest valid: batch_size"),
    "a misspelt nested key in a preset": (replaced("actor: {layers: 1}", "actor: {layesr: 1}"), "  actor: {layesr",
                                          "unknown key 'actor.layesr' in preset 'debug' (closest valid: "
                                          "actor.layers"),
    "a choice that is not one": (replaced("  dyn_cell: 'blockgru'", "  dyn_cell: 'blockgr'"), "  dyn_cell: 'blockgr'",
                                 "valid: gru, blockgru"),
    "defaults cut short": (cut_before("# --- training ---"), "  initial: 'learned'", "more keys (cut short?)"),
    "a file cut inside a flow mapping": (cut_before("  decoder: {cnn_depth: 4") + "  decoder: {cnn_depth: 4, ml",
                                         "  decoder: {cnn_depth: 4, ml", "configs.yaml:"),
    "a missing file": (None, None, "not found"),
}


def write(tmp_path, text):
    path = tmp_path / "configs.yaml"
    if text is not None:
        path.write_text(text)
    return path


@pytest.mark.parametrize("case", CASES)
def test_every_mistake_in_configs_yaml_is_one_line_naming_the_file_and_line(tmp_path, case):
    text, fragment, says = CASES[case]
    with pytest.raises(tools.ConfigError) as error:
        cfg.load_presets(write(tmp_path, text))
    message = str(error.value)
    assert "\n" not in message and says in message, message
    if fragment is not None:  # the last line of the file when the cut is at its end
        line = line_of(text, fragment) if fragment in text else len(text.splitlines())
        assert message.startswith(f"configs.yaml:{line}: "), message
    else:
        assert message.startswith("configs.yaml:"), message


@pytest.mark.parametrize("case", ["a tab-indented key", "a value of the wrong type in defaults",
                                  "a misspelt key in a preset", "a missing file", "defaults cut short"])
def test_a_broken_configs_yaml_stops_the_script_in_one_line_with_exit_2_and_writes_nothing(tmp_path, monkeypatch,
                                                                                           capsys, case):
    monkeypatch.setattr(cfg, "CONFIG_FILE", write(tmp_path, CASES[case][0]))
    logdir = tmp_path / "run"
    for argv in (["--configs", "debug", "--logdir", str(logdir)], ["--help"], ["--configs", "debug", "--print_config"]):
        with pytest.raises(SystemExit) as stop:
            dreamer.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("error: configs.yaml:"), (argv, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if CASES[case][0] is None else ["configs.yaml"])


def test_the_shipped_configs_yaml_passes_its_own_checks():
    presets = cfg.load_presets()
    assert list(presets)[0] == "defaults" and "debug" in presets
    assert presets.where("debug", "batch_size") == f"configs.yaml:{line_of(TEXT, '  batch_size: 10')}"


def test_a_stacked_value_that_schema_refuses_names_the_line_of_the_preset_that_set_it(tmp_path):
    text = replaced("  batch_length: 20\n", "  batch_length: 0\n")
    presets = cfg.load_presets(write(tmp_path, text))  # a preset's own value: checked once the presets are stacked
    with pytest.raises(tools.ConfigError) as error:
        cfg.parse(["--configs", "debug"], presets)
    assert str(error.value).startswith(f"configs.yaml:{line_of(text, '  batch_length: 0')}: Invalid value '0' for "
                                       "--batch_length"), error.value
    assert "preset 'debug'" in str(error.value)
    # The same value from the command line is the command line's mistake: no file line.
    with pytest.raises(tools.ConfigError, match="^Invalid value '0' for --batch_length"):
        cfg.parse(["--configs", "debug", "--batch_length", "0"])
    assert cfg.parse(["--configs", "debug", "--batch_length", "5"], presets).batch_length == 5


def test_repeated_configs_flags_stack_in_order_like_one():
    once = cfg.parse(["--configs", "debug", "dmc_proprio"]).to_dict()
    assert cfg.parse(["--configs", "debug", "--configs", "dmc_proprio"]).to_dict() == once
    config = cfg.parse(["--configs", "dmc_proprio", "--configs", "debug"])  # later wins
    assert (config.steps, config.batch_size, config.envs) == (600, 10, 1)
    config = cfg.parse(["--configs", "debug", "--configs", "recipe2024", "--steps", "300", "--configs", "size1m"])
    assert (config.batch_size, config.dyn_cell, config.units, config.steps) == (10, "blockgru", 64, 300)
