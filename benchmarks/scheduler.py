"""Scheduler benchmark: overlap and streaming on vs `scheduler.overlap=false`.

    python benchmarks/scheduler.py --json benchmarks/scheduler.jsonl --results-md benchmarks/SCHEDULER.md
    python benchmarks/scheduler.py --help
"""

from distflow.benchmarks.scheduler import main

if __name__ == "__main__":
    raise SystemExit(main())
