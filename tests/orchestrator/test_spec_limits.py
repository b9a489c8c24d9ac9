"""Hostile and out-of-bounds specs: each is rejected by the real `healsweep validate` in one line, exit code 2,
before anything runs (YAML bombs, binary files, deep nesting, bad plugins, unbounded grids, duplicate keys, names
that cannot be paths, store URIs no filesystem opens, unreachable tracking servers, SQLite tracking stores in
a directory that does not exist)."""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.spec import SpecError, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
TINY = (REPO / "configs" / "tiny.yaml").read_text()
BASE = yaml.safe_load(TINY)


def healsweep() -> str:
    exe = Path(sys.executable).parent / "healsweep"
    return str(exe) if exe.is_file() else shutil.which("healsweep")


def validate(path: Path, timeout: float = 120) -> tuple[int, str, str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    r = subprocess.run([healsweep(), "validate", str(path)], capture_output=True, text=True, timeout=timeout, env=env)
    return r.returncode, r.stdout, r.stderr, time.perf_counter() - t0


def assert_one_line_error(path: Path, words: str, max_s: float | None = None) -> str:
    code, out, err, secs = validate(path)
    assert code == 2, (code, out, err[-2000:])
    assert err.count("\n") == 1 and err.startswith("healsweep: error: ") and "Traceback" not in err, err[-2000:]
    assert len(err) < 400, f"error message of {len(err)} characters"
    assert words in err, err
    if max_s is not None:
        assert secs < max_s, f"took {secs:.1f} s"
    return err


def write(tmp_path: Path, d: dict | str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(d if isinstance(d, str) else yaml.safe_dump(d))
    return p


def mutated(**top) -> dict:
    d = copy.deepcopy(BASE)
    d.update(top)
    return d


BOMB = """name: tiny
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
"""


def test_billion_laughs_is_refused_quickly_and_never_echoed(tmp_path):
    err = assert_one_line_error(write(tmp_path, BOMB), "YAML nodes through aliases", max_s=60)
    assert "lol" not in err
    hidden = TINY + 'mlflow:\n  experiment: &x ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' \
                    "seeds: [*x, *x, *x, *x, *x, *x, *x, *x, *x, *x]\n"
    p = write(tmp_path, hidden, "hidden.yaml")
    with pytest.raises(SpecError) as e:  # few aliases, small expansion: an ordinary type error, quoted briefly
        load_spec(p)
    assert len(str(e.value)) < 300


def test_many_aliases_are_refused(tmp_path):
    text = TINY + "x: &x 1\nseeds: [" + ", ".join(["*x"] * 150) + "]\n"
    assert_one_line_error(write(tmp_path, text), "more than 100 YAML aliases")


def test_large_binary_and_deep_files(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(TINY + "#" * (1 << 20) + "\n")
    assert_one_line_error(big, "at most 1048576 bytes")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: tiny\n\xff\xfe\x00\x81garbage")
    assert_one_line_error(binary, "not UTF-8 text")
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: " + "[" * 20_000 + "\n")
    assert_one_line_error(deep, "nested deeper than 50 levels", max_s=60)


def test_duplicate_keys_top_level_and_nested(tmp_path):
    assert_one_line_error(write(tmp_path, TINY + "name: other\n"), "duplicate key 'name' at line")
    nested = TINY.replace("  trials_per_cell: 2\n", "  trials_per_cell: 2\n  trials_per_cell: 3\n")
    assert_one_line_error(write(tmp_path, nested, "n.yaml"), "duplicate key 'trials_per_cell' at line")


@pytest.mark.parametrize("plugins, words", [([""], "must be an absolute module name"),
                                            ([".relative_mod"], "must be an absolute module name"),
                                            (["no_such_module_xyz"], "cannot import module")])
def test_bad_plugins(tmp_path, plugins, words):
    err = assert_one_line_error(write(tmp_path, mutated(plugins=plugins)), words)
    assert "plugins[0]" in err


@pytest.mark.parametrize("top, field, words", [
    ({"seeds": [1e20]}, "seeds[0]", "must be an integer"),
    ({"seeds": [2**32]}, "seeds[0]", "must be <= 4294967295"),
    ({"name": "x" * 300}, "name", "at most 64 characters"),
    ({"name": "../etc"}, "name", "must be letters, digits"),
    ({"mlflow": {"experiment": ""}}, "mlflow.experiment", "must be a non-empty string"),
    ({"mlflow": {"experiment": 7, "tracking_uri": 42}}, "mlflow.experiment", "must be a non-empty string"),
    ({"mlflow": {"tracking_uri": 42}}, "mlflow.tracking_uri", "must be a non-empty string"),
    ({"store": {"uri": "nosuch://bucket/x"}}, "store.uri", "unknown scheme nosuch://"),
    # tracking stores the sweep could not open: they passed, and the sweep died after its dense and mask stages
    ({"mlflow": {"tracking_uri": "foo://bar"}}, "mlflow.tracking_uri", "'foo://bar': unknown scheme 'foo'; allowed:"),
    ({"mlflow": {"tracking_uri": "file:///tmp/m"}}, "mlflow.tracking_uri", "MLflow's file store is not supported"),
    ({"mlflow": {"tracking_uri": "runs/m"}}, "mlflow.tracking_uri", "MLflow's file store is not supported"),
    ({"mlflow": {"tracking_uri": "postgresql+psycopg://u:p@127.0.0.1:1/db"}}, "mlflow.tracking_uri",
     "cannot reach 127.0.0.1:1 within 3 s (Connection refused); start the tracking database"),
    ({"sparsities": [i / 2000 for i in range(1001)]}, "sparsities", "at most 1000 are allowed"),
    ({"search": {"trials_per_cell": 1e9}}, "search.trials_per_cell", "must be an integer"),
    ({"search": {"trials_per_cell": 20_000}}, "search.trials_per_cell", "must be <= 10000"),
    ({"search": {"epochs": [1, 10**9]}}, "search.epochs[1]", "must be <= 10000"),
    ({"search": {"lr": [1e-4, 1e300]}}, "search.lr[1]", "must be <= 10"),  # validated, every trial diverged
    ({"grids": [{"name": "g", "search": {"lr": [20, 30]}}]}, "grids[0].search.lr[0]", "must be <= 10"),
    ({"sparsities": [i / 1000 for i in range(1000)], "seeds": list(range(30))}, "spec", "at most 100000 are allowed"),
])
def test_specs_that_cannot_run_are_rejected_by_the_cli(tmp_path, top, field, words):
    err = assert_one_line_error(write(tmp_path, mutated(**top)), words)
    assert err.startswith(f"healsweep: error: {field}: "), err


def test_sqlite_tracking_store_in_a_missing_directory_is_one_line(tmp_path, monkeypatch):
    """SQLite creates a database file, never its directory: a spec's tracking URI or MLFLOW_TRACKING_URI (the
    sweep's fallback when the spec names none) into a directory that does not exist is refused before anything
    runs, naming where the URI came from; an existing directory passes."""
    missing = tmp_path / "no" / "such" / "dir" / "mlflow.db"
    err = assert_one_line_error(write(tmp_path, mutated(mlflow={"tracking_uri": f"sqlite:///{missing}"})),
                                "does not exist")
    assert err.startswith("healsweep: error: mlflow.tracking_uri: ") and str(missing.parent) in err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{missing}")
    err = assert_one_line_error(write(tmp_path, mutated()), "does not exist")
    assert err.startswith("healsweep: error: MLFLOW_TRACKING_URI: ")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert validate(write(tmp_path, mutated()))[0] == 0


def test_trial_bound_can_be_raised_deliberately(monkeypatch):
    big = mutated(sparsities=[i / 1000 for i in range(1000)], seeds=list(range(30)))
    with pytest.raises(SpecError, match="up to 120000 trials"):
        parse_spec(big)
    monkeypatch.setenv("HEALSWEEP_MAX_TRIALS", "200000")
    assert len(parse_spec(big).sparsities) == 1000


def test_unreachable_tracking_server_is_one_line_within_seconds(tmp_path):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = assert_one_line_error(write(tmp_path, mutated(mlflow={"tracking_uri": f"http://127.0.0.1:{port}"})),
                                f"cannot reach 127.0.0.1:{port}", max_s=60)
    assert "mlflow.tracking_uri" in err


def test_a_directory_given_as_the_spec_is_named_so(tmp_path):
    with pytest.raises(SpecError, match="spec: a directory, not a spec file: "):  # was "file not found"
        load_spec(tmp_path)


def test_relative_store_uri_is_resolved_against_the_spec_file(tmp_path, monkeypatch):
    sub = tmp_path / "specs"
    sub.mkdir()
    p = write(sub, mutated(store={"uri": "targets/here"}))
    monkeypatch.chdir(tmp_path)
    assert load_spec(p).store.uri == str(sub / "targets" / "here")
    # a parsed document (no file) resolves against the current directory; URIs pass unchanged
    assert parse_spec(mutated(store={"uri": "t"})).store.uri == str(tmp_path / "t")
    assert parse_spec(mutated(store={"uri": "s3://bucket/t"})).store.uri == "s3://bucket/t"
    assert parse_spec(mutated(store={"uri": str(tmp_path / "abs")})).store.uri == str(tmp_path / "abs")
    (tmp_path / "afile").write_text("x")  # `validate` said ok, `run` refused it after Ray had started
    for uri, why in (("afile", "is a file, not a directory"), ("afile/sub", "which is a file, not a directory")):
        with pytest.raises(SpecError, match=f"store.uri: .*{why}"):
            parse_spec(mutated(store={"uri": uri}))


def test_peak_request_names_the_largest_placement():
    s = parse_spec(mutated(resources={"cpus_per_trial": 3, "cpus_per_dense_task": 5, "gpus_per_trial": 0.5}))
    assert s.resources.peak_request() == {"CPU": 5.0, "GPU": 0.5}


@pytest.mark.parametrize("args", [["--help"], ["validate", "BAD"], ["validate", "BOMB"]])
def test_help_and_bad_specs_answer_without_importing_torch(tmp_path, args):
    """Start-up stays light: the console script imports torch only once a spec has passed every check that
    needs no registry (a regression here costs seconds on every --help and every typo)."""
    paths = {"BAD": write(tmp_path, mutated(seeds=[-1]), "bad.yaml"), "BOMB": write(tmp_path, BOMB, "bomb.yaml")}
    argv = [str(paths.get(a, a)) for a in args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-X", "importtime", healsweep(), *argv], capture_output=True, text=True,
                       timeout=120, env=env)
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert r.returncode == (0 if args == ["--help"] else 2), r.stderr[-2000:]
    assert "orchestrator.cli" in imported  # the measurement saw the project's imports
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "ray", "mlflow", "timm", "sklearn", "pyarrow"))
    assert not heavy, heavy[:10]


def test_a_method_check_quoting_a_long_value_stays_short():
    grid = [1.0 - i / 1000 for i in range(900)]  # decreasing: rr's own check quotes the whole grid
    with pytest.raises(SpecError) as e:
        parse_spec(mutated(pruners=[{"name": "rr", "settings": {"grid": grid}}]))
    assert e.value.path == "pruners[0].settings" and "strictly increasing" in str(e.value)
    assert len(e.value.message) <= 300 and "\n" not in str(e.value)


def test_the_spec_reference_in_docs_usage_validates_as_written():
    """docs/usage.md's annotated spec (every top-level key a user can give) is a spec that validates."""
    import re

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "docs" / "usage.md").read_text().split("## The spec", 1)[1]
    raw = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    spec = parse_spec(raw, base_dir=repo)
    assert {"data_seed", "offline", "calib_seed", "grids", "search", "heal"} <= set(raw) and spec.grids
