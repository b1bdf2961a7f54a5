"""LoRA with `peft`: low-rank adapters on the policy's linear layers, the base weights frozen.

The reference model is the same module with the adapter disabled (no second copy of the
weights). A rollout engine that holds its own weights receives merged ones (base +
scale * B @ A, computed per tensor, never merged in place, so the base never drifts);
the HF engine that shares the actor's module generates through the adapter itself. A
checkpoint holds the adapter (`adapter_model.safetensors`, `adapter_config.json`, naming
the base folder); `load_causal_lm` of such a folder gives the merged model, and
`distflow export --merge` writes it as a plain HF folder.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    target_modules: str  # "all-linear" (every linear layer but the output head) or comma-separated names


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> str:
    """The base model folder an adapter checkpoint was trained on."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]


def _target_names(targets: str) -> list[str] | str:
    return targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]


def saved_setting_differences(saved: dict, settings: LoraSettings, model=None) -> list[str]:
    """`key=saved value` for each of the run's LoRA settings that the adapter's saved PEFT
    config (`saved`) does not have. Target modules are compared as the modules they name
    in `model`; without it, by their last names, where the run names them (`all-linear`
    is PEFT's to expand: that needs the model)."""
    differences = []
    for key, theirs, ours in (("lora_rank", saved.get("r"), settings.rank),
                              ("lora_alpha", saved.get("lora_alpha"), settings.alpha),
                              ("lora_dropout", saved.get("lora_dropout"), settings.dropout)):
        if theirs is not None and float(theirs) != float(ours):
            differences.append(f"actor.{key}={theirs}")
    theirs = saved.get("target_modules")
    if theirs is None:
        return differences
    theirs = theirs if theirs == "all-linear" else [theirs] if isinstance(theirs, str) else sorted(theirs)
    ours = _target_names(settings.target_modules)
    if model is not None:
        same = _targeted(model, theirs) == _targeted(model, ours)
    else:
        same = "all-linear" in (theirs, ours) or {t.rsplit(".", 1)[-1] for t in theirs} == \
            {t.rsplit(".", 1)[-1] for t in ours}
    if not same:  # by last name, as the config names them (PEFT may save every layer's path)
        shown = theirs if isinstance(theirs, str) else ",".join(sorted({t.rsplit(".", 1)[-1] for t in theirs}))
        differences.append(f"actor.lora_target_modules={shown}")
    return differences


def _targeted(model, targets: list[str] | str) -> set[str]:
    """The modules of `model` that PEFT adapts for these target modules: a name matches a
    module of that name or ending in it; `all-linear` is every linear layer but the head."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers, which PEFT counts as linear too

    modules = dict(model.named_modules())
    if targets == "all-linear":
        head = model.get_output_embeddings()
        return {n for n, m in modules.items() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head}
    return {n for n in modules if any(n == t or n.endswith("." + t) for t in targets)}


def with_lora(model, settings: LoraSettings, adapter_path: str | Path | None = None):
    """`model` wrapped by peft with a trainable adapter: a new one, or the one saved in
    `adapter_path` (resuming; its settings must be the run's: PEFT loads it as saved)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_path is not None:
        saved = json.loads((Path(adapter_path) / ADAPTER_CONFIG).read_text())
        if differences := saved_setting_differences(saved, settings, model):
            raise ValueError(f"checkpoint {adapter_path}: its LoRA adapter was trained with other settings; resume "
                             f"with {', '.join(differences)}")
        return PeftModel.from_pretrained(model, str(adapter_path), is_trainable=True)
    targets = settings.target_modules
    names = _target_names(targets)
    if names != "all-linear":  # peft says so only where none is found, and without the config key
        modules = dict(model.named_modules())
        missing = [t for t in names if not any(n == t or n.endswith("." + t) for n in modules)]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)})
            raise ValueError(f"actor.lora_target_modules={targets!r}: the model has no module named "
                             f"{', '.join(missing)}; its linear layers are named {', '.join(linear)}")
        shared = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
        tied = [n for n, m in modules.items() if any(n == t or n.endswith("." + t) for t in names)
                and isinstance(getattr(m, "weight", None), torch.Tensor) and shared[m.weight.data_ptr()] > 1]
        if tied:  # its delta would be merged into the shared weight, and so into the embedding too
            raise ValueError(f"actor.lora_target_modules={targets!r}: {tied[0]} shares its weight with another "
                             f"layer (tied embeddings); leave it out")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=names, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_lora(module) -> bool:
    return hasattr(module, "peft_config")


def merged_weights(peft_model) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under their HF names, each adapted layer as base + delta.
    A tied weight comes once, under its first name."""
    from peft.tuners.lora import LoraLayer

    from distflow.engines.common import first_of_tied

    base = peft_model.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in first_of_tied(base):
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner in adapted and leaf == "weight":
            tensor = tensor + adapted[owner].get_delta_weight("default").to(tensor.dtype)
        yield name.replace(".base_layer.", "."), tensor.detach()


def load_merged(path: str | Path, load_base):
    """An adapter checkpoint as a plain model: its base (`load_base(folder)`), adapted, merged."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(adapter_base(path)), str(path)).merge_and_unload()


class AdapterDisabledReference:
    """The frozen reference as the actor's base: the actor's own module with its adapter
    switched off for the forward. The scheduler must not run it beside the rollout
    (config: LoRA turns scheduler.overlap off), which generates through the adapter."""

    def __init__(self, actor, temperature: float = 1.0):
        self.actor, self.temperature = actor, temperature

    @torch.no_grad()
    def compute_log_probs(self, batch, micro_batches: list[list[int]]) -> torch.Tensor:
        with self.actor.module.disable_adapter():
            return self.actor.compute(batch, micro_batches)
