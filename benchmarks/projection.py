"""Projection of GRPO step time to 8-512 GPUs in both modes: a model fitted to benchmarks/e2e.jsonl.

    python benchmarks/projection.py --records benchmarks/e2e.jsonl --plot benchmarks/projection.png
    python benchmarks/projection.py --help
"""

from distflow.benchmarks.projection import main

if __name__ == "__main__":
    raise SystemExit(main())
