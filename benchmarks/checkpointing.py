"""Gradient checkpointing: an actor update's memory and time with and without it.

    python benchmarks/checkpointing.py --json benchmarks/checkpointing.jsonl --results-md benchmarks/CHECKPOINTING.md
    python benchmarks/checkpointing.py --help
"""

from distflow.benchmarks.checkpointing import main

if __name__ == "__main__":
    raise SystemExit(main())
