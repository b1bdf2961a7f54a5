"""Checkpoints: the state round-trips exactly, old ones are pruned, and a run killed while
writing a checkpoint resumes from the previous one to the same metrics as a run that was
never interrupted. Done for real: torchrun workers, SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distflow.engines.actor import Actor, OptimConfig
from distflow.engines.common import causal_lm_skeleton, load_causal_lm
from distflow.trainer import checkpoint
from helpers import distflow_sweep, run_gloo
from tracking_readers import assert_same, by_key, read_mlflow

SMALL = ["trainer.total_steps=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
         "algorithm.group_size=4", "data.val_max_samples=16", "rollout.max_new_tokens=24",
         "trainer.eval_every=0", "trainer.progress=false", "runtime.launcher=torchrun"]
TIMING = ("time/", "perf/")


def _train(args, cwd, env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "distflow.cli", "train", *SMALL, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def test_optimizer_and_rng_state_round_trip(tmp_path, random_model_dir):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-2), torch.device("cpu"))
    loss = sum((p * p).sum() for p in actor.model.parameters())
    loss.backward()
    actor.optimizer.step()
    before = {k: {n: v.clone() for n, v in s.items()} for k, s in actor.optimizer.state.items()}
    rng = torch.get_rng_state()
    (tmp_path / "step_0.tmp").mkdir()  # a write that crashed (a full disk): gone before this one is written
    checkpoint.save(tmp_path / "step_1", hf_skeleton=actor.model, tokenizer=AutoTokenizer.from_pretrained(random_model_dir),
                    actor=actor, critic=None, step=1, loader_state={"epoch": 0, "offset": 4}, metrics_file=None,
                    keep_last=0)
    torch.rand(10)  # move the RNG on
    fresh = Actor(load_causal_lm(str(tmp_path / "step_1")), OptimConfig(lr=1e-2), torch.device("cpu"))
    state = checkpoint.restore(tmp_path / "step_1", actor=fresh, critic=None)
    assert state["step"] == 1 and state["dataloader"] == {"epoch": 0, "offset": 4}
    assert torch.equal(torch.get_rng_state(), rng)
    after = list(fresh.optimizer.state.values())
    assert len(after) == len(before)
    for old, new in zip(before.values(), after):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(old[name], new[name])
    for a, b in zip(actor.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    assert not list(tmp_path.glob("*.tmp")), "nothing half-written is left"
    # resumed with other settings: the moments are the checkpoint's, the learning rate and weight decay the run's
    changed = Actor(load_causal_lm(str(tmp_path / "step_1")), OptimConfig(lr=1e-3, weight_decay=0.1),
                    torch.device("cpu"))
    checkpoint.restore(tmp_path / "step_1", actor=changed, critic=None)
    assert {(g["lr"], g["weight_decay"]) for g in changed.optimizer.param_groups} == {(1e-3, 0.1)}
    assert torch.equal(next(iter(changed.optimizer.state.values()))["exp_avg"], next(iter(before.values()))["exp_avg"])
    assert checkpoint.latest(tmp_path) == tmp_path / "step_1"


def test_a_parameter_the_optimizer_never_stepped_resumes_without_state(tmp_path, random_model_dir):
    """A trainable parameter that never had a gradient (an expert no token was routed to, a
    vision tower before its first image) has no AdamW state in the checkpoint. Resuming
    takes the others' state and leaves it without one, as it was: not torch's strict-load
    error, and not a zero state with a step counted."""
    from transformers import AutoTokenizer

    actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-2), torch.device("cpu"))
    names = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    stepped = set(names[: len(names) // 2])
    sum((p * p).sum() for n, p in actor.model.named_parameters() if n in stepped).backward()
    actor.optimizer.step()
    checkpoint.save(tmp_path / "step_1", hf_skeleton=actor.model, tokenizer=AutoTokenizer.from_pretrained(random_model_dir),
                    actor=actor, critic=None, step=1, loader_state={"epoch": 0, "offset": 4}, metrics_file=None,
                    keep_last=0)
    fresh = Actor(load_causal_lm(str(tmp_path / "step_1")), OptimConfig(lr=1e-2), torch.device("cpu"))
    checkpoint.restore(tmp_path / "step_1", actor=fresh, critic=None)
    old = dict(actor.model.named_parameters())
    for name, param in fresh.model.named_parameters():
        if name in stepped:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(fresh.optimizer.state[param][key], actor.optimizer.state[old[name]][key])
        else:
            assert param not in fresh.optimizer.state, name
    meta = json.loads((tmp_path / "step_1" / "optimizer.json").read_text())  # another model's: a parameter unlisted
    meta["param_groups"][0]["params"].remove(names[-1])
    (tmp_path / "step_1" / "optimizer.json").write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match=f"no entry for 1 .* {names[-1]}"):
        checkpoint.restore(tmp_path / "step_1", actor=fresh, critic=None)


def _resume_on_two_ranks(rank: int, world: int, model_dir: str, folder: str) -> dict:
    """`_resume_with` under each strategy, in one launch (a launch's start-up costs more than the checks)."""
    return {strategy: _resume_with(model_dir, folder, strategy) for strategy in ("ddp", "fsdp2")}


def _resume_with(model_dir: str, folder: str, strategy: str):
    """One step, a checkpoint, and a fresh actor restored from it, on two ranks: (the files
    this rank read while restoring, whether the optimizer state came back whole)."""
    from unittest import mock

    from transformers import AutoTokenizer

    torch.manual_seed(0)
    actor = Actor(load_causal_lm(model_dir), OptimConfig(lr=1e-2), torch.device("cpu"), strategy=strategy)
    actor.model(input_ids=torch.arange(12).view(2, 6)).logits.float().pow(2).mean().backward()
    actor.optimizer.step()
    out = Path(folder) / strategy / "step_1"
    checkpoint.save(out, hf_skeleton=load_causal_lm(model_dir), tokenizer=AutoTokenizer.from_pretrained(model_dir),
                    actor=actor, critic=None, step=1, loader_state={"epoch": 0, "offset": 0}, metrics_file=None,
                    keep_last=0)
    before = checkpoint._full_state(actor.model, actor.optimizer, weights=False)[1].get("state", {})  # rank 0 holds it whole
    fresh = Actor(load_causal_lm(str(out)), OptimConfig(lr=1e-2), torch.device("cpu"), strategy=strategy)
    read, real = [], checkpoint.load_file
    with mock.patch.object(checkpoint, "load_file", lambda f, *a, **k: (read.append(Path(f).name), real(f, *a, **k))[1]):
        checkpoint.restore(out, actor=fresh, critic=None)
    after = checkpoint._full_state(fresh.model, fresh.optimizer, weights=False)[1].get("state", {})  # rank 0 holds it whole
    whole = before.keys() == after.keys() and all(torch.equal(v, after[n][k]) for n, s in before.items()
                                                  for k, v in s.items())
    if strategy == "ddp":  # each rank's own replica of the state, as rank 1 got it from rank 0
        whole = whole and all(torch.equal(actor.optimizer.state[old][k], fresh.optimizer.state[new][k])
                              for old, new in zip(actor.model.parameters(), fresh.model.parameters())
                              for k in actor.optimizer.state[old])
    return sorted(read), whole, fresh.strategy


def test_on_resume_rank_0_alone_reads_the_optimizer_and_every_rank_gets_its_state(tmp_path, random_model_dir):
    """The optimizer file is twice the weights in fp32; every rank reading it whole would hold
    N copies on a host at once. Rank 0 reads it and torch sends each rank its part."""
    ranks = run_gloo(_resume_on_two_ranks, 2, random_model_dir, str(tmp_path), timeout=240.0)
    for strategy in ("ddp", "fsdp2"):
        (read_0, whole_0, used_0), (read_1, whole_1, used_1) = (r[strategy] for r in ranks)
        assert used_0 == used_1 == strategy and whole_0 and whole_1
        assert read_0 == ["optimizer.safetensors", "rng.safetensors"] and read_1 == ["rng.safetensors"]


def test_export_keeps_the_trained_weights_or_casts_them_on_request(tmp_path, random_model_dir):
    """By default the exported weights are the checkpoint's fp32 master weights, bit for
    bit; with a dtype they are cast to it (half the bytes for bfloat16) and the config says
    so, so that from_pretrained loads them as they are."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the model's folder says bfloat16 (most hub models do); the checkpoint holds, and says, float32
    halved = tmp_path / "bf16-model"
    shutil.copytree(random_model_dir, halved)
    config = json.loads((halved / "config.json").read_text())
    (halved / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-2), torch.device("cpu"))
    checkpoint.save(tmp_path / "step_1", hf_skeleton=causal_lm_skeleton(str(halved)),
                    tokenizer=AutoTokenizer.from_pretrained(random_model_dir), actor=actor, critic=None, step=1,
                    loader_state={"epoch": 0, "offset": 0}, metrics_file=None, keep_last=0)
    trained = load_file(tmp_path / "step_1" / "model.safetensors")
    checkpoint.export(tmp_path / "step_1", tmp_path / "as_trained", merge=False)
    checkpoint.export(tmp_path / "step_1", tmp_path / "bf16", merge=False, dtype="bfloat16")
    kept, cast = (load_file(tmp_path / name / "model.safetensors") for name in ("as_trained", "bf16"))
    assert all(torch.equal(kept[k], v) and kept[k].dtype == torch.float32 for k, v in trained.items())
    assert all(torch.equal(cast[k], v.to(torch.bfloat16)) for k, v in trained.items())
    sizes = [(tmp_path / name / "model.safetensors").stat().st_size for name in ("as_trained", "bf16")]
    assert sizes[1] < 0.55 * sizes[0]
    assert json.loads((tmp_path / "as_trained" / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "as_trained").dtype == torch.float32
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    # a weight index beside the one weights file names its tensors alone: vLLM, which loads every
    # .safetensors file of a folder without one, then leaves the optimizer's and the RNG's out
    for name, dtype in (("step_1", torch.float32), ("as_trained", torch.float32), ("bf16", torch.bfloat16)):
        index = json.loads((tmp_path / name / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {k: "model.safetensors" for k in trained}, name
        assert index["metadata"]["total_size"] == sum(v.numel() * dtype.itemsize for v in trained.values()), name


def test_a_gpu_rank_s_cuda_rng_state_round_trips(tmp_path, random_model_dir, monkeypatch):
    """A rank that has used its GPU saves the GPU's RNG state beside the CPU's and gets it
    back on resume. No GPU here: torch.cuda's RNG calls are stood in for by a CPU
    generator's state (a uint8 tensor, as the GPU's is)."""
    from transformers import AutoTokenizer

    gpu = {"state": torch.Generator().manual_seed(7).get_state()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: gpu["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: gpu.update(state=state.clone()))
    saved = gpu["state"].clone()
    actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-2), torch.device("cpu"))
    checkpoint.save(tmp_path / "step_1", hf_skeleton=actor.model,
                    tokenizer=AutoTokenizer.from_pretrained(random_model_dir), actor=actor, critic=None, step=1,
                    loader_state={"epoch": 0, "offset": 0}, metrics_file=None, keep_last=0)
    gpu["state"] = torch.Generator().manual_seed(8).get_state()  # the GPU's generator moves on
    checkpoint.restore(tmp_path / "step_1", actor=actor, critic=None)
    assert torch.equal(gpu["state"], saved)


def test_latest_ignores_incomplete_folders_and_prune_keeps_the_newest(tmp_path, capsys):
    for step in (2, 4, 6):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / checkpoint.STATE_FILE).write_text(json.dumps({"format": 1, "step": step}))
    (tmp_path / "step_8.tmp").mkdir()  # killed while writing
    (tmp_path / "step_10").mkdir()  # no state file: not a checkpoint
    assert checkpoint.latest(tmp_path) == tmp_path / "step_6"
    (tmp_path / "step_7").mkdir()  # a disk that lost its state file's contents: skipped, saying so
    (tmp_path / "step_7" / checkpoint.STATE_FILE).write_text("")
    assert checkpoint.latest(tmp_path) == tmp_path / "step_6"
    assert "skipping checkpoint" in capsys.readouterr().err
    (tmp_path / "step_70").mkdir()  # unreadable too, and named newer: it must not push out the good ones
    (tmp_path / "step_70" / checkpoint.STATE_FILE).write_text("{")
    (tmp_path / "step_9").mkdir()  # another format's (a later version's): skipped alike, not raised on
    (tmp_path / "step_9" / checkpoint.STATE_FILE).write_text(json.dumps({"format": 2, "step": 9}))
    assert checkpoint.latest(tmp_path) == tmp_path / "step_6"
    checkpoint._prune(tmp_path, keep_last=2)
    # a folder that is not a checkpoint, or whose state cannot be read, is not counted or touched (nor the one
    # being written: `save` removes what crashed writes left before it writes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_4", "step_6", "step_7", "step_70",
                                                          "step_8.tmp", "step_9"]
    with pytest.raises(checkpoint.CheckpointError, match="trainer.resume='/nowhere': no complete checkpoint"):
        checkpoint.resolve("/nowhere", tmp_path)
    assert checkpoint.resolve("off", tmp_path) is None


def test_a_fresh_start_sets_the_earlier_run_s_metrics_tensorboard_and_tracker_ids_aside(tmp_path, capsys):
    """TensorBoard drew both runs as one curve, and the earlier run's W&B/MLflow ids stayed
    for a later resume of the new run to go on in. Numbers go on from the highest kept:
    a gap (a deleted metrics-1.jsonl) is not filled by renaming over metrics-2.jsonl."""
    from distflow.trainer.loop import set_aside_earlier_run

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "metrics-2.jsonl").write_text("kept\n")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out").write_text("")
    (tmp_path / "trackers.json").write_text('{"mlflow": "abc"}')
    (tmp_path / "summary.json").write_text("{}")
    set_aside_earlier_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics-2.jsonl", "metrics-3.jsonl", "tensorboard-1",
                                                          "trackers-1.json"]
    assert (tmp_path / "metrics-2.jsonl").read_text() == "kept\n"
    assert (tmp_path / "tensorboard-1" / "events.out").exists()
    assert "the earlier run's tensorboard is kept as tensorboard-1" in capsys.readouterr().err


@pytest.mark.slow
def test_killed_while_checkpointing_then_resumed_matches_an_uninterrupted_run(tmp_path):
    run = tmp_path / "run"
    # rank 0 is SIGKILLed while it writes the final checkpoint (step 3), after logging step 3:
    # steps 1-3 of this first attempt are an uninterrupted run; step_2 stays the latest checkpoint
    logged = "trainer.logger=jsonl,mlflow"  # a tracker's runs: continued by a resume, new for a rollback
    proc = _train([f"trainer.output_dir={run}", "trainer.save_every=1", "trainer.keep_last=1", logged], tmp_path,
                  env={"DISTFLOW_FAULT": "checkpoint:3"})
    assert proc.returncode != 0
    uninterrupted = _metrics(run)
    assert [r["step"] for r in uninterrupted] == [0, 1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final.tmp", "step_2"]  # keep_last=1
    assert checkpoint.latest(run / "checkpoints") == run / "checkpoints" / "step_2"

    tracked = json.loads((run / "trackers.json").read_text())["mlflow"]
    proc = _train([f"trainer.output_dir={run}", "trainer.save_every=1", "trainer.keep_last=1", logged], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]  # trainer.resume=auto
    assert f"distflow: resuming from {run / 'checkpoints' / 'step_2'} (step 2 of 3); trainer.resume=off" in proc.stderr
    resumed = _metrics(run)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]  # the metrics file continues, no step twice
    assert json.loads((run / "trackers.json").read_text())["mlflow"] == tracked  # the same MLflow run goes on
    # bitwise: weights, AdamW moments and the dataloader position are restored exactly, and
    # sampling is seeded per (step, prompt, sample), so the resumed step replays exactly
    assert [_untimed(r) for r in resumed] == [_untimed(r) for r in uninterrupted]
    assert resumed[3]["actor/grad_norm"] > 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final", "step_2"]
    # the resumed run's throughput and wall time are the whole run's (the restored steps count as they ran)
    summary = (run / "summary.json").read_text()
    before = json.loads((run / "checkpoints" / "step_2" / checkpoint.STATE_FILE).read_text())["wall_seconds"]
    assert before > 0 and json.loads(summary)["wall_seconds"] >= before + resumed[3]["time/step"]  # not the last
    # launch's alone
    steps = resumed[1:]
    assert json.loads(summary)["tokens_per_second"] == pytest.approx(
        sum(r["tokens/total"] for r in steps) / sum(r["time/step"] + r["time/wait_for_samples"] for r in steps))
    # the same command once more: it resumes from `final`, trains nothing and keeps the run's summary
    proc = _train([f"trainer.output_dir={run}", "trainer.save_every=1", "trainer.keep_last=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(step 3 of 3): the run is complete, nothing to train; trainer.resume=off" in proc.stderr  # said nothing
    assert (run / "summary.json").read_text() == summary and _metrics(run) == resumed
    # a changed batch size cannot go on from the checkpoint's data position: refused by name, the folder untouched
    proc = _train([f"trainer.output_dir={run}", "data.train_batch_size=8"], tmp_path)
    assert proc.returncode != 0
    assert f"checkpoint {run / 'checkpoints' / 'final'}: its run had data.train_batch_size=4, this one 8" in proc.stderr
    assert (run / "summary.json").read_text() == summary and _metrics(run) == resumed
    # rolled back to step 2 in the same folder: the later `final` is set aside (else `keep_last` would keep it over
    # the new branch's and `resume=auto` would pick it), and step 3 replays exactly
    proc = _train([f"trainer.output_dir={run}", "trainer.save_every=1", "trainer.keep_last=1", logged,
                   f"trainer.resume={run / 'checkpoints' / 'step_2'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a new MLflow run for the new branch, holding the checkpoint's steps and its own; the old one keeps the old
    branch = json.loads((run / "trackers.json").read_text())["mlflow"]
    assert branch != tracked
    assert_same(read_mlflow(run, branch)[0], by_key(_metrics(run)))
    assert_same(read_mlflow(run, tracked)[0], by_key(resumed))
    assert "the later checkpoint final of this run folder is set aside" in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints-abandoned").iterdir()) == ["final"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final", "step_2"]
    assert [_untimed(r) for r in _metrics(run)] == [_untimed(r) for r in uninterrupted]
    # the abandoned branch's metrics are kept (its step 3 was replaced by the checkpoint's copy, which ends at 2)
    assert "this folder's metrics.jsonl (the abandoned branch's steps) is kept as metrics-1.jsonl" in proc.stderr
    assert (run / "metrics-1.jsonl").read_text().splitlines() == \
        [json.dumps(r) for r in resumed]
    # started afresh in the folder (trainer.resume=off): the earlier run's checkpoints and metrics are set aside,
    # not mixed with this run's (a later resume=auto took its `final` at step 3 and trained nothing)
    proc = _train([f"trainer.output_dir={run}", "trainer.save_every=1", "trainer.keep_last=1", "trainer.resume=off",
                   "trainer.total_steps=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in _metrics(run)] == [0, 1]
    assert [_untimed(json.loads(line)) for line in (run / "metrics-2.jsonl").read_text().splitlines()] == \
        [_untimed(r) for r in uninterrupted]
    assert sorted(p.name for p in (run / "checkpoints-abandoned").iterdir()) == ["final", "final+", "step_2"]
    assert checkpoint.read_state(checkpoint.latest(run / "checkpoints"))["step"] == 1


@pytest.mark.slow
def test_ppo_resumes_from_a_path_on_another_worker_count_like_an_uninterrupted_run(tmp_path):
    """PPO's critic and both optimizers, the adaptive KL-in-reward coefficient, two
    mini-batches per step, and a resume with trainer.resume=PATH into a new run folder on
    2 workers from a checkpoint written by 1: steps 3-4 equal the uninterrupted run's.
    The 2-worker runs shard the actor and critic with FSDP2. Resumed with a fixed KL
    coefficient, the run takes it (the checkpoint's adaptive one overrode it)."""
    # sharded on 2 workers (FSDP2; the other resume test runs the default, DDP replicas)
    common = ["algorithm.name=ppo", "algorithm.use_kl_in_reward=true", "algorithm.reward_kl_ctrl=adaptive",
              "algorithm.reward_kl_target=0.0001", "algorithm.reward_kl_horizon=10", "trainer.total_steps=4",
              "actor.strategy=fsdp2", "critic.strategy=fsdp2"]
    first = distflow_sweep({"first": ["trainer.total_steps=2"]}, 1, tmp_path, [*SMALL, *common])["first"]
    ckpt = first / "checkpoints" / "final"
    assert (ckpt / "critic.safetensors").is_file() and (ckpt / "critic_optimizer.safetensors").is_file()
    # one 2-worker launch: the uninterrupted run, then the resumed one
    runs = distflow_sweep({"straight": [], "second": [f"trainer.resume={ckpt}"],
                           "fixed": [f"trainer.resume={ckpt}", "algorithm.reward_kl_ctrl=fixed",
                                     "algorithm.reward_kl_coef=0.05"]}, 2, tmp_path, [*SMALL, *common])
    want, got = _metrics(runs["straight"]), _metrics(runs["second"])
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]  # the checkpoint's metrics, then the resumed steps
    for a, b in zip(want[3:], got[3:], strict=True):
        for key in ("reward/mean", "reward/accuracy", "response/length_mean", "tokens/total"):
            assert a[key] == b[key], (key, a["step"], a[key], b[key])  # the same samples after the resume
        for key in [k for k in a if k.startswith(("actor/", "critic/", "reward_kl/"))]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a["step"], a[key], b[key])
    # the controller moved (target far below the KL) and resumed from its saved value
    assert got[4]["reward_kl/coef"] > got[1]["reward_kl/coef"] and "critic/vf_loss" in got[4]
    # resumed with a fixed coefficient: the config's, not the adaptive one the checkpoint saved
    assert [r["reward_kl/coef"] for r in _metrics(runs["fixed"])[3:]] == pytest.approx([0.05, 0.05])


