"""runtime.placement=disaggregated: rollout workers generate continuously, train workers
train, and the two meet only through the coordinator's streams (coordinator/stream.py).

    train ranks 0..T-1                           rollout ranks T..T+R-1
    Trainer on the graph's second half           RolloutWorker on its first half
      (reference, old log-probs, advantage,        (generation, reward, filters)
       updates), held-out evaluation,
       checkpoints, metrics
           ^  samples of step s, whole groups, balanced by tokens  |
           |-------------------------------------------------------|
           |  weights of version v (after v updates), from rank 0  v

Versions and staleness. The samples of step s are trained on by the policy of version
s - 1. A rollout worker generates step s with the newest weights it holds, and only
once it holds version s - 1 - k or newer (k = algorithm.max_staleness), so no sample is
more than k versions behind the policy that trains on it; every sample carries its
version (`weight_version`). k = 0 is the synchronous schedule: the same samples and the
same updates as the colocated run. With k > 0 the update needs the old (proximal)
policy's log-probs and corrects for the sampler's (algorithm.old_log_probs_from,
algorithm.rollout_correction; defaults: decoupled PPO with token-level truncated IS).

Partial rollout (rollout.partial): weights that arrive while a rollout worker generates
are swapped in between two tokens, so in-flight sequences continue on the new policy
instead of waiting for the step to end; each token carries the version that computed
it (`rollout_weight_version`) and its log-prob under that version, which the
token-level correction uses; the staleness bound counts a sample by its first token.

Resuming: the rollout workers start again from the checkpoint's step with its weights,
so samples that were in flight when the run stopped are generated again with those
weights (the first resumed step has lag 0) and nothing is trained twice.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import torch

from distflow.collectives import all_gather_objects
from distflow.config import Config, chat_template_kwargs, traced_steps
from distflow.coordinator.double_buffer import DoubleBuffer
from distflow.coordinator.layout import Layout
from distflow.coordinator.placement import Placement
from distflow.coordinator.store import LocalStore
from distflow.coordinator.stream import (TrajectoryReceiver, TrajectorySender, WeightPublisher, WeightSubscriber,
                                         assign_groups, group_tokens)
from distflow.dag.scheduler import Scheduler, node_seconds
from distflow.data.batch import Batch
from distflow.engines.common import load_tokenizer
from distflow.runtime.roles import Roles, split_roles
from distflow.trainer import checkpoint, nodes
from distflow.trainer.loop import (PromptSource, RefillPrompts, StatusFile, Trainer, close_reward_runners,
                                   fit_and_close, make_episode_runner, make_reward_runners, make_rollout_engine,
                                   resolve_overlap, worker_device, write_trace)
from distflow.trainer.metrics import MeanAccumulator, StageTimer
from distflow.trainer.recipes import ROLLOUT_ROLES, build_graph


def sample_versions(batch: Batch, engine_version: int) -> torch.Tensor:
    """The weight version each sample's staleness is counted by: with rollout.partial its
    first token's (later tokens may come from newer weights), else the engine's."""
    if "rollout_weight_version" in batch.tensors:
        return batch["rollout_weight_version"][:, 0].clone()
    return torch.full((len(batch),), engine_version, dtype=torch.long)


def changed_weights_mid_sample(batch: Batch) -> torch.Tensor:
    """rollout.partial: which samples have a response token computed by newer weights than
    their first token's (tokens past the response, under no mask, do not count)."""
    versions, mask = batch["rollout_weight_version"], batch["response_mask"].bool()
    return versions.masked_fill(~mask, -1).max(dim=1).values > batch["weight_version"]


