"""Gradient checkpointing (`actor.gradient_checkpointing`) and the chunked output head
(`actor.output_head_chunk_tokens`): what an actor update costs in memory and time with and
without them, on the same model, batch and loss.

    distflow bench checkpointing                  # about 5 min on 2 cores
    distflow bench checkpointing --quick          # the embedded model, short rows

Model: engines.py's llama-57m (a random Llama: hidden 512, 12 layers, 8 heads, MLP 1536,
vocab 32,000), fp32 on CPU; `--quick`: the embedded 0.87M-parameter model; `--model` another
of engines.py's shapes. `--device cuda`: the update on the GPU. Batch: GRPO
groups of `--group-size` rows that share a prompt (random token ids), `--prompt-len` and
`--response-len` tokens, one micro-batch; the actor's policy loss (no KL term).

Each mode runs in a fresh process: one untimed update first (it allocates AdamW's moments
and warms the allocator), then `--repeats` timed updates, then one more for the peak
memory. Per mode:
- `kept MiB`: the activations autograd keeps from the forward for the backward, counted
  by a saved-tensors hook on the first update (distinct storages, the weights excluded;
  not the checkpointed layers' inputs, which the recompute holds outside that hook: the
  peak below includes them);
- `peak step MiB`: the most memory tensors held at once during the last update, above
  what they held just before it: on CPU the running total of torch's allocator as the
  profiler records each allocation and free, on a GPU torch.cuda.max_memory_allocated;
  the same bytes in every run (not the process's resident memory, which moves by tens of
  MiB from run to run with the C heap and the thread pools' buffers);
- `seconds`: the median timed update;
- `peak score MiB`: the same for scoring the batch without gradients
  (`compute_log_probs`: the old and reference log-probs' pass), after the updates.
Modes: `kept`, the default (activations kept, actor.forward_prompt_once on: a group's
prompt runs once); `kept-per-row`, with forward_prompt_once off (every row runs its
prompt, as the checkpointed update does); `checkpointed`, gradient checkpointing on;
`head-chunked` and `checkpointed-head-chunked`, the same two with the output head run
`--head-chunk-tokens` tokens at a time (its logits never kept whole).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from distflow.benchmarks.engines import MODELS, build_random_llama
from distflow.benchmarks.records import command_line, save_results

MODES = {  # (gradient checkpointing, prompt once, the output head chunked)
    "kept": (False, True, False), "kept-per-row": (False, False, False), "checkpointed": (True, True, False),
    "head-chunked": (False, True, True), "checkpointed-head-chunked": (True, True, True)}


def _peak_tensor_mb(run, cuda: bool) -> float:
    """The most memory tensors held at once during `run()`, above what they held before
    it: torch's CUDA allocator statistics, or on CPU the running total of torch's CPU
    allocator as the profiler records each allocation and free. The profiler records no
    free of a block allocated before it started, so on CPU `run()` is called twice under
    one profiler and the second call measured: what it frees, the first call (or the
    measured call itself) allocated."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
        with record_function("distflow-measured-run"):
            run()
    with tempfile.TemporaryDirectory(prefix="distflow-bench-checkpointing-trace-") as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    span = next(e for e in events if e.get("name") == "distflow-measured-run" and e.get("ph") == "X")
    memory = [e["args"] for e in events
              if e.get("name") == "[memory]" and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
    if not memory:
        return 0.0
    first = min(memory, key=lambda a: a["Ev Idx"])
    return (max(a["Total Allocated"] for a in memory) - (first["Total Allocated"] - first["Bytes"])) / 2**20


def _batch(vocab: int, rows: int, group_size: int, prompt_len: int, response_len: int):
    from distflow.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (rows // group_size, prompt_len), generator=g).repeat_interleave(group_size, 0)
    responses = torch.randint(3, vocab, (rows, response_len), generator=g)
    return Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts),
                  "responses": responses, "response_mask": torch.ones_like(responses),
                  "advantages": torch.randn(rows, 1, generator=g).expand(rows, response_len).contiguous()})


