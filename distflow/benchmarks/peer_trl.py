"""DistFlow against TRL's `GRPOTrainer` on one machine, side by side, the same wall budget.

    distflow bench trl                  # about 4 min on 2 cores; needs TRL (README: Benchmarks)
    distflow bench trl --steps 10       # quicker

Both train GRPO on the same model folder (the embedded 0.87M-parameter Llama), the same
parquet files (the built-in arithmetic task written out: 20,000 train problems, 256
held-out), the same strict GSM8K-style reward (distflow's own function, called by both),
64 completions per step (8 prompts x 8), one update per step, temperature 1, up to 32
new tokens, learning rate 1e-4 constant, KL to the reference 0.001, token-mean loss,
group-normalised advantages. DistFlow runs `--steps` steps with 2 workers (its default
launcher, one intra-op thread each); TRL then runs in one process (torch's default
threads: both cores) until it has trained as long as DistFlow did (a callback stops it),
so both get the same wall budget for training (start-up and evaluation excluded).

Reported for each: steps, prompt+completion tokens per second of training, and held-out
accuracy before and after (greedy, the 256 held-out problems), all measured by the same
evaluator (this file's `heldout_accuracy`: DistFlow's HF engine and reward on the saved
model folder). DistFlow's own evaluation is printed beside it as a check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distflow.benchmarks.records import command_line, save_results

TRAIN_ROWS, HELDOUT_ROWS = 20000, 256
PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS, LR, KL = 8, 8, 32, 1e-4, 0.001


def write_task(folder: Path) -> tuple[str, str]:
    from distflow.data.dataset import write_builtin_parquet

    return (write_builtin_parquet(str(folder / "train.parquet"), "arith", "train", TRAIN_ROWS),
            write_builtin_parquet(str(folder / "test.parquet"), "arith", "test", HELDOUT_ROWS))


def heldout_accuracy(model_path: str, test_file: str) -> float:
    """Greedy accuracy on the held-out parquet: DistFlow's evaluation (HF engine, strict reward)."""
    from distflow.data.dataset import PromptReader, ShardedDataset
    from distflow.engines.common import load_causal_lm, load_tokenizer
    from distflow.engines.reward import RewardRunner
    from distflow.engines.rollout import HFRolloutEngine
    from distflow.trainer.evaluation import EvalSettings, evaluate
    from distflow.trainer.nodes import encode_prompt

    tok = load_tokenizer(model_path)
    rows, _ = PromptReader(ShardedDataset(test_file), 192, "error", "error").take(
        list(range(HELDOUT_ROWS)), lambda row: encode_prompt(tok, row), replace=False)
    runner = RewardRunner(None, 30.0)
    try:
        report = evaluate(HFRolloutEngine(load_causal_lm(model_path), tok), tok, [r for r, _ in rows],
                          [ids for _, ids in rows], runner, runner, EvalSettings(max_new_tokens=MAX_NEW_TOKENS))
    finally:
        runner.close()
    return report["accuracy"]


def run_distflow(work: Path, train: str, test: str, steps: int) -> dict:
    out = work / "distflow"
    cmd = [sys.executable, "-m", "distflow.cli", "train", f"data.train_files={train}", f"data.val_files={test}",
           f"data.train_batch_size={PROMPTS_PER_STEP}", f"actor.ppo_mini_batch_size={PROMPTS_PER_STEP}",
           f"algorithm.group_size={GROUP}", f"rollout.max_new_tokens={MAX_NEW_TOKENS}", f"actor.lr={LR}",
           "actor.lr_scheduler=constant", "actor.lr_warmup_steps=0", f"algorithm.kl_coef={KL}",
           f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.progress=false",
           f"trainer.output_dir={out}"]
    proc = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"distflow train failed: {proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    steps_done = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    tokens = sum(m["tokens/total"] for m in steps_done)
    # the step and its wait for prompts, as TRL's elapsed time holds its data loading (perf/tokens_per_second's basis)
    train_seconds = sum(m["time/step"] + m["time/wait_for_samples"] for m in steps_done)
    return {"framework": "distflow", "steps": len(steps_done), "train_seconds": train_seconds,
            "tokens": tokens, "tokens_per_s": tokens / train_seconds, "model": str(out / "checkpoints" / "final"),
            "own_heldout_initial": summary["heldout_accuracy_initial"],
            "own_heldout_final": summary["heldout_accuracy_final"]}


