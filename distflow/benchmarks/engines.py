"""Rollout engines: HF `generate` (rollout.engine=hf) against vLLM (rollout.engine=vllm),
the same prompts, seeds and sampling parameters, in one process, one after the other.

    distflow bench engines                         # about 6 min on 2 cores
    distflow bench engines --quick                 # batch 8, embedded model only

Needs vLLM (README: Rollout on vLLM). Models:
  embedded  the built-in 0.87M-parameter Llama (character tokenizer, vocab 100).
  llama-57m a random Llama built in code: hidden 512, 12 layers, 8 heads, MLP 1536,
            vocab 32,000 (tied), fp32, 57M parameters; random weights rarely stop early,
            so nearly every sequence runs to max_new_tokens on both engines.
For each model and batch size (64, 512; prompts of the built-in task, each sampled with
its own seed at T=1; HF in calls of rollout.micro_batch_size=128 sequences, as the
trainer runs it; vLLM all at once): generated tokens per second, counted from the response masks
(EOS included), over one timed call after an untimed warm-up call. Also: engine start-up
seconds (vLLM: LLM() in-process; HF: loading the model) and weight sync, seconds per
push and per 100 MB of fp32 weights, each weight once (a tied embedding and head one
tensor, as a run pushes it), in place (HF: copy into the parameters; vLLM:
`reload_weights` on the tensor stream), median of 3. On the embedded model a push is
mostly fixed cost, which the per-100 MB figure scales up.

Both engines use what the machine gives them: HF runs first with torch's default
intra-op threads; vLLM's CPU backend then binds its own OpenMP threads. Neither runs
while the other does.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from distflow.benchmarks.records import command_line, save_results

MODELS = {"embedded": None,
          "llama-57m": {"hidden_size": 512, "num_hidden_layers": 12, "num_attention_heads": 8,
                        "num_key_value_heads": 8, "intermediate_size": 1536, "vocab_size": 32000},
          # Qwen2.5-0.5B's shape (its vocabulary of 151,936 too) as a Llama: for a GPU
          "qwen-0.5b-shape": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}}


def build_random_llama(folder: Path, shape: dict) -> str:
    """A Llama of `shape` with random weights and the built-in character tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from distflow.engines.tiny_model import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=256, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def task_prompts(tokenizer, count: int) -> list[list[int]]:
    from distflow.data.dataset import PromptReader, ShardedDataset
    from distflow.trainer.nodes import encode_prompt

    rows, _ = PromptReader(ShardedDataset("builtin:arith:train"), 192, "error", "error").take(
        list(range(count)), lambda row: encode_prompt(tokenizer, row), replace=False)
    return [ids for _, ids in rows]


def timed_generate(engine, prompts, seeds, params) -> tuple[float, int]:
    engine.generate(prompts[:8], seeds[:8], params)  # warm-up
    start = time.perf_counter()
    out = engine.generate(prompts, seeds, params)
    return time.perf_counter() - start, int(out["response_mask"].sum())


