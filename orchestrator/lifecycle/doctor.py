"""``healsweep doctor DIR``: every file of a run directory and of its store, checked; one line per problem (what
is damaged, what was lost); with ``repair``, what can be repaired is repaired, in dependency order:

0. a damaged ``sweep.json``: rebuilt from the record, the database and the spec artifact (sweep_record.py);
1. the trial record (``trials.jsonl``, the source of truth: orchestrator/rundir/records.py): a torn last line is cut
   off (its trial runs again), damaged lines are dropped (their trials run again); with ``rerun_lost``
   (``--rerun-lost-weights``) so are the lines of trials whose healed weights (``trials/<id>/``) are lost (the
   journal rebuilt first, those trials asked again);
2. the tracking database (the run directory's own ``mlflow.db``): damaged -> rebuilt from the record; intact ->
   recorded trials missing from it recreated, duplicate runs deleted, stray parent runs of the sweep deleted;
3. the Optuna journal: torn, damaged, not replaying or disagreeing with the record -> rebuilt from it;
4. leftover temporary files (``.tmp-*``) in the run directory and the store: removed;
5. the target store: damaged or missing shards and unreadable manifests moved to its quarantine (the next
   ``healsweep run --resume`` recomputes exactly those rows: tasks/store);
6. a sweep left unended (its parent run RUNNING, no live driver: lifecycle/unended.py): recorded as interrupted.

A repair holds the run directory's lock (a sweep's driver holds it while it runs): it refuses while a driver runs
the sweep, and no sweep starts in the directory while it repairs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator.lifecycle import resume
from orchestrator.lifecycle.store_check import store_problems
from orchestrator.lifecycle.sweep_record import rebuild_sweep, rebuilt_sweep, sweep_damage
from orchestrator.lifecycle.unended import mark_unended, parent_state, partial_words
from orchestrator.rundir import records
from orchestrator.rundir.files import (JOURNAL_FILE, SWEEP_FILE, ResumeError, holder_words, lock_holder, lock_run_dir,
                                       read_sweep, release_run_dir)
from orchestrator.tracking.rebuild import (drop_stray_parents, journal_disagrees, parent_gone, rebuild_journal,
                                          rebuild_tracking, reopen_parent, runs_off, stray_parents, sync_runs)
from orchestrator.tracking.recorder import backfill
from orchestrator.tracking.store import local_tracking_uri, relocate


@dataclass
class Problem:
    path: str
    what: str  # what is damaged
    lost: str  # what was lost (or "nothing")
    fix: Callable[[], str] | None = None  # repairs it; -> what was done
    later: bool = False  # repaired by `healsweep run --resume` (a quarantined shard is recomputed there)
    hint: str = ""  # how a problem --repair leaves is repaired (said with the summary)

    def line(self) -> str:
        return f"{self.path}: {self.what}; lost: {self.lost}"


class Doctor:
    def __init__(self, out_dir: Path, rerun_lost: bool = False, live: str | None = None) -> None:
        self.dir = Path(out_dir).resolve()
        self.rerun_lost = rerun_lost  # --rerun-lost-weights: a trial whose healed weights are lost runs again
        self.live = live  # what holds the run directory now (files.lock_holder), None: nothing
        self.info = read_sweep(self.dir)
        self.record = self.dir / records.TRIALS_FILE
        self.journal = self.dir / JOURNAL_FILE

    def _scan(self) -> records.Scan:
        return records.scan(self.record)

    # ------------------------------------------------------------------ checks, in repair order
    def examine(self) -> list[Problem]:
        return [*self.check_record(), *self.check_weights(), *self.check_tracking(), *self.check_journal(),
                *self.check_temp(), *self.check_store(), *self.check_ended()]

    def check_record(self) -> list[Problem]:
        s, out = self._scan(), []
        if not self.record.exists() or s.clean and not records.trials(s):
            return self._no_record(self.record.exists())
        if s.torn is not None:
            out.append(Problem(str(self.record), f"torn last line ({s.torn_bytes} bytes: a write cut short)",
                               "that trial's result (it runs again on resume)", lambda: self._drop_torn()))
        lost = self._lost_with(s) if s.damaged else ""
        for n, why in s.damaged:
            out.append(Problem(str(self.record), f"line {n} damaged ({why})", lost, lambda: self._drop_damaged()))
        return out

    def check_weights(self) -> list[Problem]:
        """Recorded trials whose healed weights (``trials/<id>/``), whole when they were recorded, are missing or
        not whole now: one problem for them all. Their numbers stand, so only ``rerun_lost`` repairs it: their
        record lines are dropped and the resume runs them again, whose numbers then replace the recorded ones."""
        gone = resume.lost_weights(self.dir, records.trials(self._scan()))
        if not gone:
            return []
        named = "; ".join(f"{t}: {why}" for t, why in list(gone.items())[:4]) + ("; ..." if len(gone) > 4 else "")
        lost = ("their healed weights; their records are dropped and the resume heals them again: its numbers "
                "replace the recorded ones" if self.rerun_lost else "their healed weights (healsweep export of them "
                "fails); their numbers stand")
        return [Problem(str(self.dir / "trials"), f"{len(gone)} finished trial(s) without whole healed weights "
                        f"({named})", lost, (lambda: self._drop_unsaved()) if self.rerun_lost else None,
                        hint="lost healed weights: --repair --rerun-lost-weights has the resume heal those trials "
                        "again (its numbers replace the recorded ones)")]

    def _drop_unsaved(self) -> str:
        """The journal first (those trials asked, not told), then the record: a record left with no trial line
        would otherwise be written again from the journal (``_no_record``), and a repair cut short between the two
        leaves a journal that disagrees with the record, which the next repair rebuilds."""
        s = self._scan()
        gone = resume.lost_weights(self.dir, records.trials(s))
        if not gone:
            return "already dropped"
        rebuild_journal(self.journal, {t: r for t, r in records.trials(s).items() if t not in gone})
        records.rewrite(self.record, [r for r in s.records if not (r.get("kind") == records.TRIAL
                                                                   and r.get("trial_id") in gone)])
        return f"dropped {len(gone)} trial(s) from {records.TRIALS_FILE} and the journal: they run again on resume"

    def _lost_with(self, s: records.Scan) -> str:
        """What damaged record lines lost: the trials an intact journal tells as done that no intact line records
        (they run again on resume); a garbage line that was no trial's loses nothing."""
        if not self.journal.exists() or records.scan(self.journal, records.check_json).damaged or \
                resume.journal_problem(self.journal):
            return "that line's trial result, if it was one (it runs again on resume)"
        trials = records.trials(s)
        gone = [t for t in journal_disagrees(self.journal, trials) if t not in trials]
        if not gone:
            return "nothing (every trial the journal tells is in the intact lines)"
        return f"{len(gone)} trial result(s) ({', '.join(gone[:4])}): they run again on resume"

    def _no_record(self, emptied: bool = False) -> list[Problem]:
        """A sweep from before trials.jsonl (``emptied``: a record without a trial line): its record is written
        from the journal and MLflow while both are intact (nothing to rebuild from otherwise)."""

        told = resume.told_count(self.journal) if self.journal.exists() and not resume.journal_problem(
            self.journal) else 0
        db_ok = resume.db_problem(self.dir / resume.DB_FILE) is None and (self.dir / resume.DB_FILE).exists()
        if not told:
            return []
        what = "holds none of the trials the journal tells" if emptied else "missing (a sweep from before it)"
        if not db_ok:
            return [Problem(str(self.record), f"{what} and the tracking database damaged",
                            f"the MLflow runs of {told} trials: nothing to rebuild them from")]
        return [Problem(str(self.record), f"{what}; {told} trials in the journal",
                        "nothing yet: written from the journal and MLflow", lambda: self._backfill())]

    def _backfill(self) -> str:

        client = self._client()
        n = backfill(self.dir, client, self.info.get("experiment") or "healsweep", self.info["sweep_id"],
                     self.info.get("parent_run_id"))
        return f"written from the journal and MLflow ({n} trials)"

    def _drop_torn(self) -> str:
        return f"cut {records.drop_torn(self._scan())} bytes"

    def _drop_damaged(self) -> str:
        s = self._scan()
        if not s.damaged:
            return "already rewritten"
        records.rewrite(self.record, s.records)
        return f"rewritten without {len(s.damaged)} damaged line(s)"

    def check_tracking(self) -> list[Problem]:
        db = self.dir / resume.DB_FILE
        if not resume.own_db(self.dir, self.info):
            return []  # a tracking server or a shared database: not the run directory's to repair
        if not db.exists() and not self.info.get("parent_run_id"):
            return []  # the sweep stopped before it reached MLflow: nothing to check
        why = resume.db_problem(db) if db.exists() else "missing"
        trials = records.trials(self._scan())
        if why and not self.record.exists():  # nothing to rebuild it from (the record problem says so)
            return [Problem(str(db), f"damaged ({why})", "its runs (no trials.jsonl to rebuild them from)")]
        if why:
            return [Problem(str(db), f"damaged ({why})", f"nothing recorded: {len(trials)} trial runs and the parent "
                            "run rebuilt from trials.jsonl, under new run ids (MLflow gives each run its own: an id "
                            "quoted before, in a model card or a link, no longer resolves); runs of trials not "
                            "recorded run again",
                            lambda: self._rebuild_db())]
        gone = self._parent_gone()
        if gone:
            return [Problem(str(db), f"the sweep's parent run {self.info['parent_run_id']} is {gone}",
                            "nothing: " + ("restored" if gone == "deleted" else f"recreated from {records.TRIALS_FILE}'s "
                                           "parent line, under a new id"), lambda: self._reopen_parent())]
        out = []
        if missing := self._missing_runs(trials):
            out.append(Problem(str(db), f"{len(missing)} recorded trial(s) without their one MLflow run in its "
                               f"recorded status ({', '.join(missing[:4])})", "nothing: recreated from trials.jsonl",
                               lambda: self._sync_db()))
        if strays := self._strays():
            out.append(Problem(str(db), f"{len(strays)} stray parent run(s) of the sweep besides its own "
                               f"{self.info['parent_run_id']} ({', '.join(strays[:4])}: a start or a repair cut "
                               "short; MLflow's UI shows it as a sweep of its own)", "nothing: deleted (MLflow keeps "
                               "them as deleted), any trial run under one pointed at the sweep's own",
                               lambda: self._drop_strays()))
        return out

    def _client(self, write: bool = True):
        """The run's MLflow client; a repair (``write``) first points a copied or moved run directory's sweep.json
        and database at their new place, a check only reads the database where it now is (it wrote, and a
        read-only copy ended the check in a traceback)."""
        from mlflow import MlflowClient

        if not write:
            return MlflowClient(local_tracking_uri(self.dir))  # only called for the run directory's own database
        relocate(self.dir)
        self.info = read_sweep(self.dir)
        return MlflowClient(self.info["tracking_uri"])

    def _missing_runs(self, trials: dict[str, dict]) -> list[str]:
        if not trials:
            return []
        client = self._client(write=False)
        return runs_off(client, self._exp_id(client), self.info["sweep_id"], trials)

    def _exp_id(self, client) -> str | None:
        exp = client.get_experiment_by_name(self.info.get("experiment") or "healsweep")
        return exp.experiment_id if exp else None

    def _strays(self) -> list[str]:
        client = self._client(write=False)
        return stray_parents(client, self._exp_id(client), self.info["sweep_id"], self.info.get("parent_run_id"))

    def _drop_strays(self) -> str:
        client = self._client()
        n = drop_stray_parents(client, self._exp_id(client), self.info["sweep_id"], self.info["parent_run_id"])
        return f"deleted {n} stray parent run(s)" if n else "already deleted"

    def _parent_gone(self) -> str | None:
        return parent_gone(self._client(write=False), self.info.get("parent_run_id"))

    def _reopen_parent(self) -> str:
        client = self._client()
        done = reopen_parent(client, self._exp_id(client), self.dir, self.info)
        self.info = read_sweep(self.dir)
        return done

    def _rebuild_db(self) -> str:
        c = rebuild_tracking(self.dir, self.info, self._scan())
        self.info = read_sweep(self.dir)
        return f"rebuilt from trials.jsonl ({c['created']} trial runs and the parent run)"

    def _sync_db(self) -> str:
        client = self._client()
        c = sync_runs(client, self._exp_id(client), self.info["sweep_id"], self.info["parent_run_id"],
                      records.trials(self._scan()))
        return (f"{c['created']} run(s) recreated, {c['deleted']} duplicate(s) deleted"
                + (f", {c['ended']} set to their recorded status" if c["ended"] else ""))

    def check_journal(self) -> list[Problem]:
        js = records.scan(self.journal, records.check_json)
        trials = records.trials(self._scan())
        whats = ([f"torn last line ({js.torn_bytes} bytes: a write cut short)"] if js.torn is not None else [])
        whats += [f"line {n} damaged ({why})" for n, why in js.damaged]
        if whats and trials and (off := self._disagreeing(trials)) and len(off) > len(whats):
            whats[-1] += (f"; its intact lines lack {len(off)} recorded trial(s): more than "
                          f"{'that write' if len(whats) == 1 else 'those lines'} was lost")
        if not whats:
            why = resume.journal_problem(self.journal)
            whats = [why] if why else []
        if not whats and trials:
            off = journal_disagrees(self.journal, trials)
            whats = [f"disagrees with trials.jsonl on {len(off)} trial(s) ({', '.join(off[:4])})"] if off else []
        lost = "nothing recorded (told trials come back from trials.jsonl; trials asked but not finished run again)"
        return [Problem(str(self.journal), w, lost, lambda: self._rebuild_journal()) for w in whats]

    def _disagreeing(self, trials: dict[str, dict]) -> list[str]:
        """Recorded trials the journal's intact lines do not tell as recorded ([] when they do not replay)."""
        try:
            return journal_disagrees(self.journal, trials)
        except Exception:  # noqa: BLE001 - whatever Optuna raises on lines it cannot replay: the line says so
            return []

    def _rebuild_journal(self) -> str:
        s = records.scan(self.journal, records.check_json)
        if s.clean and not resume.journal_problem(self.journal) and \
                not journal_disagrees(self.journal, records.trials(self._scan())):
            return "already rebuilt"
        c = rebuild_journal(self.journal, records.trials(self._scan()))
        return f"rebuilt from trials.jsonl ({c['told']} told, {c['asked']} to run again)"

    def check_temp(self) -> list[Problem]:
        root = Path(self.info["store"])
        return [Problem(str(p), f"leftover temporary file ({p.stat().st_size} bytes: a write that did not finish)",
                        "nothing (the write is redone when needed)", lambda p=p: _unlink(p))
                for p in resume.temp_files(self.dir, root)]

    def check_store(self) -> list[Problem]:

        return store_problems(self.dir, self.info, Problem)

    def _parent(self) -> tuple[str, dict] | None:
        """(status, tags) of the parent run in the run directory's own sound database, else None (a tracking server
        is not contacted; a damaged database is check_tracking's)."""
        db = self.dir / resume.DB_FILE
        if self.live or not resume.own_db(self.dir, self.info) or not db.exists() or resume.db_problem(db):
            return None
        return parent_state(self._client(write=False), self.info.get("parent_run_id"))

    def check_ended(self) -> list[Problem]:
        state = self._parent()
        if state is None or state[0] != "RUNNING":
            return []
        return [Problem(str(self.dir), "the sweep did not end: no healsweep driver holds it, yet its parent run is "
                        "RUNNING (its last driver stopped without a trace: killed, or its machine went down)",
                        "the work of the trials that were running then (they run again on resume)",
                        lambda: self._mark_unended(), hint=f"or continue it at once with healsweep run --resume {self.dir}")]

    def _mark_unended(self) -> str:
        client = self._client()
        return mark_unended(client, self._exp_id(client), self.info, self.journal, records.trials(self._scan()))

    def partial(self) -> str:
        """" (the sweep is partial: ...)" for a sweep recorded as interrupted, else ""."""
        state = self._parent()
        return partial_words(state[1], self.dir) if state is not None else ""


