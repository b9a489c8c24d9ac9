"""healsweep bundle --python 3.12 --freeze FREEZE.txt --out DIR: an offline install bundle for an air-gapped machine."""
from __future__ import annotations

import argparse
from pathlib import Path

import orchestrator
from orchestrator.bundle.build import BundleRequest, build_bundle, read_present
from orchestrator.bundle.resolve import BundleError
from orchestrator.bundle.fetch import read_wheel
from orchestrator.commands.common import CliError, not_a_dir

DESCRIPTION = """\
Build, on a machine with package access, one file holding exactly the wheels a TARGET machine lacks to run
healsweep, and install it there with no index (docs/offline-install.md).

Say what the target holds with its `pip freeze` (--freeze; local versions such as torch==2.11.0+cu130 and
`name @ file://` lines are understood) and/or a names-only list (--assume-present FILE, --present NAME[==VER]):
a name without a version is ASSUMED to satisfy every requirement on it (recorded as an assumption in the
manifest). healsweep's requirements are walked recursively with markers evaluated for the target's Python and
platform; a requirement the target satisfies is not fetched and not descended into; every other one is fetched with
`pip download --no-deps --only-binary=:all:` for the target's tags and its own requirements walked in turn.
healsweep's own wheel is built from this checkout. Wheels are slimmed (ELF binaries stripped, needs binutils'
`strip`; Ray's Java jars and dashboard web client dropped; RECORD rewritten), stored uncompressed and packed with a
manifest (name, version, sha256 of each wheel, the target, the freeze's sha256) into OUT/NAME.tar.xz, with the
installer OUT/install.py next to it. On the target:  python3 install.py NAME.tar.xz [--target DIR | --user]
"""


def add_parser(sub):
    p = sub.add_parser("bundle", help="build an offline install bundle for a machine without a package index",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", required=True, metavar="X.Y[.Z]", help="the target's CPython version, e.g. 3.12")
    p.add_argument("--freeze", type=Path, action="append", default=[], metavar="FILE",
                   help="the target's `pip freeze` output (repeatable)")
    p.add_argument("--assume-present", type=Path, action="append", default=[], metavar="FILE",
                   help="a list of what the target holds, one NAME or NAME==VERSION a line (repeatable)")
    p.add_argument("--present", nargs="+", default=[], metavar="NAME[==VER]",
                   help="packages the target holds, named on the command line")
    p.add_argument("--platform", default="manylinux_2_28_x86_64", metavar="TAG",
                   help="the target's newest wheel platform tag (default manylinux_2_28_x86_64: glibc 2.28+; every "
                        "older manylinux tag is accepted too)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory for NAME.tar.xz and install.py")
    p.add_argument("--name", default="healsweep-offline", help="archive name without .tar.xz (default %(default)s)")
    p.add_argument("--extra", action="append", default=[], metavar="EXTRA",
                   help="include a healsweep extra, e.g. hub (Hugging Face datasets) (repeatable)")
    p.add_argument("--max-mb", type=float, default=40.0, help="exit 2 when the bundle is larger (default 40)")
    p.add_argument("--xz-preset", type=int, default=9, choices=range(10), metavar="0-9",
                   help="xz compression preset (default 9, run as 9 extreme: smallest, ~1 min per 100 MB)")
    p.add_argument("--strip", choices=("unneeded", "debug", "none"), default="unneeded",
                   help="how to strip ELF binaries (binutils' strip): unneeded (default; debug sections and static "
                        "symbols go, ~12 MB of each of Ray's three big binaries), debug (keep static symbols for "
                        "C++ backtraces), none (no binutils needed)")
    p.add_argument("--find-links", type=Path, action="append", default=[], metavar="DIR",
                   help="also look for wheels in DIR (pip download --find-links)")
    p.add_argument("--no-index", action="store_true", help="fetch only from --find-links, never from an index")
    p.add_argument("--index-url", metavar="URL", help="package index to fetch from (default: pip's configuration)")
    p.add_argument("--healsweep-wheel", type=Path, metavar="WHL", help="use this healsweep wheel instead of building one")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    if not 0 < args.max_mb < float("inf"):  # nan compared False with every size: the limit was ignored
        raise CliError(f"--max-mb must be a positive number of MB, got {args.max_mb:g}")
    if why := not_a_dir(str(args.out)):
        raise CliError(f"--out: {why}")
    if args.healsweep_wheel is not None and not args.healsweep_wheel.is_file():
        raise CliError(f"--healsweep-wheel {args.healsweep_wheel}: no such file")
    index: list[str] = ["--no-index"] if args.no_index else []
    index += ["--index-url", args.index_url] if args.index_url else []
    for d in args.find_links:
        index += ["--find-links", str(d)]
    try:
        if args.healsweep_wheel is not None:
            read_wheel(args.healsweep_wheel)  # a wheel, before --out is made
        text, source = read_present(args.freeze, args.assume_present, args.present)
        req = BundleRequest(python=args.python, platform=args.platform, present_text=text, present_source=source,
                            out=args.out, name=args.name, extras=frozenset(args.extra), max_mb=args.max_mb,
                            preset=args.xz_preset, strip=args.strip, index_args=tuple(index),
                            own_wheel=args.healsweep_wheel)
        build_bundle(req, _checkout(), lambda line: print(line, flush=True))
    except BundleError as e:
        raise CliError(str(e)) from None
    print(f"install on the target:  python3 {args.out / 'install.py'} {args.out / (args.name + '.tar.xz')} "
          "[--target DIR | --user]")
    return 0


def _checkout() -> Path:

    return Path(orchestrator.__file__).resolve().parent.parent
