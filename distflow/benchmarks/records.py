"""What every benchmark saves: its records as JSON lines (`--json`) and its results page
(`--results-md`), which quotes the command that made them."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path


def command_line(program: str, argv: Sequence[str] | None) -> str:
    """`program` and the arguments the benchmark ran with (`argv`, else this process's),
    as a results page quotes them."""
    args = sys.argv[1:] if argv is None else argv
    return f"{program} {shlex.join(args)}".rstrip()


def publish(args: argparse.Namespace, records: Sequence[dict], lines: Sequence[str]) -> None:
    """The results page of `lines` printed, and saved with `records` (`save_results`)."""
    page = "\n".join(lines) + "\n"
    print(page, end="")
    save_results(args, records, page)


def save_results(args: argparse.Namespace, records: Sequence[dict], page: str) -> None:
    """`records`, one JSON object a line, into `args.json`, and `page` into
    `args.results_md`, each where given; either replaces what the file held."""
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in records))
    if args.results_md:
        Path(args.results_md).write_text(page)
