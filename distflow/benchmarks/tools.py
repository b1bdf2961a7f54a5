"""Multi-turn episodes that call the python tool: their environments stepped one episode
after another (`rollout.env_workers=1`) against on several threads at once (the default, 8).

    python benchmarks/tools.py --json benchmarks/tool_calls.jsonl --results-md benchmarks/TOOL_CALLS.md
    distflow bench tools --episodes 16 --repeats 1          # a quick look

What is timed is `EpisodeRunner.generate` on `--episodes` episodes of two turns: the first
turn calls the python tool (a short program, run in the code sandbox with its limits,
exactly as `rollout.tools=python` runs it), the second answers. The turns' text comes from
a fixed-answer engine, not a model, so that the time is the environments' (tool calls,
observation tokens), not generation's; the tokenizer, the tool environment and the
sandbox are the run's own. Each setting is timed `--repeats` times, alternating; the
median is reported, with the ratio of the two measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from distflow.benchmarks.records import command_line, publish
from distflow.data.batch import Batch
from distflow.engines.agent import EpisodeRunner, EpisodeSettings, ToolEnvironment
from distflow.engines.rollout import SamplingParams, response_mask_from
from distflow.engines.tools import Toolbox, tool_call_text

PROGRAM = "print(sum(i * i for i in range(1000)))"


class FixedAnswers:
    """A rollout engine whose first turn calls the python tool and whose later turns answer:
    the same text for every episode, so every episode makes the same one tool call."""

    weight_version, tensor_parallel_size = 0, 1

    def __init__(self, tokenizer, prompt_length: int):
        self.tok, self.prompt_length = tokenizer, prompt_length
        self.stop_token_ids = (tokenizer.eos_token_id,)
        call = tool_call_text("python", {"code": PROGRAM})
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                      for t in (call, "#### 332833500")]

    def generate(self, prompts, seeds, params) -> Batch:
        rows = [self.turns[min(int(len(p) > self.prompt_length), 1)][:params.max_new_tokens] for p in prompts]
        responses = torch.full((len(rows), params.max_new_tokens), self.tok.pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            responses[i, :len(row)] = torch.tensor(row)
        mask = response_mask_from(responses, self.stop_token_ids)
        return Batch({"responses": responses, "response_mask": mask, "rollout_log_probs": -0.5 * mask.float()})


def time_episodes(episodes: int, env_workers: int, tokenizer) -> tuple[float, Batch]:
    prompt = tokenizer("Q: what is the sum of the squares below 1000?\nA: ", add_special_tokens=False)["input_ids"]
    toolbox = Toolbox(["python"])
    runner = EpisodeRunner(FixedAnswers(tokenizer, len(prompt)), tokenizer, lambda: ToolEnvironment(toolbox),
                           EpisodeSettings(max_turns=2, max_total_tokens=512, env_workers=env_workers))
    start = time.perf_counter()
    out = runner.generate([prompt] * episodes, list(range(episodes)), SamplingParams(max_new_tokens=160),
                          [{}] * episodes)
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench tools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--env-workers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write one record per setting (JSON lines)")
    parser.add_argument("--results-md", help="write the table as markdown")
    args = parser.parse_args(argv)
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import load_tokenizer

    tokenizer = load_tokenizer(BUILTIN_MODEL)
    seconds: dict[int, list[float]] = {w: [] for w in args.env_workers}
    outputs = {}
    for _ in range(args.repeats):
        for workers in args.env_workers:  # alternating, so that drift on the machine hits each alike
            elapsed, outputs[workers] = time_episodes(args.episodes, workers, tokenizer)
            seconds[workers].append(elapsed)
    first = args.env_workers[0]
    for workers, out in outputs.items():  # the same episodes, whatever the threads
        if not torch.equal(out["responses"], outputs[first]["responses"]) or out["tool_errors"].sum():
            raise SystemExit(f"env_workers={workers}: the episodes differ from env_workers={first}'s, or a tool failed")
    records = [{"env_workers": w, "episodes": args.episodes, "median_seconds": statistics.median(s),
                "seconds": s, "tool_calls": float(outputs[w]["tool_calls"].sum()), "cores": os.cpu_count(),
                "x_first": statistics.median(seconds[first]) / statistics.median(s)} for w, s in seconds.items()]
    lines = [f"Command: `{command_line('python benchmarks/tools.py', argv)}`", "",
             "| rollout.env_workers | episodes | tool calls | median s | tool calls / s | speed-up |",
             "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['env_workers']} | {r['episodes']} | {r['tool_calls']:.0f} | {r['median_seconds']:.3f} | "
                     f"{r['tool_calls'] / r['median_seconds']:.1f} | {r['x_first']:.2f}x |")
    lines += ["", f"{os.cpu_count()} cores; the engine's turns are fixed answers, so the time is the environments'."]
    publish(args, records, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