def run_trl(work: Path, model: str, train: str, budget_s: float) -> dict:
    """TRL's GRPOTrainer, stopped once it has trained for `budget_s` seconds."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from distflow.engines.common import load_tokenizer, render_prompt
    from distflow.engines.reward import default_compute_score

    tok = load_tokenizer(model)
    table = pq.read_table(train).to_pylist()
    data = Dataset.from_list([{"prompt": render_prompt(tok, row["prompt"]), "data_source": row["data_source"],
                               "ground_truth": row["reward_model"]["ground_truth"]} for row in table])

    def strict_reward(prompts, completions, ground_truth, data_source, **_):
        return [default_compute_score(src, text, gt) for text, gt, src in zip(completions, ground_truth, data_source)]

    class WallBudget(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.elapsed = time.perf_counter() - self.start
            control.should_training_stop = self.elapsed >= budget_s

    out = work / "trl"
    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
                        num_generations=GROUP, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0,
                        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, beta=KL,
                        loss_type="dapo", scale_rewards="group", max_steps=100000, logging_steps=1,
                        save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=1,
                        dataloader_num_workers=0, disable_tqdm=True,
                        # TRL's default recomputes each layer's activations in the backward; DistFlow's
                        # (actor.gradient_checkpointing) keeps them: the same on both sides
                        gradient_checkpointing=False)
    budget = WallBudget()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=strict_reward, args=config,
                          train_dataset=data, processing_class=tok, callbacks=[budget])
    trainer.train()
    trainer.save_model(str(out / "final"))
    tok.save_pretrained(str(out / "final"))
    logs = [r for r in trainer.state.log_history if "num_tokens" in r]
    tokens = logs[-1]["num_tokens"] if logs else float("nan")
    return {"framework": "trl", "steps": trainer.state.global_step, "train_seconds": budget.elapsed,
            "tokens": tokens, "tokens_per_s": tokens / budget.elapsed, "model": str(out / "final")}


def markdown(rows: list[dict], command: str, seconds: float) -> str:
    lines = [f"Measured with `{command}` ({seconds / 60:.1f} min, {platform.machine()}, {os.cpu_count()} cores).", "",
             "| framework | steps in the budget | training seconds | tokens/s | held-out before | held-out after |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['framework']} | {r['steps']} | {r['train_seconds']:.1f} | {r['tokens_per_s']:,.0f} "
                     f"| {r['heldout_initial']:.1%} | {r['heldout_final']:.1%} |")
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    lines += ["", f"DistFlow / TRL tokens/s: {ratio:.2f}x."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench trl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="DistFlow's steps; they set the wall budget")
    parser.add_argument("--json", help="write the two records (JSON lines)")
    parser.add_argument("--results-md", help="write the table as markdown")
    args = parser.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print("distflow bench trl: TRL is not importable in this Python (README: Benchmarks)", file=sys.stderr)
        return 2
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import resolve_model_path

    start = time.time()
    model = resolve_model_path(BUILTIN_MODEL)
    with tempfile.TemporaryDirectory(prefix="distflow-bench-trl-") as tmp:
        work = Path(tmp)
        train, test = write_task(work)
        before = heldout_accuracy(model, test)
        ours = run_distflow(work, train, test, args.steps)
        theirs = run_trl(work, model, train, ours["train_seconds"])
        for r in (ours, theirs):
            r.update(heldout_initial=before, heldout_final=heldout_accuracy(r.pop("model"), test))
    for r in (ours, theirs):
        print(f"{r['framework']:>8}: {r['steps']} steps in {r['train_seconds']:.1f} s, {r['tokens_per_s']:,.0f} "
              f"tokens/s, held-out {r['heldout_initial']:.1%} -> {r['heldout_final']:.1%}")
    print(f"distflow's own evaluation: {ours['own_heldout_initial']:.1%} -> {ours['own_heldout_final']:.1%}")
    command = command_line("distflow bench trl", argv)
    save_results(args, [ours, theirs], markdown([ours, theirs], command, time.time() - start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