def weight_sync_seconds(engine, state: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(seconds per push, seconds per 100 MB pushed): the median of three pushes of `state`."""
    size = sum(t.numel() * t.element_size() for t in state.values())
    times = []
    for version in range(3):
        start = time.perf_counter()
        engine.update_weights(iter(state.items()), version=version + 1)
        times.append(time.perf_counter() - start)
    return statistics.median(times), statistics.median(times) / (size / 100e6)


def measure(name: str, path: str, batches: list[int], max_new_tokens: int) -> list[dict]:
    from distflow.config import RolloutConfig
    from distflow.engines.common import load_causal_lm, load_tokenizer
    from distflow.engines.rollout import HFRolloutEngine, SamplingParams, sample_seed
    from distflow.engines.vllm_rollout import VLLMRolloutEngine

    tok = load_tokenizer(path)
    prompts = task_prompts(tok, max(batches))
    seeds = [sample_seed(0, 1, i) for i in range(len(prompts))]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    records = {b: {"model": name, "batch": b, "max_new_tokens": max_new_tokens} for b in batches}
    start = time.perf_counter()
    hf = HFRolloutEngine(load_causal_lm(path), tok, micro_batch_size=RolloutConfig().micro_batch_size)
    hf_start = time.perf_counter() - start
    # what a run pushes: each weight once (a tied embedding and head is one tensor; its state dict lists it twice)
    state = {k: v.detach().clone() for k, v in hf.model.named_parameters()}
    params_m = sum(p.numel() for p in hf.model.parameters()) / 1e6
    hf_push, hf_sync = weight_sync_seconds(hf, state)
    hf_threads = torch.get_num_threads()
    for b in batches:
        secs, tokens = timed_generate(hf, prompts[:b], seeds[:b], params)
        records[b].update(hf_seconds=secs, hf_tokens=tokens, hf_tokens_per_s=tokens / secs)
    hf.close()
    start = time.perf_counter()
    vllm = VLLMRolloutEngine(path, tok, max_model_len=256, kv_cache_memory_gb=2.0)
    vllm_start = time.perf_counter() - start
    vllm_push, vllm_sync = weight_sync_seconds(vllm, state)
    for b in batches:
        secs, tokens = timed_generate(vllm, prompts[:b], seeds[:b], params)
        records[b].update(vllm_seconds=secs, vllm_tokens=tokens, vllm_tokens_per_s=tokens / secs)
    vllm.close()
    for r in records.values():
        r.update(params_millions=round(params_m, 2), speedup=r["vllm_tokens_per_s"] / r["hf_tokens_per_s"],
                 hf_startup_s=hf_start, vllm_startup_s=vllm_start, hf_sync_s_per_100mb=hf_sync,
                 vllm_sync_s_per_100mb=vllm_sync, hf_sync_s=hf_push, vllm_sync_s=vllm_push,
                 hf_torch_threads=hf_threads)
    return list(records.values())


def markdown(records: list[dict], command: str, seconds: float) -> str:
    lines = [f"Measured with `{command}` ({seconds / 60:.1f} min, {platform.machine()}, {os.cpu_count()} cores).", "",
             "| model | params | batch | HF tokens/s | vLLM tokens/s | vLLM / HF | start-up s (HF / vLLM) "
             "| weight sync s per push (HF / vLLM) | weight sync s per 100 MB (HF / vLLM) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['model']} | {r['params_millions']}M | {r['batch']} | {r['hf_tokens_per_s']:,.0f} "
                     f"| {r['vllm_tokens_per_s']:,.0f} | {r['speedup']:.2f} | {r['hf_startup_s']:.1f} / "
                     f"{r['vllm_startup_s']:.1f} | {r['hf_sync_s']:.3f} / {r['vllm_sync_s']:.3f} "
                     f"| {r['hf_sync_s_per_100mb']:.3f} / {r['vllm_sync_s_per_100mb']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench engines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 8, the embedded model only")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", help="write one record per (model, batch) (JSON lines)")
    parser.add_argument("--results-md", help="write the table as markdown")
    args = parser.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("distflow bench engines: vLLM is not importable in this Python (README: Rollout on vLLM)",
              file=sys.stderr)
        return 2
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import resolve_model_path

    start, records = time.time(), []
    batches = [8] if args.quick else [64, 512]
    with tempfile.TemporaryDirectory(prefix="distflow-bench-engines-") as tmp:
        for name, shape in MODELS.items():
            if args.quick and shape is not None:
                continue
            path = resolve_model_path(BUILTIN_MODEL) if shape is None else build_random_llama(Path(tmp) / name, shape)
            for r in measure(name, path, batches, args.max_new_tokens):
                records.append(r)
                print(f"{r['model']:>10} batch {r['batch']:>3}: HF {r['hf_tokens_per_s']:,.0f} tokens/s, "
                      f"vLLM {r['vllm_tokens_per_s']:,.0f} tokens/s ({r['speedup']:.2f}x); weight sync "
                      f"{r['hf_sync_s_per_100mb']:.3f} / {r['vllm_sync_s_per_100mb']:.3f} s per 100 MB", flush=True)
    command = command_line("distflow bench engines", argv)
    save_results(args, records, markdown(records, command, time.time() - start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
