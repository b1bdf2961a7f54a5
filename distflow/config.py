"""Typed run configuration: dataclasses per section, YAML file plus dotted overrides.

A leaf module (no distflow imports), so every layer may read the config types.

    cfg = load_config("grpo.yaml", ["algorithm.group_size=8", "trainer.total_steps=50"])

Every user error is a `ConfigError` whose message is one line naming the key, the bad
value and what is allowed; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A bad config key or value; the message is a single line meant for the user."""


def _spec(default: Any, *, min: float | None = None, max: float | None = None,
          choices: tuple | None = None, doc: str = "") -> Any:
    """A dataclass field with bounds / choices that `validate` enforces generically."""
    return field(default=default, metadata={"min": min, "max": max, "choices": choices, "doc": doc})


BUILTIN_MODEL = "builtin:tiny-arith"
# folders in distflow/assets (engines/tiny_model.py, engines/tiny_vlm.py)
BUILTIN_MODELS = (BUILTIN_MODEL, "builtin:tiny-arith-tools", "builtin:tiny-dots-vl")
TRACKERS = ("tensorboard", "wandb", "mlflow")  # distflow.trainer.tracking
TOOLS = ("calculator", "python")  # distflow.engines.tools
VLLM_MIN_TEMPERATURE = 0.01  # vLLM raises a lower sampling temperature to this (SamplingParams, _MAX_TEMP)

# The built-in recipes: one YAML file each (distflow/recipes/NAME.yaml).
RECIPES_DIR = Path(__file__).parent / "recipes"
ALGORITHMS = tuple(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))


@dataclass(kw_only=True)
class ModelConfig:
    path: str = _spec(BUILTIN_MODEL, doc="local HuggingFace causal-LM folder, or builtin:tiny-arith "
                                               "(builtin:tiny-arith-tools: warm-started to call a calculator)")
    dtype: str = _spec("float32", choices=("float32", "bfloat16"),
                       doc="compute dtype: the rollout and the reference run in it, the actor and the critic "
                           "compute in it on fp32 master weights and AdamW state")
    disable_dropout: bool = _spec(True, doc="the trained models (policy and critic) without dropout, as TRL's "
                                            "disable_dropout: the policy that sampled is the one the update scores "
                                            "(a LoRA adapter keeps actor.lora_dropout)")


@dataclass(kw_only=True)
class DataConfig:
    train_files: str = _spec("builtin:arith:train", doc="comma-separated parquet/jsonl files or builtin:TASK:train "
                                                        "(TASK: arith, arith-tools, dots)")
    val_files: str = _spec("", doc="comma-separated parquet/jsonl files or builtin:TASK:test; empty: the test split "
                                   "of the built-in task train_files names (your own train_files need held-out "
                                   "files named here)")
    train_batch_size: int = _spec(16, min=1, doc="prompts per step, over all workers")
    val_max_samples: int = _spec(256, min=-1, doc="held-out rows: a sample of val_files' rows drawn with a fixed seed "
                                                  "(the same rows every run); -1: all of them (verl's default)")
    max_prompt_length: int = _spec(192, min=1, doc="tokens; see on_long_prompt")
    on_bad_row: str = _spec("error", choices=("error", "skip"),
                            doc="a malformed row: stop naming file and row, or skip it (counted, replaced)")
    on_long_prompt: str = _spec("error", choices=("error", "skip", "truncate"),
                                doc="a prompt over max_prompt_length: stop, skip it, or keep its last tokens")
    chat_template_kwargs: str = _spec("", doc="more arguments to the chat template, a mapping in YAML or JSON: "
                                              "'{enable_thinking: false}' turns Qwen3's thinking off (TRL's "
                                              "chat_template_kwargs, verl's data.apply_chat_template_kwargs); "
                                              "data.chat_template_kwargs.NAME=VALUE sets one")
    max_image_pixels: int = _spec(12_845_056, min=1, max=178_956_970,
                                  doc="an image of more pixels is scaled down to this many, its aspect ratio kept "
                                      "(as qwen-vl-utils and the Qwen2-VL processor scale down to their max_pixels, "
                                      "the default); at most Pillow's decompression-bomb limit, over which an image "
                                      "is a bad row")


