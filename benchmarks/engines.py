"""Rollout engines: HF generate vs vLLM (needs vLLM; README: Rollout on vLLM).

    .venv-vllm/bin/python benchmarks/engines.py --json benchmarks/engines.jsonl --results-md benchmarks/ENGINES.md
    python benchmarks/engines.py --help
"""

from distflow.benchmarks.engines import main

if __name__ == "__main__":
    raise SystemExit(main())
