"""``python -m atp_router.protogen [--check] [--out DIR]``: write the generated files in
``proto/``, or with ``--check`` list those that drifted and exit 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from atp_router.protogen import PROTO_DIR, check, write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m atp_router.protogen", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on drift")
    ap.add_argument("--out", type=Path, default=PROTO_DIR, help=f"output directory (default {PROTO_DIR})")
    args = ap.parse_args(argv)
    outcome = check(args.out) if args.check else write(args.out)
    for name, reason in outcome.skipped:
        print(f"skipped {name}: {reason}", file=sys.stderr)
    if args.check:
        for name in outcome.changed:
            print(f"drifted: {args.out / name} (run `python -m atp_router.protogen`)")
        return 1 if outcome.changed else 0
    for name in outcome.changed:
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