@dataclass(kw_only=True)
class RolloutConfig:
    engine: str = _spec("hf", choices=("hf", "vllm"),
                        doc="hf: HuggingFace generate in each worker, on the actor's own weights under DDP, "
                            "else on a full copy; vllm: a vLLM "
                            "engine colocated in each worker, weights pushed in place (README: Rollout on vLLM)")
    tensor_parallel_size: int = _spec(1, min=1, doc="vllm: ranks per engine, each holding 1/k of every layer "
                                                    "(sets rollout.replica_size); the HF engine refuses k > 1")
    gpu_memory_utilization: float = _spec(0.5, min=0.01, max=1.0, doc="vllm on GPU: share of GPU memory it may use")
    kv_cache_memory_gb: float | None = _spec(None, min=0.01, doc="vllm: KV-cache size in GiB (default: from "
                                                                 "gpu_memory_utilization on GPU, 1 GiB on CPU)")
    release_memory_after_rollout: bool = _spec(True, doc="vllm on GPU beside a trainer: sleep after each step's "
                                                        "generation (weights offloaded, KV cache dropped), wake "
                                                        "for the weight push; not where no trainer shares the "
                                                        "GPU (a rollout worker, evaluation); vLLM's CPU backend "
                                                        "cannot")
    temperature: float = _spec(1.0, min=1e-4)
    top_p: float = _spec(1.0, min=1e-4, max=1.0)
    max_new_tokens: int = _spec(32, min=1)
    micro_batch_size: int = _spec(128, min=1, doc="the HF engine: sequences generated per generate() call (where "
                                                   "the scheduler overlaps, each call is one stream chunk, at most "
                                                   "scheduler.stream_chunk_size)")
    replica_size: int = _spec(1, min=1, doc="ranks that share one rollout replica: each generates every k-th of "
                                           "its sequences and all of them then hold its output (the layout a "
                                           "tensor-parallel engine leaves; the HF engine splits no tensor)")
    max_turns: int = _spec(1, min=1, doc="assistant turns per episode; > 1: multi-turn with rollout.tools or "
                                         "rollout.env (max_new_tokens is then per turn); with rollout.agent the "
                                         "most calls one sample may make")
    max_total_tokens: int = _spec(0, min=0, doc="multi-turn: response tokens per episode, turns and tool results "
                                                "together; 0 = max_new_tokens * max_turns")
    tools: str = _spec("", doc="multi-turn: comma-separated built-in tools the model may call in Hermes "
                               "<tool_call> format: calculator, python (the code sandbox)")
    tool_timeout_s: float = _spec(5.0, min=0.01, doc="the python tool's limit per call")
    max_tool_calls_per_turn: int = _spec(8, min=1, doc="multi-turn: tool calls of one assistant turn that are run; "
                                                       "the rest are answered with an error (tool/errors)")
    env_workers: int = _spec(8, min=1, doc="multi-turn: threads that reset, step and close the environments of "
                                           "different episodes at once (tool calls, sandboxed programs, an "
                                           "environment's waits overlap); each episode's own is called one call at "
                                           "a time; 1: one episode after another (environments that share state "
                                           "unsafely)")
    env_timeout_s: float = _spec(300.0, min=0.01, doc="multi-turn: an environment call (making and resetting it, a "
                                                      "step, closing it) that takes longer, from its start, fails "
                                                      "its episode (env/failed), as do the later calls of the episodes "
                                                      "on its thread (see env_workers), which is left to it and closes "
                                                      "their environments if the call returns")
    tool_schemas: str | None = _spec(None, doc="multi-turn: a .json file, a list of OpenAI-format tool schemas "
                                               "({\"type\": \"function\", \"function\": {\"name\", ...}}) of "
                                               "the tools rollout.env or rollout.agent provides; the chat template "
                                               "shows them to the model with every prompt, beside rollout.tools' "
                                               "own (an agent's first request sends the same as tools=)")
    env: str | None = _spec(None, doc="multi-turn: module:Class or file.py:Class of the environment, made per "
                                      "episode with the rollout's tools (default: their results are the "
                                      "observation); openenv:module:Class for an OpenEnv environment, run as it is")
    on_failed_episode: str = _spec("drop_group", choices=("drop_group", "score_zero"),
                                   doc="multi-turn or rollout.agent: an episode whose environment or agent raised "
                                       "(env/failed, agent/failed). drop_group: its prompt group leaves the step "
                                       "(dynamic sampling refills it), since the failure says nothing about the "
                                       "policy; score_zero: it trains with reward 0 beside its group")
    partial: bool = _spec(False, doc="runtime.placement=disaggregated, HF engine: weights that arrive during a "
                                     "generation are swapped in at the next token, so in-flight sequences "
                                     "continue on them; each token is tagged with its version "
                                     "(rollout_weight_version) and a sample's weight_version is its first token's")
    agent: str | None = _spec(None, doc="module:function or file.py:function, `async def run(client, row) -> reward`: "
                                        "an agent written against an OpenAI client; its calls to the run's "
                                        "OpenAI-compatible endpoint (at most max_turns) are the sample")
    agent_timeout_s: float = _spec(300.0, min=0.01, doc="rollout.agent: one sample's run, its calls' waits for "
                                                        "the batched engine included; a run that takes longer is "
                                                        "cut and fails (agent/failed)")


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = _spec("grpo", doc="the recipe: a built-in name (distflow dag show NAME) or a recipe YAML file; "
                                  "it sets the keys below that you do not set yourself")
    graph: str | None = _spec(None, doc="YAML graph file: with base: (the run's recipe) nodes added to, replacing "
                                        "or removed from the recipe's; without it, the whole graph")
    estimator: str = _spec("grpo", doc="advantage estimator: a registered name (distflow.algos.estimators) "
                                       "or module:function / file.py:function")
    policy_loss: str = _spec("vanilla", doc="policy loss: a registered name (distflow.algos.core)")
    group_size: int = _spec(8, min=1, doc="responses per prompt (n)")
    clip_ratio_low: float = _spec(0.2, min=0.0, max=1.0)
    clip_ratio_high: float = _spec(0.2, min=0.0)
    clip_ratio_c: float = _spec(3.0, min=1.0001, doc="dual-clip bound for negative advantages")
    loss_agg_mode: str = _spec("token-mean", choices=(
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    use_kl_loss: bool = _spec(True, doc="add kl_coef * KL(policy || reference) to the actor's loss")
    kl_coef: float = _spec(0.001, min=0.0)
    kl_type: str = _spec("low_var_kl", doc="KL estimator of the KL loss: k1, k2, k3, low_var_kl (k3), abs, a "
                                           "name registered with distflow.algos.kl.register_kl, or "
                                           "module:function / file.py:function; name+: straight-through (its value, "
                                           "k2's gradient)")
    use_kl_in_reward: bool = _spec(False, doc="subtract beta * KL(sampler || reference) from each token's reward "
                                              "before the advantage estimator (verl's use_kl_in_reward)")
    reward_kl_coef: float = _spec(0.001, min=0.0, doc="beta, the initial KL-in-reward coefficient")
    reward_kl_type: str = _spec("k1", doc="KL estimator of the reward penalty (the names of kl_type)")
    reward_kl_ctrl: str = _spec("fixed", choices=("fixed", "adaptive"),
                                doc="adaptive: beta follows reward_kl_target (Ziegler et al.'s controller)")
    reward_kl_target: float = _spec(0.1, min=1e-12, doc="the adaptive controller's target KL per token")
    reward_kl_horizon: int = _spec(10000, min=1, doc="the adaptive controller's horizon, in samples")
    rollout_correction: str = _spec("auto", choices=("auto", "off", "token_tis", "seq_tis", "token_mask", "seq_mask"),
                                    doc="re-weight the policy loss by exp(old - rollout log-probs), the trainer's "
                                        "over the engine's: truncated (tis) or masked, per token or per sequence "
                                        "(distflow.algos.correction); auto: token_tis with rollout.engine=vllm, "
                                        "with stale samples, and on bf16 rollout workers apart from the trainers "
                                        "(off where old_log_probs_from=rollout), off with a colocated hf engine "
                                        "(its sampler is the trainer's own forward)")
    rollout_correction_cap: float = _spec(2.0, min=1.0, doc="the truncation cap / the mask's [1/cap, cap] band")
    old_log_probs_from: str = _spec("recompute", choices=("recompute", "rollout"),
                                    doc="the PPO ratio's old policy: recompute (the trainer's weights before the "
                                        "update, a forward when updates are off-policy: decoupled PPO with "
                                        "asynchronous rollouts) or rollout (the engine's own log-probs, no forward)")
    max_staleness: int = _spec(0, min=0, doc="runtime.placement=disaggregated: samples may come from weights up to "
                                             "k training steps old (a version per training step, whatever its "
                                             "mini-batches; rollout workers pause when k versions ahead); "
                                             "0 = synchronous")
    dynamic_sampling: bool = _spec(False, doc="DAPO: drop groups whose rewards are all equal and generate more "
                                              "prompts until the batch is full")
    mask_truncated_responses: bool = _spec(False, doc="responses cut at their token budget (their last token no "
                                                      "stop token) add nothing to the policy loss, their tokens "
                                                      "not counted (DAPO's overlong filtering, TRL's "
                                                      "mask_truncated_completions); their rewards still set their "
                                                      "groups' advantages")
    entropy_coef: float = _spec(0.0, min=0.0)
    gamma: float = _spec(1.0, min=0.0, max=1.0, doc="discount (PPO's GAE, REINFORCE++)")
    lam: float = _spec(1.0, min=0.0, max=1.0, doc="GAE lambda")
    max_refill_rounds: int = _spec(3, min=0, doc="dynamic sampling: extra generation rounds per step; after them a "
                                                  "batch short of passing groups is topped up with dropped ones "
                                                  "(no signal; dynamic_sampling/passed_groups counts the others)")
    overlong_buffer_len: int = _spec(0, min=0, doc="overlong shaping (DAPO): tokens before the limit where the penalty "
                                                   "ramps (verl's overlong_buffer.len); above 0 it wins over "
                                                   "overlong_buffer_fraction; 0: the fraction decides (shaping is off "
                                                   "where both are 0: overlong_buffer_fraction=0 turns DAPO's off)")
    overlong_buffer_fraction: float = _spec(0.0, min=0.0, max=1.0,
                                            doc="overlong shaping (DAPO) with the buffer as a share of the response "
                                                "budget (the paper: 4096 of 20480 tokens, 0.2), so it scales with "
                                                "rollout.max_new_tokens; 0 = off")
    overlong_penalty_factor: float = _spec(1.0, min=0.0)


@dataclass(kw_only=True)
class ActorConfig:
    lr: float = _spec(1e-4, min=0.0, doc="peak learning rate (after warm-up)")
    lr_scheduler: str = _spec("cosine", choices=("constant", "cosine", "linear"),
                              doc="the learning rate over trainer.total_steps after the warm-up: constant, "
                                  "or decaying from lr, the first step after the warm-up's, towards "
                                  "lr * min_lr_ratio, which the step after the last would reach (as HF's)")
    lr_warmup_steps: int = _spec(3, min=0, doc="steps of linear warm-up from lr / (warm-up + 1) to lr")
    min_lr_ratio: float = _spec(0.1, min=0.0, max=1.0, doc="where the decay ends, over lr (one decay step after the last step)")
    weight_decay: float = _spec(0.0, min=0.0)
    grad_clip: float = _spec(1.0, min=0.0, doc="the largest gradient norm; 0 = no clipping")
    ppo_epochs: int = _spec(1, min=1)
    ppo_mini_batch_size: int = _spec(16, min=1, doc="prompts per optimizer step, over all workers")
    micro_batch_size: int = _spec(64, min=1, doc="sequences per forward/backward on one worker")
    forward_prompt_once: bool = _spec(True, doc="rows of a micro-batch with the same prompt (a GRPO group) run "
                                                "its tokens once and their responses on its cached keys and "
                                                "values: the same log-probs and gradients, less compute; the "
                                                "actor and the reference; not on a vision-language model or "
                                                "with actor.strategy=fsdp2")
    gradient_checkpointing: bool = _spec(False, doc="recompute each decoder layer's activations in the backward "
                                                    "instead of keeping them from the forward (HF's activation "
                                                    "checkpointing, verl's enable_gradient_checkpointing): one "
                                                    "layer's activations in memory instead of all, for about one "
                                                    "more forward of compute; the update then runs each row's "
                                                    "prompt itself (forward_prompt_once: scoring forwards only)")
    output_head_chunk_tokens: int = _spec(0, min=0, doc="0: the output head's logits of a micro-batch are kept "
                                                        "whole for the log-probs and the backward; N: the model's "
                                                        "final hidden states go through the head N "
                                                        "tokens at a time, its logits recomputed per chunk in the "
                                                        "backward and never kept (verl's fused-kernel log-probs): "
                                                        "memory of N x vocab instead of tokens x vocab; the actor "
                                                        "and the reference; the same log-probs and gradients, to "
                                                        "rounding; refused for a model whose logits are capped or "
                                                        "scaled after its head (Gemma 2, Cohere, Granite)")
    use_dynamic_bsz: bool = _spec(False, doc="form micro-batches by token budget instead of count")
    max_tokens_per_micro_batch: int = _spec(4096, min=1, doc="with use_dynamic_bsz: a micro-batch's padded tokens, "
                                                             "rows x (widest prompt + widest response), at most")
    strategy: str = _spec("auto", choices=("auto", "fsdp2", "ddp"),
                          doc="ddp: a full replica per worker, gradients all-reduced once per mini-batch (the HF "
                              "rollout then shares its weights); fsdp2: sharded per decoder layer; auto: ddp when "
                              "16 bytes a parameter fit in a quarter of a worker's memory (always with LoRA)")
    lora_rank: int = _spec(0, min=0, doc="LoRA adapters of this rank on the policy (peft), the base frozen; "
                                         "0 = full fine-tuning")
    lora_alpha: float = _spec(16.0, min=0.0, doc="LoRA's scale is lora_alpha / lora_rank")
    lora_dropout: float = _spec(0.0, min=0.0, max=1.0)
    lora_target_modules: str = _spec("all-linear", doc="all-linear (attention and MLP: every linear layer but the "
                                                       "output head) or comma-separated module names, e.g. q_proj,v_proj")


@dataclass(kw_only=True)
class CriticConfig:
    lr: float = _spec(1e-4, min=0.0, doc="PPO's critic (value head on a copy of the policy)")
    value_clip: float = _spec(0.5, min=0.0, doc="clip range of the value loss")
    grad_clip: float = _spec(1.0, min=0.0, doc="the largest gradient norm; 0 = no clipping")
    strategy: str = _spec("auto", choices=("auto", "fsdp2", "ddp"), doc="as actor.strategy")
    gradient_checkpointing: bool = _spec(False, doc="as actor.gradient_checkpointing")


@dataclass(kw_only=True)
class SchedulerConfig:
    overlap: bool | str = _spec("auto", choices=(True, False, "auto"),
                                doc="run independent nodes concurrently and stream rollout chunks; auto = "
                                    "on with a GPU or a spare CPU core per host, off when the workers fill the cores")
    threads: int = _spec(2, min=1, doc="thread pool for non-collective nodes")
    stream_chunk_size: int = _spec(64, min=1, doc="sequences per rollout chunk that consumers start on (the HF "
                                                  "engine generates a chunk per call; vLLM, which batches a whole "
                                                  "call as it runs, takes the step's sequences in one)")


@dataclass(kw_only=True)
class RewardConfig:
    custom_fn: str | None = _spec(None, doc="module:function or path.py:function; several, comma-separated: their "
                                            "scores' weighted sum (TRL's reward_funcs), each logged as "
                                            "reward_extra/<its name>")
    custom_fn_weights: str = _spec("", doc="comma-separated, one per custom_fn function: the weights of their sum "
                                           "(TRL's reward_weights); empty: 1 each")
    custom_fn_kwargs: str = _spec("", doc="more keyword arguments to every call of custom_fn, a mapping in YAML or "
                                          "JSON ('{strict: true}'); reward.custom_fn_kwargs.NAME=VALUE sets one "
                                          "(verl's custom_reward_function.reward_kwargs)")
    timeout_s: float = _spec(30.0, min=0.0, doc="per-sample limit; the function runs in a child process (0 = in-process, no limit)")
    async_concurrency: int = _spec(64, min=1, doc="an async def custom_fn (an LLM judge): how many of a worker's "
                                                  "samples it awaits at once, each within timeout_s; other functions "
                                                  "score one sample at a time")
    gsm8k_mode: str = _spec("strict", choices=("strict", "flexible"),
                            doc="the default reward's #### rule: strict needs '#### N'; flexible reads the last "
                                "number when there is no #### (verl's modes); accuracy stays strict")
    from_env: bool = _spec(False, doc="multi-turn with rollout.env: the sum of the environment's step rewards is the "
                                      "sample's reward instead of the function's (accuracy stays the function's)")
    model_path: str | None = _spec(None, doc="a HF sequence-classification folder with one label (a reward model): "
                                             "its score of the prompt and response (a multi-turn episode's turns "
                                             "and observations), rendered by its own chat template, is the reward "
                                             "instead of the function's (accuracy stays the rule's), as verl's "
                                             "reward_model and TRL's reward_funcs=<model>")
    model_micro_batch_size: int = _spec(8, min=1, doc="reward.model_path: conversations per forward")
    model_max_length: int = _spec(4096, min=2, doc="reward.model_path: tokens of a conversation scored (a longer "
                                                   "one keeps its end)")


@dataclass(kw_only=True)
class TrainerConfig:
    total_steps: int = _spec(60, min=1)
    seed: int = _spec(1, min=0)
    output_dir: str | None = _spec(None, doc="run folder; default runs/<time>-<algorithm>")
    eval_every: int = _spec(10, min=0, doc="steps between held-out evaluations; 0 = start and end only")
    save_every: int = _spec(0, min=0, doc="steps between checkpoints (step_N); 0 = only at the end")
    save_final: bool = _spec(True, doc="a checkpoint `final` after the last step (then the last step_N is not "
                                       "written twice)")
    max_bad_steps: int = _spec(3, min=1, doc="stop after this many steps in a row with a non-finite loss or "
                                           "gradient, or with no sample's reward computed")
    keep_last: int = _spec(0, min=0, doc="keep only the newest M step_* checkpoints; 0 = keep all")
    resume: str = _spec("auto", doc="auto (the run folder's latest checkpoint, if any) | off | PATH")
    progress: bool = _spec(True)
    trace_steps: str = _spec("", doc="comma-separated steps to write a Chrome trace of (run_dir/traces)")
    logger: str = _spec("jsonl", doc="comma-separated: jsonl (metrics.jsonl, always) plus any of " + ", ".join(TRACKERS)
                        + " (run_dir/tensorboard, run_dir/wandb, run_dir/mlflow.db; rank 0 writes)")
    project_name: str = _spec("distflow", doc="the W&B project and the MLflow experiment")
    experiment_name: str | None = _spec(None, doc="the W&B / MLflow run name; default: the run folder's name")
    wandb_mode: str = _spec("offline", choices=("offline", "online"),
                            doc="offline: no network, `wandb sync run_dir/wandb/offline-run-*` uploads later")


@dataclass(kw_only=True)
class RuntimeConfig:
    launcher: str = _spec("ray", choices=("ray", "torchrun"))
    num_workers: int = _spec(2, min=1)
    device: str = _spec("auto", choices=("auto", "cpu", "cuda"))
    threads_per_worker: int = _spec(1, min=1, doc="torch intra-op threads per CPU worker")
    collective_timeout_s: int = _spec(1800, min=1, doc="how long a collective waits for the slowest worker (rank 0 "
                                                       "writing a large model's checkpoint included); torch's default")
    mode: str = _spec("distributed", choices=("distributed", "centralized"),
                      doc="centralized: the single-controller baseline; every stage's data passes through the "
                          "driver (benchmarks)")
    centralized_wire: str = _spec("numpy", choices=("numpy", "verl", "verl-numpy"),
                                  doc="centralized mode: what the driver's batches travel through Ray's object store "
                                      "as: numpy buffers (zero-copy), or verl's DataProto serialised by verl with "
                                      "torch.save (verl, its default) or numpy arrays (verl-numpy); the verl ones need "
                                      "verl in this Python (README, Benchmarks)")
    placement: str = _spec("colocated", choices=("colocated", "disaggregated"),
                           doc="colocated: every worker generates and trains; disaggregated: rollout_workers "
                               "generate and train_workers train, samples streamed rank to rank, weights pushed "
                               "back after every update (num_workers becomes their sum)")
    train_workers: int = _spec(1, min=1, doc="disaggregated: the workers that train (ranks 0..T-1)")
    rollout_workers: int = _spec(1, min=1, doc="disaggregated: the workers that generate (the ranks after them)")
    stream_timeout_s: int = _spec(3600, min=1, doc="disaggregated: how long one side waits for the other's samples "
                                                   "or weights (a whole step of the other side, its evaluation and "
                                                   "checkpoint included; at the end the rollout side waits "
                                                   "max_staleness + 2 times it for the trainers' last steps)")
    ray_address: str | None = _spec(None, doc="host:port of a running Ray cluster to join (opt-in); "
                                              "default: a private Ray on this machine, or, for a `ray job "
                                              "submit` entrypoint, the job's cluster ($RAY_ADDRESS)")
    network: str = _spec("auto", choices=("auto", "loopback", "host"),
                         doc="loopback: run in a network namespace whose only interface is the loopback, "
                             "so no port of Ray or torch.distributed is reachable from outside; "
                             "auto: loopback where the machine allows it (root or user namespaces) and the run "
                             "needs no outside server (trainer.wandb_mode=online does), else host")


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))


