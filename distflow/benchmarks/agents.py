"""rollout.agent's endpoint: how many engine calls a step's agents make, against one per turn.

    python benchmarks/agents.py --json benchmarks/agents.jsonl --results-md benchmarks/AGENTS.md
    distflow bench agents --agents 32 --repeats 1          # a quick look

`--agents` agents, each an `openai.AsyncOpenAI` loop of `--turns` calls (each call's reply
and a fixed user message sent back, as `examples/agents/arith_agent.py` asks again), run
through `AgentRunner` as `rollout.agent` runs them: the endpoint, its batching, the real
`openai` client and the tokenizer are the run's own. The engine answers every request with
the same few tokens and takes `--engine-seconds` per call, whatever its size (generation is
not what is measured; a real engine batches a call's sequences at about that cost). So the
least a step can take is one engine call per turn, `turns x engine-seconds`; what is
reported is the engine calls made and the seconds taken, each against that least, median
over `--repeats`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from distflow.benchmarks.records import command_line, publish
from distflow.data.batch import Batch
from distflow.engines.common import render_prompt
from distflow.engines.openai_endpoint import AgentRunner, AgentSettings
from distflow.engines.rollout import SamplingParams, response_mask_from


class TimedAnswers:
    """A rollout engine whose every completion is the same text and whose every call takes
    `seconds`, counting its calls."""

    weight_version, tensor_parallel_size, batches_continuously = 0, 1, False

    def __init__(self, tokenizer, seconds: float):
        self.tok, self.seconds, self.calls = tokenizer, seconds, 0
        self.stop_token_ids = (tokenizer.eos_token_id,)
        self.answer = tokenizer("#### 7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(self, prompts, seeds, params) -> Batch:
        self.calls += 1
        time.sleep(self.seconds)
        responses = torch.full((len(prompts), params.max_new_tokens), self.tok.pad_token_id, dtype=torch.long)
        responses[:, :len(self.answer)] = torch.tensor(self.answer[:params.max_new_tokens])
        mask = response_mask_from(responses, self.stop_token_ids)
        return Batch({"responses": responses, "response_mask": mask, "rollout_log_probs": -0.5 * mask.float()})


def asking_again(turns: int):
    async def run(client, row) -> float:
        messages = list(row["prompt"])
        for _ in range(turns):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Check it, and give the answer again after ####."}]
        return 1.0
    return run


def time_agents(agents: int, turns: int, engine_seconds: float, tokenizer) -> tuple[float, int, Batch]:
    engine = TimedAnswers(tokenizer, engine_seconds)
    rows = [{"prompt": [{"role": "user", "content": f"Q: what is {i} + 7?"}], "ground_truth": str(i + 7),
             "data_source": "bench", "extra_info": {}} for i in range(agents)]
    prompts = [tokenizer(render_prompt(tokenizer, r["prompt"]), add_special_tokens=False)["input_ids"] for r in rows]
    runner = AgentRunner(engine, tokenizer, asking_again(turns),
                         AgentSettings(max_total_tokens=64 * turns, max_calls=turns, timeout_s=600))
    try:
        start = time.perf_counter()
        out = runner.generate(prompts, list(range(agents)), SamplingParams(max_new_tokens=16), rows)
        return time.perf_counter() - start, engine.calls, out
    finally:
        runner.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench agents", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--engine-seconds", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write one record per setting (JSON lines)")
    parser.add_argument("--results-md", help="write the table as markdown")
    args = parser.parse_args(argv)
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import load_tokenizer

    tokenizer = load_tokenizer(BUILTIN_MODEL)
    least = args.turns * args.engine_seconds
    records = []
    for agents in args.agents:
        seconds, calls = [], []
        for _ in range(args.repeats):
            elapsed, made, out = time_agents(agents, args.turns, args.engine_seconds, tokenizer)
            if out["agent_failed"].sum() or out["num_turns"].tolist() != [float(args.turns)] * agents:
                raise SystemExit(f"{agents} agents: an agent failed or made other than {args.turns} calls")
            seconds.append(elapsed)
            calls.append(made)
        records.append({"agents": agents, "turns": args.turns, "engine_seconds": args.engine_seconds,
                        "engine_calls": statistics.median(calls), "calls": calls,
                        "median_seconds": statistics.median(seconds), "seconds": seconds,
                        "x_least": statistics.median(seconds) / least, "cores": os.cpu_count()})
    lines = [f"Command: `{command_line('python benchmarks/agents.py', argv)}`", "",
             "| agents | turns | engine calls (least: turns) | median s | x the least (turns x engine s) |",
             "|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['agents']} | {r['turns']} | {r['engine_calls']:g} | {r['median_seconds']:.2f} | "
                     f"{r['x_least']:.2f}x |")
    lines += ["", f"{os.cpu_count()} cores; every engine call takes {args.engine_seconds:g} s whatever its size, "
                  "so what is above the least is the endpoint's and the clients' own time and the turns "
                  "split over more calls."]
    publish(args, records, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
