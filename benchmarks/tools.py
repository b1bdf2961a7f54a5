"""Multi-turn episodes calling the python tool: environments stepped one after another vs on threads.

    python benchmarks/tools.py --json benchmarks/tool_calls.jsonl --results-md benchmarks/TOOL_CALLS.md
    python benchmarks/tools.py --help
"""

from distflow.benchmarks.tools import main

if __name__ == "__main__":
    raise SystemExit(main())
