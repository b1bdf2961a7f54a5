"""DistFlow vs TRL's GRPOTrainer, the same model, data, reward and wall budget (needs TRL).

    .venv-trl/bin/python benchmarks/peer_trl.py --json benchmarks/peer_trl.jsonl --results-md benchmarks/PEER_TRL.md
    python benchmarks/peer_trl.py --help
"""

from distflow.benchmarks.peer_trl import main

if __name__ == "__main__":
    raise SystemExit(main())