# ---------------------------------------------------------------------------- coercion


def _allowed_types(annotation: Any) -> tuple[type, ...]:
    hint = annotation
    if get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(a for a in get_args(hint))
    if get_origin(hint) is Literal:
        return (str,)
    return (hint,)


def _type_name(types_: tuple) -> str:
    names = ["null" if t is type(None) else t.__name__ for t in types_]
    return " or ".join(names)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    allowed = _allowed_types(annotation)
    if value is None or (value == "" and type(None) in allowed):  # `key=` clears an optional key, as null does
        if type(None) in allowed:
            return None
        raise ConfigError(f"{key}=null: expected {_type_name(allowed)}")
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is float and isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if t is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if t is str and isinstance(value, bool) and bool not in allowed:  # YAML 1.1 reads off/on as booleans
            return "on" if value else "off"
    raise ConfigError(f"{key}={value!r}: expected {_type_name(allowed)}, got {type(value).__name__}")


def _section_fields(section: str) -> dict[str, dataclasses.Field]:
    cls = typing.get_type_hints(Config)[section]
    return {f.name: f for f in dataclasses.fields(cls)}


def _annotation(section: str, name: str) -> Any:
    """The type annotation of `section.name`, resolved."""
    return typing.get_type_hints(typing.get_type_hints(Config)[section])[name]



