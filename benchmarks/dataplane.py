"""Data-plane benchmark: Data Coordinator vs a single-controller driver.

    python benchmarks/dataplane.py --quick
    python benchmarks/dataplane.py --help
"""

from distflow.benchmarks.dataplane import main

# The guard matters: the coordinator's workers are spawned processes, which re-import
# the main script; without it each would start the benchmark again.
if __name__ == "__main__":
    raise SystemExit(main())
