"""benchmarks/mutations.py, the mutation battery: its mechanics on a tiny stand-in repository (a module,
a test file and a mutation table of its own), that every mutation of the real table names reference tests that
exist in the fast tier and, in the slow tier, that every mutation still applies to this checkout (the one check
that reads product text verbatim: a comment or a reformatted line must not fail the fast tier; the battery itself
refuses a stale mutation in one line before it runs). Nothing here trains or imports the learner; the tests that
run the battery start pytest in copies of the stand-in (and git), so tests/conftest.py counts them slow."""

import ast
import hashlib
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

spec = importlib.util.spec_from_file_location("bench_mutations", ROOT / "benchmarks" / "mutations.py")
mutations = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutations)

# The names the battery promises (benchmarks/mutations.py's docstring and issue).
PROMISED = {"critic_no_grad", "actor_no_grad", "decoder_frozen", "reward_head_frozen", "continue_head_frozen",
            "kl_dropped", "return_norm_off", "slow_critic_frozen", "entropy_sign", "resume_no_optimizer",
            "replay_stuck", "latents_not_saved", "eval_fresh_weights"}

TINY = '''def add(a, b):
    return a + b


def scale(x):
    return 2 * x
'''

TINY_TESTS = '''import tiny


def test_scale_is_a_number():
    assert isinstance(tiny.scale(1), int)


def test_add():
    assert tiny.add(2, 3) == 5, "add is broken"
'''


def edit(file, old, new):
    return {"file": file, "old": old, "new": new}


ADD, SCALE = "tests/test_tiny.py::test_add", "tests/test_tiny.py::test_scale_is_a_number"
TABLE = [
    {"name": "add_subtracts", "slip": "add subtracts", "edits": [edit("tiny.py", "a + b", "a - b")],
     "caught_by": [ADD]},
    {"name": "scale_by_three", "slip": "scale by 3, untested", "edits": [edit("tiny.py", "2 * x", "3 * x")],
     "caught_by": [SCALE]},
    {"name": "colon_dropped", "slip": "a syntax slip", "edits": [edit("tiny.py", "def add(a, b):", "def add(a, b)")],
     "caught_by": [ADD]},
]


def stand_in(root, tests=TINY_TESTS):
    """A git repository at `root` with tiny.py and tests/test_tiny.py (untracked: .ci/run's selection
    takes untracked files that git does not ignore)."""
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    (root / "tiny.py").write_text(TINY)
    (root / "tests").mkdir()
    (root / "tests" / "test_tiny.py").write_text(tests)
    (root / ".gitignore").write_text("ignored.txt\n")
    (root / "ignored.txt").write_text("not copied\n")
    return root


