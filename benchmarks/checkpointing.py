"""Gradient checkpointing and the chunked output head: an actor update's memory and time
with and without them.

    python benchmarks/checkpointing.py --json benchmarks/checkpointing.jsonl --results-md benchmarks/CHECKPOINTING.md
    python benchmarks/checkpointing.py --help
"""

from distflow.benchmarks.checkpointing import main

if __name__ == "__main__":
    raise SystemExit(main())
