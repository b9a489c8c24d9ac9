"""Build an offline bundle: healsweep's wheel, the missing set for the target, slimmed and packed."""
from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from packaging.version import Version

from orchestrator.bundle.fetch import build_own_wheel, manylinux_platforms, pip_fetcher, read_wheel
from orchestrator.bundle.pack import Manifest, Present, Target, wheel_entry, write_archive
from orchestrator.bundle.resolve import BundleError, Fetch, Resolution, parse_freeze, resolve, target_environment
from orchestrator.bundle.slim import slim_wheel, strip_tool

# What the installer imports on the target to call the install good: a sweep's driver and trial dependencies.
CHECK_IMPORTS = ("ray", "ray.tune", "optuna", "mlflow", "mlflow.store.tracking.sqlalchemy_store", "orchestrator.cli")


@dataclass(frozen=True)
class BundleRequest:
    python: str  # target CPython, "3.12" or "3.12.3"
    platform: str  # wheel platform tag, e.g. manylinux_2_28_x86_64
    present_text: str  # the target's pip freeze and/or names-only list, concatenated
    present_source: str  # where present_text came from (manifest)
    out: Path  # directory: OUT/NAME.tar.xz and OUT/install.py
    name: str = "healsweep-offline"
    extras: frozenset[str] = frozenset()  # healsweep extras to include (e.g. hub)
    max_mb: float = 40.0
    preset: int = 9
    strip: str = "unneeded"  # slim.STRIP_MODES
    index_args: tuple[str, ...] = ()  # e.g. ("--no-index", "--find-links", DIR) or ("--index-url", URL)
    own_wheel: Path | None = None  # a prebuilt healsweep wheel instead of building one from the checkout
    check_imports: tuple[str, ...] = CHECK_IMPORTS


@dataclass(frozen=True)
class BundleResult:
    archive: Path
    size: int
    resolution: Resolution
    fetched_bytes: int  # the missing set's wheels as downloaded
    stored_bytes: int  # after slimming, uncompressed


def build_bundle(req: BundleRequest, repo: Path, log: Callable[[str], None], fetch: Fetch | None = None) -> BundleResult:
    """Build ``req.out/req.name.tar.xz``; ``fetch`` defaults to ``pip download`` for the target."""
    env = target_environment(req.python, req.platform)
    present = parse_freeze(req.present_text, req.present_source)
    strip = (strip_tool(), req.strip) if req.strip != "none" else None
    req.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="healsweep-bundle-", dir=req.out) as tmp:
        work = Path(tmp)
        own = req.own_wheel or build_own_wheel(repo, work / "own", log)
        platforms = manylinux_platforms(req.platform)
        mm = env["python_version"]
        fetch = fetch or pip_fetcher(work / "fetched", mm, platforms, req.index_args, log)
        log(f"walk healsweep's requirements for CPython {mm} on {req.platform} against {len(present)} present packages")
        res = resolve(read_wheel(own), present, env, fetch, req.extras)
        _log_resolution(res, log)
        wheels, entries = _slim_all(res, work / "slim", strip, log)
        manifest = Manifest(Target(mm, tuple(platforms), env), _present(req, present), entries,
                            roots=[f"healsweep{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}"],
                            check_imports=req.check_imports, satisfied=res.satisfied, upgrades=res.upgrades)
        archive = req.out / f"{req.name}.tar.xz"
        size = write_archive(archive, manifest, wheels, req.preset, log)
        fetched = sum(d.path.stat().st_size for d in res.bundle.values())
        stored = sum(p.stat().st_size for p in wheels)
    log(f"bundle: {archive} {size / 1e6:.1f} MB ({len(wheels)} wheels: {fetched / 1e6:.1f} MB as fetched, "
        f"{stored / 1e6:.1f} MB slimmed and stored); installer: {req.out / 'install.py'}")
    if size > req.max_mb * 1e6:
        raise BundleError(f"bundle {archive} is {size / 1e6:.1f} MB, over --max-mb {req.max_mb:g} "
                          "(kept; see the missing set above, or raise --max-mb)")
    return BundleResult(archive, size, res, fetched, stored)


def _present(req: BundleRequest, present: dict[str, Version | None]) -> Present:
    digest = hashlib.sha256(req.present_text.encode()).hexdigest()
    return Present(req.present_source, digest, {n: (str(v) if v is not None else None) for n, v in present.items()})


def _log_resolution(res: Resolution, log) -> None:
    log(f"missing set: {len(res.bundle)} wheels; {len(res.satisfied)} requirements satisfied by the target"
        f" ({sum(v == 'assumed' for v in res.satisfied.values())} of them assumed: listed without a version)")
    for name, (old, new) in sorted(res.upgrades.items()):
        log(f"  upgrade: target holds {name} {old}, too old for a requirement; bundling {new}")


def _slim_all(res: Resolution, dest: Path, strip: tuple[str, str] | None, log) -> tuple[list[Path], list[dict]]:
    dest.mkdir(parents=True, exist_ok=True)
    wheels, entries = [], []
    for dist in res.bundle.values():
        out = dest / dist.path.name
        rep = slim_wheel(dist.path, out, dist.name, strip)
        if rep.stripped or rep.dropped:
            log(f"  slim {dist.path.name}: {rep.stripped} binaries stripped (-{rep.saved_by_strip / 1e6:.1f} MB), "
                f"{rep.dropped} files dropped (-{rep.saved_by_drop / 1e6:.1f} MB)")
        wheels.append(out)
        entries.append(wheel_entry(out, dist.name, str(dist.version), dist.requires))
    return wheels, entries


def read_present(freeze: Sequence[Path], lists: Sequence[Path], names: Sequence[str]) -> tuple[str, str]:
    """(text, source) of everything said to be present: freeze files, names-only list files, --present names."""
    parts, sources = [], []
    for path in (*freeze, *lists):
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise BundleError(f"cannot read {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise BundleError(f"{path} is not a text file (not UTF-8): give the target's `pip freeze` output") from None
        sources.append(path.name)
    if names:
        parts.append("\n".join(names))
        sources.append("--present")
    if not parts:
        raise BundleError("say what the target holds: --freeze FILE (its pip freeze), --assume-present FILE or --present NAME")
    return "\n".join(parts) + "\n", " + ".join(sources)