@pytest.fixture
def quick(monkeypatch):
    """The stand-in's pytest runs need none of the plugins installed here (hypothesis's alone takes
    seconds to import); the battery passes its environment on."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture
def repo(tmp_path, quick):
    return stand_in(tmp_path / "repo")


def hashes(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.relative_to(root).parts}


def row(out, name):
    """The report line of a mutation."""
    lines = [line for line in out.splitlines() if line.split()[:1] == [name]]
    assert len(lines) == 1, out
    return lines[0]


# -- the real table ----------------------------------------------------------------------------------


def test_every_mutation_names_reference_tests_that_exist():
    """Each mutation's caught_by names test functions of this checkout's test files (read from their syntax,
    not run), and every promised mutation is in the table."""
    names = mutations.check_table(mutations.MUTATIONS)
    assert PROMISED <= set(names), sorted(PROMISED - set(names))
    for mutation in mutations.MUTATIONS:
        for test in mutation["caught_by"]:
            file, function = test.split("::")[:2]
            tree = ast.parse((ROOT / file).read_text())
            defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
            assert function.split("[")[0] in defined, (mutation["name"], test)


@pytest.mark.slow  # reads product lines verbatim: a rewording of them must not fail the fast tier
def test_every_mutation_of_the_table_applies_once_to_this_checkout():
    """Each edit's old text occurs exactly once in its file here (a rename in the product shows up
    here, not as a battery that silently passes), and every promised mutation is in the table."""
    names = mutations.check_table(mutations.MUTATIONS)
    assert PROMISED <= set(names), sorted(PROMISED - set(names))
    assert len(names) >= len(PROMISED) + 2
    for mutation in mutations.MUTATIONS:
        texts = mutations.edited_files(ROOT, mutation)
        for file, text in texts.items():
            assert text != (ROOT / file).read_text(), mutation["name"]
            if file.endswith(".py"):  # a behaviour change that still imports, not a syntax slip
                compile(text, f"{mutation['name']}: {file}", "exec")
        assert mutation["slip"] == " ".join(mutation["slip"].split()), mutation["name"]  # one line


# -- pure functions and the command line ----------------------------------------------------------------


@pytest.mark.parametrize("text, count", [("nothing here\n", 0), ("a + b\na + b\n", 2)])
def test_an_old_text_not_found_exactly_once_is_an_error_naming_mutation_and_file(text, count):
    with pytest.raises(mutations.BatteryError) as error:
        mutations.apply_edits({"tiny.py": text}, TABLE[0])
    message = str(error.value)
    assert "\n" not in message and "add_subtracts" in message and "tiny.py" in message
    assert f"occurs {count} times" in message


def test_edits_apply_in_order_and_leave_their_input_alone():
    texts = {"tiny.py": TINY}
    mutation = {"name": "twice", "slip": "x",
                "edits": [edit("tiny.py", "a + b", "a - b"), edit("tiny.py", "a - b", "b")]}
    assert "return b\n" in mutations.apply_edits(texts, mutation)["tiny.py"]
    assert texts == {"tiny.py": TINY}


def test_a_table_with_a_duplicate_name_or_an_empty_edit_is_refused():
    with pytest.raises(mutations.BatteryError, match="add_subtracts: the name is taken"):
        mutations.check_table([TABLE[0], TABLE[0]])
    with pytest.raises(mutations.BatteryError, match="changes nothing"):
        mutations.check_table([{"name": "same", "slip": "x", "edits": [edit("tiny.py", "a", "a")], "caught_by": [ADD]}])
    with pytest.raises(mutations.BatteryError, match="same: caught_by must name its reference tests"):
        mutations.check_table([{"name": "same", "slip": "x", "edits": [edit("tiny.py", "a", "b")]}])


def test_list_prints_one_name_a_line(capsys, tmp_path):
    assert mutations.main(["--list"], table=TABLE, root=tmp_path) == 0
    assert capsys.readouterr().out.splitlines() == ["add_subtracts", "scale_by_three", "colon_dropped"]


@pytest.mark.parametrize("argv, expected", [
    (["--only", "add_subtracts,nope"], "--only nope: no such mutation; valid: add_subtracts, scale_by_three, "
                                       "colon_dropped"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--pytest-args", "'unclosed"], "--pytest-args"),
])
def test_a_mistake_is_one_line_and_exit_status_2(capsys, tmp_path, argv, expected):
    assert mutations.main(argv, table=TABLE, root=tmp_path) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("mutations.py: ") and expected in err, err


def test_the_junit_report_gives_the_first_failing_test_and_its_line(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text('''<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
        failures="1" skipped="1" tests="4"><testcase classname="tests.test_a" file="tests/test_a.py" line="3"
        name="test_ok" time="0.1"/><testcase classname="tests.test_a.TestB" file="tests/test_a.py" line="9"
        name="test_b[x-1]" time="0.2"><failure message="AssertionError: the critic did not move&#10;assert 1 == 2">
        trace</failure></testcase></testsuite></testsuites>''')
    counts, first = mutations.read_junit(report)
    assert counts == {"tests": 4, "failures": 1, "errors": 0, "skipped": 1}
    assert first == ("failure", "tests/test_a.py::TestB::test_b[x-1]", "AssertionError: the critic did not move")


# -- the battery on the stand-in (pytest and git in subprocesses) ------------------------------------


def test_a_caught_an_escaped_and_a_collection_error_mutation_and_the_checkout_untouched(repo, capsys, tmp_path):
    before = hashes(repo)
    out_file = tmp_path / "report.md"
    assert mutations.main(["--out", str(out_file)], table=TABLE, root=repo) == 1  # one escaped
    out = capsys.readouterr().out
    assert hashes(repo) == before  # every mutation was made in a copy
    assert "passed" in row(out, "(clean)") and "2 passed" in row(out, "(clean)")
    caught = row(out, "add_subtracts")
    assert caught.split()[1] == "caught" and "caught (collection" not in caught
    assert "tests/test_tiny.py::test_add: AssertionError: add is broken" in caught
    assert row(out, "scale_by_three").split()[1] == "ESCAPED"
    weak = row(out, "colon_dropped")
    assert "caught (collection error)" in weak and "tests/test_tiny.py: SyntaxError" in weak, weak
    assert out.strip().splitlines()[-2].startswith("Totals: 3 mutations: 2 caught (1 by a collection error), "
                                                   "1 escaped, 0 errors")
    table = out_file.read_text()
    assert f"| add_subtracts | add subtracts | {ADD} | caught | tests/test_tiny.py::test_add |" in table
    assert "| scale_by_three |" in table and "ESCAPED" in table


def test_every_mutation_caught_exits_0_and_only_runs_a_subset(repo, capsys):
    assert mutations.main(["--only", "add_subtracts"], table=TABLE, root=repo) == 0
    out = capsys.readouterr().out
    assert "scale_by_three" not in out and "colon_dropped" not in out
    assert "Totals: 1 mutations: 1 caught (0 by a collection error), 0 escaped, 0 errors" in out


def test_a_failing_clean_copy_stops_before_any_mutation(tmp_path, capsys, quick):
    repo = stand_in(tmp_path / "repo", TINY_TESTS + "\n\ndef test_broken():\n    assert False, 'broken before'\n")
    assert mutations.main(["--fast-tier"], table=TABLE, root=repo) == 1
    out = capsys.readouterr().out
    clean = row(out, "(clean)")
    assert clean.split()[1] == "FAILED" and "tests/test_tiny.py::test_broken: AssertionError: broken before" in clean
    assert "no mutation was run" in out
    assert not any(m["name"] in out for m in TABLE)


def test_a_stale_old_text_stops_the_battery_with_one_line_before_running(repo, capsys):
    stale = [{"name": "renamed", "slip": "the product renamed it", "edits": [edit("tiny.py", "def plus(", "x")],
              "caught_by": [ADD]}]
    assert mutations.main([], table=stale, root=repo) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "renamed" in err and "tiny.py" in err and "0 times" in err
    twice = [{"name": "twice", "slip": "x", "edits": [edit("tiny.py", "return", "yield")], "caught_by": [ADD]}]
    assert mutations.main([], table=twice, root=repo) == 2
    assert "occurs 2 times in tiny.py" in capsys.readouterr().err


def test_the_copy_holds_the_repository_files_and_keep_keeps_it(repo, capsys):
    (repo / "tests" / "test_tiny.py").write_text(TINY_TESTS + "\n\ndef test_no_ignored_file():\n"
                                                 "    import pathlib\n"
                                                 "    assert not pathlib.Path('ignored.txt').exists()\n"
                                                 "    assert pathlib.Path('.gitignore').exists()\n")
    assert mutations.main(["--keep", "--fast-tier", "--only", "add_subtracts", "--pytest-args",
                           "-k 'test_add or ignored'"],
                          table=TABLE, root=repo) == 0
    out = capsys.readouterr().out
    assert "2 passed" in row(out, "(clean)")  # -k left test_scale_is_a_number out
    kept = pathlib.Path(out.strip().splitlines()[-1].split(" in ")[-1])
    try:
        copies = sorted(kept.glob("*/repo"))
        assert len(copies) == 2 and all(sorted(p.name for p in c.parent.iterdir()) == ["repo"] for c in copies)
        assert any("a - b" in (c / "tiny.py").read_text() for c in copies)
        assert (repo / "tiny.py").read_text() == TINY
    finally:
        shutil.rmtree(kept)
