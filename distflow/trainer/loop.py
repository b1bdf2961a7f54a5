"""The worker program. Every worker runs `run_worker` (SPMD): it loads the engines,
takes its own prompts, and runs the step loop; workers meet only in collectives.

`Trainer.step` is the whole algorithm, as named stages (see stages.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distflow.config import Config, from_dict
from distflow.coordinator.double_buffer import DoubleBuffer
from distflow.coordinator.executor import TransferStats
from distflow.coordinator.layout import Layout
from distflow.coordinator.store import LocalStore
from distflow.data.dataset import ShardedDataset
from distflow.data.loader import ShardedSampler
from distflow.engines.actor import FSDPActor, OptimConfig, ReferenceModel
from distflow.engines.common import load_causal_lm, load_tokenizer
from distflow.engines.reward import load_reward_fn
from distflow.engines.rollout import HFRolloutEngine, SamplingParams
from distflow.trainer import stages
from distflow.trainer.metrics import MeanAccumulator, MetricsWriter, StageTimer
from distflow.trainer.report import save_checkpoint, write_plot


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, device: torch.device, progress: bool):
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.tokenizer = load_tokenizer(cfg.model.path)
        # The prefetch thread gets its own instance: HF fast tokenizers may mutate their
        # padding/truncation state per call, which two threads must not share.
        self.prefetch_tokenizer = load_tokenizer(cfg.model.path)
        # Each worker opens the files (metadata only) and reads the rows of its own shard.
        self.train_rows = ShardedDataset(cfg.data.train_files)
        val = ShardedDataset(cfg.data.val_files)
        self.val_rows = val.rows(list(range(min(len(val), cfg.data.val_max_samples)))[self.rank::self.world])
        # Layouts: rollout replicas are TP groups; training is data-parallel over all ranks.
        self.rollout_layout = Layout(self.world, tp_size=cfg.rollout.tensor_parallel_size)
        self.train_layout = Layout.data_parallel(self.world)
        self.sampler = ShardedSampler(len(self.train_rows), cfg.data.train_batch_size,
                                      self.rollout_layout.dp_rank(self.rank), self.rollout_layout.dp_size,
                                      cfg.trainer.seed)
        self.reward_fn = load_reward_fn(cfg.reward.custom_fn)
        torch.manual_seed(cfg.trainer.seed)
        self.actor = FSDPActor(load_causal_lm(cfg.model.path, cfg.model.dtype),
                               OptimConfig(lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay,
                                           grad_clip=cfg.actor.grad_clip), device)
        self.rollout = HFRolloutEngine(load_causal_lm(cfg.model.path, cfg.model.dtype, device), self.tokenizer,
                                       cfg.rollout.micro_batch_size)
        self.ref = (ReferenceModel(load_causal_lm(cfg.model.path, cfg.model.dtype), device)
                    if cfg.algorithm.use_kl_loss else None)
        self.store = LocalStore()
        self.writer = MetricsWriter(run_dir / "metrics.jsonl") if self.rank == 0 else None
        self.progress = progress and self.rank == 0

    # ------------------------------------------------------------------ one step

    def prepare(self, step: int) -> list[stages.Sequence_]:
        """The step's prompts, tokenised: runs on the prefetch thread one step ahead."""
        positions = self.sampler.local_positions(step)
        rows = list(zip([p for p, _ in positions], self.train_rows.rows([i for _, i in positions])))
        share = (self.rollout_layout.tp_rank(self.rank), self.rollout_layout.tp_size)
        return stages.prepare_sequences(rows, self.cfg, self.prefetch_tokenizer, share)

    def step(self, step: int, seqs: list[stages.Sequence_]) -> dict[str, float]:
        cfg, store, timer, acc = self.cfg, self.store, StageTimer(step, self._status), MeanAccumulator()
        moved, tp = TransferStats(), self.rollout_layout.tp_size
        store.clear()
        with timer("prompts"):
            prompt_ids = stages.stage_prompts(store, seqs, cfg)
        with timer("rollout"):
            stages.stage_rollout(store, prompt_ids, self.rollout, cfg, step)
        with timer("reward"):
            stages.stage_reward(store, self.tokenizer, self.reward_fn)
        if tp > 1:  # the TP group's members generated halves of one replica: gather it
            with timer("reshard"):
                stages.stage_reshard(store, self.train_layout, self.rollout_layout, "none", moved)
        with timer("advantage"):  # GRPO groups are whole on every replica
            stages.stage_advantage(store, cfg)
        if tp > 1:  # to the training layout, balanced over the DP ranks, streamed into the reference
            with timer("reshard_ref_log_prob"):
                stages.stage_stream_reshard_ref(store, self.rollout_layout, self.train_layout, self.ref, cfg, moved)
        else:
            with timer("ref_log_prob"):
                stages.stage_ref_log_prob(store, self.ref, cfg)
        with timer("old_log_prob"):
            stages.stage_old_log_prob(store, self.actor, cfg)
        with timer("actor_update"):
            stages.stage_actor_update(store, self.actor, cfg, acc)
        with timer("weight_sync"):
            stages.stage_weight_sync(self.actor, self.rollout)
        stages.record_rollout_metrics(store, acc)
        for name, value in moved.as_metrics().items():
            acc.add_total(name, value)
            acc.add_max(f"{name}_busiest_rank", value)
        for stage, seconds in timer.seconds.items():
            acc.add_max(f"time/{stage}", seconds)
        return acc.reduce()

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, step: int) -> float:
        with StageTimer(step, self._status)("evaluate"):  # named in errors and in the status file
            return self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> float:
        """Greedy held-out accuracy over all workers (validation rows interleaved)."""
        rows = self.val_rows
        correct = 0.0
        if rows:
            ids = stages.tokenize_prompts(self.tokenizer, rows, self.cfg.data.max_prompt_length)
            out = self.rollout.generate(ids, None, SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens,
                                                                  greedy=True))
            out.meta.update({"ground_truth": [r.ground_truth for r in rows],
                             "data_source": [r.data_source for r in rows],
                             "extra_info": [r.extra_info for r in rows]})
            _, acc = stages.score_responses(self.tokenizer, out, self.reward_fn)
            correct = float(acc.sum())
        totals = torch.tensor([correct, float(len(rows))], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(totals)
        return float(totals[0] / totals[1])

    # ------------------------------------------------------------------ the run

    def fit(self) -> dict:
        cfg, start = self.cfg, time.time()
        total, eval_every = cfg.trainer.total_steps, cfg.trainer.eval_every
        initial = self.evaluate(0)
        self._log({"step": 0, "val/accuracy": initial})
        bar = self._progress_bar(total)
        tokens, train_seconds, final = 0.0, 0.0, initial
        # the next step's prompts are read and tokenised while this step computes
        for index, seqs in DoubleBuffer(lambda i: self.prepare(i + 1), total):
            step = index + 1
            t0 = time.perf_counter()
            metrics = self.step(step, seqs)
            seconds = time.perf_counter() - t0
            train_seconds += seconds
            tokens += metrics["tokens/total"]
            metrics.update({"step": step, "time/step": seconds,
                            "perf/tokens_per_second": metrics["tokens/total"] / seconds})
            if step == total or (eval_every and step % eval_every == 0):
                final = metrics["val/accuracy"] = self.evaluate(step)
            if cfg.trainer.save_every and step % cfg.trainer.save_every == 0 and step != total:
                self._save(f"step_{step}")
            self._log(metrics)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", val=f"{final:.3f}")
        if bar is not None:
            bar.close()
        if cfg.trainer.save_final:
            self._save("final")
        summary = {
            "heldout_accuracy_initial": initial, "heldout_accuracy_final": final, "steps": total,
            "num_workers": self.world, "wall_seconds": time.time() - start,
            "train_seconds": train_seconds, "tokens_per_second": tokens / max(train_seconds, 1e-9),
            "algorithm": cfg.algorithm.name, "run_dir": str(self.run_dir),
        }
        if self.rank == 0:
            history = self.writer.read()
            summary["reward_first"] = next(r["reward/mean"] for r in history if "reward/mean" in r)
            summary["reward_last"] = history[-1]["reward/mean"]
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            write_plot(history, self.run_dir / "reward.png")
        return summary

    def _status(self, step: int, stage: str) -> None:
        """Where this worker is, for the launcher: it names the stage when a worker dies."""
        path = self.run_dir / "status" / f"rank-{self.rank}.json"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "pid": os.getpid(), "step": step, "stage": stage}))
        os.replace(tmp, path)  # atomic: the launcher never reads half a file

    def _log(self, record: dict) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def _save(self, name: str) -> None:
        if self.rank == 0:  # the rollout copy holds the latest full weights already
            save_checkpoint(self.rollout.model, self.tokenizer, self.run_dir / "checkpoints" / name)

    def _progress_bar(self, total: int):
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)


def run_worker(cfg_dict: dict, run_dir: str, progress: bool = False) -> dict:
    """Entry point of every worker (Ray actor or torchrun process); the process group
    is already initialised by the runtime."""
    cfg = from_dict(cfg_dict)
    device = torch.device("cpu")
    if torch.cuda.is_available() and cfg.runtime.device != "cpu":
        device = torch.device("cuda", torch.cuda.current_device())
    return Trainer(cfg, Path(run_dir), device, progress).fit()
