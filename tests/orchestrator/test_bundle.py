"""healsweep bundle: the missing-set walk on hand-written freezes (target markers, local versions, extras, upgrades,
re-picks), slimmed wheels that pip still installs, and a whole bundle of small wheels built here, fetched by the
real ``pip download`` from a local directory (no network), installed by install.py with no index."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from orchestrator.bundle.build import BundleRequest, build_bundle
from orchestrator.bundle.fetch import manylinux_platforms, read_wheel
from orchestrator.bundle.resolve import BundleError, Dist, parse_freeze, resolve, target_environment
from orchestrator.bundle.slim import record_line, slim_wheel, strip_tool

HERE_PY = f"{sys.version_info[0]}.{sys.version_info[1]}"
OTHER_PY = "3.12" if HERE_PY != "3.12" else "3.11"


def make_wheel(where: Path, name: str, version: str, requires=(), files: dict[str, bytes] | None = None) -> Path:
    """A valid pure wheel ``name-version-py3-none-any.whl`` with a package ``name`` (or ``files``)."""
    files = dict(files or {f"{name}/__init__.py": f"VERSION = {version!r}\n".encode()})
    info = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    files[f"{info}/METADATA"] = meta.encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(record_line(n, d) + "\n" for n, d in files.items()) + f"{info}/RECORD,,\n"
    path = where / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{info}/RECORD", record)
    return path


class FakeIndex:
    """An index held in memory: name -> {version: requires}; fetch picks the newest inside the specifier."""

    def __init__(self, dists: dict[str, dict[str, tuple[str, ...]]]):
        self.dists, self.calls = dists, []

    def __call__(self, name: str, spec: SpecifierSet) -> Dist:
        self.calls.append((name, str(spec)))
        versions = [Version(v) for v in self.dists.get(name, {}) if spec.contains(v, prereleases=True)]
        if not versions:
            raise BundleError(f"no {name}{spec}")
        v = max(versions)
        return Dist(name, v, self.dists[name][str(v)])


ENV312 = target_environment("3.12", "manylinux_2_28_x86_64")


def root(*requires: str) -> Dist:
    return Dist("app", Version("1.0"), requires)


def test_freeze_lines_local_versions_urls_editables_and_names():
    got = parse_freeze("# comment\ntorch==2.11.0+cu130\nFoo_Bar==1.2\nbaz @ file:///tmp/baz-1.0-py3-none-any.whl\n"
                       "-e git+https://x/y.git@abc#egg=my_pkg\nplain\n\nnumpy===2.5.2\nnumpy\n", "f.txt")
    assert got == {"torch": Version("2.11.0+cu130"), "foo-bar": Version("1.2"), "baz": None, "my-pkg": None,
                   "plain": None, "numpy": Version("2.5.2")}  # a later bare name keeps the known version
    assert parse_freeze("ray[tune]==2.60.0\n") == {"ray": Version("2.60.0")}
    with pytest.raises(BundleError, match=r"f.txt:2: expected NAME"):
        parse_freeze("ok==1\nbad>=1\n", "f.txt")


def test_walk_stops_at_present_versions_and_fetches_the_rest():
    index = FakeIndex({"b": {"1.0": (), "2.5": ("g>=1",)}, "g": {"1.0": ()}, "a": {"9.0": ("never",)}})
    present = parse_freeze("A==1.5\nb==1.0\ntorch==2.11.0+cu130\nfoo-bar==3\n")
    res = resolve(root("a>=1", "b>=2", "torch>=2.4,==2.11.*", "Foo_Bar>=2"), present, ENV312, index)
    assert list(res.bundle) == ["app", "b", "g"]  # a, torch and foo-bar present; g is b's requirement
    assert res.satisfied == {"a": "1.5", "torch": "2.11.0+cu130", "foo-bar": "3"}
    assert res.upgrades == {"b": ("1.0", "2.5")}
    assert ("a", ">=1") not in index.calls  # a present one is never fetched, nor descended into
    later = resolve(root("b>=1", "c"), present, ENV312, FakeIndex({**index.dists, "c": {"1": ("b>=2",)}}))
    assert later.upgrades == {"b": ("1.0", "2.5")} and "b" not in later.satisfied


def test_cli_says_what_is_missing_in_one_line(tmp_path, capsys):
    from orchestrator.cli import main

    assert main(["bundle", "--python", "3.12", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("healsweep: error: say what the target holds: --freeze FILE (its pip "
                                               "freeze), --assume-present FILE or --present NAME")
    assert main(["bundle", "--python", "3.12", "--freeze", str(tmp_path / "nope.txt"), "--out", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
    for bad in ("nan", "0", "inf"):  # nan compared False with every size: the limit was silently ignored
        assert main(["bundle", "--python", "3.12", "--present", "torch", "--out", str(tmp_path), "--max-mb", bad]) == 2
        assert capsys.readouterr().err.strip() == f"healsweep: error: --max-mb must be a positive number of MB, got {bad}"
    # were tracebacks: --out a file, a missing or broken --healsweep-wheel, a freeze file that is not text
    (tmp_path / "afile").write_text("x")
    (tmp_path / "junk.whl").write_bytes(b"not a zip")
    (tmp_path / "freeze.bin").write_bytes(b"torch==2\xff\xfe\n")
    base = ["bundle", "--python", "3.12", "--no-index", "--strip", "none"]
    for extra, line in (
            (["--present", "torch", "--out", str(tmp_path / "afile")], f"--out: {tmp_path / 'afile'} is a file"),
            (["--present", "torch", "--out", str(tmp_path / "o1"), "--healsweep-wheel", str(tmp_path / "no.whl")],
             f"--healsweep-wheel {tmp_path / 'no.whl'}: no such file"),
            (["--present", "torch", "--out", str(tmp_path / "o2"), "--healsweep-wheel", str(tmp_path / "junk.whl")],
             "junk.whl: not a wheel (BadZipFile)"),
            (["--freeze", str(tmp_path / "freeze.bin"), "--out", str(tmp_path / "o3")],
             f"{tmp_path / 'freeze.bin'} is not a text file (not UTF-8)")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"healsweep: error: {line}"), err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("o")]  # no --out directory left behind


def test_markers_are_evaluated_for_the_target_not_this_machine():
    index = FakeIndex({"old": {"1": ()}, "new": {"1": ()}, "win": {"1": ()}, "arm": {"1": ()}})
    reqs = ('old; python_version < "3.12"', 'new; python_version >= "3.12"', 'win; sys_platform == "win32"',
            'arm; platform_machine == "aarch64"')
    res = resolve(root(*reqs), {}, ENV312, index)
    assert set(res.bundle) == {"app", "new"}
    arm = resolve(root(*reqs), {}, target_environment("3.11", "manylinux_2_17_aarch64"), FakeIndex(index.dists))
    assert set(arm.bundle) == {"app", "old", "arm"}
    assert "app: win; sys_platform == \"win32\"" in res.excluded


def test_extras_pull_their_requirements_also_when_requested_later():
    index = FakeIndex({"d": {"1.0": ('e; extra == "x1"', 'f; extra == "other"')}, "e": {"1": ()}, "f": {"1": ()},
                       "c": {"1": ("d[x1]",)}})
    res = resolve(root("d", "c"), {}, ENV312, index)
    assert set(res.bundle) == {"app", "d", "c", "e"}  # x1 asked for by c after d was picked without extras
    assert resolve(root("d[x1]"), {}, ENV312, FakeIndex(index.dists), extras=frozenset()).bundle.keys() >= {"e"}


def test_a_later_tighter_requirement_repicks_inside_both_specifiers():
    index = FakeIndex({"h": {"2.0": (), "3.0": ()}, "c": {"1": ("h<3",)}})
    res = resolve(root("h", "c"), {}, ENV312, index)
    assert res.bundle["h"].version == Version("2.0")
    with pytest.raises(BundleError, match="no single version of h"):
        resolve(root("h>=3", "c"), {}, ENV312, FakeIndex(index.dists))


def test_names_without_versions_are_assumptions():
    res = resolve(root("torch>=99", "numpy<1"), parse_freeze("torch\nnumpy\n"), ENV312, FakeIndex({}))
    assert res.satisfied == {"torch": "assumed", "numpy": "assumed"} and list(res.bundle) == ["app"]


def test_target_environment_and_platform_tags():
    env = target_environment("3.12.3", "manylinux2014_aarch64")
    assert (env["python_version"], env["python_full_version"], env["platform_machine"]) == ("3.12", "3.12.3", "aarch64")
    for bad in (("3", "manylinux_2_28_x86_64"), ("3.12", "win_amd64"), ("3.12", "manylinux_2_28_sparc")):
        with pytest.raises(BundleError):
            target_environment(*bad)
    tags = manylinux_platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and {"manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    arm = manylinux_platforms("manylinux_2_17_aarch64")
    assert "manylinux2014_aarch64" in arm and not [t for t in arm if t.startswith(("manylinux1", "manylinux2010"))]


def _elf_with_symbols(tmp: Path) -> bytes | None:
    if shutil.which("gcc") is None:
        return None
    src = tmp / "x.c"
    src.write_text("static int helper(int x) { return x * 3; }\nint exported(int x) { return helper(x) + 1; }\n")
    subprocess.run(["gcc", "-g", "-shared", "-fPIC", "-o", str(tmp / "x.so"), str(src)], check=True)
    return (tmp / "x.so").read_bytes()


def test_slimmed_wheel_drops_rays_jars_strips_binaries_and_pip_installs_it(tmp_path):
    elf = _elf_with_symbols(tmp_path)
    if elf is None:
        pytest.skip("no gcc to build an ELF file with debug sections")
    files = {"ray/__init__.py": b"X = 1\n", "ray/jars/ray_dist.jar": b"J" * 5000,
             "ray/dashboard/client/build/index.html": b"<html>", "ray/_x.so": elf}
    src = make_wheel(tmp_path, "ray", "2.60.0", files=files)
    (tmp_path / "slim").mkdir()
    out = tmp_path / "slim" / src.name
    rep = slim_wheel(src, out, "ray", (strip_tool(), "unneeded"))
    assert (rep.dropped, rep.stripped) == (2, 1) and rep.saved_by_drop == 5006 and rep.saved_by_strip > 0
    with zipfile.ZipFile(out) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
        assert not [n for n in z.namelist() if "/jars/" in n or "/build/" in n]
        assert len(z.read("ray/_x.so")) < len(elf)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "-q", "--target",
                           str(tmp_path / "site"), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr  # pip checks every file against the rewritten RECORD
    nm = subprocess.run(["nm", "-D", str(tmp_path / "site" / "ray" / "_x.so")], capture_output=True, text=True)
    assert "exported" in nm.stdout  # the dynamic symbols stay


def _bundle(tmp_path: Path, python: str, log: list[str]) -> Path:
    links = tmp_path / "links"
    links.mkdir(exist_ok=True)
    own = make_wheel(tmp_path, "fakeapp", "0.1", requires=["fakedep>=1", "presentpkg>=2", 'skipped; python_version < "3"'])
    make_wheel(links, "fakedep", "1.0")
    make_wheel(links, "fakedep", "1.1", requires=["fakeleaf"])
    make_wheel(links, "fakeleaf", "0.3")
    req = BundleRequest(python=python, platform="manylinux_2_28_x86_64", present_text="presentpkg==2.0+local\n",
                        present_source="freeze.txt", out=tmp_path / f"out{python}", preset=0, strip="none",
                        index_args=("--no-index", "--find-links", str(links)), own_wheel=own,
                        check_imports=("fakeapp", "fakedep", "fakeleaf"))
    return build_bundle(req, tmp_path, log.append).archive


def _install(archive: Path, *args: str, image: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": str(image)} if image else {})
    return subprocess.run([sys.executable, str(archive.parent / "install.py"), str(archive), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_bundle_of_small_wheels_installs_with_no_index(tmp_path):
    log: list[str] = []
    archive = _bundle(tmp_path, HERE_PY, log)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        manifest = json.load(tar.extractfile("healsweep-offline/manifest.json"))
        packed = {w["file"]: tar.extractfile(f"healsweep-offline/wheels/{w['file']}").read() for w in manifest["wheels"]}
    assert all((w["size"], w["sha256"]) == (len(packed[w["file"]]), hashlib.sha256(packed[w["file"]]).hexdigest())
               for w in manifest["wheels"])
    assert {w["file"] for w in manifest["wheels"]} == {"fakeapp-0.1-py3-none-any.whl", "fakedep-1.1-py3-none-any.whl",
                                                       "fakeleaf-0.3-py3-none-any.whl"}
    assert "healsweep-offline/install.py" in names and manifest["target"]["python"] == HERE_PY
    assert manifest["satisfied_by_target"] == {"presentpkg": "2.0+local"}
    assert len(manifest["present"]["sha256"]) == 64
    proc = _install(archive, "--target", str(tmp_path / "site"))  # the machine lacks presentpkg: pip check says so
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "install.py: problem: pip check: fakeapp 0.1 requires presentpkg, which is not installed.")
    image = tmp_path / "image"  # the target's own packages
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--target", str(image),
                    str(make_wheel(tmp_path, "presentpkg", "2.0+local"))], check=True)
    proc = _install(archive, "--target", str(tmp_path / "site"), image=image)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok: 3 wheels installed" in proc.stdout
    assert (tmp_path / "site" / "fakeleaf" / "__init__.py").read_text() == "VERSION = '0.3'\n"
    assert any("missing set: 3 wheels" in line for line in log)


def test_installer_refuses_an_altered_wheel_and_another_python(tmp_path):
    archive = _bundle(tmp_path, HERE_PY, [])
    work = tmp_path / "x"
    with tarfile.open(archive) as tar:
        tar.extractall(work)
    whl = next((work / "healsweep-offline" / "wheels").glob("fakeleaf-*.whl"))
    whl.write_bytes(whl.read_bytes() + b"x")
    bad = tmp_path / "bad.tar.xz"
    with tarfile.open(bad, "w:xz") as tar:
        tar.add(work / "healsweep-offline", arcname="healsweep-offline")
    shutil.copy(archive.parent / "install.py", tmp_path / "install.py")
    proc = _install(bad, "--target", str(tmp_path / "site"))
    assert proc.returncode == 2 and f"sha256 mismatch: {whl.name}" in proc.stderr
    assert not (tmp_path / "site").exists()  # nothing installed
    other = _bundle(tmp_path, OTHER_PY, [])
    proc = _install(other, "--target", str(tmp_path / "site2"))
    assert proc.returncode == 2 and f"the bundle is for Python {OTHER_PY}" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_read_wheel_and_a_bundle_over_the_size_limit(tmp_path):
    whl = make_wheel(tmp_path, "Some_Thing", "1.2", requires=["x>=1"])
    assert read_wheel(whl) == Dist("some-thing", Version("1.2"), ("x>=1",), whl)
    (tmp_path / "links").mkdir()
    req = BundleRequest(python=HERE_PY, platform="manylinux_2_28_x86_64", present_text="x==1\n", present_source="f",
                        out=tmp_path / "o", preset=0, strip="none", max_mb=0.000001,
                        index_args=("--no-index", "--find-links", str(tmp_path / "links")), own_wheel=whl)
    with pytest.raises(BundleError, match=r"over --max-mb 1e-06 \(kept"):
        build_bundle(req, tmp_path, lambda s: None)
    assert (tmp_path / "o" / "healsweep-offline.tar.xz").is_file()