# verl's names for keys DistFlow has under another name: an unknown key that is one of them says so
VERL_KEYS = {
    "trainer.n_gpus_per_node": "runtime.num_workers (workers over all nodes, one GPU each)",
    "trainer.nnodes": "runtime.num_workers (workers over all nodes) with runtime.ray_address",
    "trainer.total_epochs": "trainer.total_steps (training is counted in steps)",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.test_freq": "trainer.eval_every",
    "trainer.save_freq": "trainer.save_every",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.resume_mode": "trainer.resume (auto, off or a checkpoint path)",
    "data.max_response_length": "rollout.max_new_tokens",
    "data.apply_chat_template_kwargs": "data.chat_template_kwargs",
    "data.filter_overlong_prompts": "data.on_long_prompt=skip (a prompt over data.max_prompt_length is skipped "
                                    "and replaced when its step draws it)",
    "data.truncation": "data.on_long_prompt (error, skip, or truncate: keeps the prompt's last tokens)",
    "data.shuffle": "nothing: the rows are always shuffled, seeded by trainer.seed",
    "data.seed": "trainer.seed",
    "data.prompt_key": "nothing: the prompt is the 'prompt' column (verl's default)",
    "algorithm.adv_estimator": "algorithm.estimator",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.actor.optim.lr": "actor.lr",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor_rollout_ref.actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl_type",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coef",
    "actor_rollout_ref.actor.loss_agg_mode": "algorithm.loss_agg_mode",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_ratio_high",
    "actor_rollout_ref.rollout.n": "algorithm.group_size",
    "actor_rollout_ref.rollout.name": "rollout.engine (hf or vllm)",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "custom_reward_function.path": "reward.custom_fn=path.py:function",
    "custom_reward_function.name": "reward.custom_fn=path.py:function",
    "custom_reward_function.reward_kwargs": "reward.custom_fn_kwargs",
    "reward_model.enable": "reward.model_path=FOLDER (a sequence-classification reward model)",
    "reward_model.model.path": "reward.model_path",
    "reward_model.micro_batch_size_per_gpu": "reward.model_micro_batch_size",
    "reward_model.max_length": "reward.model_max_length",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "rollout.max_turns",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "rollout.tools (built-in) or rollout.tool_schemas",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "algorithm.policy_loss",
    "actor_rollout_ref.actor.clip_ratio_c": "algorithm.clip_ratio_c",
    "actor_rollout_ref.actor.grad_clip": "actor.grad_clip",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "actor.gradient_checkpointing",
    "algorithm.kl_penalty": "algorithm.reward_kl_type",
    "algorithm.kl_ctrl.kl_coef": "algorithm.reward_kl_coef",
    "algorithm.kl_ctrl.type": "algorithm.reward_kl_ctrl (fixed or adaptive)",
    "algorithm.kl_ctrl.target_kl": "algorithm.reward_kl_target",
    "algorithm.kl_ctrl.horizon": "algorithm.reward_kl_horizon",
    "algorithm.filter_groups.enable": "algorithm.dynamic_sampling",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.max_refill_rounds (extra rounds, not batches)",
    "reward_model.overlong_buffer.enable": "algorithm.overlong_buffer_len > 0 or algorithm.overlong_buffer_fraction "
                                           "> 0 (both 0: off)",
    "reward_model.overlong_buffer.len": "algorithm.overlong_buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "algorithm.overlong_penalty_factor",
    "critic.optim.lr": "critic.lr",
}
VERL_MAPPING_KEYS = ("data.apply_chat_template_kwargs", "custom_reward_function.reward_kwargs")  # verl's keys of a
# mapping, set one name at a time