class TrainSide:
    """A train worker's ends of the streams: samples in (every rank), weights out (rank 0)."""

    def __init__(self, cfg: Config, roles: Roles, first_step: int):
        self.cfg, self.roles = cfg, roles
        self.receiver = TrajectoryReceiver(roles.bridge, roles.rollout_ranks, first_step, cfg.trainer.total_steps,
                                           cfg.runtime.stream_timeout_s)
        self.publisher = WeightPublisher(roles.weights) if roles.weights is not None else None
        self.notes: dict[int, list[dict]] = {}
        self.dropped: dict[int, int] = {}
        self.lock = threading.Lock()

    def receive(self, step: int) -> Batch:
        """Step `step`'s samples (runs on the prefetch thread). A sample older than
        max_staleness versions is dropped and counted (the rollout workers' pause keeps
        this from happening; the check is what the bound promises)."""
        batch, notes = self.receiver.take(step)
        lag = (step - 1) - batch["weight_version"] if len(batch) else torch.zeros(0, dtype=torch.long)
        fresh = lag <= self.cfg.algorithm.max_staleness
        with self.lock:
            self.notes[step], self.dropped[step] = notes, int((~fresh).sum())
        return batch if bool(fresh.all()) else batch.select(fresh.nonzero().flatten())

    def record(self, step: int, batch: Batch, acc: MeanAccumulator) -> dict[str, float]:
        """The version-lag metrics of the step's samples (into `acc`); returns the rollout
        side's own metrics (rollout rank 0's note, on the train rank that got it)."""
        with self.lock:
            notes, dropped = self.notes.pop(step), self.dropped.pop(step)
        acc.add_total("async/dropped_stale_samples", dropped)
        lag = ((step - 1) - batch["weight_version"]).float() if len(batch) else torch.zeros(0)
        acc.add("async/version_lag_mean", float(lag.sum()), len(lag))
        acc.add_max("async/version_lag_max", float(lag.max()) if len(lag) else 0.0)
        for k in range(self.cfg.algorithm.max_staleness + 1):  # the lag histogram, as fractions
            acc.add(f"async/version_lag_{k}", float((lag == k).sum()), len(lag))
        if "rollout_weight_version" in batch.tensors:
            acc.add("async/partial_samples", float(changed_weights_mid_sample(batch).sum()), len(batch))
        return next((n["metrics"] for n in notes if "metrics" in n), {})

    def publish(self, actor, version: int) -> None:
        """The updated policy to every rollout worker (train rank 0 sends; with sharded
        weights every train rank takes part in gathering them)."""
        if version >= self.cfg.trainer.total_steps:  # nobody generates with the last weights
            return
        weights = actor.iter_full_weights()
        if self.publisher is not None:  # in the rollout engines' dtype (model.dtype), as HF loads them
            self.publisher.publish(weights, version, getattr(torch, self.cfg.model.dtype),
                                   getattr(actor.module, "_keep_in_fp32_modules", None) or ())
        elif not actor.holds_full_weights:
            for _ in weights:  # each tensor's gather is a collective
                pass

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.receiver.check()