def measure_mode(path: str, checkpointing: bool, prompt_once: bool, head_chunked: bool, rows: int, group_size: int,
                 prompt_len: int, response_len: int, repeats: int, head_chunk_tokens: int, device: str) -> dict:
    """One mode in this process (see the module docstring)."""
    from distflow.config import load_config
    from distflow.engines.actor import Actor, OptimConfig
    from distflow.engines.common import load_causal_lm
    from distflow.trainer.nodes import make_policy_loss

    actor = Actor(load_causal_lm(path), OptimConfig(lr=1e-6), torch.device(device), prompt_once=prompt_once,
                  gradient_checkpointing=checkpointing, head_chunk_tokens=head_chunk_tokens if head_chunked else 0)
    batch = _batch(actor.module.config.vocab_size, rows, group_size, prompt_len, response_len)
    cfg = load_config(None, ["algorithm.use_kl_loss=false"])
    loss = make_policy_loss(cfg, float(batch["response_mask"].sum()), float(len(batch)))
    micro = [list(range(rows))]
    weights = {p.untyped_storage().data_ptr() for p in actor.module.parameters()}
    kept: dict[int, int] = {}  # storage -> bytes: views of one tensor count once

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        actor.train_mini_batch(batch, micro, loss)
    cuda = device.startswith("cuda")
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        actor.train_mini_batch(batch, micro, loss)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"kept_mb": sum(kept.values()) / 2**20,
            "peak_step_mb": _peak_tensor_mb(lambda: actor.train_mini_batch(batch, micro, loss), cuda),
            "peak_score_mb": _peak_tensor_mb(lambda: actor.compute_log_probs(batch, micro), cuda),
            "seconds": statistics.median(seconds),
            "parameters_millions": round(sum(p.numel() for p in actor.module.parameters()) / 1e6, 2)}


def markdown(records: list[dict], command: str, seconds: float) -> str:
    r0 = records[0]
    lines = [f"Measured with `{command}` ({seconds / 60:.1f} min, {platform.machine()}, {os.cpu_count()} cores): "
             f"{r0['model']} ({r0['parameters_millions']}M parameters) on {r0['device']}, {r0['rows']} rows in "
             f"groups of "
             f"{r0['group_size']}, {r0['prompt_len']} + {r0['response_len']} tokens, one micro-batch, "
             f"median of {r0['repeats']} updates; head-chunked: {r0['head_chunk_tokens']} tokens a chunk.", "",
             "| mode | kept MiB | peak step MiB | seconds | peak score MiB | kept / kept's | peak / kept's "
             "| seconds / kept's | peak score / kept's |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = next(r for r in records if r["mode"] == "kept")
    for r in records:
        lines.append(f"| {r['mode']} | {r['kept_mb']:,.1f} | {r['peak_step_mb']:,.1f} | {r['seconds']:.2f} "
                     f"| {r['peak_score_mb']:,.1f} | {r['kept_mb'] / base['kept_mb']:.2f} "
                     f"| {r['peak_step_mb'] / base['peak_step_mb']:.2f} | {r['seconds'] / base['seconds']:.2f} "
                     f"| {r['peak_score_mb'] / base['peak_score_mb']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench checkpointing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the embedded model, 16 + 48 tokens")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--head-chunk-tokens", type=int, default=256, help="the head-chunked modes' chunk")
    parser.add_argument("--model", choices=[m for m in MODELS if m != "embedded"], default="llama-57m")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the update on the GPU")
    parser.add_argument("--json", help="write one record per mode (JSON lines)")
    parser.add_argument("--results-md", help="write the table as markdown")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_len, args.response_len = 16, 48
    shape = (args.rows, args.group_size, args.prompt_len, args.response_len, args.repeats, args.head_chunk_tokens,
             args.device)
    if args.rows % args.group_size:
        parser.error(f"--rows={args.rows}: must be a multiple of --group-size={args.group_size}")
    if args.child:  # one mode, in this fresh process: its record on the last line
        print(json.dumps(measure_mode(args.child[1], *MODES[args.child[0]], *shape)))
        return 0
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import resolve_model_path

    start, records = time.time(), []
    name = "embedded" if args.quick else args.model
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="distflow-bench-checkpointing-") as tmp:
        path = resolve_model_path(BUILTIN_MODEL) if args.quick else build_random_llama(Path(tmp) / name, MODELS[name])
        for mode in MODES:
            child = [sys.executable, "-m", "distflow.benchmarks.checkpointing", "--child", mode, path,
                     *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                       if k in ("rows", "group_size", "prompt_len", "response_len", "repeats", "head_chunk_tokens",
                                "device"))]
            proc = subprocess.run(child, capture_output=True, text=True, env=env, timeout=1800)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            record = {"model": name, "mode": mode, "rows": args.rows, "group_size": args.group_size,
                      "prompt_len": args.prompt_len, "response_len": args.response_len, "repeats": args.repeats,
                      "head_chunk_tokens": args.head_chunk_tokens, "device": args.device,
                      **json.loads(proc.stdout.strip().splitlines()[-1])}
            records.append(record)
            print(f"{mode:>25}: kept {record['kept_mb']:,.1f} MiB, peak step {record['peak_step_mb']:,.1f} MiB, "
                  f"{record['seconds']:.2f} s per update, peak score {record['peak_score_mb']:,.1f} MiB", flush=True)
    command = command_line("distflow bench checkpointing", argv)
    save_results(args, records, markdown(records, command, time.time() - start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