def _set(cfg: Config, dotted: str, value: Any) -> None:
    if dotted.startswith("+"):
        raise ConfigError(f"unknown config key '{dotted}': drop the '+' (Hydra's syntax for a new key; "
                          "DistFlow's keys all exist already)")
    verl = dotted if dotted in VERL_KEYS else next((k for k in VERL_MAPPING_KEYS if dotted.startswith(k + ".")), None)
    if verl is not None:
        raise ConfigError(f"unknown config key '{dotted}': verl's name; here it is {VERL_KEYS[verl]}")
    mapping = _mapping_key(dotted)
    if mapping is not None:  # one argument: data.chat_template_kwargs.enable_thinking=false
        section, field = mapping.split(".")
        setattr(getattr(cfg, section), field,
                json.dumps(mapping_setting(cfg, mapping) | {dotted[len(mapping) + 1:]: value}, default=str))
        return
    parts = dotted.split(".")
    if parts[0] not in SECTIONS:
        raise ConfigError(f"unknown config key '{dotted}': sections are {', '.join(SECTIONS)}")
    if len(parts) != 2:
        raise ConfigError(f"unknown config key '{dotted}': use section.key, e.g. {parts[0]}.<key>")
    section, name = parts
    fields = _section_fields(section)
    if name not in fields:
        raise ConfigError(
            f"unknown config key '{dotted}': keys in {section} are {', '.join(sorted(fields))}")
    setattr(getattr(cfg, section), name, _coerce(dotted, value, _annotation(section, name)))


def _value(cfg: Config, dotted: str) -> Any:
    mapping = _mapping_key(dotted)
    if mapping is not None:
        return mapping_setting(cfg, mapping).get(dotted[len(mapping) + 1:])
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def validate(cfg: Config, training: bool = True) -> Config:
    """Check every field's bounds and choices, then cross-field rules; without `training`
    (`distflow eval`) not those of how a step's batch is split."""
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            _check_field(cfg, f"{section}.{f.name}")
    _validate_cross(cfg, training)
    return cfg


def _validate_engine(cfg: Config) -> None:
    """A tensor-parallel vLLM engine is one rollout replica; `auto` correction follows the engine."""
    r = cfg.rollout
    if r.tensor_parallel_size > 1:
        if r.engine != "vllm":
            raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size}: the HF engine splits no "
                              "tensors; use rollout.engine=vllm (rollout.replica_size shares a replica's rows)")
        if r.replica_size not in (1, r.tensor_parallel_size):
            raise ConfigError(f"rollout.replica_size={r.replica_size}: a vLLM engine of rollout.tensor_parallel_size="
                              f"{r.tensor_parallel_size} ranks is one replica; leave replica_size unset")
        r.replica_size = r.tensor_parallel_size
    if r.engine == "vllm" and r.temperature < VLLM_MIN_TEMPERATURE:
        raise ConfigError(f"rollout.temperature={r.temperature:g} on vLLM: it samples at {VLLM_MIN_TEMPERATURE:g} at "
                          "least, and the trainer's log-probs would divide by another temperature than the "
                          f"sampler's; use a temperature of {VLLM_MIN_TEMPERATURE:g} or more, or rollout.engine=hf")
    if r.engine == "vllm" and r.temperature != 1.0 and r.top_p < 1.0:
        raise ConfigError(f"rollout.top_p={r.top_p} with rollout.temperature={r.temperature} on vLLM: its log-probs "
                          "after temperature are renormalised over the top-p nucleus, not the trainer's softmax; use "
                          "temperature=1 or top_p=1 there, or rollout.engine=hf")
    a = cfg.algorithm
    if a.rollout_correction == "auto":  # wherever the sampler's probabilities are not the trainer's own
        stale = a.max_staleness > 0 and a.old_log_probs_from == "recompute"
        # a rollout worker's HF engine is a copy of its own, in model.dtype: in bf16 not the trainer's fp32 weights
        apart_in_bf16 = cfg.runtime.placement == "disaggregated" and cfg.model.dtype != "float32"
        differ = (r.engine == "vllm" or stale or apart_in_bf16) and a.old_log_probs_from == "recompute"
        a.rollout_correction = "token_tis" if differ else "off"
    if a.old_log_probs_from == "rollout" and a.rollout_correction != "off":
        raise ConfigError(f"algorithm.rollout_correction={a.rollout_correction!r}: with "
                          "algorithm.old_log_probs_from=rollout the old policy is the sampler's, nothing to correct; "
                          "use rollout_correction=off or old_log_probs_from=recompute")


def _check_field(cfg: Config, key: str) -> None:
    """A field's bounds and choices (from its `_spec`)."""
    section, name = key.split(".")
    value, meta = getattr(getattr(cfg, section), name), _section_fields(section)[name].metadata
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: must be a finite number")
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{key}={value!r}: allowed values are {', '.join(map(str, meta['choices']))}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{key}={value!r}: must be >= {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"{key}={value!r}: must be <= {meta['max']}")


def _validate_logger(cfg: Config) -> None:
    """trainer.logger: known names, jsonl among them, and each tracker's package installed."""
    import importlib.util

    value = cfg.trainer.logger
    names = [n.strip() for n in value.split(",") if n.strip()]
    for name in names:
        if name not in ("jsonl", *TRACKERS):
            raise ConfigError(f"trainer.logger={value!r}: unknown logger {name!r}; choose from jsonl, "
                              + ", ".join(TRACKERS))
    if "jsonl" not in names:
        raise ConfigError(f"trainer.logger={value!r}: must include jsonl (metrics.jsonl feeds the progress bar, "
                          f"resume and the plots), e.g. trainer.logger=jsonl,{names[0] if names else 'tensorboard'}")
    for name in names:  # each tracker's package has its name
        if name != "jsonl" and importlib.util.find_spec(name) is None:
            raise ConfigError(f"trainer.logger={value!r}: the {name} package is not installed; "
                              'pip install "distflow[tracking]"')


def _validate_lora(cfg: Config) -> None:
    import importlib.util

    if not cfg.actor.lora_rank:
        return
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f'actor.lora_rank={cfg.actor.lora_rank}: the peft package is not installed; '
                          'pip install "distflow[lora]"')
    if cfg.actor.strategy == "fsdp2":
        raise ConfigError(f"actor.lora_rank={cfg.actor.lora_rank}: LoRA trains DDP replicas (a frozen base needs no "
                          "sharded optimizer state); use actor.strategy=auto or ddp")
    if cfg.scheduler.overlap is True:
        raise ConfigError(f"actor.lora_rank={cfg.actor.lora_rank}: the reference is the actor with its adapter "
                          "switched off, which must not run beside the rollout; use scheduler.overlap=auto or false")


