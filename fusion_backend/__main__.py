"""``python -m fusion_backend {explain,bench} ...``: the command-line entry points."""

from __future__ import annotations

import sys
from typing import Optional

USAGE = """usage: python -m fusion_backend {explain,bench} [options]

  explain FILE.py   compile a model file with the fusion backend, print what was fused (and why
                    not), and check the result against eager (--train checks gradients too)
  bench             benchmark eager vs Inductor vs fusion (time, memory, roofline) on CUDA

Run a command with --help for its options."""


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "explain":
        from .explain_cli import main as explain_main

        return explain_main(rest)
    if command == "bench":
        from .bench.cli import main as bench_main

        return bench_main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
