"""healsweep doctor DIR [--repair]: check every file of a run directory and its store; repair what can be."""
from __future__ import annotations

from pathlib import Path

from orchestrator.commands.common import DEFAULT_HOME, CliError
from orchestrator.lifecycle import doctor
from orchestrator.lifecycle.sweep_record import sweep_damage
from orchestrator.rundir.files import SWEEP_FILE, ResumeError, read_sweep
from orchestrator.sweep.console import quiet_libraries


def add_parser(sub):
    p = sub.add_parser("doctor", help="check a run directory's files and store; --repair repairs them",
                       description="Check every file of run directory DIR and of its store: the trial record "
                                   "(trials.jsonl: per-line checksums), the SQLite tracking database (PRAGMA "
                                   "integrity_check), the Optuna journal (every line, and that it replays and agrees "
                                   "with the record), leftover temporary files, target-store manifests and shard "
                                   "checksums, mask files. One line per problem: what is damaged and what was lost. "
                                   "With --repair: rebuild a damaged sweep.json (from the record, the database and "
                                   "the parent run's spec), the tracking database and the Optuna journal from the "
                                   "record, drop torn or damaged lines, remove temporary files, quarantine damaged "
                                   "shards and masks (recomputed by healsweep run --resume DIR). Healed weights lost "
                                   "since their trial was recorded are named; their numbers stand, and only "
                                   "--rerun-lost-weights has the resume heal those trials again. A sweep whose driver "
                                   "was killed (its parent run left RUNNING, no live driver) is named, and --repair "
                                   "records it as interrupted. --repair refuses while a driver runs the sweep, and "
                                   "holds the run directory against one while it repairs. Exit code 0: sound "
                                   "(or repaired); 1: problems found (left); 2: DIR is not a run directory, or a live "
                                   "driver holds it (--repair).")
    p.add_argument("dir", metavar="DIR", help="run directory of a sweep (holds sweep.json)")
    p.add_argument("--repair", action="store_true", help="repair what can be repaired (without it: only report)")
    p.add_argument("--rerun-lost-weights", action="store_true",
                   help="with --repair: drop the records of trials whose healed weights are lost, so that the next "
                        "healsweep run --resume heals them again (its numbers replace the recorded ones)")
    p.add_argument("--cache", metavar="DIR", help="the model cache a rebuilt sweep.json names (only for a damaged "
                   "sweep.json; default: the one it named, if still readable, else ./.healsweep/models)")
    p.add_argument("--verbose", action="store_true", help="show a traceback for an unexpected failure")
    p.set_defaults(func=main)
    return p


def main(args) -> int:

    quiet_libraries(args.verbose)

    try:
        if args.rerun_lost_weights and not args.repair:
            raise CliError("--rerun-lost-weights repairs: give --repair with it")
        d = Path(args.dir)
        if args.cache and (d / SWEEP_FILE).is_file() and sweep_damage(d) is None:
            raise CliError(f"--cache names the model cache of a rebuilt sweep.json; {d / SWEEP_FILE} is sound (its "
                           f"cache: {read_sweep(d).get('cache')}): leave --cache out")
        return doctor.run(d, args.repair, cache=args.cache and Path(args.cache), rerun_lost=args.rerun_lost_weights,
                          default_cache=DEFAULT_HOME / "models")
    except ResumeError as e:
        raise CliError(str(e)) from None
