"""The worker program. Every worker runs `run_worker` (SPMD): it loads the engines,
takes its own prompts, and runs the step loop; workers meet only in collectives.

`Trainer.step` runs the algorithm's task graph (built from the recipe by recipes.py)
with the per-worker scheduler; the nodes' code is in nodes.py. In runtime.mode=centralized
the same scheduler runs each node on the driver's command instead
(runtime/centralized.py)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sys
import threading
import time
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from distflow.algos.kl import AdaptiveKLController, make_kl_controller
from distflow.collectives import all_gather_objects, all_reduce_sum
from distflow.config import (Config, chat_template_kwargs, from_dict, response_token_budget, reward_fn_kwargs,
                             reward_fn_weights, tool_names, traced_steps)
from distflow.coordinator.double_buffer import DoubleBuffer
from distflow.coordinator.executor import TransferStats
from distflow.coordinator.layout import Layout
from distflow.coordinator.placement import Placement
from distflow.coordinator.store import LocalStore
from distflow.dag.scheduler import Scheduler, chrome_trace, node_seconds
from distflow.data.batch import Batch
from distflow.data.dataset import PromptReader, PromptRow, ShardedDataset
from distflow.data.images import ImagePrompter, vision_token_ids
from distflow.data.loader import ShardedSampler
from distflow.engines.actor import Actor, OptimConfig, ReferenceModel, lr_factor
from distflow.engines.common import (causal_lm_skeleton, checkpoints_activations, load_causal_lm, load_image_prompter,
                                     load_tokenizer, resolve_model_path, without_dropout)
from distflow.engines.agent import EpisodeRunner, EpisodeSettings, ToolEnvironment, tool_result_form
from distflow.engines.critic import Critic
from distflow.engines.openai_endpoint import AgentRunner, AgentSettings
from distflow.engines.lora import AdapterDisabledReference, LoraSettings, adapter_base, is_adapter_folder, with_lora
from distflow.engines.reward import RewardRunner
from distflow.engines.reward_model import RewardModel
from distflow.engines.rollout import HFRolloutEngine, RolloutEngine
from distflow.engines.tools import Toolbox, schemas
from distflow.plugins import load_callable
from distflow.runtime import netns
from distflow.runtime.centralized import run_commanded_step
from distflow.runtime.process_group import DEVICE_ENV
from distflow.trainer import checkpoint, nodes
from distflow.trainer.evaluation import EvalSettings, evaluate, write_report
from distflow.trainer.metrics import MeanAccumulator, MetricsWriter, StageTimer, progress_postfix
from distflow.trainer.recipes import ROLLOUT_ROLES, build_graph
from distflow.trainer.report import write_plot
from distflow.trainer.tracking import RUN_IDS, TENSORBOARD_DIR, Trackers


def resolve_overlap(cfg: Config, device: torch.device) -> bool:
    """scheduler.overlap=auto: overlap needs somewhere to run the second node. A GPU
    worker has its host CPU for rewards beside the device work; CPU workers need a core
    left over (measured in benchmarks/SCHEDULER.md: with every core busy, threads only
    contend)."""
    if cfg.scheduler.overlap != "auto":
        return bool(cfg.scheduler.overlap)
    if cfg.actor.lora_rank:  # the reference (adapter off) must not run beside the rollout (adapter on)
        return False
    if device.type == "cuda":
        return True
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.runtime.num_workers))  # workers on this host
    return (os.cpu_count() or 1) > local * cfg.runtime.threads_per_worker


def set_aside_earlier_run(run_dir: Path) -> None:
    """A run that starts at step 0 in a folder an earlier run used (trainer.resume=off, or
    one that stopped before its first checkpoint) does not mix with it: the earlier
    checkpoints move to `checkpoints-abandoned/` (else `resume=auto` and `keep_last` would
    take them for this run's); its metrics file becomes `metrics-<n>.jsonl`, its
    TensorBoard folder `tensorboard-<n>` (TensorBoard drew both runs as one curve) and its
    trackers' run ids `trackers-<n>.json` (a later resume of this run went on in its W&B
    or MLflow run)."""
    for moved in checkpoint.set_aside_newer(run_dir / "checkpoints", 0):
        print(f"distflow: starting at step 0: the earlier run's checkpoint {moved.name} in this folder is set "
              f"aside in {moved.parent}", file=sys.stderr)
    for name in ("metrics.jsonl", TENSORBOARD_DIR, RUN_IDS):
        if (run_dir / name).exists():
            kept = checkpoint.set_aside_numbered(run_dir / name)
            print(f"distflow: starting at step 0: the earlier run's {name} is kept as {kept.name}", file=sys.stderr)
    (run_dir / "summary.json").unlink(missing_ok=True)


def write_trace(run_dir: Path, step: int, rank: int, spans) -> None:
    """trainer.trace_steps: the step's node spans on this worker as a Chrome trace,
    run_dir/traces/step_<step>_rank_<rank>.json (the job's rank)."""
    path = run_dir / "traces" / f"step_{step}_rank_{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans, rank)))


def lora_settings(cfg: Config) -> LoraSettings | None:
    """The run's LoRA settings; None without actor.lora_rank."""
    a = cfg.actor
    return LoraSettings(rank=a.lora_rank, alpha=a.lora_alpha, dropout=a.lora_dropout,
                        target_modules=a.lora_target_modules) if a.lora_rank else None


class StatusFile:
    """Where a worker is, for the launcher (run_dir/status/rank-<rank>.json): it names the
    stage when a worker dies. Nodes start on several threads, so writes are serialised,
    and each is atomic: the launcher never reads half a file."""

    def __init__(self, run_dir: Path, rank: int, role: str = ""):
        self.path, self.rank, self.role = run_dir / "status" / f"rank-{rank}.json", rank, role
        self.lock = threading.Lock()

    def __call__(self, step: int, stage: str) -> None:
        with self.lock:
            self.path.parent.mkdir(exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rank": self.rank, "pid": os.getpid(), "step": step,
                                       "stage": f"{stage}{self.role}"}))
            os.replace(tmp, self.path)


