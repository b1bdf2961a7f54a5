"""rollout.agent's endpoint: the engine calls a step's agents make, against one per turn.

    python benchmarks/agents.py --json benchmarks/agents.jsonl --results-md benchmarks/AGENTS.md
    python benchmarks/agents.py --help
"""

from distflow.benchmarks.agents import main

if __name__ == "__main__":
    raise SystemExit(main())
