"""The compatibility-verdict cache (orchestrator/spec/verdicts.py): a second validation of the same spec reaches
the same verdict without building any model (timm is never imported), bad verdicts come back word for word,
and the key moves with every input the checks read."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.spec import verdicts
from orchestrator.spec.checks import SpecError
from orchestrator.spec.parse import parse_spec

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(name="t", models=["vit_digits"], sparsities=[0.5], calib_sizes=[32], pruners=["magnitude"],
            healers=["starfish"])

PROBE = """
import json, sys
from orchestrator.spec.checks import SpecError
from orchestrator.spec.parse import parse_spec
try:
    spec = parse_spec(json.loads(sys.argv[1]))
    out = {"ok": True, "scope": dict(spec.scope), "pruners": [p.name for p in spec.pruners]}
except SpecError as e:
    out = {"ok": False, "error": str(e)}
out["timm"] = "timm" in sys.modules
print(json.dumps(out))
"""


def _probe(raw: dict, cache: Path) -> dict:
    env = dict(os.environ, HEALSWEEP_CHECK_CACHE=str(cache), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(raw)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_second_validation_builds_no_model_and_agrees(tmp_path):
    cold = _probe(TINY, tmp_path)
    warm = _probe(TINY, tmp_path)
    assert cold["ok"] and cold["timm"]  # the first check built the ViT with timm
    assert warm["ok"] and not warm["timm"]  # the second one did not need it
    assert {k: v for k, v in cold.items() if k != "timm"} == {k: v for k, v in warm.items() if k != "timm"}
    assert len(list(tmp_path.glob("*.json"))) == 1  # one model, one verdict


@pytest.mark.timeout(600)
def test_bad_verdict_is_cached_word_for_word(tmp_path):
    bad = dict(TINY, pruners=[{"name": "corp", "scope": "blocks"}], sparsities=[0.5])
    cold, warm = _probe(bad, tmp_path), _probe(bad, tmp_path)
    assert not cold["ok"] and cold["error"].startswith("pruners[0]")
    assert warm == dict(cold, timm=False)


def _spec():
    return parse_spec(dict(TINY, healers=["starfish", "crbn"]))


def test_key_moves_with_every_entry_the_checks_read(monkeypatch, tmp_path):
    monkeypatch.setenv("HEALSWEEP_CHECK_CACHE", str(tmp_path))
    spec = _spec()
    base = verdicts.verdict_key(verdicts.model_entries(spec, "vit_digits"))
    other = parse_spec(dict(TINY, healers=["starfish", {"name": "crbn", "settings": {"bn_batches": 5}}]))
    swapped = parse_spec(dict(TINY, healers=["crbn", "starfish"]))  # same names, other positions in messages
    scoped = parse_spec(dict(TINY, healers=["starfish", "crbn"], scope={"vit_digits": "mlp"}))
    keys = {verdicts.verdict_key(verdicts.model_entries(s, "vit_digits")) for s in (other, swapped, scoped)}
    assert base not in keys and len(keys) == 3
    assert verdicts.verdict_key(verdicts.model_entries(_spec(), "vit_digits")) == base  # and only with them
    ladder = parse_spec(dict(TINY, healers=["starfish", "crbn"], sparsities=[0.5, 0.9]))
    assert verdicts.verdict_key(verdicts.model_entries(ladder, "vit_digits")) == base  # magnitude reads no sparsity


def test_sparsities_count_for_pruners_that_check_them():
    rr = dict(TINY, models=["resnet_digits"], pruners=["rr"], healers=["crbn"])
    a, b = parse_spec(dict(rr, sparsities=[0.9])), parse_spec(dict(rr, sparsities=[0.95]))
    ka, kb = (verdicts.verdict_key(verdicts.model_entries(s, "resnet_digits")) for s in (a, b))
    assert ka != kb  # RR's candidate grid is checked against each sparsity


def test_code_digest_covers_every_checking_source(monkeypatch, tmp_path):
    for d in verdicts.CODE_DIRS:
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "m.py").write_text("x = 1\n")
    monkeypatch.setattr(verdicts, "ROOT", tmp_path)
    verdicts.code_digest.cache_clear()
    try:
        first = verdicts.code_digest()
        verdicts.code_digest.cache_clear()
        (tmp_path / "orchestrator/spec/m.py").write_text("x = 2\n")
        assert verdicts.code_digest() != first
        verdicts.code_digest.cache_clear()
        (tmp_path / "orchestrator/spec/m.py").write_text("x = 1\n")
        assert verdicts.code_digest() == first
    finally:
        verdicts.code_digest.cache_clear()


def test_unreadable_verdicts_are_ignored_and_off_disables(monkeypatch, tmp_path):
    monkeypatch.setenv("HEALSWEEP_CHECK_CACHE", str(tmp_path))
    spec, calls = _spec(), []
    path = tmp_path / f"{verdicts.verdict_key(verdicts.model_entries(spec, 'vit_digits'))}.json"
    path.write_text('{"ok": false}')  # no path/message: not a verdict
    assert verdicts.cached_check(spec, "vit_digits", lambda: calls.append(1)) is False and calls == [1]
    assert json.loads(path.read_text()) == {"ok": True}
    assert verdicts.cached_check(spec, "vit_digits", lambda: calls.append(2)) is True and calls == [1]

    def fails():
        raise SpecError("scope.vit_digits", "no such scope")

    path.unlink()
    with pytest.raises(SpecError):
        verdicts.cached_check(spec, "vit_digits", fails)
    with pytest.raises(SpecError, match="^scope.vit_digits: no such scope$"):
        verdicts.cached_check(spec, "vit_digits", lambda: None)  # the cached verdict, not the lambda's
    monkeypatch.setenv("HEALSWEEP_CHECK_CACHE", "off")
    assert verdicts.cached_check(spec, "vit_digits", lambda: calls.append(3)) is False and calls == [1, 3]
