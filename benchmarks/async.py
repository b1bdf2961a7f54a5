"""Asynchronous disaggregated vs synchronous colocated training, on the same cores.

    python benchmarks/async.py --json benchmarks/async.jsonl --results-md benchmarks/ASYNC.md
    python benchmarks/async.py --help
"""

from distflow.benchmarks.async_rl import main

if __name__ == "__main__":
    raise SystemExit(main())