def _validate_turns(cfg: Config) -> None:
    import importlib.util

    r = cfg.rollout
    given = [k for k, on in (("reward.custom_fn", cfg.reward.custom_fn), ("reward.from_env", cfg.reward.from_env),
                             ("rollout.agent", r.agent)) if on]
    if cfg.reward.model_path is not None and given:
        raise ConfigError(f"reward.model_path={cfg.reward.model_path!r}: the reward model gives the reward; "
                          f"leave {given[0]} unset")
    if r.tool_schemas is not None and not (r.env or r.agent):
        raise ConfigError(f"rollout.tool_schemas={r.tool_schemas!r}: the schemas of the tools rollout.env or "
                          "rollout.agent runs; the built-in tool environment runs rollout.tools alone (their "
                          "schemas reach the template without it)")
    if r.tools and r.env is not None and r.env.startswith("openenv:"):
        raise ConfigError(f"rollout.tools={r.tools!r}: an OpenEnv environment runs as it is, without the built-in "
                          "tools; leave rollout.tools unset")
    if cfg.reward.from_env and (r.env is None or r.max_turns == 1):
        raise ConfigError("reward.from_env=true: needs rollout.env (an environment whose steps give rewards) "
                          "and rollout.max_turns > 1")
    if r.env is not None and r.env.startswith("openenv:") and importlib.util.find_spec("openenv") is None:
        raise ConfigError(f'rollout.env={r.env!r}: the openenv package is not installed; '
                          'pip install "distflow[openenv]"')
    if r.agent is not None:
        if r.tools or r.env:
            raise ConfigError(f"rollout.agent={r.agent!r}: the agent runs its own tools and environment; leave "
                              f"rollout.{'tools' if r.tools else 'env'} unset")
        if ":" not in r.agent:
            raise ConfigError(f"rollout.agent={r.agent!r}: expected module:function or path.py:function")
        if importlib.util.find_spec("openai") is None:
            raise ConfigError(f'rollout.agent={r.agent!r}: the openai package is not installed; '
                              'pip install "distflow[agents]"')
        if cfg.data.on_long_prompt == "truncate":
            raise ConfigError(f"data.on_long_prompt=truncate: rollout.agent={r.agent!r} sends each row's messages "
                              "whole, which a truncated prompt no longer matches; use skip or error")
    elif r.max_turns == 1:
        for key in ("tools", "env", "tool_schemas"):
            if getattr(r, key):
                raise ConfigError(f"rollout.{key}={getattr(r, key)!r}: tools and environments answer between "
                                  "turns; set rollout.max_turns > 1")
        return
    if not (r.tools or r.env or r.agent):
        raise ConfigError(f"rollout.max_turns={r.max_turns}: needs rollout.tools (e.g. calculator), rollout.env "
                          "or rollout.agent")
    for name in tool_names(cfg):
        if name not in TOOLS:
            raise ConfigError(f"rollout.tools={r.tools!r}: unknown tool {name!r}; built in: {', '.join(TOOLS)}")
    if r.tensor_parallel_size > 1 or r.replica_size > 1:
        raise ConfigError(f"rollout.max_turns={r.max_turns}{', rollout.agent' if r.agent else ''}: multi-turn "
                          "episodes run on one-rank replicas; "
                          "use rollout.tensor_parallel_size=1 and rollout.replica_size=1")
    if r.max_total_tokens and r.max_total_tokens < r.max_new_tokens:
        raise ConfigError(f"rollout.max_total_tokens={r.max_total_tokens}: must be >= rollout.max_new_tokens="
                          f"{r.max_new_tokens} (one turn)")


def _validate_placement(cfg: Config) -> None:
    """disaggregated: num_workers is train_workers + rollout_workers; colocated runs are synchronous."""
    rt = cfg.runtime
    if cfg.rollout.partial:
        r = cfg.rollout
        if rt.placement != "disaggregated":
            raise ConfigError("rollout.partial=true: weights change during a generation only when rollout workers "
                              "and train workers are apart; use runtime.placement=disaggregated")
        if r.engine != "hf" or r.max_turns > 1 or r.agent:
            raise ConfigError("rollout.partial=true: the token-by-token swap is built for the HF engine's "
                              "single-turn generation; use rollout.engine=hf and rollout.max_turns=1 "
                              "without rollout.agent")
    if rt.placement == "colocated":
        if cfg.algorithm.max_staleness:
            raise ConfigError(f"algorithm.max_staleness={cfg.algorithm.max_staleness}: colocated workers alternate "
                              "generating and training (always synchronous); use runtime.placement=disaggregated")
        return
    if rt.mode == "centralized":
        raise ConfigError("runtime.placement=disaggregated: the single-controller baseline is colocated; "
                          "use runtime.mode=distributed")
    rt.num_workers = rt.train_workers + rt.rollout_workers


def _held_out_of_builtin(cfg: Config) -> None:
    """An empty data.val_files on a built-in training task is that task's test split."""
    sources = [src.strip() for src in cfg.data.train_files.split(",") if src.strip()]
    if not cfg.data.val_files and sources and all(src.startswith("builtin:") for src in sources):
        tasks = dict.fromkeys(src.split(":")[1] for src in sources)
        cfg.data.val_files = ",".join(f"builtin:{task}:test" for task in tasks)


def _validate_cross(cfg: Config, training: bool) -> None:
    for key in MAPPING_SETTINGS:
        mapping_setting(cfg, key)
    if cfg.reward.custom_fn_kwargs.strip() and cfg.reward.custom_fn is None:
        raise ConfigError("reward.custom_fn_kwargs: arguments to reward.custom_fn, which is not set")
    _validate_placement(cfg)
    _held_out_of_builtin(cfg)
    if cfg.algorithm.clip_ratio_low >= 1:
        raise ConfigError(f"algorithm.clip_ratio_low={cfg.algorithm.clip_ratio_low}: must be < 1 (the ratio's lower "
                          "clip, 1 - clip_ratio_low, must stay above 0)")
    longest = cfg.data.max_prompt_length + response_token_budget(cfg)
    if cfg.actor.use_dynamic_bsz and cfg.actor.max_tokens_per_micro_batch < longest:
        raise ConfigError(f"actor.max_tokens_per_micro_batch={cfg.actor.max_tokens_per_micro_batch}: smaller than "
                          f"the longest sequence a step may hold, {longest} tokens (data.max_prompt_length and the "
                          "response's budget, rollout.max_new_tokens or an episode's max_total_tokens); raise it")
    if cfg.data.val_max_samples == 0:
        raise ConfigError("data.val_max_samples=0: no held-out rows to evaluate; use a number of rows, or -1 for all")
    n_workers, workers = cfg.runtime.num_workers, "num_workers"
    if cfg.runtime.placement == "disaggregated":  # the rollout side holds the replicas
        n_workers, workers = cfg.runtime.rollout_workers, "rollout_workers"
    _validate_engine(cfg)
    _validate_logger(cfg)
    _validate_lora(cfg)
    _validate_turns(cfg)
    size = cfg.rollout.replica_size
    if n_workers % size:
        raise ConfigError(f"rollout.replica_size={size}: must divide runtime.{workers}={n_workers}")
    if training:
        _validate_step_split(cfg, n_workers, workers)
    if cfg.runtime.mode == "centralized":
        if cfg.runtime.launcher != "ray":
            raise ConfigError("runtime.mode='centralized': needs runtime.launcher=ray (the driver is Ray's)")
        if cfg.rollout.replica_size != 1:
            raise ConfigError("runtime.mode='centralized': needs rollout.replica_size=1")
        if cfg.scheduler.overlap is True:
            raise ConfigError("runtime.mode='centralized': runs one node at a time; use scheduler.overlap=auto or false")
    if cfg.runtime.ray_address is not None:
        if cfg.runtime.launcher != "ray":
            raise ConfigError(f"runtime.ray_address={cfg.runtime.ray_address!r}: needs runtime.launcher=ray")
        if cfg.runtime.network == "loopback":
            raise ConfigError(f"runtime.ray_address={cfg.runtime.ray_address!r}: a cluster cannot be "
                              "loopback-only; use runtime.network=auto or host")
    if cfg.runtime.network == "loopback" and "wandb" in cfg.trainer.logger and cfg.trainer.wandb_mode == "online":
        raise ConfigError("trainer.wandb_mode=online: W&B sends to its server, which a loopback-only run "
                          "(runtime.network=loopback) cannot reach; use runtime.network=auto or host, or "
                          "trainer.wandb_mode=offline")
    if cfg.model.path not in BUILTIN_MODELS:
        path = os.path.expanduser(cfg.model.path)
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
            raise ConfigError(
                f"model.path={cfg.model.path!r}: not a local HuggingFace model folder "
                f"(no config.json there); use {' or '.join(BUILTIN_MODELS)}, a folder made by save_pretrained or a LoRA checkpoint")
        if not any(name.endswith(".safetensors") for name in os.listdir(path)):
            raise ConfigError(f"model.path={cfg.model.path!r}: no .safetensors weights there (pickled .bin "
                              f"weights are never loaded; re-save with save_pretrained(safe_serialization=True))")
    validate_recipe_name(cfg.algorithm.name)
    if cfg.algorithm.graph is not None and not os.path.isfile(os.path.expanduser(cfg.algorithm.graph)):
        raise ConfigError(f"algorithm.graph={cfg.algorithm.graph!r}: no such file")
    buffer, budget = cfg.algorithm.overlong_buffer_len, response_token_budget(cfg)
    if buffer > budget:
        limit = ("rollout.max_new_tokens" if budget == cfg.rollout.max_new_tokens and cfg.rollout.max_turns == 1
                 else "the episode's token budget (rollout.max_total_tokens, else max_new_tokens x max_turns)")
        raise ConfigError(f"algorithm.overlong_buffer_len={buffer}: must be <= {limit}={budget}")
    reward_fn_weights(cfg)  # the functions named as module:function and their weights
    traced_steps(cfg)


