"""Resumable checkpoints, with nothing pickled.

    checkpoints/step_<k>/               (and checkpoints/final/)
        config.json, model.safetensors, tokenizer files   the policy as a HF folder
        (with LoRA: adapter_config.json, adapter_model.safetensors, the adapter; its base is model.path)
        optimizer.safetensors, optimizer.json             AdamW state (full, not sharded)
        critic.safetensors, critic_optimizer.*            PPO's critic, when there is one
        rng.safetensors                                   each rank's torch RNG states (CPU, its GPU)
        metrics.jsonl                                     the run's metrics up to step k
        trainer_state.json                                step, dataloader position, world size

Every rank takes part (gathering FSDP shards is a collective); rank 0 writes. The folder
is written as `step_<k>.tmp` and renamed when complete, so a crash mid-write leaves the
previous checkpoint as the latest loadable one. States are full (unsharded), so a run can
resume on a different number of workers. `trainer.keep_last=M` keeps the M newest
`step_*` folders (`final` is never removed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from distflow.collectives import all_gather_objects
from distflow.engines.common import index_single_weights_file
from distflow.engines.lora import LoraSettings, is_lora

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_ASIDE = ".replaced"  # a checkpoint being replaced by a newer one of the same name (`put_in_place`)
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; one line naming the folder and the problem."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _full_state(model, optimizer, weights: bool = True) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """(the model's full state dict, or None without `weights`; its optimizer's), on the
    CPU: a collective under FSDP2 (the shards are gathered)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options) if weights else None,
            get_optimizer_state_dict(model, optimizer, options=options))


# An optimizer tensor's name in its file: the parameter's name, NUL, the state's key ("exp_avg").
_NAME_KEY = "\x00"


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    # written at once, never changed: the tensors as they are (the offload made CPU copies already), not cloned again
    tensors = {f"{name}{_NAME_KEY}{key}": value.detach().contiguous().cpu()
               for name, entry in state["state"].items() for key, value in entry.items()}
    return tensors, {"param_groups": state["param_groups"], "format": FORMAT_VERSION}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for flat, value in tensors.items():
        name, key = flat.split(_NAME_KEY)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save(path: Path, *, hf_skeleton, tokenizer, actor, critic, step: int, loader_state: dict[str, int],
         metrics_file: Path | None, keep_last: int, algorithm_state: dict[str, float] | None = None,
         image_processor=None, wall_seconds: float = 0.0) -> None:
    """Collective: every rank calls it with its own engines; rank 0 writes `path`.
    `hf_skeleton`: a model of the policy's class and config (its weights unused);
    `image_processor`: a VLM's, saved beside the tokenizer.
    `algorithm_state`: numbers the algorithm carries across steps (the adaptive KL
    coefficient), the same on every rank. `wall_seconds`: the training loop's time so far,
    over every launch (a resumed run's summary counts it)."""
    lora = is_lora(actor.module)  # the adapter alone is saved: the base's weights are not gathered
    actor_sd, actor_osd = _full_state(actor.model, actor.optimizer, weights=not lora)
    critic_state = _full_state(critic.model, critic.optimizer) if critic is not None else None
    rngs = all_gather_objects(_rng_states())  # a few KB between our own workers
    if _rank() == 0:
        tmp = path.with_name(path.name + ".tmp")
        for stale in path.parent.glob("*.tmp"):  # what a crashed write left (a full disk's): before this one's
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
        if lora:  # the adapter alone (its config names the base folder)
            actor.module.save_pretrained(tmp, safe_serialization=True)
        else:  # the policy as a HF folder, from the actor's weights (save_pretrained consumes the dict it gets)
            hf_skeleton.save_pretrained(tmp, safe_serialization=True, state_dict=dict(actor_sd))
        tokenizer.save_pretrained(tmp)
        if image_processor is not None:
            image_processor.save_pretrained(tmp)
        tensors, meta = _flatten_optimizer(actor_osd)
        save_file(tensors, tmp / "optimizer.safetensors")
        (tmp / "optimizer.json").write_text(json.dumps(meta))
        if critic_state is not None:
            save_file({k: v.contiguous() for k, v in critic_state[0].items()}, tmp / "critic.safetensors")
            tensors, meta = _flatten_optimizer(critic_state[1])
            save_file(tensors, tmp / "critic_optimizer.safetensors")
            (tmp / "critic_optimizer.json").write_text(json.dumps(meta))
        save_file({f"{device}rank_{r}": torch.tensor(state, dtype=torch.uint8)
                   for r, states in enumerate(rngs) for device, state in states.items()}, tmp / "rng.safetensors")
        index_single_weights_file(tmp)  # vLLM loads the model's weights alone, not the files above
        if metrics_file is not None and metrics_file.exists():
            shutil.copyfile(metrics_file, tmp / "metrics.jsonl")
        _fault_point(f"checkpoint:{step}")
        (tmp / STATE_FILE).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "dataloader": loader_state,
                                                  "world_size": len(rngs), "algorithm": algorithm_state or {},
                                                  "wall_seconds": wall_seconds}))
        put_in_place(tmp, path)
        _prune(path.parent, keep_last)
    if dist.is_initialized():
        dist.barrier()  # nobody runs ahead of a checkpoint that is still being written


