"""Which distributions a target machine lacks.

Walks requirements from healsweep's own (a wheel's Requires-Dist), with markers evaluated for the TARGET's Python
and platform (never this machine's), and stops at every requirement the target already satisfies: its
``pip freeze`` (or a names-only list, where a name without a version is an assumption that any version will do)
holds a version inside the specifier. Everything else is fetched (``Fetch``: a wheel for the target) and its own
Requires-Dist walked in turn. Pure: the fetcher is injected, so the walk is tested on a hand-made index.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


class BundleError(Exception):
    """A user-facing bundle problem: one line."""


@dataclass(frozen=True)
class Dist:
    """A wheel the builder picked for the target."""
    name: str  # canonical (PEP 503)
    version: Version
    requires: tuple[str, ...]  # its Requires-Dist lines
    path: Path | None = None


Fetch = Callable[[str, SpecifierSet], Dist]  # (canonical name, specifier) -> the target's newest wheel inside it


@dataclass
class Resolution:
    """The walk's answer: what to bundle, what the target already holds (and why), what it must upgrade."""
    bundle: dict[str, Dist] = field(default_factory=dict)  # name -> picked wheel, walk order
    satisfied: dict[str, str] = field(default_factory=dict)  # name -> the target's version, or "assumed"
    upgrades: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (target's version, bundled)
    excluded: set[str] = field(default_factory=set)  # requirement lines whose markers are false on the target


_FREEZE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def parse_freeze(text: str, source: str = "freeze") -> dict[str, Version | None]:
    """``pip freeze`` output (or a names-only list) -> canonical name -> version; None when the line names no
    version (``name``, ``name @ file://...``, ``-e ...#egg=name``): an assumption that any version satisfies."""
    present: dict[str, Version | None] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("-e") else raw.strip()
        if not line:
            continue
        if line.startswith("-e"):
            egg = re.search(r"#egg=([A-Za-z0-9._-]+)", line)
            if egg:
                present[canonicalize_name(egg.group(1))] = None
            continue
        m = _FREEZE_NAME.match(line)
        if not m:
            raise BundleError(f"{source}:{n}: not a package line: {raw.strip()!r}")
        name, rest = canonicalize_name(m.group(0)), line[m.end():].split(";", 1)[0].strip()
        if rest.startswith("[") and "]" in rest:  # extras in a names list: name[extra]==ver
            rest = rest[rest.index("]") + 1:].strip()
        version = _freeze_version(rest, source, n, raw)
        if version is not None or name not in present:  # a known version beats the same name listed without one
            present[name] = version
    return present


def _freeze_version(rest: str, source: str, n: int, raw: str) -> Version | None:
    if not rest or rest.startswith("@"):
        return None
    for op in ("===", "=="):
        if rest.startswith(op):
            try:
                return Version(rest[len(op):].strip())
            except InvalidVersion:
                raise BundleError(f"{source}:{n}: invalid version in {raw.strip()!r}") from None
    raise BundleError(f"{source}:{n}: expected NAME, NAME==VERSION or NAME @ URL, got {raw.strip()!r}")


_ARCHES = ("x86_64", "aarch64", "ppc64le", "s390x", "i686", "armv7l")


def target_environment(python: str, platform: str) -> dict[str, str]:
    """PEP 508 marker environment of a CPython ``python`` ("3.12" or "3.12.3") on wheel platform tag
    ``platform`` (manylinux_2_28_x86_64, manylinux2014_aarch64, ...): markers are evaluated for it."""
    if not re.fullmatch(r"3\.\d+(\.\d+)?", python):
        raise BundleError(f"--python: expected a CPython version like 3.12 or 3.12.3, got {python!r}")
    full = python if python.count(".") == 2 else python + ".0"
    if not platform.startswith(("manylinux", "musllinux", "linux")):
        raise BundleError(f"--platform: only Linux wheel tags are supported (manylinux_2_28_x86_64, ...), got {platform!r}")
    arch = next((a for a in _ARCHES if platform.endswith("_" + a)), None)
    if arch is None:
        raise BundleError(f"--platform {platform!r}: unknown architecture; expected one of {', '.join(_ARCHES)}")
    return {"python_version": ".".join(full.split(".")[:2]), "python_full_version": full, "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": arch,
            "platform_release": "", "platform_version": "", "implementation_name": "cpython",
            "implementation_version": full, "platform_python_implementation": "CPython", "extra": ""}


def wanted(req: Requirement, env: Mapping[str, str], extras: frozenset[str]) -> bool:
    """Whether requirement ``req`` of a distribution requested with ``extras`` applies on the target."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in ("", *sorted(extras)))


def parse_requirement(line: str, owner: str) -> Requirement:
    try:
        return Requirement(line)
    except InvalidRequirement as e:
        raise BundleError(f"{owner}: invalid requirement {line!r}: {e}") from None


def resolve(root: Dist, present: Mapping[str, Version | None], env: Mapping[str, str], fetch: Fetch,
            extras: frozenset[str] = frozenset(), rounds: int = 6) -> Resolution:
    """The wheels the target lacks to run ``root`` (requested with ``extras``). A version picked early that a later
    requirement rules out is re-picked inside both specifiers on the next round (up to ``rounds``)."""
    pins: dict[str, SpecifierSet] = {}
    for _ in range(rounds):
        conflict = _walk(root, present, env, fetch, extras, pins)
        if isinstance(conflict, Resolution):
            return conflict
        name, spec = conflict
        if pins.get(name) == spec:
            break
        pins[name] = spec
    raise BundleError(f"no single version of {name} satisfies {spec or 'its requirements'} (after {rounds} rounds)")


def _walk(root: Dist, present, env, fetch: Fetch, extras: frozenset[str], pins: dict[str, SpecifierSet]):
    res = Resolution(bundle={root.name: root})
    seen_extras: dict[str, frozenset[str]] = {root.name: extras}
    specs: dict[str, SpecifierSet] = {}
    queue = deque(_requirements(root, env, extras, res))
    while queue:
        req = queue.popleft()
        name = canonicalize_name(req.name)
        specs[name] = specs.get(name, SpecifierSet()) & req.specifier
        if name not in res.bundle and _satisfied(name, req.specifier, present, res):
            continue
        if name in res.bundle:
            dist = res.bundle[name]
            if not req.specifier.contains(dist.version, prereleases=True):
                return name, specs[name] & pins.get(name, SpecifierSet())
            new = frozenset(req.extras) - seen_extras[name]
            if new:
                seen_extras[name] |= new
                queue.extend(_requirements(dist, env, new, res))
            continue
        dist = _fetch(fetch, name, specs[name] & pins.get(name, SpecifierSet()), name in pins)
        if name in present and present[name] is not None:
            res.upgrades[name] = (str(present[name]), str(dist.version))
            res.satisfied.pop(name, None)  # an earlier, looser requirement is now met by the bundled version
        res.bundle[name] = dist
        seen_extras[name] = frozenset(req.extras)
        queue.extend(_requirements(dist, env, frozenset(req.extras), res))
    return res


def _fetch(fetch: Fetch, name: str, spec: SpecifierSet, repick: bool) -> Dist:
    try:
        return fetch(name, spec)
    except BundleError as e:
        if not repick:
            raise
        raise BundleError(f"no single version of {name} satisfies {spec} (several packages' requirements): {e}") from None


def _satisfied(name: str, spec: SpecifierSet, present, res: Resolution) -> bool:
    if name not in present:
        return False
    have = present[name]
    if have is None:
        res.satisfied[name] = "assumed"
        return True
    if spec.contains(have, prereleases=True):  # local versions (2.11.0+cu130) match their public part
        res.satisfied[name] = str(have)
        return True
    return False


def _requirements(dist: Dist, env, extras: frozenset[str], res: Resolution) -> list[Requirement]:
    out = []
    for line in dist.requires:
        req = parse_requirement(line, f"{dist.name} {dist.version}")
        if wanted(req, env, extras):
            out.append(req)
        else:
            res.excluded.add(f"{dist.name}: {line}")
    return out
