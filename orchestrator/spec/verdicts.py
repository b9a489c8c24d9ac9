"""A cache of model/method compatibility verdicts, so that re-validating a spec does not rebuild its models.

Checking that a scope exists and that every pruner and healer can serve a model needs the model's architecture,
and building one imports timm (and through it torchvision and torch._dynamo): about 2.3 s of the 4.5 s that
``healsweep validate configs/default.yaml`` took on 2 cores. The verdict of those checks is a pure function of
the model entry, the spec entries that apply to it and the code that checks them, so it is cached under a key
made of exactly those: the model's reference, its scope, every pruner/healer entry that applies to it (with its
position in the spec, which error messages quote), the sha256 of every source file under ``tasks/`` and
``orchestrator/spec/`` and the installed versions of torch, timm and torchvision. Change any of them and the
checks run again. Both verdicts are cached: "ok" and the exact ``SpecError`` (field and message).

Specs with ``plugins`` are always checked in full (a plugin's code is outside the key). The cache is a
directory of small JSON files (``.healsweep/checks`` under the current directory, or ``HEALSWEEP_CHECK_CACHE``;
``HEALSWEEP_CHECK_CACHE=off`` disables it); a file that cannot be read or parsed is ignored and rewritten.
"""
from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Callable

from orchestrator.spec.checks import SpecError
from tasks.atomic import atomic_write

ROOT = Path(__file__).resolve().parents[2]  # the repository / installed package root
CODE_DIRS = ("tasks", "orchestrator/spec")
PACKAGES = ("torch", "timm", "torchvision")


def cache_dir() -> Path | None:
    v = os.environ.get("HEALSWEEP_CHECK_CACHE", "")
    if v.lower() in ("off", "0", "false", "no"):
        return None
    return Path(v) if v else Path(".healsweep") / "checks"


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the checking code's sources (path and bytes, sorted) and the installed model libraries."""
    h = hashlib.sha256()
    for d in CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    for pkg in PACKAGES:
        try:
            h.update(f"{pkg}={metadata.version(pkg)}\0".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{pkg}=none\0".encode())
    return h.hexdigest()


def model_entries(spec, m: str) -> dict:
    """Everything of ``spec`` the checks of model ``m`` read (entries keep their spec position). Sparsities
    are read only by pruners with a ``check_sparsity`` (e.g. RR's candidate grid), so editing the sparsity
    ladder of a spec without such a pruner keeps its verdicts."""
    from orchestrator.spec.registries import get, sparsity_check

    def sparsities(p):
        return list(p.sparsities or spec.sparsities) if sparsity_check(get("pruner", p.name)) else None

    return {
        "model": spec.model_refs.get(m) or {"name": m},
        "scope": spec.scope.get(m),
        "pruners": [[i, p.name, p.settings, p.scope, sparsities(p)]
                    for i, p in enumerate(spec.pruners) if p.applies_to(m)],
        "healers": [[j, h.name, h.settings] for j, h in enumerate(spec.healers) if h.applies_to(m)],
    }


def verdict_key(entries: dict) -> str:
    blob = json.dumps({"entries": entries, "code": code_digest()}, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()


def _read(path: Path) -> dict | None:
    try:
        v = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(v, dict) and (v.get("ok") is True or (v.get("ok") is False and isinstance(v.get("path"), str)
                                                         and isinstance(v.get("message"), str)))
    return v if ok else None


def write_entry(path: Path, verdict: dict) -> None:

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(verdict)))
    except OSError:  # a read-only cache directory only costs the next validation its time
        pass


def cached_check(spec, m: str, check: Callable[[], None]) -> bool:
    """Run ``check()`` (raises SpecError or returns) unless a verdict for the same inputs is cached; cache its
    verdict. Returns True when the verdict came from the cache."""
    root = cache_dir()
    if root is None or spec.plugins:
        check()
        return False
    path = root / f"{verdict_key(model_entries(spec, m))}.json"
    v = _read(path)
    if v is not None:
        if v["ok"]:
            return True
        raise SpecError(v["path"], v["message"])
    try:
        check()
    except SpecError as e:
        write_entry(path, {"ok": False, "path": e.path, "message": e.message})
        raise
    write_entry(path, {"ok": True})
    return False
