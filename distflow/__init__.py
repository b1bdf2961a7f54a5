"""DistFlow: fully distributed (multi-controller) RL post-training for LLMs.

Layers, each importing only those above it in this list (DESIGN.md):
algos -> data -> coordinator -> dag -> engines -> runtime -> trainer / cli.
"""

__version__ = "0.1.0"