def _validate_step_split(cfg: Config, n_workers: int, workers: str) -> None:
    """How a step's prompts split over the rollout replicas, the train side and the mini-batches."""
    batch, size = cfg.data.train_batch_size, cfg.rollout.replica_size
    if batch % (n_workers // size):
        raise ConfigError(f"data.train_batch_size={batch}: must be divisible by the number of rollout "
                          f"replicas, runtime.{workers} / rollout.replica_size = {n_workers // size}")
    per_replica = batch // (n_workers // size) * cfg.algorithm.group_size
    if per_replica < size:
        raise ConfigError(f"rollout.replica_size={size}: a replica's {per_replica} sequences a step (data.train_batch_size"
                          f" / replicas x algorithm.group_size) leave a member without any; raise the batch or group "
                          "size, or use a smaller replica")
    if cfg.runtime.placement == "disaggregated" and batch % cfg.runtime.train_workers:
        raise ConfigError(f"data.train_batch_size={batch}: must be divisible by runtime.train_workers="
                          f"{cfg.runtime.train_workers} (the train side's loader splits each step's prompts evenly)")
    mini = cfg.actor.ppo_mini_batch_size
    if batch % mini:
        raise ConfigError(f"actor.ppo_mini_batch_size={mini}: must divide data.train_batch_size={batch}")
    if cfg.algorithm.dynamic_sampling and cfg.algorithm.group_size < 2:
        raise ConfigError(f"algorithm.group_size={cfg.algorithm.group_size}: dynamic sampling keeps only groups "
                          "whose rewards differ, which a group of one response never does; use group_size >= 2")


def response_token_budget(cfg: Config) -> int:
    """The tokens a sample may have after its prompt: one turn's, or a multi-turn
    episode's or agent's (its turns and the tool results between them)."""
    r = cfg.rollout
    if r.max_turns == 1 and r.agent is None:
        return r.max_new_tokens
    return r.max_total_tokens or r.max_new_tokens * r.max_turns


def overlong_buffer_tokens(cfg: Config) -> int:
    """DAPO's overlong buffer in tokens (0: no shaping): algorithm.overlong_buffer_len where
    above 0, else algorithm.overlong_buffer_fraction of the response budget (at least one
    token where the fraction is above 0)."""
    a = cfg.algorithm
    if a.overlong_buffer_len or not a.overlong_buffer_fraction:
        return a.overlong_buffer_len
    return max(1, round(a.overlong_buffer_fraction * response_token_budget(cfg)))


TEMPLATE_KWARGS = "data.chat_template_kwargs"
REWARD_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")  # verl's compute_score keywords
# the settings that are mappings of names to values: (an example, the names DistFlow sets itself: the chat
# template's own arguments, the reward function's per-sample ones)
MAPPING_SETTINGS = {
    TEMPLATE_KWARGS: ("{enable_thinking: false}", ("conversation", "messages", "tools", "documents",
                                                   "add_generation_prompt", "tokenize", "continue_final_message",
                                                   "chat_template", "return_dict", "return_tensors")),
    "reward.custom_fn_kwargs": ("{strict: true}", REWARD_ARGUMENTS),
}


def _mapping_key(dotted: str) -> str | None:
    """The mapping setting `dotted` sets one name of (data.chat_template_kwargs.NAME), if any."""
    return next((key for key in MAPPING_SETTINGS if dotted.startswith(key + ".")), None)


def mapping_setting(cfg: Config, key: str) -> dict[str, Any]:
    """A mapping setting (`MAPPING_SETTINGS`) as a mapping; a ConfigError names what is wrong with it."""
    section, field = key.split(".")
    given = getattr(getattr(cfg, section), field)
    text = given.strip()
    try:  # as JSON holds it (a YAML date as its text): the same values in every process, a reward child's too
        value = json.loads(json.dumps(yaml.safe_load(text), default=str)) if text else {}
    except yaml.YAMLError:
        value = None
    example, reserved = MAPPING_SETTINGS[key]
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{key}={given!r}: expected a mapping of names to values, e.g. '{example}'")
    if own := sorted(set(value) & set(reserved)):
        raise ConfigError(f"{key}: {', '.join(own)} is set by DistFlow, not here")
    return value


def chat_template_kwargs(cfg: Config) -> dict[str, Any]:
    """data.chat_template_kwargs as a mapping (`mapping_setting`)."""
    return mapping_setting(cfg, TEMPLATE_KWARGS)


def reward_fn_specs(cfg: Config) -> list[str]:
    """reward.custom_fn's functions ([] for none), each module:function or path.py:function."""
    specs = [s.strip() for s in (cfg.reward.custom_fn or "").split(",") if s.strip()]
    for spec in specs:
        if ":" not in spec:
            raise ConfigError(f"reward.custom_fn={cfg.reward.custom_fn!r}: expected module:function or "
                              f"path.py:function, comma-separated ({spec!r} is neither)")
    return specs


def reward_fn_weights(cfg: Config) -> list[float]:
    """reward.custom_fn_weights, one per reward.custom_fn function (1 each where empty)."""
    specs, text = reward_fn_specs(cfg), cfg.reward.custom_fn_weights.strip()
    if not text:
        return [1.0] * len(specs)
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        weights = []
    if len(weights) != len(specs) or not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"reward.custom_fn_weights={text!r}: expected {len(specs)} finite number(s), "
                          f"comma-separated, one per reward.custom_fn function")
    return weights


def reward_fn_kwargs(cfg: Config) -> dict[str, Any]:
    """reward.custom_fn_kwargs as a mapping (`mapping_setting`)."""
    return mapping_setting(cfg, "reward.custom_fn_kwargs")


def tool_names(cfg: Config) -> list[str]:
    """rollout.tools as a list of names."""
    return [t.strip() for t in cfg.rollout.tools.split(",") if t.strip()]


def traced_steps(cfg: Config) -> set[int]:
    """trainer.trace_steps as a set of steps; a ConfigError names a part that is not one."""
    parts = [p for p in str(cfg.trainer.trace_steps).replace(" ", "").split(",") if p]
    for part in parts:
        if not (part.isdigit() and int(part) >= 1):
            raise ConfigError(f"trainer.trace_steps={cfg.trainer.trace_steps!r}: {part!r} is not a step "
                              "(comma-separated integers >= 1)")
    return {int(p) for p in parts}


# ---------------------------------------------------------------------------- loading


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if key in SECTIONS and not prefix and value in (None, ""):  # a section whose keys are all commented out
            continue
        if isinstance(value, dict) and dotted in MAPPING_SETTINGS:  # a mapping's value, nested values and all
            items.append((dotted, json.dumps(_scalars_typed(value), default=str)))
        elif isinstance(value, dict):  # a section, or another program's (verl's actor_rollout_ref): its dotted keys
            items.extend(_flatten(value, dotted + "."))
        else:
            items.append((dotted, value))
    return items


def _scalars_typed(value: Any) -> Any:
    """A nested value of a config file (read with every scalar as its text) with each scalar
    read as YAML reads it (numbers, booleans, null)."""
    if isinstance(value, dict):
        return {k: _scalars_typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scalars_typed(v) for v in value]
    try:
        return yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        return value


def parse_override(text: str) -> tuple[str, Any]:
    """`section.key=value`, its value as `_typed` reads it."""
    if "=" not in text:
        raise ConfigError(f"bad override '{text}': expected key=value, e.g. trainer.total_steps=50")
    key, raw = text.split("=", 1)
    return key.strip(), _typed(key.strip(), raw)