class RolloutWorker:
    """A rollout rank: the graph's first half, step after step, as far ahead of the
    trainers as the staleness bound lets it."""

    def __init__(self, cfg: Config, run_dir: Path, device: torch.device, roles: Roles):
        import torch.distributed as dist

        self.cfg, self.run_dir, self.roles = cfg, run_dir, roles
        self.trace_steps = traced_steps(cfg)
        self._status = StatusFile(run_dir, roles.world_rank, " (rollout worker)")  # under its rank in the job
        self.rank, self.world = dist.get_rank(), dist.get_world_size()  # within the rollout workers
        self.graph = build_graph(cfg).split(ROLLOUT_ROLES)[0]
        self.tokenizer = load_tokenizer(cfg.model.path, chat_template_kwargs(cfg))
        layout = Layout(self.world, tp_size=cfg.rollout.replica_size)
        self.prompts = PromptSource(cfg, layout, self.rank, self.tokenizer.pad_token_id)
        resume_from = checkpoint.resolve(cfg.trainer.resume, run_dir)
        self.start_step = self.prompts.resumed_step(resume_from)  # checked before the model loads
        torch.manual_seed(cfg.trainer.seed)
        self.engine = make_rollout_engine(cfg, str(resume_from or cfg.model.path), self.tokenizer, device, actor=None)
        self.engine.weight_version = self.start_step
        reward_fn, accuracy_fn = make_reward_runners(cfg, device)
        overlap = resolve_overlap(cfg, device)
        self.ctx = nodes.WorkerContext(cfg=cfg, tokenizer=self.tokenizer, rollout=self.engine, actor=None,
                                       reward_fn=reward_fn, accuracy_fn=accuracy_fn, overlap=overlap)
        self.ctx.episodes = make_episode_runner(cfg, self.engine, self.tokenizer)
        self.scheduler = Scheduler(self.graph, placement=Placement(layout, layout), overlap=overlap,
                                   threads=cfg.scheduler.threads,
                                   refill=RefillPrompts(self.prompts, self.tokenizer, self.ctx)
                                   if any(n.refill for n in self.graph.nodes) else None,
                                   on_node=lambda name: self._status(self.ctx.step, name),
                                   train_ranks=cfg.runtime.train_workers)  # a filter leaves each of them a row
        self.sender = TrajectorySender(roles.bridge, roles.train_ranks)
        self.weights = WeightSubscriber(roles.weights, self.start_step)
        self.swaps_in_flight = 0  # rollout.partial: weights swapped in during a generation
        if cfg.rollout.partial:
            self.engine.newer_weights = self._swap_during_generation

    def _newer_weights(self):
        """(version, weights) newer than the engine's, if any arrived; else None."""
        tp_group = getattr(self.engine, "tp_group", None)  # a tensor-parallel vLLM engine's ranks
        if tp_group is not None:  # one version for all of them
            return self.weights.take_agreed(tp_group, self.engine.weight_version, self.cfg.runtime.stream_timeout_s)
        newest = self.weights.take_newer()
        return newest if newest is not None and newest[0] > self.engine.weight_version else None

    def _swap_during_generation(self):
        """rollout.partial: asked by the engine after every token; counted when it swaps."""
        newest = self._newer_weights()
        self.swaps_in_flight += newest is not None
        return newest

    def run(self) -> dict:
        cfg, k = self.cfg, self.cfg.algorithm.max_staleness
        first, total = self.start_step + 1, cfg.trainer.total_steps
        store, busy, start = LocalStore(), 0.0, time.perf_counter()
        for index, sources in DoubleBuffer(lambda i: self.prompts.prepare(first + i), max(total - self.start_step, 0)):
            step = first + index
            timer = StageTimer(step, self._status)
            with timer("wait_for_weights"):
                self.weights.wait_for(step - 1 - k, cfg.runtime.stream_timeout_s)
            with timer("weight_swap"):
                newest = self._newer_weights()
                if newest is not None:
                    self.engine.update_weights(newest[1], version=newest[0])
            t0 = time.perf_counter()
            self.ctx.step, self.ctx.acc = step, MeanAccumulator()
            store.clear()
            store.put(sources)
            spans = self.scheduler.run(self.ctx, store, step)
            if step in self.trace_steps:  # under its rank in the job, beside the train workers' traces
                write_trace(self.run_dir, step, self.roles.world_rank, spans)
            batch = self._rows_to_send(store)
            batch.tensors["weight_version"] = sample_versions(batch, self.engine.weight_version)
            busy += time.perf_counter() - t0
            metrics = self._metrics(step, spans, timer)  # a collective among the rollout workers
            owner = assign_groups(all_gather_objects(group_tokens(batch)), len(self.roles.train_ranks))  # and one more
            self.sender.send(step, batch, {"metrics": metrics} if self.rank == 0 else {}, owner)
        self.sender.close()
        # the trainers end the stream after their last update: up to k + 1 steps after the last samples were sent,
        # and then the final evaluation and checkpoint
        self.weights.join(cfg.runtime.stream_timeout_s * (cfg.algorithm.max_staleness + 2))
        return {"role": "rollout", "rank": self.roles.world_rank, "busy_fraction": busy / (time.perf_counter() - start)}

    def _rows_to_send(self, store: LocalStore) -> Batch:
        """Each sample once, in whole groups: with rollout.replica_size > 1 a replica's
        members each hold a share of its groups (or, after a `groups` node, all of them),
        so the shares are gathered onto every member and only its first sends them."""
        placement = self.scheduler.placement
        if placement.rollout.tp_size == 1:
            return store.all()
        if self.scheduler.state != "groups":
            placement.move(store, self.scheduler.state, "groups")
        batch = store.all()
        return batch if placement.rollout.tp_rank(self.rank) == 0 else batch.select(torch.arange(0))

    def _metrics(self, step: int, spans, timer: StageTimer) -> dict[str, float]:
        """The rollout side's timings and counters of the step, over all rollout workers."""
        acc = self.ctx.acc
        counts = self.prompts.take_counts(step)
        for name in ("skipped_rows", "truncated_prompts"):
            acc.add_total(f"data/{name}", counts[name])
        for name, value in self.scheduler.counters.items():
            acc.add_total(name, value if self.rank == 0 else 0.0)
        for node, secs in node_seconds(spans).items():
            acc.add_max(f"time/{node}", secs)
        acc.add_max("async/rollout_wait_for_weights_s", timer.seconds["wait_for_weights"])
        acc.add_max("time/weight_swap", timer.seconds["weight_swap"])
        if self.cfg.rollout.partial:
            acc.add_total("async/swaps_during_generation", self.swaps_in_flight)
            self.swaps_in_flight = 0
        return acc.reduce()

    def close(self) -> None:
        self.scheduler.close()
        if self.ctx.episodes is not None:
            self.ctx.episodes.close()
        self.engine.close()
        close_reward_runners(self.ctx.reward_fn, self.ctx.accuracy_fn)


def run_disaggregated(cfg: Config, run_dir: Path, progress: bool) -> dict:
    """A worker of a disaggregated run: split the job's group into the two sides, then
    train or generate."""
    rt = cfg.runtime
    roles = split_roles(rt.train_workers, rt.rollout_workers, rt.collective_timeout_s, rt.stream_timeout_s)
    device = worker_device(cfg)
    if roles.role == "rollout":
        worker = RolloutWorker(cfg, run_dir, device, roles)
        try:
            result = worker.run()
        finally:
            worker.close()
        roles.close()
        return result
    resume_from = checkpoint.resolve(cfg.trainer.resume, run_dir)
    start = checkpoint.read_state(resume_from)["step"] if resume_from is not None else 0
    side = TrainSide(cfg, roles, start + 1)
    eval_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="hf",
                                                                    tensor_parallel_size=1, replica_size=1))
    summary = fit_and_close(Trainer(eval_cfg, run_dir, device, progress, stream=side, tracked_cfg=cfg),
                            after_fit=side.close)
    roles.close()
    return summary
