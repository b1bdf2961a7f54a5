"""Pieces the engines share: loading a HF causal LM (or a vision-language model), its
tokenizer and image processor from a local folder, and the one forward pass that turns
(prompt, response) pairs into per-token log-probs."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from distflow.algos.core import entropy_from_logits, log_probs_from_hidden, log_probs_from_logits
from distflow.config import BUILTIN_MODELS, ConfigError
from distflow.data.images import ImagePrompter, holds_images, model_inputs


def resolve_model_path(path: str) -> str:
    if path in BUILTIN_MODELS:
        from distflow.engines.tiny_model import ASSETS

        return str(ASSETS / path.removeprefix("builtin:"))
    local = os.path.expanduser(path)
    # absolute where it is here: a LoRA adapter records its base by the path it was loaded from
    return os.path.abspath(local) if os.path.exists(local) else local


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_tokenizer(path: str, chat_template_kwargs: dict | None = None):
    """The model folder's tokenizer, padding on the left; `chat_template_kwargs`
    (data.chat_template_kwargs: Qwen3's enable_thinking) go to every rendering of its chat
    template, a prompt's, an episode's turns and an agent's messages alike."""
    from transformers import AutoTokenizer

    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(resolve_model_path(path))
    tok.padding_side = "left"
    if tok.pad_token_id is None:  # many causal LMs ship without one; EOS is the usual stand-in
        tok.pad_token = tok.eos_token
    if chat_template_kwargs:
        tok.apply_chat_template = functools.partial(tok.apply_chat_template, **chat_template_kwargs)
    return tok


def has_chat_template(path: str) -> bool:
    """Whether the model folder's tokenizer has a chat template (a `chat_template.jinja`
    or `.json` beside it, or one in its tokenizer_config.json), read from its files; True
    where `path` is not a folder here (loading it says what is wrong)."""
    folder = resolve_model_path(path)
    if not os.path.isdir(folder):
        return True
    if any(os.path.isfile(os.path.join(folder, name)) for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def is_vision_language(config) -> bool:
    """Whether a model config is a vision-language model's (Qwen2-VL's has a vision_config)."""
    return hasattr(config, "vision_config")


def _model_class(config):
    """AutoModelForCausalLM, or for a vision-language config (Qwen2-VL's) AutoModelForImageTextToText."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def load_causal_lm(path: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    """A HF causal-LM (or vision-language) folder; a LoRA checkpoint (an adapter folder) as
    its base with the adapter merged."""
    from transformers import AutoConfig

    from distflow.engines.lora import is_adapter_folder, load_merged

    if is_adapter_folder(resolve_model_path(path)):
        return load_merged(resolve_model_path(path), lambda base: load_causal_lm(base, dtype, device))
    quiet_transformers()
    folder = resolve_model_path(path)
    # safetensors only (never unpickle weights) and no code from the model folder
    model = _model_class(AutoConfig.from_pretrained(folder)).from_pretrained(
        folder, dtype=getattr(torch, dtype), use_safetensors=True, trust_remote_code=False)
    return model.to(device)


def without_dropout(model):
    """`model` with every dropout off: its nn.Dropout modules and the attention dropout
    that Llama-style layers apply as a number (TRL's disable_dropout, for those too)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if isinstance(getattr(model.config, "attention_dropout", None), float):
        model.config.attention_dropout = 0.0
    return model


def causal_lm_skeleton(path: str):
    """The model's class and config with no weights (meta device): what writes a HF
    folder from a state dict (`save_pretrained(dir, state_dict=...)`), with the folder's
    generation config (its stop tokens; rebuilt from the config they would be lost); a
    LoRA checkpoint's are its base's."""
    from transformers import AutoConfig

    from distflow.engines.lora import adapter_base, is_adapter_folder

    quiet_transformers()
    folder = resolve_model_path(path)
    folder = adapter_base(folder) if is_adapter_folder(folder) else folder
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # float32, as the weights it writes (the config records the dtype it is built in)
        skeleton = _model_class(config).from_config(config, dtype=torch.float32)
    if os.path.isfile(os.path.join(folder, "generation_config.json")):  # its stop tokens and defaults, kept
        from transformers import GenerationConfig

        skeleton.generation_config = GenerationConfig.from_pretrained(folder)
    return skeleton


WEIGHTS_FILE, WEIGHTS_INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def index_single_weights_file(folder: str | Path) -> None:
    """Write `model.safetensors.index.json` for a folder whose weights are one
    `model.safetensors` beside other `.safetensors` files (a checkpoint's optimizer and
    RNG states), where it has none: without an index vLLM loads every `.safetensors`
    file of a folder as the model's weights; with one, only the files it names
    (transformers reads `model.safetensors` first either way)."""
    from safetensors import safe_open

    folder = Path(folder)
    weights, index = folder / WEIGHTS_FILE, folder / WEIGHTS_INDEX_FILE
    if index.exists() or not weights.is_file() or not any(f != weights for f in folder.glob("*.safetensors")):
        return
    with safe_open(weights, "pt") as f:
        names = sorted(f.keys())
    with open(weights, "rb") as f:  # the tensors' bytes: the file less its 8-byte length and its JSON header
        total = weights.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": {k: WEIGHTS_FILE for k in names}}, indent=2)
    written = None
    try:  # whole or not at all, whichever rank (of however many, on however many hosts) writes it too
        fd, written = tempfile.mkstemp(prefix=f".{WEIGHTS_INDEX_FILE}.", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(written, index)
    except OSError as e:
        if written is not None:
            with contextlib.suppress(OSError):
                os.unlink(written)
        if not index.is_file():
            raise OSError(f"{folder}: cannot write {WEIGHTS_INDEX_FILE}, which vLLM needs to load this folder's "
                          f"weights alone and not its other .safetensors files ({e.strerror or e})") from None


IMAGE_PROCESSOR_FILE = "preprocessor_config.json"  # what AutoImageProcessor reads from a model folder


def takes_images(path: str) -> bool:
    """Whether the model folder is a vision-language model's: it has an image processor."""
    return os.path.isfile(os.path.join(resolve_model_path(path), IMAGE_PROCESSOR_FILE))


VISION_TOKENS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")  # the Qwen2-VL family's


def _config_folder(folder: str) -> str:
    """Where a model folder's config is: its own, or a LoRA checkpoint's base's."""
    from distflow.engines.lora import adapter_base, is_adapter_folder

    return resolve_model_path(adapter_base(folder)) if is_adapter_folder(folder) else folder


def check_vision_model(path: str) -> None:
    """A vision-language model folder DistFlow can feed images to: the Qwen2-VL family's
    image tokens in its config and patches in its image processor; else one line."""
    folder = resolve_model_path(path)
    config = json.loads(Path(_config_folder(folder), "config.json").read_text())
    processor = json.loads(Path(folder, IMAGE_PROCESSOR_FILE).read_text())
    missing = [k for k in VISION_TOKENS if config.get(k) is None] + (["patch_size"] if "patch_size" not in processor
                                                                     else [])
    if missing:
        raise ValueError(f"model.path={path}: a vision-language model ({config.get('model_type')}) without "
                         f"{', '.join(missing)}; images are fed to the Qwen2-VL family's (Qwen2-VL, Qwen2.5-VL)")


def load_image_prompter(path: str, tokenizer, dtype: str = "float32") -> ImagePrompter | None:
    """The model folder's image processor as an ImagePrompter keeping pixels in `dtype`
    (model.dtype); None for a text-only model. A LoRA checkpoint holds the processor; its
    model config is its base's."""
    if not takes_images(path):
        return None
    from transformers import AutoConfig, AutoImageProcessor

    folder = resolve_model_path(path)
    quiet_transformers()
    return ImagePrompter(AutoImageProcessor.from_pretrained(folder), tokenizer,
                         AutoConfig.from_pretrained(_config_folder(folder)), getattr(torch, dtype))


def first_of_tied(module) -> Iterator[tuple[str, torch.Tensor]]:
    """`module.state_dict()`'s (name, tensor) pairs with a tied weight (the output head
    sharing the embedding: one parameter under two names) once, under its first name. Ties
    are read from the module's parameters, so every rank skips the same names; not from the
    tensors' memory: an FSDP2 rank whose shard of a weight holds no row has an empty tensor
    there, and every empty tensor's data_ptr is 0 (that rank skipped weights the others
    gathered, and the collectives went out of step)."""
    first: dict[int, str] = {}
    tied = {name for name, p in module.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name}
    for name, tensor in module.state_dict().items():
        if name not in tied:
            yield name, tensor


def unwrapped(model):
    """The HF model inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return getattr(model, "module", model)


def enable_gradient_checkpointing(model) -> None:
    """HF's activation checkpointing, non-reentrant, on the first HF model inside `model`
    (a causal LM, the one under a LoRA adapter, or a critic's body): each decoder layer's
    forward is run again in the backward instead of its activations being kept. It wraps
    the layers' `forward`, not their `__call__`, so FSDP2's hooks stay outside."""
    from transformers import PreTrainedModel

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None or not hf.supports_gradient_checkpointing:
        raise ValueError(f"{type(hf or model).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
        hf.activation_checkpointing_enable(kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpoints_activations(model) -> bool:
    """Some layer of `model` recomputes its activations in the backward."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in unwrapped(model).modules())


def render_prompt(tokenizer, messages: list[dict[str, str]], tools: list[dict] | None = None) -> str:
    """The prompt's text, tokenised without special tokens added: the chat template's (which
    writes any BOS itself), with the tools' JSON schemas where the run has tools (a template
    without a tools section leaves them out). A tokenizer without a template (a base model)
    gets the messages' contents, a line each, after the BOS its tokenizer puts first (as TRL
    tokenises a plain prompt: Llama-2 and Mistral base models expect it)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False)
    text = "\n".join(m["content"] for m in messages) + "\n"
    bos = tokenizer.bos_token_id
    return tokenizer.bos_token + text if bos is not None and tokenizer("x")["input_ids"][:1] == [bos] else text


@runtime_checkable
class LogProbModel(Protocol):
    """What the trainer needs from anything that scores responses (actor, reference)."""

    def compute_log_probs(self, batch, micro_batches: list[list[int]]) -> torch.Tensor: ...


def trim_padding(prompts: torch.Tensor, prompt_mask: torch.Tensor,
                 responses: torch.Tensor, response_mask: torch.Tensor):
    """Drop prompt columns that are padding in every row (left) and response columns
    that are padding in every row (right): less compute, same result."""
    keep_left = int((prompt_mask.sum(0) > 0).nonzero().min()) if prompt_mask.any() else 0
    valid_right = (response_mask.sum(0) > 0).nonzero()
    keep_right = int(valid_right.max()) + 1 if len(valid_right) else 1
    return (prompts[:, keep_left:], prompt_mask[:, keep_left:],
            responses[:, :keep_right], response_mask[:, :keep_right])


def computing_in(dtype: torch.dtype, device: torch.device):
    """Forwards in `dtype` on weights as they are (fp32: nothing to do; bf16: autocast)."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


@contextlib.contextmanager
def vision_tower_always_runs(owner, images: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """A vision-language model's forward on rows without an image still runs its vision
    tower: on one blank image (the patches of one merged token), times 0, added to the
    token embeddings (verl adds the same zero). DDP expects a gradient for every parameter
    in every backward, and FSDP2 gathers the tower's shards in collectives every rank
    joins in the same order: at the embeddings in the forward, last in the backward, as
    a forward with images does; a micro-batch of text-only rows on one rank failed the
    step. `owner`: the module with `get_image_features` and the input embeddings (the
    causal LM, or the critic's body)."""
    if holds_images(images or {}) or not is_vision_language(owner.config):
        yield
        return
    vision = owner.config.vision_config
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2

    def add_zero(module, args, embeddings):
        pixels = torch.zeros(merge * merge, width, device=embeddings.device)
        grid = torch.tensor([[1, merge, merge]], device=embeddings.device)
        features = owner.get_image_features(pixel_values=pixels, image_grid_thw=grid).pooler_output
        return embeddings + 0.0 * sum(f.sum() for f in features).to(embeddings.dtype)

    handle = owner.get_input_embeddings().register_forward_hook(add_zero)
    try:
        yield
    finally:
        handle.remove()


def forward_response(model, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                     responses: torch.Tensor, response_mask: torch.Tensor,
                     with_entropy: bool = False, temperature: float = 1.0,
                     observation_mask: torch.Tensor | None = None,
                     images: dict[str, torch.Tensor] | None = None,
                     prompt_once: bool = False, head_chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of `responses` given left-padded `prompts`, under
    softmax(logits / temperature): the distribution the rollout sampled from.

    Returns tensors of the full response width R; columns trimmed as padding are 0.
    Position ids follow the attention mask, as generation with left padding does. In a
    multi-turn episode the environment's tokens (`observation_mask`) are attended to like
    the generated ones (`response_mask`, the loss mask). `images`: the rows' padded
    `pixel_values` and `image_grid_thw` (data/images.py); the model then places the
    image tokens itself (Qwen2-VL's M-RoPE), as its generation does. `prompt_once`: rows
    with the same prompt share one forward of it (`_states_prompt_once`); not on a vision-language model.
    `head_chunk_tokens` > 0: the model's forward runs its output head on nothing, and the
    head's input, the final hidden states (`_head_inputs`), goes through the head that many
    tokens at a time (`log_probs_from_hidden`), its logits never kept whole; the model
    must pass `check_head_chunking`.
    """
    full_width = responses.shape[1]
    seen = response_mask if observation_mask is None else response_mask + observation_mask  # (B, R)
    p, pm, r, rm = trim_padding(prompts, prompt_mask, responses, seen)
    hidden = head_chunk_tokens > 0
    vlm = is_vision_language(unwrapped(model).config)  # its rows with and without images run alike
    with _head_inputs(model, hidden) as head_inputs, vision_tower_always_runs(unwrapped(model), images):
        states = _states_prompt_once(model, p, pm, r, rm, head_inputs) if prompt_once and not vlm else None
        if states is None:
            input_ids = torch.cat([p, r], dim=1)  # (B, P + R')
            attention = torch.cat([pm, rm], dim=1).long()
            position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
            vision = model_inputs(images, input_ids, unwrapped(model).config.image_token_id) if images else {}
            out = model(input_ids=input_ids, attention_mask=attention, position_ids=None if vision else position_ids,
                        use_cache=False, **vision, **_head_arguments(model, r.shape[1] + 1))
            # from the last prompt position on, each position predicts the next token of r: (B, R', V or H)
            states = _scoring_states(out, head_inputs)[:, -(r.shape[1] + 1): -1]
    if hidden:
        head = unwrapped(model).get_output_embeddings()  # after the forward: FSDP2 has gathered it
        log_probs, entropy = log_probs_from_hidden(states.flatten(0, 1), head.weight, head.bias, r.flatten(),
                                                   temperature, head_chunk_tokens, with_entropy)
        log_probs, entropy = log_probs.view(r.shape), entropy.view(r.shape) if with_entropy else None
    else:
        logits = states.float() / temperature
        log_probs = log_probs_from_logits(logits, r)
        entropy = entropy_from_logits(logits) if with_entropy else None
    pad = full_width - r.shape[1]
    if pad:
        log_probs = torch.nn.functional.pad(log_probs, (0, pad))
        entropy = torch.nn.functional.pad(entropy, (0, pad)) if entropy is not None else None
    return log_probs, entropy


def _head_arguments(model, positions: int) -> dict:
    """What the forward asks of the output head: its logits on the last `positions` only
    (TRL's logits_to_keep: the prompt's other positions predict nothing that is scored)."""
    return {"logits_to_keep": positions} if takes_logits_to_keep(unwrapped(model)) else {}


@contextlib.contextmanager
def _head_inputs(model, hidden: bool) -> Iterator[list[torch.Tensor] | None]:
    """For a chunked output head (`hidden`): a list to which each forward of `model`
    inside appends its output head's input (the final hidden states of the positions the
    forward keeps), while the head itself is handed none of them and computes no logits.
    Unlike `output_hidden_states`, which keeps every layer's states until the forward
    returns, only the final ones are kept. Without `hidden`: None (the logits are used).
    Only this thread's forwards: the hook is the module's, and a generate on the same
    model in another thread (one worker's HF engine, ReMax's greedy baseline beside the
    scoring) needs its logits."""
    if not hidden:
        yield None
        return
    taken: list[torch.Tensor] = []
    owner = threading.get_ident()

    def take(head, args):
        if threading.get_ident() != owner:
            return None
        states = args[0]
        taken.append(states)
        # a new empty tensor, not a view: what the head saves for its backward must not hold the states
        return (states.new_empty((*states.shape[:-2], 0, states.shape[-1])), *args[1:])

    handle = unwrapped(model).get_output_embeddings().register_forward_pre_hook(take)
    try:
        yield taken
    finally:
        handle.remove()


def _scoring_states(out, head_inputs: list[torch.Tensor] | None) -> torch.Tensor:
    """The forward's logits, or with `head_inputs` (`_head_inputs`) the final hidden
    states it handed its output head."""
    if head_inputs is None:
        return out.logits
    if not head_inputs:
        raise RuntimeError("actor.output_head_chunk_tokens: the model's forward did not run its output head "
                           "(get_output_embeddings()), so its final hidden states are unknown; use 0")
    return head_inputs.pop()


def check_head_chunking(model) -> None:
    """A chunked output head (actor.output_head_chunk_tokens) needs a HF causal LM whose
    forward can skip its head (`logits_to_keep`), whose head is a plain linear layer, and
    whose logits are that head's output unchanged: not capped or scaled after it (Gemma
    2's soft-capping, Cohere's and Granite's scales), which the chunks would leave out.
    Checked with one forward of two tokens whose head output is replaced by known values."""
    lm = unwrapped(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if not takes_logits_to_keep(lm) or type(head) is not torch.nn.Linear:
        raise ConfigError(f"actor.output_head_chunk_tokens: {type(lm).__name__}'s output head "
                          f"({type(head).__name__}) is not a plain linear layer its forward can skip; use 0")
    known: list[torch.Tensor] = []

    def replace(module, args, output):  # small integers: exact in every float dtype
        known.append(torch.arange(output.numel(), device=output.device).remainder(101).sub(50)
                     .view(output.shape).to(output.dtype))
        return known[-1]

    handle = head.register_forward_hook(replace)
    try:
        with torch.no_grad():
            logits = lm(input_ids=torch.tensor([[0, 1]], device=head.weight.device)).logits
    finally:
        handle.remove()
    if len(known) != 1 or not torch.equal(logits.to(known[0].dtype), known[0]):
        raise ConfigError(f"actor.output_head_chunk_tokens: {type(lm).__name__}'s forward changes its output "
                          f"head's logits (or does not run that head), which chunks of the head would leave "
                          f"out; use 0")


def _forward_parameters(model):
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a LoRA adapter (peft)
    return inspect.signature(hf.forward).parameters


def takes_logits_to_keep(model) -> bool:
    """The HF model runs its output head on the last N positions only when asked
    (`logits_to_keep=N`)."""
    return "logits_to_keep" in _forward_parameters(model)


def cache_arguments(model) -> tuple[str, dict]:
    """How a HF causal LM takes a key/value cache: the argument's name (`cache` from
    transformers 5.2x on, `past_key_values` before), and `logits_to_keep=1` (logits of
    the last position only) where it takes that."""
    return ("cache" if "cache" in _forward_parameters(model) else "past_key_values",
            _head_arguments(model, 1))


def distinct_prompts(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct rows of left-padded prompts (ids and mask), and each row's index among them."""
    unique, row_prompt = torch.unique(torch.cat([ids, mask], dim=1), dim=0, return_inverse=True)
    return unique[:, :ids.shape[1]], unique[:, ids.shape[1]:], row_prompt


def rows_can_share(cache) -> bool:
    """Whether each row can take its prompt's part of a prefill's `cache`: HF's
    DynamicCache of attention keys and values alone (full or sliding-window). Not the
    state of a linear-attention or SSM layer (Qwen3-Next, Granite-4.0-H, Jamba), nor a
    model's own cache class (Falcon-H1): rows sharing a prompt run it each there."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    return isinstance(cache, DynamicCache) and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)
                                                   for layer in cache.layers)


def _rows_of_prompts(cache, row_prompt: torch.Tensor):
    """The distinct prompts' cache, made to give each row its prompt's keys and values
    (`row_prompt`: each row's prompt). A layer of HF's plain `DynamicLayer` does it in its
    update, joined to the new tokens' and stored by no one, so a forward without
    gradients frees each layer's as it moves on, where HF's cache would keep every
    layer's, the responses' included, until the forward returns. Other layers are
    indexed up front (HF's `batch_select_indices`)."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.get_seq_length() > 0:
            layer.update = functools.partial(_joined_to_prompt, layer.keys, layer.values, row_prompt)
        else:
            layer.batch_select_indices(row_prompt)
    return cache


def _joined_to_prompt(keys: torch.Tensor, values: torch.Tensor, row_prompt: torch.Tensor,
                      new_keys: torch.Tensor, new_values: torch.Tensor, *args, **kwargs):
    return torch.cat([keys[row_prompt], new_keys], dim=-2), torch.cat([values[row_prompt], new_values], dim=-2)


def _states_prompt_once(model, prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                        seen: torch.Tensor, head_inputs: list[torch.Tensor] | None) -> torch.Tensor | None:
    """The logits that predict `responses` (B, R', V), or with `head_inputs`
    (`_head_inputs`) the final hidden states that do (B, R', H), with each distinct prompt
    of the batch run once: its keys and values are then handed to every row that has it,
    and those rows run only their response tokens on them. Causal attention makes this the
    same function as one forward per row (a prompt's states never see what follows it),
    and autograd sums each shared prompt's gradient over its rows. With GRPO's groups of
    G samples a prompt of P tokens costs P once instead of G times. None where no two
    rows share a prompt (then one forward per row is as cheap), in a forward with
    gradients through checkpointed layers, which take no cache there (HF's rule), and for
    a model whose cache rows cannot share (`rows_can_share`: a hybrid linear-attention or
    SSM model)."""
    lm = unwrapped(model)
    if lm.training and torch.is_grad_enabled() and checkpoints_activations(lm):
        return None
    ids, mask, row_prompt = distinct_prompts(prompts, prompt_mask)
    if len(ids) == len(prompts):
        return None
    width = prompts.shape[1]
    cache_arg, _ = cache_arguments(lm)
    # the prompts alone, outside a DDP wrapper: DDP takes one forward per backward, and
    # their parameters' gradients reach its hooks through the response forward's backward
    prompt_out = lm(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    use_cache=True, **_head_arguments(lm, 1))
    if not rows_can_share(prompt_out.past_key_values):
        return None
    # the prompt's last position predicts the first response token
    first = _scoring_states(prompt_out, head_inputs)[:, -1:][row_prompt]
    cache = _rows_of_prompts(prompt_out.past_key_values, row_prompt)
    attention = torch.cat([prompt_mask, seen], dim=1).long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, width:]
    rest = model(input_ids=responses, attention_mask=attention, position_ids=positions, use_cache=True,
                 **{cache_arg: cache}, **_head_arguments(model, responses.shape[1]))
    # and each response token the next
    return torch.cat([first, _scoring_states(rest, head_inputs)[:, :-1]], dim=1)
