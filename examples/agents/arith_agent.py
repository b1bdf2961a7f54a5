"""An agent written against the OpenAI client, trained by DistFlow (README: Multi-turn rollouts with tools):

    distflow train rollout.agent=examples/agents/arith_agent.py:run rollout.max_turns=2 \
        rollout.max_total_tokens=96

It asks the row's question; when the reply has no `#### <answer>` line it asks once more
for one. Its reward is the task's own rule on the last reply (DistFlow's scorer, the one
import from it); the agent itself runs against any OpenAI-compatible server.
"""

from __future__ import annotations

from distflow.engines.reward import default_compute_score


async def run(client, row: dict) -> float:
    messages = list(row["prompt"])
    reply = await client.chat.completions.create(model="policy", messages=messages)
    text = reply.choices[0].message.content or ""
    if "####" not in text:
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "Give the final answer as #### <number>."}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
    return default_compute_score(row["data_source"], text, row["ground_truth"], row["extra_info"])