def _complete(folder, step):
    folder.mkdir()
    (folder / checkpoint.STATE_FILE).write_text(json.dumps({"format": 1, "step": step}))
    return folder


def test_replacing_a_checkpoint_leaves_a_complete_one_whenever_it_is_cut_short(tmp_path, monkeypatch):
    """A resumed run writes `final` again: its old `final` goes aside first and is removed
    last, so a crash between any two steps leaves a complete checkpoint to resume from."""
    _complete(tmp_path / "final", 60)
    real_replace, calls = os.replace, []

    def crash_at_the_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", crash_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.put_in_place(_complete(tmp_path / "final.tmp", 100), tmp_path / "final")
    monkeypatch.undo()
    found = checkpoint.latest(tmp_path)
    assert found == tmp_path / "final.replaced" and checkpoint.read_state(found)["step"] == 60
    checkpoint.put_in_place(tmp_path / "final.tmp", tmp_path / "final")  # the next save completes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert checkpoint.read_state(checkpoint.latest(tmp_path))["step"] == 100
    _complete(tmp_path / "step_40.replaced", 40)  # left by a crash; a later save is newer
    checkpoint._prune(tmp_path, keep_last=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_checkpoint_keeps_the_models_generation_config(tmp_path, random_model_dir):
    """Its stop tokens and sampling defaults (a list of eos ids, as Llama-3-Instruct's),
    which a skeleton rebuilt from config.json alone would lose."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    from distflow.engines.common import causal_lm_skeleton

    base = tmp_path / "base"
    shutil.copytree(random_model_dir, base)
    GenerationConfig(eos_token_id=[2, 3], temperature=0.7, do_sample=True).save_pretrained(base)
    actor = Actor(load_causal_lm(str(base)), OptimConfig(lr=1e-2), torch.device("cpu"))
    checkpoint.save(tmp_path / "step_1", hf_skeleton=causal_lm_skeleton(str(base)),
                    tokenizer=AutoTokenizer.from_pretrained(base), actor=actor, critic=None, step=1,
                    loader_state={"epoch": 0, "offset": 4}, metrics_file=None, keep_last=0)
    kept = GenerationConfig.from_pretrained(tmp_path / "step_1")
    assert kept.eos_token_id == [2, 3] and kept.temperature == 0.7


def _agree(rank: int, world: int, folders: list[str], resumes: list[str]) -> tuple[str, str]:
    """agree_on_the_run_folder on this rank's folder and trainer.resume (a rank on another
    host without a shared file system sees another folder, or no checkpoint): what it set
    trainer.resume to, or the error it raised."""
    from distflow.config import load_config
    from distflow.trainer.loop import agree_on_the_run_folder

    cfg = load_config(None, [f"trainer.resume={resumes[rank]}"])
    try:
        agree_on_the_run_folder(cfg, Path(folders[rank]))
        return "resume", cfg.trainer.resume
    except Exception as e:
        return type(e).__name__, str(e)


def test_workers_that_do_not_share_the_run_folder_or_its_checkpoint_all_stop_in_one_line(tmp_path):
    """Each worker resolves trainer.resume itself: on hosts without a shared file system
    worker 0 resumed at its step while the others started at 0, in step until the
    collectives drifted apart and hung. Now every worker raises the same one line."""
    from helpers import run_gloo

    shared, elsewhere = tmp_path / "run", tmp_path / "other-host-run"
    ckpt = shared / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoint.STATE_FILE).write_text(json.dumps({"format": 1, "step": 4}))
    # one folder for both: both resume from its newest checkpoint, and say which
    assert run_gloo(_agree, 2, [str(shared)] * 2, ["auto", "auto"]) == [("resume", str(ckpt))] * 2
    # worker 1's "run folder" is another one: it does not see what worker 0 writes
    blind = run_gloo(_agree, 2, [str(shared), str(elsewhere)], ["auto", "auto"])
    assert blind[0][0] == blind[1][0] == "RuntimeError" and blind[1][1] == blind[0][1].replace(str(shared),
                                                                                               str(elsewhere))
    assert blind[0][1].startswith(f"run folder {shared}: worker(s) [1] (host ") and "a file system they share" in \
        blind[0][1]
    # the same folder, but worker 1 was given a checkpoint its host does not have
    missing = run_gloo(_agree, 2, [str(shared)] * 2, ["auto", str(tmp_path / "nowhere")])
    assert missing[0] == missing[1] == ("CheckpointError", f"trainer.resume='{tmp_path / 'nowhere'}': no complete "
                                        "checkpoint there (a folder with trainer_state.json, or a run folder with "
                                        "checkpoints/)")
    differ = run_gloo(_agree, 2, [str(shared)] * 2, ["auto", "off"])
    assert differ[0] == differ[1] and differ[0][0] == "CheckpointError" and \
        f"different checkpoints to resume from (worker 0: {ckpt}, worker 1: none)" in differ[0][1]
