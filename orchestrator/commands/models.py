"""healsweep models ls | train NAME | verify: the reference models' shipped weights and trained checkpoints."""
from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.commands.common import DEFAULT_HOME, CliError, not_a_dir


def add_parser(sub):
    p = sub.add_parser("models", help="reference models: list, verify the shipped weights, train a new checkpoint",
                       description="The reference models (vit_digits, resnet_digits) load weights shipped in the "
                                   "repository (tasks/models/weights), verified against the sha256 recorded with "
                                   "them on every load; every machine uses the same bytes. `train` retrains one with "
                                   "its recipe and writes a new checkpoint named by its own sha256 into the model "
                                   "cache (never over the shipped file); a spec uses it as "
                                   "{name: NAME, path: FILE, sha256: DIGEST}.")
    cmds = p.add_subparsers(dest="models_cmd", required=True, metavar="ACTION")
    ls = cmds.add_parser("ls", help="list the reference models, their shipped weights and digests",
                         description="One line per reference model: its shipped weights file, that file's sha256 "
                                     "and evaluation accuracy, and the data seed its recipe trained on.")
    ls.set_defaults(func=main_ls)
    ver = cmds.add_parser("verify", help="check the shipped files' sha256 (exit 2 when one does not match)",
                          description="Hash every shipped weights file and compare it with the sha256 recorded "
                                      "next to it. Exit code 0: every file matches; 2: one is missing or differs "
                                      "(named on one line).")
    ver.set_defaults(func=main_verify)
    tr = cmds.add_parser("train", help="train a reference model into the model cache (a new checkpoint)",
                         description="Train reference model NAME with its recipe on the train split of --data-seed "
                                     "(about 45 s for vit_digits and 20 s for resnet_digits on 2 quiet cores) and "
                                     "write CACHE/NAME-<sha256[:16]>.safetensors. Prints the file, its sha256, its "
                                     "evaluation accuracy and the spec entry that uses it. The same machine and "
                                     "seeds give the same bytes; another CPU type gives other weights (other "
                                     "kernels), hence another digest.")
    tr.add_argument("name", metavar="NAME", help="a reference model (healsweep models ls)")
    tr.add_argument("--data-seed", type=int, default=0, help="dataset split seed (default 0, the shipped weights')")
    tr.add_argument("--train-seed", type=int, default=0, help="training seed: init, order, augmentation (default 0)")
    tr.add_argument("--cache", type=Path, default=DEFAULT_HOME / "models",
                    help="model cache directory to write to (default .healsweep/models)")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(func=main_train)
    return p


def main_ls(args: argparse.Namespace) -> int:
    from tasks.models import MODELS
    from tasks.models.weights import DATA_SEED, SHIPPED

    for name in MODELS.names():
        w = SHIPPED[name]
        print(f"{name}: {w.path} sha256 {w.sha256} (data seed {DATA_SEED}, evaluation top-1 "
              f"{w.eval_correct}/{w.eval_total} = {100 * w.eval_acc:.2f} %)")
    return 0


def main_verify(args: argparse.Namespace) -> int:
    from tasks.models import ModelSourceError
    from tasks.models.checkpoint_file import verify
    from tasks.models.weights import SHIPPED

    for name, w in SHIPPED.items():
        try:
            verify(w.path, w.sha256)
        except ModelSourceError as e:
            raise CliError(str(e)) from None
        print(f"{name}: ok ({w.sha256[:16]})")
    return 0


def main_train(args: argparse.Namespace) -> int:
    from orchestrator.spec.checks import MAX_SEED
    from tasks.models import MODELS

    if args.name not in MODELS:
        raise CliError(f"unknown reference model {args.name!r}; allowed: {', '.join(MODELS.names())}")
    for flag, v in (("--data-seed", args.data_seed), ("--train-seed", args.train_seed)):
        if not 0 <= v <= MAX_SEED:
            raise CliError(f"{flag} must be in [0, {MAX_SEED}], got {v}")
    if why := not_a_dir(args.cache):
        raise CliError(f"--cache: {why}")
    from tasks.models.reference import train_reference

    path, sha, acc = train_reference(args.name, args.cache, data_seed=args.data_seed, train_seed=args.train_seed,
                                     progress=not args.quiet)
    print(f"{args.name}: {path}\n  sha256 {sha}\n  evaluation top-1 {100 * acc:.2f} % (data seed {args.data_seed})")
    print(f"  spec entry: {{name: {args.name}, path: {path.resolve()}, sha256: {sha[:16]}}}"
          + (f" with data_seed: {args.data_seed}" if args.data_seed else ""))
    return 0