def _readable_cache(out_dir: Path) -> Path | None:
    """The model cache a damaged but readable sweep.json names (a field missing), else None."""
    try:
        cache = json.loads((Path(out_dir) / SWEEP_FILE).read_bytes()[: 64 << 20]).get("cache")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return Path(cache) if isinstance(cache, str) and cache else None


def _unlink(p: Path) -> str:
    p.unlink(missing_ok=True)
    return "removed"


def run(out_dir: Path, repair: bool, say: Callable[[str], None] = print, cache: Path | None = None,
        rerun_lost: bool = False, default_cache: Path | None = None) -> int:
    """Check (and with ``repair`` repair) ``out_dir``; -> exit code: 0 sound or repaired, 1 problems left. A repair
    holds the run directory's lock (RunLockedError while a sweep's driver or another repair holds it); a check
    beside a live driver says that what it is writing may show as a problem (``_run``). ``cache``: the model cache
    a rebuilt sweep.json names (``--cache``; else the one a readable damaged one named, else ``default_cache``)."""
    out_dir = Path(out_dir)
    held = lock_holder(out_dir)
    if not repair or not any((out_dir / f).is_file() for f in (SWEEP_FILE, records.TRIALS_FILE)):
        if held:  # (not a run directory: refused in _run's own words)
            what = "repairing it" if held.endswith(" doctor") else "running this sweep"
            say(f"{out_dir.resolve()}: {holder_words(held)} is {what} now: a file it is writing may show as a problem")
        return _run(out_dir, repair, say, (cache, default_cache), rerun_lost, held)
    lock_run_dir(out_dir, role="doctor")
    try:
        return _run(out_dir, repair, say, (cache, default_cache), rerun_lost, None)
    finally:
        release_run_dir(out_dir)


