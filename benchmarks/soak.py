"""Soak benchmark: the default task for 200 steps on 4 workers, host-memory slope per process.

    python benchmarks/soak.py --steps 200 --workers 4 --json benchmarks/soak.json
    python benchmarks/soak.py --help
"""

from distflow.benchmarks.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