def _typed(key: str, raw: str) -> Any:
    """A value as written (an override's text, or a config file's scalar): read as YAML
    (numbers, booleans, null), except for a text key, which takes the text as written
    (YAML 1.1 made `0755` 493, `12:30` 750 and `1.10` 1.1, and cut `runs/exp #2` at its
    comment); null still clears an optional one, a quoted text loses its quotes, and
    verl's list syntax gives a comma-separated key its text."""
    text = raw.strip()
    if _takes_text_only(key) and not (text in ("null", "Null", "NULL", "~") or text.startswith(("'", '"', "["))):
        return text
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, list) and key in COMMA_SEPARATED:  # verl's list syntax: trainer.logger=[jsonl,wandb]
        value = ",".join(str(v) for v in value)
    if value is not None and not isinstance(value, str) and _takes_text_only(key):
        value = text
    return value


def _typed_items(tree: dict) -> list[tuple[str, Any]]:
    """A config or recipe file's (section.key, value) pairs, each value as `_typed` reads
    it (the file is read with every scalar as its text: `_read_yaml`)."""
    out = []
    for key, value in _flatten(tree):
        if isinstance(value, list):
            value = ",".join(value) if key in COMMA_SEPARATED else [_typed(key, v) for v in value]
        elif isinstance(value, str):
            value = _typed(key, value)
        out.append((key, value))
    return out


COMMA_SEPARATED = ("data.train_files", "data.val_files", "trainer.logger", "trainer.trace_steps", "rollout.tools",
                   "actor.lora_target_modules")


def _takes_text_only(dotted: str) -> bool:
    section, _, name = dotted.partition(".")
    if section not in SECTIONS or name not in _section_fields(section):
        return False
    allowed = _allowed_types(_annotation(section, name))
    return str in allowed and not {bool, int, float} & set(allowed)


def _read_yaml(path: str | Path, what: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"{what}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            tree = yaml.load(f, Loader=yaml.BaseLoader) or {}  # every scalar as its text; `_typed_items` types it
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: not UTF-8 text (a YAML file is)") from None
    except yaml.YAMLError as e:  # its message, where it says it, names the line and column
        raise ConfigError(f"{what}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{what}: top level must be a mapping")
    return tree


@dataclass(frozen=True)
class Recipe:
    """An algorithm as data: what it is, and the config values it stands for (its
    estimator, policy loss, aggregation, optional nodes and tuned defaults)."""

    name: str
    description: str
    paper: str
    settings: tuple[tuple[str, Any], ...]  # (section.key, value), applied where the user set nothing

    def setting(self, key: str) -> Any:
        """The recipe's value for `key`, else the config's default."""
        return dict(self.settings).get(key, _default(key))


def _default(dotted: str) -> Any:
    return _value(Config(), dotted)


def relocated_file_spec(spec: str, place: Callable[[str], str]) -> str:
    """`[openenv:]file.py:name` with its file's path passed through `place`; a module's
    `module:name`, or a registered name, as it is; a comma-separated list, each of them."""
    if "," in spec:  # several (reward.custom_fn), each so
        return ",".join(relocated_file_spec(part.strip(), place) for part in spec.split(",") if part.strip())
    prefix = "openenv:" if spec.startswith("openenv:") else ""
    target, _, name = spec.removeprefix(prefix).rpartition(":")
    return f"{prefix}{place(target)}:{name}" if target.endswith(".py") else spec


def _beside(key: str, value: Any, folder: Path) -> Any:
    """`file.py:function` and a relative `algorithm.graph` in a recipe file mean the file
    beside the recipe."""
    if isinstance(value, str) and ".py:" in value:
        return relocated_file_spec(value, lambda target: target if Path(target).expanduser().is_absolute()
                                   else str((folder / target).resolve()))
    if key == "algorithm.graph" and isinstance(value, str) and not Path(value).expanduser().is_absolute():
        return str((folder / value).resolve())
    return value


def load_recipe(name: str) -> Recipe:
    """A built-in recipe by name, or a recipe YAML file (`description`, `paper`, and
    config sections such as `algorithm:`). Every key is checked like a config key."""
    builtin = name in ALGORITHMS
    path = RECIPES_DIR / f"{name}.yaml" if builtin else Path(os.path.expanduser(name))
    what = f"recipe {name}" if builtin else f"algorithm.name={name}"
    tree = _read_yaml(path, what)
    unknown = sorted(set(tree) - {"description", "paper"} - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {unknown} (keys: description, paper, {', '.join(SECTIONS)})")
    settings = [(k, _beside(k, v, path.parent))
                for k, v in _typed_items({k: v for k, v in tree.items() if k in SECTIONS})]
    probe = Config()
    for key, value in settings:
        if key == "algorithm.name":
            raise ConfigError(f"{what}: a recipe cannot set algorithm.name")
        try:
            _set(probe, key, value)
            _check_field(probe, key)
        except ConfigError as e:
            raise ConfigError(f"{what}: {e}") from None
    return Recipe(path.stem, str(tree.get("description", "")), str(tree.get("paper", "")), tuple(settings))


_RUN_OWN_KEYS = ("trainer.output_dir", "trainer.resume")


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = (), training: bool = True) -> Config:
    """The config of `path` (YAML) and `overrides` (key=value), the recipe's settings
    under them, validated (`training`: see validate). Where an override changes the
    algorithm.name the file names, a file value equal to what the file's recipe (or the
    default) gives is that recipe's, not a choice: the new recipe's or the default replaces
    it (a run's recorded config.json, which holds every value, reused for another algorithm);
    and where the file is a run's recorded config.json, its trainer.output_dir and
    trainer.resume are not taken (that run's folder: the other algorithm's run is a new one)."""
    cfg, given = Config(), set()
    if path is not None:
        for key, value in _typed_items(_read_yaml(path, f"--config {path}")):
            _set(cfg, key, value)
            given.add(key)
    # a file that names its algorithm (a run's config.json does): its values that are that recipe's follow
    # an algorithm.name override; a file that names none holds the user's own choices
    file_recipe = cfg.algorithm.name if "algorithm.name" in given else None
    file_values = {key: _value(cfg, key) for key in given}
    for text in overrides:
        key, value = parse_override(text)
        _set(cfg, key, value)
        given.add(key)
        file_values.pop(key, None)
    validate_recipe_name(cfg.algorithm.name)
    if file_recipe is not None and cfg.algorithm.name != file_recipe:
        validate_recipe_name(file_recipe)
        resolved = Config()  # what the file's recipe gives every key
        for key, value in load_recipe(file_recipe).settings:
            _set(resolved, key, value)
        for key, value in file_values.items():
            # a run's recorded config: its folder and resume setting are that run's; the other algorithm's is a new run
            if value == _value(resolved, key) or (key in _RUN_OWN_KEYS and _records_its_own_run(path, file_values)):
                _set(cfg, key, _default(key))
                given.discard(key)
    for key, value in load_recipe(cfg.algorithm.name).settings:
        if key not in given:
            _set(cfg, key, value)
    return validate(cfg, training)


def _records_its_own_run(path: str, file_values: dict[str, Any]) -> bool:
    """Whether the config file is a run's recorded config.json: its trainer.output_dir is the
    file's own folder (a hand-written file's output_dir is the user's choice)."""
    folder = file_values.get("trainer.output_dir")
    return folder is not None and Path(folder).expanduser().resolve() == Path(path).expanduser().resolve().parent


def validate_recipe_name(name: str) -> None:
    if name not in ALGORITHMS and not name.endswith((".yaml", ".yml")):
        raise ConfigError(f"algorithm.name={name!r}: allowed values are {', '.join(ALGORITHMS)} "
                          "or a recipe .yaml file")


def from_dict(tree: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config sent to a worker as a plain dict (already validated by the launcher)."""
    cfg = Config()
    for key, value in _flatten(tree):
        _set(cfg, key, value)
    return cfg