def _fault_point(name: str) -> None:
    """Fault injection for the reliability tests: DISTFLOW_FAULT=<name> (here
    `checkpoint:<step>`) kills this process at this point with SIGKILL, as a crash or an
    OOM kill would."""
    if os.environ.get("DISTFLOW_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def put_in_place(tmp: Path, path: Path) -> None:
    """The complete checkpoint `tmp` becomes `path`; an earlier one there (a resumed
    run's `final`) is renamed aside first and removed last, so a crash at any point
    leaves a complete checkpoint that `latest` finds."""
    _sync(tmp)
    aside = path.with_name(path.name + _ASIDE)
    if path.exists():
        if aside.exists():  # a crash left one aside before: `path` is the newer
            shutil.rmtree(aside)
        os.replace(path, aside)
    os.replace(tmp, path)  # complete: from now on it is the latest checkpoint
    _sync(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _sync(folder: Path) -> None:
    """Its files' contents and its entries on disk (a power loss after the rename leaves
    the checkpoint complete, not a folder of empty files)."""
    for f in folder.iterdir():
        if f.is_file():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _prune(folder: Path, keep_last: int) -> None:
    """After a complete save: drop the checkpoints a crash left aside while they were
    being replaced (the one just saved is newer) and, with keep_last > 0, all but the
    newest `keep_last` readable `step_*` checkpoints."""
    for stale in folder.glob(f"*{_ASIDE}"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last <= 0:
        return
    # by the step their state file records; one whose state cannot be read is not counted (nor removed), so it
    # cannot push out the good ones
    steps = sorted((state["step"], p) for p, state in _checkpoints(folder) if _STEP_DIR.match(p.name))
    for _, old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint under `folder` (`step_*` or `final`; one a crash
    left renamed aside while a newer was put in its place, where that one is not there),
    or None. One whose state file cannot be read (a disk that lost it) is skipped, saying so."""
    found = [(state["step"], p.name.startswith("final"), not p.name.endswith(_ASIDE), p)
             for p, state in _checkpoints(folder)]
    return max(found)[3] if found else None


def _checkpoints(folder: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(path, trainer state) of each complete checkpoint in `folder` (`step_*`, `final`,
    and one left aside by `put_in_place`); one whose state file cannot be read, or is of
    another format, is skipped, saying so."""
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        name = p.name.removesuffix(_ASIDE)
        if (p / STATE_FILE).is_file() and (_STEP_DIR.match(name) or name == "final"):
            try:
                state = read_state(p, json.loads((p / STATE_FILE).read_text()))
            except (OSError, ValueError, AttributeError, CheckpointError) as e:  # AttributeError: JSON, not a dict
                print(f"distflow: skipping checkpoint {p}: its {STATE_FILE} cannot be read or used ({e})",
                      file=sys.stderr)
                continue
            yield p, state


def set_aside_newer(folder: Path, step: int) -> list[Path]:
    """A run resumed from an earlier step than its folder's newest checkpoints (a rollback
    after a divergence): those newer than `step` belong to the abandoned branch. They move
    to `<folder>-abandoned/` (a name taken there gets a suffix), out of the way of
    `latest` and of `keep_last`'s pruning, which would otherwise keep them over the new
    branch's. Returns where they went."""
    moved = []
    for p, state in list(_checkpoints(folder)):
        if state["step"] > step:
            out = folder.with_name(folder.name + "-abandoned") / p.name
            while out.exists():
                out = out.with_name(out.name + "+")
            out.parent.mkdir(exist_ok=True)
            os.replace(p, out)
            moved.append(out)
    return moved


def set_aside_numbered(path: Path) -> Path:
    """`path` (a file or folder of a run folder) renamed `<stem>-<n><suffix>`, n one above
    the highest kept so far (a gap left by a deleted one is not filled: no rename replaces
    a kept file); returns the new name."""
    taken = [re.fullmatch(rf"{re.escape(path.stem)}-(\d+){re.escape(path.suffix)}", p.name)
             for p in path.parent.iterdir()]
    aside = path.with_name(f"{path.stem}-{1 + max((int(m[1]) for m in taken if m), default=0)}{path.suffix}")
    path.rename(aside)
    return aside


def read_state(path: Path, state: dict | None = None) -> dict[str, Any]:
    """The checkpoint's trainer state (`state`: its file's contents, read already), checked."""
    if state is None:
        try:
            state = json.loads((path / STATE_FILE).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path}: no readable {STATE_FILE} ({e})") from None
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format {state.get('format')!r}, expected {FORMAT_VERSION}")
    return state


def resolve(resume: str, run_dir: Path) -> Path | None:
    """trainer.resume: off -> None; auto -> the run folder's latest, if any; else a path."""
    if resume == "off":
        return None
    if resume == "auto":
        return latest(run_dir / "checkpoints")
    path = Path(resume).expanduser()
    if not (path / STATE_FILE).is_file():
        inner = latest(path / "checkpoints") or latest(path)
        if inner is None:
            raise CheckpointError(f"trainer.resume={resume!r}: no complete checkpoint there "
                                  f"(a folder with {STATE_FILE}, or a run folder with checkpoints/)")
        path = inner
    return path


def check_resumable(path: Path, lora: LoraSettings | None) -> None:
    """A checkpoint this run can go on from: a LoRA adapter of its settings (`lora`) for a
    LoRA run, the whole model's weights otherwise (one line where not; PEFT's and torch's
    own errors point elsewhere, and PEFT loads an adapter as it was saved, whatever the
    run's rank, alpha, dropout or target modules say; `all-linear` is checked where the
    model is there, `lora.with_lora`)."""
    from distflow.engines.lora import ADAPTER_CONFIG, is_adapter_folder, saved_setting_differences

    if not is_adapter_folder(path):
        if lora is not None:
            raise CheckpointError(f"checkpoint {path}: the whole model's weights, but this run trains a LoRA adapter "
                                  f"(actor.lora_rank={lora.rank}); resume without actor.lora_rank, or start a new "
                                  "LoRA run with the checkpoint as model.path")
        return
    saved = json.loads((path / ADAPTER_CONFIG).read_text())
    if lora is None:
        raise CheckpointError(f"checkpoint {path}: a LoRA adapter of rank {saved.get('r')}, but this run has "
                              f"actor.lora_rank=0; resume with actor.lora_rank={saved.get('r')}")
    if differences := saved_setting_differences(saved, lora):
        raise CheckpointError(f"checkpoint {path}: its LoRA adapter was trained with other settings; resume with "
                              f"{', '.join(differences)}")


def _load_optimizer(engine, path: Path, stem: str) -> None:
    """The engine's AdamW moments and steps from the checkpoint; its settings (learning rate,
    betas, weight decay) stay this run's, as the config says (a resumed run may change them).
    Under several workers rank 0 alone reads the file and torch sends each rank its part,
    one tensor at a time: not every rank holding the whole optimizer at once. A parameter
    the checkpoint lists but has no state for was never stepped (an expert no token
    reached): it is left without state, as it was, not given a zero state whose step counts."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    meta = json.loads((path / f"{stem}.json").read_text())
    with safe_open(path / f"{stem}.safetensors", "pt") as f:  # the names alone, from the file's header
        stepped = {flat.split(_NAME_KEY)[0] for flat in f.keys()}
    listed = {name for group in meta["param_groups"] for name in group["params"]}
    # the unwrapped module's names, as torch's optimizer state names them (DDP's `module.` prefix dropped)
    trainable = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    if trainable - listed:
        unknown = sorted(trainable - listed)
        raise CheckpointError(f"checkpoint {path}: {stem} has no entry for {len(unknown)} of this model's trainable "
                              f"parameters (e.g. {unknown[0]}); it was saved for another model")
    broadcast = dist.is_initialized() and dist.get_world_size() > 1
    state = (_unflatten_optimizer(load_file(path / f"{stem}.safetensors"), meta)
             if not broadcast or _rank() == 0 else {})
    # strict=False: torch's loader gives the never-stepped ones a zero state with a step, undone below
    set_optimizer_state_dict(engine.model, engine.optimizer, state, options=StateDictOptions(
        full_state_dict=True, strict=False, broadcast_from_rank0=broadcast))
    params = dict(engine.module.named_parameters(remove_duplicate=False))  # a tied weight under each of its names
    for name in listed - stepped:
        engine.optimizer.state.pop(params[name], None)
    for group in engine.optimizer.param_groups:
        group.update(lr=engine.optim.lr, betas=engine.optim.betas, weight_decay=engine.optim.weight_decay)


def restore(path: Path, *, actor, critic) -> dict[str, Any]:
    """Collective: optimizer (and critic) states and this rank's RNG; the policy weights
    were loaded from the folder itself. Returns the trainer state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = read_state(path)
    _load_optimizer(actor, path, "optimizer")
    if critic is not None:
        if not (path / "critic.safetensors").is_file():
            raise CheckpointError(f"checkpoint {path}: has no critic, but this recipe trains one")
        set_model_state_dict(critic.model, load_file(path / "critic.safetensors"),
                             options=StateDictOptions(full_state_dict=True))
        _load_optimizer(critic, path, "critic_optimizer")
    rngs = load_file(path / "rng.safetensors")
    if f"rank_{_rank()}" in rngs:
        torch.set_rng_state(rngs[f"rank_{_rank()}"])
    if f"cuda_rank_{_rank()}" in rngs and torch.cuda.is_available():
        torch.cuda.set_rng_state(rngs[f"cuda_rank_{_rank()}"])
    return state


def _rng_states() -> dict[str, list[int]]:
    """This rank's RNG states by key prefix: the CPU generator's (""), and its GPU's
    ("cuda_") where it has used one (dropout, if on, draws from it)."""
    states = {"": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda_"] = torch.cuda.get_rng_state().tolist()
    return states


_RESUME_ONLY = ("optimizer.safetensors", "optimizer.json", "critic.safetensors", "critic_optimizer.safetensors",
                "critic_optimizer.json", "rng.safetensors", "metrics.jsonl", STATE_FILE)


def export(path: Path, out: Path, merge: bool, dtype: str | None = None) -> list[str]:
    """A checkpoint as a folder to share: what `from_pretrained` needs, without the state
    only resuming uses. A LoRA checkpoint with `merge`: its base with the adapter merged,
    as a plain HF folder; without: the adapter (and tokenizer). `dtype` (bfloat16,
    float16, float32): the floating-point weights cast to it, and the config saying so
    (by default they stay as trained: the fp32 master weights). Returns the files written."""
    from distflow.engines.common import IMAGE_PROCESSOR_FILE, load_causal_lm, load_tokenizer
    from distflow.engines.lora import adapter_base, is_adapter_folder

    if path.name.endswith(".tmp"):
        raise CheckpointError(f"checkpoint {path}: a checkpoint still being written, or one a crash cut short")
    if (path / "checkpoints").is_dir():
        raise CheckpointError(f"checkpoint {path}: a run folder; export one of its checkpoints, e.g. "
                              f"{path / 'checkpoints' / 'final'}")
    weights = any(path.glob("*.safetensors")) if path.is_dir() else False
    if not path.is_dir() or not (((path / "config.json").is_file() and weights) or is_adapter_folder(path)):
        raise CheckpointError(f"checkpoint {path}: not a model folder (no config.json and .safetensors weights, "
                              "or adapter_config.json)")
    out = out.expanduser().resolve()  # `--out .`: the folder's own name, for the partial one beside it
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"export --out {out}: exists and is not an empty folder; choose a new folder")
    if merge and is_adapter_folder(path) and not Path(base := adapter_base(path)).expanduser().is_dir():
        raise CheckpointError(f"checkpoint {path}: its adapter's base model {base} is not a folder here; "
                              "export the adapter without --merge, or put the base there")
    # a new folder is written beside `out` and renamed when complete; an empty one the user made (the working
    # directory, say) is written in place and emptied again on a failure: none is left looking like a model
    made = not out.exists()
    folder = out.with_name(out.name + ".partial") if made else out
    if made:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    try:
        if merge and is_adapter_folder(path):  # merged into the fp32 base, then cast (a bf16 base would round first)
            load_causal_lm(str(path), "float32").save_pretrained(folder, safe_serialization=True)
            load_tokenizer(str(path)).save_pretrained(folder)
            if (path / IMAGE_PROCESSOR_FILE).is_file():  # a VLM's image processor, as the checkpoint holds it
                shutil.copy2(path / IMAGE_PROCESSOR_FILE, folder / IMAGE_PROCESSOR_FILE)
        else:
            for f in path.iterdir():
                if f.is_file() and f.name not in _RESUME_ONLY:
                    shutil.copy2(f, folder / f.name)
        if dtype is not None:
            _cast_weights(folder, getattr(torch, dtype))
    except BaseException:
        for written in folder.iterdir() if not made else ():
            shutil.rmtree(written) if written.is_dir() else written.unlink()
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if made:
        os.replace(folder, out)
    return sorted(f.name for f in out.iterdir())


def _cast_weights(folder: Path, dtype: torch.dtype) -> None:
    """The floating-point tensors of `folder`'s safetensors files cast to `dtype`, one
    file at a time; its config and shard index say so."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(f).items()}
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        save_file(tensors, f, metadata={"format": "pt"})
    for index in folder.glob("*.safetensors.index.json"):
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(data, indent=2))
    config_file = folder / "config.json"  # an adapter folder has none: its base's says
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        for key in ("dtype", "torch_dtype"):  # transformers 5's name, and the older one where it is there
            if key == "dtype" or key in config:
                config[key] = str(dtype).removeprefix("torch.")
        config_file.write_text(json.dumps(config, indent=2))