def _run(out_dir: Path, repair: bool, say: Callable[[str], None], caches: tuple, rerun_lost: bool,
         live: str | None) -> int:
    """``run``'s check and repair. A repair can reveal the next problem (a record line dropped: the journal now
    disagrees), so repairs go in passes. A damaged sweep.json comes first: nothing else can be read without it
    (``caches``: ``run``'s cache and default_cache, the model cache a rebuilt one names, not recorded elsewhere;
    ``rerun_lost``, ``live``: ``Doctor``'s)."""
    if (why := sweep_damage(out_dir)) is not None:
        kept = _readable_cache(out_dir)  # a readable one (a field missing) keeps its model cache
        cache = Path(caches[0]) if caches[0] else kept or Path(caches[1] or "models")
        try:
            rebuilt_sweep(out_dir, cache)
        except ResumeError as e:  # nothing to rebuild it from: read_sweep's own one line (exit 2)
            raise ResumeError(f"{Path(out_dir) / SWEEP_FILE}: damaged ({why}) and not rebuildable: {e}") from None
        lost = (f"nothing (its model cache {cache} kept)" if kept and cache == kept else
                f"nothing (its model cache {kept} replaced by --cache {cache.resolve()})" if kept else
                f"the model cache it named (the rebuilt one names {cache.resolve()}; --cache chooses it)")
        say(f"{Path(out_dir).resolve() / SWEEP_FILE}: damaged ({why}); lost: {lost}; the rest is rebuilt from "
            f"{records.TRIALS_FILE} and {resume.DB_FILE}")
        if not repair:
            say(f"1 problem (the other files are checked once it is rebuilt); repair with healsweep doctor {out_dir} "
                "--repair")
            return 1
        say(f"repaired {Path(out_dir).resolve() / SWEEP_FILE}: {rebuild_sweep(out_dir, cache)}")
    doc = Doctor(out_dir, rerun_lost, live)
    problems = doc.examine()
    for p in problems:
        say(p.line())
    if not problems:
        say(f"{doc.dir}: every file checked, no problem found{doc.partial()}")
        return 0
    if not repair:
        say(f"{len(problems)} problem(s); repair with healsweep doctor {out_dir} --repair"
            + "".join(f" ({p.hint})" for p in problems if p.hint))
        return 1
    fixed = 0
    for _ in range(3):
        for p in problems:
            if p.fix is not None:
                done = p.fix()
                say(f"repaired {p.path}: {done}")
                fixed += not done.startswith("already")  # one rewrite settled several lines: counted once
        problems = [p for p in doc.examine() if not p.later]
        if all(p.fix is None for p in problems):
            break
        for p in problems:
            say(p.line())
    for p in problems:
        say(f"not repaired: {p.line()}")
    stuck = [p for p in problems if not p.hint]  # a hinted one is repaired as its hint says
    then = (f"continue with healsweep run --resume {out_dir}" if not stuck else "what is left cannot be repaired "
            "from this run directory's own files (a resume would refuse it too): restore them from a copy, or run the "
            "sweep again into another --out")
    say(f"{fixed} repair(s)" + (f", {len(problems)} problem(s) left" if problems else ", nothing left")
        + "".join(f" ({p.hint})" for p in problems if p.hint) + f"; {then}")
    return 1 if problems else 0