class PromptSource:
    """This worker's prompts: the rows of its shard of data.train_files (metadata only is
    opened; rows are read when a step needs them) under the bad-row policy, tokenised
    into the step's source fields, one row per response. `prepare` runs on the prefetch
    thread one step ahead, with a tokenizer of its own (HF fast tokenizers may mutate
    their padding state per call, which two threads must not share)."""

    def __init__(self, cfg: Config, layout: Layout, rank: int, pad_id: int):
        self.cfg, self.layout, self.rank, self.pad_id = cfg, layout, rank, pad_id
        self.rows = ShardedDataset(cfg.data.train_files)
        self.reader = PromptReader(self.rows, cfg.data.max_prompt_length, cfg.data.on_bad_row,
                                   cfg.data.on_long_prompt, cfg.trainer.seed)
        self.sampler = ShardedSampler(len(self.rows), cfg.data.train_batch_size, layout.dp_rank(rank),
                                      layout.dp_size, cfg.trainer.seed)
        self.prefetch_tokenizer = load_tokenizer(cfg.model.path, chat_template_kwargs(cfg))
        self.images = load_image_prompter(cfg.model.path, self.prefetch_tokenizer, cfg.model.dtype)  # a VLM's
        self.tools = prompt_tools(cfg)
        self.counts: dict[int, Counter] = defaultdict(Counter)  # step -> skipped rows, truncated prompts
        self.lock = threading.Lock()

    def batch(self, step: int, positions: list[tuple[int, int]], tokenizer, sampler: ShardedSampler,
              refill_round: int = 0) -> Batch:
        """`positions` from `sampler`; a refill round's come after the step's own and earlier rounds'."""
        encode = partial(nodes.encode_prompt, tokenizer, images=self.images,
                         max_image_pixels=self.cfg.data.max_image_pixels, tools=self.tools)
        taken, counts = self.reader.take([i for _, i in positions], encode, draw=sampler.global_indices(step),
                                         positions=[p for p, _ in positions])
        if self.layout.tp_rank(self.rank) == 0:  # a TP group's members read the same rows
            with self.lock:
                self.counts[step].update(counts)
        offset = refill_round * self.cfg.data.train_batch_size
        rows = [(offset + pos, (sampler.epoch_of(step, pos), refill_round), row, ids)
                for (pos, _), (row, ids) in zip(positions, taken)]
        share = (self.layout.tp_rank(self.rank), self.layout.tp_size)
        return nodes.source_batch(rows, self.cfg, self.pad_id, share, self.images)

    def prepare(self, step: int) -> Batch:
        """The step's prompts, tokenised."""
        return self.batch(step, self.sampler.local_positions(step), self.prefetch_tokenizer, self.sampler)

    def resumed_step(self, path: Path | None) -> int:
        """The step the checkpoint `path` ends on (0 for None: a fresh start), once its saved
        data position is checked against this run's data, batch size and seed; called
        before any model loads, so that a changed one stops the run at once."""
        if path is None:
            return 0
        state = checkpoint.read_state(path)
        try:
            after = self.sampler.next_step(state["dataloader"])
        except ValueError as e:
            raise checkpoint.CheckpointError(f"checkpoint {path}: {e}") from None
        if after != state["step"] + 1:
            raise checkpoint.CheckpointError(f"checkpoint {path}: dataloader position {state['dataloader']} "
                                             f"does not match step {state['step']}")
        return state["step"]

    def take_counts(self, step: int) -> Counter:
        with self.lock:
            return self.counts.pop(step, Counter())


