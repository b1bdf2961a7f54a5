"""End-to-end benchmark: distributed vs centralized mode, one host and the emulated cluster.

    python benchmarks/e2e.py --json benchmarks/e2e.jsonl --results-md benchmarks/E2E.md --plot benchmarks/e2e.png
    python benchmarks/e2e.py --help
"""

from distflow.benchmarks.e2e import main

if __name__ == "__main__":
    raise SystemExit(main())