class RefillPrompts:
    """More prompts for a refilling filter (DAPO's dynamic sampling): round r of step s
    draws a fresh batch from its own seeded stream, so it never touches the steps'
    data order and is the same for any number of workers."""

    def __init__(self, source: PromptSource, tokenizer, ctx: nodes.WorkerContext):
        self.source, self.tokenizer, self.ctx, cfg = source, tokenizer, ctx, source.cfg
        self.target_groups, self.max_rounds = cfg.data.train_batch_size, cfg.algorithm.max_refill_rounds
        self.samplers: dict[int, ShardedSampler] = {}  # per round, kept: each shuffles the dataset once an epoch

    def prompts(self, round_: int) -> Batch:
        s, cfg = self.source, self.source.cfg
        if round_ not in self.samplers:
            self.samplers[round_] = ShardedSampler(len(s.rows), cfg.data.train_batch_size, s.layout.dp_rank(s.rank),
                                                   s.layout.dp_size, cfg.trainer.seed + 1_000_003 * round_)
        sampler = self.samplers[round_]
        return s.batch(self.ctx.step, sampler.local_positions(self.ctx.step), self.tokenizer, sampler, round_)

    def group_keys(self, batch: Batch) -> list[int]:
        return batch["group"].tolist()

    def renumber(self, batch: Batch, kept: list[int]) -> Batch:
        """Mini-batches over the kept groups, in key order (spread evenly if fewer than asked)."""
        cfg = self.source.cfg
        count = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
        index = {k: i * count // len(kept) for i, k in enumerate(kept)}
        batch.tensors["mini_batch"] = torch.tensor([index[k] for k in batch["group"].tolist()], dtype=torch.long)
        return batch


def make_placement(cfg: Config, rollout: Layout, train: Layout) -> Placement:
    """The step's moves between the layouts (`balanced_within`)."""
    return Placement(rollout, train, balance_within=balanced_within(cfg))


def balanced_within(cfg: Config) -> str | None:
    """With several PPO mini-batches each one is balanced over the training ranks on its
    own (each is an update that waits for its slowest rank), not only the step's rows as
    a whole: the field of their labels."""
    return "mini_batch" if cfg.data.train_batch_size > cfg.actor.ppo_mini_batch_size else None


def make_rollout_engine(cfg: Config, policy_path: str, tokenizer, device: torch.device,
                        actor: Actor | None) -> RolloutEngine:
    """rollout.engine: HF generate on the policy (the actor's own weights when every worker
    holds them whole, else a full copy; `actor` None: no trainer in this process, as in evaluation
    and on a disaggregated rollout worker), or a colocated vLLM engine."""
    r = cfg.rollout
    if r.engine == "hf" and actor is not None and actor.holds_full_weights:  # DDP or one worker: nothing to copy
        return HFRolloutEngine(actor.module, tokenizer, r.micro_batch_size, shares_trainer_weights=True,
                               compute_dtype=actor.compute_dtype)
    if r.engine == "hf":
        return HFRolloutEngine(load_causal_lm(policy_path, cfg.model.dtype, device), tokenizer, r.micro_batch_size)
    from distflow.engines.vllm_rollout import VLLMRolloutEngine

    path = resolve_model_path(policy_path)
    adapter = is_adapter_folder(path)  # a LoRA checkpoint: vLLM loads its base, then takes the merged weights
    engine = VLLMRolloutEngine(resolve_model_path(adapter_base(path)) if adapter else path, tokenizer,
                               tensor_parallel_size=r.tensor_parallel_size, dtype=cfg.model.dtype,
                               max_model_len=cfg.data.max_prompt_length + response_token_budget(cfg),
                               seed=cfg.trainer.seed,
                               gpu_memory_utilization=r.gpu_memory_utilization,
                               kv_cache_memory_gb=r.kv_cache_memory_gb,
                               # a rollout worker's or evaluation's engine has its GPU to itself: sleeping would
                               # only cost the copies out and back and the KV cache's rebuild
                               release_memory_after_rollout=r.release_memory_after_rollout and actor is not None,
                               temperature=r.temperature, top_p=r.top_p)
    if adapter:  # the trainer's weights, or the checkpoint's merge where none is here (evaluation, a rollout worker)
        engine.update_weights(actor.iter_full_weights() if actor is not None else
                              load_causal_lm(path, cfg.model.dtype).state_dict().items(), version=0)
    return engine


def prompt_tools(cfg: Config) -> list[dict]:
    """The schemas of the tools the model may call (rollout.tools, rollout.tool_schemas),
    which the chat template renders with every prompt."""
    return schemas(tool_names(cfg), cfg.rollout.tool_schemas)


def make_episode_runner(cfg: Config, engine: RolloutEngine, tokenizer) -> EpisodeRunner | AgentRunner | None:
    """rollout.agent: the user's OpenAI-client agent on an endpoint backed by `engine`;
    rollout.max_turns > 1: multi-turn episodes with rollout.tools, in rollout.env or the
    default tool environment. Both generate(prompts, seeds, params, tasks) -> Batch."""
    r = cfg.rollout
    budget = response_token_budget(cfg)
    if r.agent is not None:
        return AgentRunner(engine, tokenizer, load_callable(r.agent, "rollout.agent"),
                           AgentSettings(max_total_tokens=budget, max_calls=r.max_turns, timeout_s=r.agent_timeout_s))
    if r.max_turns == 1:
        return None
    toolbox, one_at_a_time = Toolbox(tool_names(cfg), r.tool_timeout_s, r.max_tool_calls_per_turn), False
    if r.env is not None and r.env.startswith("openenv:"):
        from distflow.engines.openenv_env import OpenEnvEnvironment

        env_class = load_callable(r.env.removeprefix("openenv:"), "rollout.env")
        make_env = OpenEnvEnvironment.episodes_of(env_class)
        one_at_a_time = not OpenEnvEnvironment.concurrent(env_class)  # OpenEnv's server runs one session of it
    else:
        make_env = (partial(load_callable(r.env, "rollout.env"), toolbox) if r.env else
                    partial(ToolEnvironment, toolbox, tool_result_form(tokenizer)))
    model_config = getattr(getattr(engine, "model", None), "config", None)  # the HF engine's (VLMs run on it)
    return EpisodeRunner(engine, tokenizer, make_env, EpisodeSettings(
        max_turns=r.max_turns, max_total_tokens=budget, step_last_turn=cfg.reward.from_env, env_workers=r.env_workers,
        env_timeout_s=r.env_timeout_s, one_episode_at_a_time=one_at_a_time,
        keep_messages=cfg.reward.model_path is not None,  # the reward model reads the episode's conversation
        dropped_ids=frozenset(vision_token_ids(model_config) if model_config is not None else ())))


def make_reward_runners(cfg: Config, device: torch.device) -> tuple[RewardRunner | RewardModel, RewardRunner]:
    """(the configured reward: reward.model_path's model on `device`, or the function;
    the strict accuracy metric): one runner when they are the same function."""
    rw = cfg.reward
    if rw.model_path is not None:
        return (RewardModel(rw.model_path, device, rw.model_micro_batch_size, rw.model_max_length),
                RewardRunner(None, rw.timeout_s, measures="accuracy"))
    reward_fn = RewardRunner(rw.custom_fn, rw.timeout_s, gsm8k_mode=rw.gsm8k_mode, concurrency=rw.async_concurrency,
                             kwargs=reward_fn_kwargs(cfg), weights=reward_fn_weights(cfg))
    accuracy_fn = (reward_fn if rw.custom_fn is None and rw.gsm8k_mode == "strict"
                   else RewardRunner(None, rw.timeout_s, measures="accuracy"))
    return reward_fn, accuracy_fn


def close_reward_runners(*runners: RewardRunner) -> None:
    for runner in {id(r): r for r in runners}.values():
        runner.close()


def reference_model(cfg: Config, actor: Actor, device: torch.device) -> ReferenceModel | AdapterDisabledReference:
    """The frozen policy for the KL terms, computing as the actor does, so their KL is 0
    before the first update: with LoRA the actor's own base (its adapter off, no second
    copy); beside a DDP or one-worker actor, fp32 weights under the actor's autocast;
    beside FSDP2, whose forwards run on weights cast to model.dtype, weights loaded in it."""
    if cfg.actor.lora_rank:
        return AdapterDisabledReference(actor, cfg.rollout.temperature)
    sharded = actor.strategy == "fsdp2"
    model = load_causal_lm(cfg.model.path, cfg.model.dtype) if sharded else load_causal_lm(cfg.model.path)
    return ReferenceModel(model, device, cfg.rollout.temperature, cfg.actor.forward_prompt_once,
                          cfg.actor.output_head_chunk_tokens, torch.float32 if sharded else actor.compute_dtype)


def heldout_rows(cfg: Config, tokenizer, images: ImagePrompter | None, rank: int,
                 world: int) -> tuple[list[tuple[PromptRow, list[int]]], dict[str, float]]:
    """This worker's held-out rows and their prompt ids, under the bad-row policy (a bad
    row is dropped, not replaced), and how many rows were chosen of how many in the files
    (`rows_chosen`, `rows_in_files`), and how many of those were dropped as bad or had their
    prompt truncated over all workers (`skipped_rows`, `truncated_prompts`; a collective). The rows are
    data.val_max_samples of them (-1: all), a sample of the files' rows drawn with a fixed
    seed (the same rows for every run, and no stride that a file's order could alias with),
    in file order, every world-th of those here."""
    data = ShardedDataset(cfg.data.val_files)
    wanted = len(data) if cfg.data.val_max_samples < 0 else min(len(data), cfg.data.val_max_samples)
    chosen = range(len(data)) if wanted == len(data) else sorted(random.Random(0).sample(range(len(data)), wanted))
    indices = list(chosen)[rank::world]
    encode = partial(nodes.encode_prompt, tokenizer, images=images, max_image_pixels=cfg.data.max_image_pixels,
                     tools=prompt_tools(cfg))
    taken, counts = PromptReader(data, cfg.data.max_prompt_length, cfg.data.on_bad_row, cfg.data.on_long_prompt
                                 ).take(indices, encode, replace=False)
    skipped, truncated = all_reduce_sum(counts["skipped_rows"], counts["truncated_prompts"])  # over the workers
    return taken, {"rows_chosen": wanted, "rows_in_files": len(data), "skipped_rows": skipped,
                   "truncated_prompts": truncated}


def skipped_an_update(record: dict) -> bool:
    """Whether an update of the step met NaN/inf and was skipped (`*/skipped_updates`)."""
    return any(v > 0 for k, v in record.items() if k.endswith("/skipped_updates"))


def scored_nothing(record: dict) -> bool:
    """Whether every reward call of the step failed or timed out: every sample scored 0, so
    the step had nothing to learn from (a reward function broken for every input, a judge
    that cannot be reached)."""
    scored = record.get("reward/scored", 0.0)
    return scored > 0 and record.get("reward/failed", 0.0) + record.get("reward/timed_out", 0.0) >= scored


def failed_every_episode(record: dict) -> bool:
    """Whether every episode of a multi-turn or agent step failed (its environment or
    rollout.agent raised): the reward scores them all, but nothing was learnt from."""
    total = record.get("episodes/total", 0.0)
    return total > 0 and record.get("episodes/failed", 0.0) >= total


def worker_device(cfg: Config) -> torch.device:
    """This worker's device: the GPU the runtime bound it to, where it chose one
    (`process_group.uses_cuda`); outside a launched worker, a GPU unless runtime.device=cpu."""
    chosen = os.environ.get(DEVICE_ENV)
    if chosen == "cuda" or (chosen is None and torch.cuda.is_available() and cfg.runtime.device != "cpu"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, device: torch.device, progress: bool, relay=None, stream=None,
                 tracked_cfg: Config | None = None):
        """`relay`: this worker's end of the single controller (runtime.mode=centralized);
        `stream`: a disaggregated run's train side (trainer/disaggregated.py), which
        brings the samples and takes the weights, and then this runs the graph's train half;
        `tracked_cfg`: the settings W&B, MLflow and TensorBoard record, where they are not
        `cfg` (that train side evaluates under its own rollout settings). Where building
        fails, what was built is closed before the error goes on."""
        self._parts = contextlib.ExitStack()  # what close() closes, each added as it is built
        try:
            self._build(cfg, run_dir, device, progress, relay, stream, tracked_cfg or cfg)
        except BaseException:
            self._parts.close()
            raise

    def _build(self, cfg: Config, run_dir: Path, device: torch.device, progress: bool, relay, stream,
               tracked_cfg: Config) -> None:
        self.cfg, self.run_dir, self.device, self.stream = cfg, run_dir, device, stream
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.graph = build_graph(cfg)  # validated (and its callables imported) before any model loads
        if stream is not None:
            self.graph = self.graph.split(ROLLOUT_ROLES)[1]
        self.tokenizer = load_tokenizer(cfg.model.path, chat_template_kwargs(cfg))
        # Layouts: a rollout replica is a group of replica_size ranks; training is data-parallel over all ranks.
        self.rollout_layout = Layout(self.world, tp_size=cfg.rollout.replica_size)
        self.train_layout = Layout.data_parallel(self.world)
        self.prompts = PromptSource(cfg, self.rollout_layout, self.rank, self.tokenizer.pad_token_id)
        self.val, held_out = heldout_rows(cfg, self.tokenizer, self.prompts.images, self.rank, self.world)
        if self.rank == 0 and held_out["skipped_rows"] + held_out["truncated_prompts"]:
            print(f"distflow: held-out rows: {held_out['skipped_rows']:.0f} of {held_out['rows_chosen']} dropped as "
                  f"bad (data.on_bad_row), {held_out['truncated_prompts']:.0f} prompts truncated "
                  f"(data.on_long_prompt); val/accuracy is measured on what is left", file=sys.stderr)
        rows, batch = len(self.prompts.rows), cfg.data.train_batch_size
        if self.rank == 0 and rows < batch:  # verl refuses it (an empty dataloader); a small test set is worth a run
            print(f"distflow: data.train_files has {rows} rows, fewer than data.train_batch_size={batch}: every step "
                  "holds some prompts more than once", file=sys.stderr)
        roles = {n.role for n in self.graph.nodes}  # which engines this graph needs
        torch.manual_seed(cfg.trainer.seed)
        # resuming: the policy comes from the checkpoint (a HF folder), the reference from model.path
        self.resume_from = checkpoint.resolve(cfg.trainer.resume, run_dir)
        self.prompts.resumed_step(self.resume_from)  # checked before the models load
        policy_path = str(self.resume_from) if self.resume_from else cfg.model.path
        # the actor and the reference score at the rollout's temperature: the distribution sampled from
        # the actor and the critic keep fp32 master weights and compute in model.dtype
        compute_dtype = getattr(torch, cfg.model.dtype)
        actor = Actor(self._policy(policy_path),
                      OptimConfig(lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay, grad_clip=cfg.actor.grad_clip),
                      device, cfg.rollout.temperature, cfg.actor.strategy, compute_dtype, cfg.actor.forward_prompt_once,
                      cfg.actor.gradient_checkpointing, cfg.actor.output_head_chunk_tokens)
        rollout = make_rollout_engine(cfg, policy_path, self.tokenizer, device, actor)
        self._parts.callback(rollout.close)
        self.policy_skeleton = causal_lm_skeleton(cfg.model.path)  # what writes the policy into a checkpoint
        ref = reference_model(cfg, actor, device) if "reference" in roles else None
        critic = (Critic(self._trained(load_causal_lm(cfg.model.path)),
                         OptimConfig(lr=cfg.critic.lr, grad_clip=cfg.critic.grad_clip),
                         device, cfg.critic.strategy, compute_dtype, cfg.critic.gradient_checkpointing)
                  if roles & {"critic_forward", "critic_train"} else None)
        reward_fn, accuracy_fn = make_reward_runners(cfg, device)
        self._parts.callback(close_reward_runners, reward_fn, accuracy_fn)
        a = cfg.algorithm
        reward_kl = (make_kl_controller(a.reward_kl_ctrl, a.reward_kl_coef, a.reward_kl_target, a.reward_kl_horizon)
                     if a.use_kl_in_reward else None)
        overlap = resolve_overlap(cfg, device) and relay is None  # a single controller: one node at a time
        self.ctx = nodes.WorkerContext(cfg=cfg, tokenizer=self.tokenizer, rollout=rollout, actor=actor, ref=ref,
                                       critic=critic, reward_fn=reward_fn, accuracy_fn=accuracy_fn, overlap=overlap,
                                       reward_kl=reward_kl)
        self.ctx.episodes = make_episode_runner(cfg, rollout, self.tokenizer)
        if self.ctx.episodes is not None:
            self._parts.callback(self.ctx.episodes.close)
        self.rollout, self.actor, self.relay = rollout, actor, relay
        self.placement = make_placement(cfg, self.rollout_layout, self.train_layout)
        self._status = StatusFile(run_dir, self.rank)
        self.scheduler = Scheduler(self.graph, placement=self.placement, overlap=overlap,
                                   threads=cfg.scheduler.threads,
                                   refill=RefillPrompts(self.prompts, self.tokenizer, self.ctx)
                                   if any(n.refill for n in self.graph.nodes) else None,
                                   on_node=lambda name: self._status(self.ctx.step, name))
        self._parts.callback(self.scheduler.close)
        self.trace_steps = traced_steps(cfg)
        self.store = LocalStore()
        self.writer = MetricsWriter(run_dir / "metrics.jsonl") if self.rank == 0 else None
        self.progress = progress and self.rank == 0
        self.start_step, self.history, self.bad_steps, self.wall_before = 0, [], 0, 0.0
        self.new_branch = False  # resumed from a rollback or another run's checkpoint (rank 0 knows)
        if self.resume_from is not None:
            self._resume(self.resume_from)
        elif self.rank == 0:
            set_aside_earlier_run(run_dir)
        # last, so that a run that failed to start leaves no tracker run open
        self.trackers = Trackers(tracked_cfg, run_dir, self.rank,  # TensorBoard, W&B, MLflow (trainer.logger)
                                 resumed=self.resume_from is not None, start_step=self.start_step,
                                 history=self.history, new_branch=self.new_branch)

    def _policy(self, policy_path: str):
        """The policy to train: the model folder or the checkpoint; with LoRA the base model
        with a new adapter, or the checkpoint's adapter."""
        lora = lora_settings(self.cfg)
        if lora is None:
            return self._trained(load_causal_lm(policy_path))
        return with_lora(self._trained(load_causal_lm(self.cfg.model.path)), lora,
                         adapter_path=self.resume_from if self.resume_from else None)

    def _trained(self, model):
        """A model to train (policy or critic), without dropout unless model.disable_dropout=false."""
        return without_dropout(model) if self.cfg.model.disable_dropout else model

    def _resume(self, path: Path) -> None:
        """Optimizer, critic, RNG, dataloader position, the metrics so far and the run of
        steps with skipped updates they end on."""
        state = checkpoint.restore(path, actor=self.actor, critic=self.ctx.critic)
        self.start_step, self.wall_before = state["step"], state.get("wall_seconds", 0.0)
        # an adaptive controller goes on from where it was; a fixed one's coefficient is the config's
        if isinstance(self.ctx.reward_kl, AdaptiveKLController) and "reward_kl_coef" in state.get("algorithm", {}):
            self.ctx.reward_kl.value = state["algorithm"]["reward_kl_coef"]
        abandoned = []
        if self.rank == 0:  # said every time: a config copied from a run's config.json names that run's folder
            total = self.cfg.trainer.total_steps
            print(f"distflow: resuming from {path} (step {self.start_step} of {total})"
                  + (": the run is complete, nothing to train" if self.start_step >= total else "")
                  + "; trainer.resume=off, or another trainer.output_dir, starts a new run", file=sys.stderr)
            if self.start_step < total:  # done no more until it ends again
                (self.run_dir / "summary.json").unlink(missing_ok=True)
            abandoned = checkpoint.set_aside_newer(self.run_dir / "checkpoints", self.start_step)
            for moved in abandoned:
                print(f"distflow: resumed from step {self.start_step}: the later checkpoint {moved.name} of this run "
                      f"folder is set aside in {moved.parent}", file=sys.stderr)
        metrics = path / "metrics.jsonl"
        self.history = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        for record in self.history:  # the run of bad steps the checkpoint ends on goes on counting
            self.bad_steps = self.bad_steps + 1 if skipped_an_update(record) or scored_nothing(record) \
                or failed_every_episode(record) else 0
        if self.writer is not None:  # the run's metrics file continues from the checkpoint's copy
            kept = self._keep_metrics_the_checkpoint_lacks(rolled_back=bool(abandoned))
            self.new_branch = bool(abandoned) or kept  # the folder's W&B and MLflow runs logged other steps
            tmp = self.writer.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
            os.replace(tmp, self.writer.path)

    def _keep_metrics_the_checkpoint_lacks(self, rolled_back: bool) -> bool:
        """The run folder's metrics file, before the checkpoint's copy replaces it, kept as
        `metrics-<n>.jsonl` where its records are not the run the checkpoint goes on: a
        rollback's abandoned branch (`rolled_back`: later checkpoints were set aside; its
        steps after the checkpoint show why it was abandoned), or another run's (a
        checkpoint of another folder resumed here): then True. After a crash the steps past
        the last checkpoint run again, so the file is replaced as it is."""
        try:
            lines = [line for line in self.writer.path.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return False
        # the checkpoint's file is a copy of this one when it was written: the same text (NaN too)
        if lines and (rolled_back or lines[:len(self.history)] != [json.dumps(r) for r in self.history]):
            kept = checkpoint.set_aside_numbered(self.writer.path)
            why = "the abandoned branch's" if rolled_back else "another run's"
            print(f"distflow: resumed from step {self.start_step}: this folder's metrics.jsonl ({why} steps) is "
                  f"kept as {kept.name}", file=sys.stderr)
            return True
        return False

    # ------------------------------------------------------------------ one step

    def prepare(self, step: int) -> Batch:
        """The step's prompts, tokenised (or, disaggregated, its samples as they arrive):
        runs on the prefetch thread one step ahead."""
        return self.prompts.prepare(step) if self.stream is None else self.stream.receive(step)

    def step(self, step: int, sources: Batch) -> dict[str, float]:
        self.ctx.step, self.ctx.acc = step, MeanAccumulator()
        acc, store, a = self.ctx.acc, self.store, self.cfg.actor
        lr = a.lr * lr_factor(step, self.cfg.trainer.total_steps, a.lr_warmup_steps, a.lr_scheduler, a.min_lr_ratio)
        self.actor.set_lr(lr)
        acc.add("actor/lr", lr, 1.0)
        self.placement.stats = TransferStats()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        store.clear()
        store.put(sources)
        spans = (self.scheduler.run(self.ctx, store, step) if self.relay is None
                 else run_commanded_step(self.scheduler, self.ctx, store, step, self.relay))
        timer = StageTimer(step, self._status)
        with timer("weight_sync"):  # the rollout engine gets the updated policy, in place
            if self.stream is None:
                self.rollout.update_weights(self.actor.iter_full_weights(), version=step)
            else:  # to the rollout workers; the evaluation engine here takes them when it evaluates
                self.stream.publish(self.actor, version=step)
        seconds = node_seconds(spans) | timer.seconds
        nodes.record_rollout_metrics(store.all(), acc, response_token_budget(self.cfg), self.ctx.episodes is not None)
        counts = self.prompts.take_counts(step)
        for name in ("skipped_rows", "truncated_prompts"):
            acc.add_total(f"data/{name}", counts[name])
        for name, value in self.placement.stats.as_metrics().items():
            acc.add_total(name, value)
            acc.add_max(f"{name}_busiest_rank", value)
        for name, value in self.scheduler.counters.items():
            acc.add_total(name, value if self.rank == 0 else 0.0)  # the same on every worker
        for node, secs in seconds.items():
            acc.add_max(f"time/{node}", secs)
        if self.device.type == "cuda":  # torch's allocations in this worker (vLLM's pool is its own)
            acc.add_max("perf/gpu_peak_allocated_gb", torch.cuda.max_memory_allocated(self.device) / 2**30)
        if step in self.trace_steps:
            write_trace(self.run_dir, step, self.rank, spans)
        rollout_side = self.stream.record(step, store.all(), acc) if self.stream is not None else {}
        return acc.reduce() | rollout_side

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, step: int) -> dict[str, float]:
        with StageTimer(step, self._status)("evaluate"):  # named in errors and in the status file
            if self.stream is not None and self.rollout.weight_version != step:  # disaggregated: behind the actor
                self.rollout.update_weights(() if self.rollout.shares_trainer_weights
                                            else self.actor.iter_full_weights(), version=step)
            return self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """Greedy held-out accuracy over all workers (validation rows interleaved), overall
        and per `extra_info["level"]` where the rows have one (the built-in task's 1-3),
        and the mean reward (as training scores it: an agent's or environment's own); with
        episodes, the share whose environment or agent raised (they count as wrong)."""
        report = evaluate(self.rollout, self.tokenizer, [row for row, _ in self.val], [ids for _, ids in self.val],
                          self.ctx.reward_fn, self.ctx.accuracy_fn,
                          EvalSettings(max_new_tokens=self.cfg.rollout.max_new_tokens,
                                       reward_field=nodes.rollout_reward_field(self.cfg)), episodes=self.ctx.episodes)
        return {f"val/{name}": value for name, value in report.items()
                if name.startswith(("accuracy", "response_length/", "reward_extra/"))
                or name in ("reward", "failed_episodes")}

    # ------------------------------------------------------------------ the run

    def fit(self) -> dict:
        cfg = self.cfg
        self.fit_started = time.time() - self.wall_before  # the loop's clock, over every launch of the run
        total, eval_every, first = cfg.trainer.total_steps, cfg.trainer.eval_every, self.start_step + 1
        if self.start_step == 0:
            held_out = self.evaluate(0)
            initial = final = held_out["val/accuracy"]
            self._log({"step": 0, **held_out})
        else:  # resumed: the held-out numbers so far come from the checkpoint's metrics
            vals = [r["val/accuracy"] for r in self.history if "val/accuracy" in r] or [float("nan")]
            initial, final = vals[0], vals[-1]
        bar = self._progress_bar(total, self.start_step)
        # the steps a resumed run restored count in its throughput as they did when they ran
        done = [r for r in self.history if "time/step" in r]
        tokens = sum(r["tokens/total"] for r in done)
        train_seconds = sum(r["time/step"] + r.get("time/wait_for_samples", 0.0) for r in done)
        ready = time.perf_counter()
        # the next step's prompts are read and tokenised while this step computes
        for index, seqs in DoubleBuffer(lambda i: self.prepare(first + i), max(total - self.start_step, 0)):
            step = first + index
            t0 = time.perf_counter()
            waited = t0 - ready  # for the step's prompts (disaggregated: its samples)
            metrics = self.step(step, seqs)
            seconds = time.perf_counter() - t0
            train_seconds += seconds + waited
            tokens += metrics["tokens/total"]
            metrics.update({"step": step, "time/step": seconds, "time/wait_for_samples": waited,
                            "perf/tokens_per_second": metrics["tokens/total"] / (seconds + waited)})
            if step == total or (eval_every and step % eval_every == 0):
                metrics.update(self.evaluate(step))
                final = metrics["val/accuracy"]
            self._log(metrics)
            self._check_bad_steps(step, metrics)
            last_is_final = step == total and cfg.trainer.save_final  # then its checkpoint is `final`
            if cfg.trainer.save_every and step % cfg.trainer.save_every == 0 and not last_is_final:
                self._save(f"step_{step}", step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(progress_postfix(metrics, final))
            ready = time.perf_counter()
        if bar is not None:
            bar.close()
        if cfg.trainer.save_final and self.start_step < total:
            self._save("final", total)
        summary = {
            "heldout_accuracy_initial": initial, "heldout_accuracy_final": final, "steps": total,
            "num_workers": cfg.runtime.num_workers, "placement": cfg.runtime.placement,
            "wall_seconds": time.time() - self.fit_started,
            "train_seconds": train_seconds, "tokens_per_second": tokens / max(train_seconds, 1e-9),
            "algorithm": cfg.algorithm.name, "run_dir": str(self.run_dir),
            "network": "cluster" if cfg.runtime.ray_address else "loopback" if netns.inside() else "host",
            **self.actor.parameter_counts(),
            "actor_strategy": self.actor.strategy,  # what actor.strategy=auto resolved to
            "actor_gradient_checkpointing": checkpoints_activations(self.actor.model),
            "actor_output_head_chunk_tokens": self.actor.head_chunk_tokens,  # 0: the logits kept whole
        }
        if self.stream is not None:
            rt = cfg.runtime
            summary |= {"train_workers": rt.train_workers, "rollout_workers": rt.rollout_workers,
                        "max_staleness": cfg.algorithm.max_staleness}
        summary_file = self.run_dir / "summary.json"
        if self.rank == 0 and self.start_step >= total and summary_file.exists():
            return json.loads(summary_file.read_text())  # relaunched when done: nothing trained, the run's own stands
        if self.rank == 0:
            history = self.writer.read()
            summary["reward_first"] = next(r["reward/mean"] for r in history if "reward/mean" in r)
            summary["reward_last"] = history[-1]["reward/mean"]
            summary_file.write_text(json.dumps(summary, indent=1))
            write_plot(history, self.run_dir / "reward.png")
        return summary

    def close(self, failed: bool = False) -> None:
        """The trackers (`failed`: they mark the run failed), then every part, last built
        first, each even where one before it fails to close (that error is raised once all
        are done)."""
        with self._parts:
            self.trackers.close(failed)

    def _check_bad_steps(self, step: int, metrics: dict[str, float]) -> None:
        """A step where an update met NaN/inf was skipped (counted in */skipped_updates),
        where no sample's reward could be computed, or where every episode failed;
        `trainer.max_bad_steps` such steps in a row stop the run: something is broken."""
        unscored, unplayed = scored_nothing(metrics), failed_every_episode(metrics)
        if self.stream is not None and dist.is_initialized():  # disaggregated: one train rank got the rollout's counts
            flags = torch.tensor([float(unscored), float(unplayed)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            unscored, unplayed = bool(flags[0]), bool(flags[1])
        self.bad_steps = self.bad_steps + 1 if skipped_an_update(metrics) or unscored or unplayed else 0
        if self.bad_steps < self.cfg.trainer.max_bad_steps:
            return
        limit = f"trainer.max_bad_steps={self.cfg.trainer.max_bad_steps}"
        if skipped_an_update(metrics):
            raise FloatingPointError(
                f"stopping at step {step}: {self.bad_steps} steps in a row had a non-finite loss or gradient "
                f"({limit}); updates were skipped, the last checkpoint is intact; check the rewards, the learning "
                f"rate and the data")
        network = " (runtime.network=auto runs it without the host's network: a judge it calls is reached only " \
            "with runtime.network=host)" if netns.inside() else ""
        if unplayed and not unscored:
            raise RuntimeError(
                f"stopping at step {step}: {self.bad_steps} steps in a row had every episode fail ({limit}): the "
                f"environment or rollout.agent raised on every sample (env/failed, agent/failed; the first error is "
                f"printed above); check it{network}")
        raise RuntimeError(
            f"stopping at step {step}: {self.bad_steps} steps in a row could score no sample ({limit}): every "
            f"reward call failed or timed out (reward/failed, reward/timed_out; the first error is printed above); "
            f"check the reward function{network}")

    def _log(self, record: dict) -> None:
        if self.writer is not None:
            self.writer.write(record)
        self.trackers.log(record)

    def _save(self, name: str, step: int) -> None:
        """A resumable checkpoint (collective); its policy folder is a normal HF model."""
        with StageTimer(step, self._status)("checkpoint"):
            checkpoint.save(self.run_dir / "checkpoints" / name, hf_skeleton=self.policy_skeleton, tokenizer=self.tokenizer,
                            actor=self.actor, critic=self.ctx.critic, step=step,
                            loader_state=self.prompts.sampler.state_dict(step),
                            metrics_file=self.writer.path if self.writer is not None else None,
                            keep_last=self.cfg.trainer.keep_last,
                            algorithm_state={"reward_kl_coef": self.ctx.reward_kl.value}
                            if self.ctx.reward_kl is not None else None,
                            image_processor=self.prompts.images.processor if self.prompts.images else None,
                            wall_seconds=time.time() - self.fit_started)

    def _progress_bar(self, total: int, done: int):
        """`done`: the steps a resumed run restored, which the rate and ETA leave out."""
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True)


def agree_on_the_run_folder(cfg: Config, run_dir: Path) -> None:
    """Collective, before anything is built: every worker sees what worker 0 writes in the
    run folder (its checkpoints and status; on several hosts, a file system they share at
    the same path) and resumes from the same checkpoint. `cfg.trainer.resume` becomes
    that checkpoint ("off": none), so both sides of a disaggregated run read the same.
    Where the workers differ, each raises the same one line (none waits in a collective
    the others left)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    marker = run_dir / "status" / "shared-folder-check"
    if rank == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{os.getpid()} {time.time_ns()}")
    written = all_gather_objects(marker.read_text() if rank == 0 else None)[0]  # after worker 0 wrote it
    try:
        found = checkpoint.resolve(cfg.trainer.resume, run_dir)
        resume = ("checkpoint", None if found is None else str(found))
    except checkpoint.CheckpointError as e:
        resume = ("error", str(e))
    seen = all_gather_objects((marker.is_file() and marker.read_text() == written, resume, socket.gethostname()))
    blind = [r for r, (sees, _, _) in enumerate(seen) if not sees]
    if blind:
        raise RuntimeError(f"run folder {run_dir}: worker(s) {blind} (host {seen[blind[0]][2]}) do not see what worker "
                           f"0 (host {seen[0][2]}) writes there; a run on several hosts needs trainer.output_dir on a "
                           "file system they share, at the same path")
    if errors := [message for _, (kind, message), _ in seen if kind == "error"]:
        raise checkpoint.CheckpointError(errors[0])
    if len({found for _, (_, found), _ in seen}) > 1:
        raise checkpoint.CheckpointError(
            "trainer.resume: the workers found different checkpoints to resume from ("
            + ", ".join(f"worker {r}: {found or 'none'}" for r, (_, (_, found), _) in enumerate(seen))
            + "); a run on several hosts needs trainer.output_dir on a file system they share")
    cfg.trainer.resume = seen[0][1][1] or "off"
    if cfg.trainer.resume != "off":  # the same checkpoint on every worker: the same answer
        checkpoint.check_resumable(Path(cfg.trainer.resume), lora_settings(cfg))


def run_worker(cfg_dict: dict, run_dir: str, progress: bool = False, relay=None) -> dict:
    """Entry point of every worker (Ray actor or torchrun process); the process group
    is already initialised by the runtime. `relay`: this worker's end of the driver in
    runtime.mode=centralized (the driver runs each step's graph)."""
    cfg = from_dict(cfg_dict)
    agree_on_the_run_folder(cfg, Path(run_dir))
    if cfg.runtime.placement == "disaggregated":
        from distflow.trainer.disaggregated import run_disaggregated  # it builds on this module

        return run_disaggregated(cfg, Path(run_dir), progress)
    return fit_and_close(Trainer(cfg, Path(run_dir), worker_device(cfg), progress, relay))


def fit_and_close(trainer: Trainer, after_fit=lambda: None) -> dict:
    """`trainer.fit()`, then `after_fit()`, then `trainer.close()`; where either raises,
    the trainer is closed as failed (its trackers mark the run so) and the error goes on."""
    try:
        summary = trainer.fit()
        after_fit()
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()
    return summary


def run_eval_worker(cfg_dict: dict, report_path: str, k: int) -> dict | None:
    """Entry point of every worker of `distflow eval`: the policy at model.path on
    data.val_files (every world-th row here), scored as in training; rank 0 writes the
    JSON report and returns the metrics."""
    cfg = from_dict(cfg_dict)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = worker_device(cfg)
    tokenizer = load_tokenizer(cfg.model.path, chat_template_kwargs(cfg))
    taken, chosen = heldout_rows(cfg, tokenizer, load_image_prompter(cfg.model.path, tokenizer, cfg.model.dtype),
                                 rank, world)
    with contextlib.ExitStack() as parts:  # each part closed, last built first, even where a later one fails to build
        engine = make_rollout_engine(cfg, cfg.model.path, tokenizer, device, actor=None)
        parts.callback(engine.close)
        episodes = make_episode_runner(cfg, engine, tokenizer)
        if episodes is not None:
            parts.callback(episodes.close)
        reward_fn, accuracy_fn = make_reward_runners(cfg, device)
        parts.callback(close_reward_runners, reward_fn, accuracy_fn)
        r = cfg.rollout
        report = evaluate(engine, tokenizer, [row for row, _ in taken], [ids for _, ids in taken], reward_fn,
                          accuracy_fn, EvalSettings(max_new_tokens=r.max_new_tokens, k=k, temperature=r.temperature,
                                                    top_p=r.top_p, seed=cfg.trainer.seed,
                                                    reward_field=nodes.rollout_reward_field(cfg)), by_source=True,
                          episodes=episodes)
    if rank != 0:
        return None
    report |= chosen
    write_report(Path(report_path), report, {"model": cfg.model.path, "files": cfg.data.val_files, "k": k,
                                             "temperature": cfg.rollout.temperature, "workers": world})
    return report
