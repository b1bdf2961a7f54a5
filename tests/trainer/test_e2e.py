"""End-to-end runs on real worker processes (torchrun and Ray), CPU, a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import distflow_sweep, distflow_train, run_metrics
from tracking_readers import read_mlflow

pytestmark = pytest.mark.slow

# small but real: the built-in model and task, rewards are non-zero from the start
SMALL = ["trainer.total_steps=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
         "algorithm.group_size=4", "data.val_max_samples=16", "rollout.max_new_tokens=24",
         "trainer.eval_every=0", "trainer.progress=false"]


PROBE = """
import json, os
from pathlib import Path
from distflow.engines.reward import default_compute_score

def score(data_source, solution_str, ground_truth, extra_info=None):
    path = Path(__file__).parent / f"probe-{os.getpid()}.json"
    if not path.exists():  # what the network looks like from inside the run, while it runs
        listening = [line.split()[1] for name in ("/proc/net/tcp", "/proc/net/tcp6") if os.path.exists(name)
                     for line in open(name).readlines()[1:] if line.split()[3] == "0A"]
        interfaces = [line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]]
        path.write_text(json.dumps({"netns": os.readlink("/proc/self/ns/net"), "interfaces": interfaces,
                                    "listening": listening}))
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""


def test_ray_launcher_run_leaves_summary_plot_checkpoint_and_no_payload(tmp_path):
    """Also: the run is loopback-only (runtime.network=auto as root): Ray's and
    torch.distributed's listening ports live in a network namespace whose only
    interface is the loopback. And runtime.mode=centralized, the single-controller
    baseline, gives exactly the same metrics with every stage's data through the driver."""
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "run"
    args = [*SMALL, "trainer.total_steps=2", "scheduler.overlap=false", f"reward.custom_fn={tmp_path / 'probe.py'}:score"]
    proc = distflow_train([*args, f"trainer.output_dir={out}"], tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("heldout_accuracy_initial", "heldout_accuracy_final", "steps", "num_workers",
                "wall_seconds", "tokens_per_second"):
        assert key in summary
    assert summary["num_workers"] == 2 and summary["steps"] == 2 and summary["tokens_per_second"] > 0
    assert "heldout_accuracy_final=" in proc.stdout
    assert (out / "reward.png").stat().st_size > 1000
    records = run_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    # held-out accuracy per level of the built-in task too; the levels' rows make up the whole
    levels = [k for k in records[0] if k.startswith("val/accuracy/level_")]
    assert sorted(levels) == ["val/accuracy/level_1", "val/accuracy/level_2", "val/accuracy/level_3"]
    assert records[1]["actor/lr"] == pytest.approx(1e-4 / 4)  # the first warm-up step of the cosine schedule
    # a response's clip ratio at the step and at the held-out evaluation (verl's response_length/clip_ratio)
    assert 0.0 <= records[1]["response/clip_ratio"] <= 1.0 and 0.0 <= records[0]["val/response_length/clip_ratio"] <= 1
    for key in ("reward/mean", "reward/accuracy", "response/length_mean", "actor/kl", "actor/entropy",
                "actor/clip_frac", "actor/clip_frac_lower", "actor/approx_kl", "actor/grad_norm",
                "perf/tokens_per_second", "time/rollout",
                "time/actor_update", "time/reward", "time/ref_log_prob"):
        assert key in records[1], key
    # the launcher measured what it received: control only, no batch payload
    launcher = json.loads((out / "launcher.json").read_text())
    assert launcher["payload_bytes_received"] == 0
    assert launcher["received_by_source"]["result"]["control"] > 0  # the meter did see the summaries
    # loopback only: one probe per worker's reward process
    probes = [json.loads(p.read_text()) for p in tmp_path.glob("probe-*.json")]
    assert len(probes) == 2 and summary["network"] == "loopback" and "network=loopback" in proc.stdout
    for probe in probes:
        assert probe["interfaces"] == ["lo"] and probe["netns"] != os.readlink("/proc/self/ns/net")
        assert len(probe["listening"]) >= 4  # Ray's servers, the TCPStore, gloo: all behind the loopback
    # the final policy is a normal HF folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = out / "checkpoints" / "final"
    assert (ckpt / "model.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.decode(tok("Ann has 3", add_special_tokens=False)["input_ids"]) == "Ann has 3"

    central = tmp_path / "centralized"
    distflow_train([*args, "runtime.mode=centralized", "trainer.save_final=false", f"trainer.output_dir={central}"],
              tmp_path)
    skip = ("time/", "perf/", "coordinator/")  # timings, and the peer-to-peer transfer counters
    for a, b in zip(records, run_metrics(central), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(skip)} == \
            {k: v for k, v in b.items() if not k.startswith(skip)}  # bit for bit
    driver = json.loads((central / "launcher.json").read_text())
    assert driver["mode"] == "centralized" and driver["payload_bytes_received"] == 0
    # the driver took in every stage's outputs and sent out every stage's inputs
    assert 0 < driver["driver_payload_bytes_received"] < driver["driver_payload_bytes_sent"]
    # it ran the graph: every node of every step on every worker was its call
    from distflow.config import load_config
    from distflow.trainer.recipes import build_graph

    graph = build_graph(load_config(None, []))
    ran = {k.removeprefix("time/relay_in_") for k in run_metrics(central)[1] if k.startswith("time/relay_in_")}
    assert ran == set(graph.order)
    assert driver["driver_steps"] == 2 and driver["driver_node_calls"] == 2 * 2 * len(graph.order)


def test_any_local_model_parquet_data_custom_reward_and_periodic_checkpoints(tmp_path, random_model_dir):
    """The non-default path: model.path, verl parquet files, reward.custom_fn, save_every
    without save_final (the last step's step_N was skipped, as if `final` stood for it),
    and a training set smaller than a batch (it trains, saying that prompts repeat)."""
    from distflow.data.dataset import write_builtin_parquet

    train = write_builtin_parquet(str(tmp_path / "train.parquet"), "arith", "train", 3)
    val = write_builtin_parquet(str(tmp_path / "val.parquet"), "arith", "test", 8)
    (tmp_path / "length_reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return len(solution_str) / 100.0\n"
        "def has_digit(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(any(c.isdigit() for c in solution_str))\n")
    out = tmp_path / "run"
    proc = distflow_train([*SMALL, "trainer.total_steps=2", "runtime.launcher=torchrun", "runtime.num_workers=1",
                           f"model.path={random_model_dir}", f"data.train_files={train}", f"data.val_files={val}",
                           f"reward.custom_fn={tmp_path / 'length_reward.py'}:score,"
                           f"{tmp_path / 'length_reward.py'}:has_digit", "reward.custom_fn_weights=1,0.5",
                           "trainer.save_every=1",
                           "trainer.save_final=false", f"trainer.output_dir={out}"], tmp_path)
    assert "data.train_files has 3 rows, fewer than data.train_batch_size=4: every step holds some prompts more " \
           "than once" in proc.stderr
    records = run_metrics(out)
    # the custom rewards are used for training (an untrained model never solves a problem,
    # but its responses have length), the rule-based accuracy is still reported; each function's own mean too
    assert records[1]["reward/mean"] > 0 and records[1]["reward/accuracy"] == 0.0
    assert records[1]["reward/mean"] == pytest.approx(records[1]["reward_extra/score_1"]
                                                      + 0.5 * records[1]["reward_extra/has_digit"], rel=1e-4)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert (out / "checkpoints" / "step_2" / "model.safetensors").exists()


# Runs on 2 torchrun workers that differ only in their settings share one launch
# (`python -m distflow.train --runs`): the start-up is paid once.
PLACEMENTS = ["trainer.save_final=false", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=3"]
TWO_WORKER_RUNS = {
    "dp2": PLACEMENTS,  # test_placements_train_like_plain_data_parallel's reference
    "fixed": ["trainer.total_steps=2", "trainer.save_final=false", "actor.ppo_mini_batch_size=2",
              "actor.micro_batch_size=2"],
    "budget": ["trainer.total_steps=2", "trainer.save_final=false", "actor.ppo_mini_batch_size=2",
               "actor.use_dynamic_bsz=true", "actor.max_tokens_per_micro_batch=1000"],
    "checkpointed": ["trainer.total_steps=2", "trainer.save_final=false", "actor.ppo_mini_batch_size=2",
                     "actor.micro_batch_size=2", "actor.gradient_checkpointing=true"],
    "head_chunked": ["trainer.total_steps=2", "trainer.save_final=false", "actor.ppo_mini_batch_size=2",
                     "actor.micro_batch_size=2", "actor.output_head_chunk_tokens=16"],
    "tis": ["trainer.total_steps=2", "trainer.save_final=false", "actor.ppo_mini_batch_size=2",
            "algorithm.rollout_correction=token_tis"],
    "bf16": ["model.dtype=bfloat16"],
    "truncated_masked": ["trainer.total_steps=2", "trainer.save_final=false", "actor.ppo_mini_batch_size=2",
                         "actor.micro_batch_size=2", "algorithm.mask_truncated_responses=true"],
}


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory) -> dict:
    return distflow_sweep(TWO_WORKER_RUNS, 2, tmp_path_factory.mktemp("two-workers"), SMALL)


def test_placements_train_like_plain_data_parallel(two_worker_runs, tmp_path):
    """The same math as 2 plain data-parallel workers from 4 workers with rollout TP groups
    of 2 (2 replicas, reshard to DP=4 for training), and from 2 rollout workers + 2 train
    workers with max_staleness=0 (runtime.placement=disaggregated: samples streamed to the
    trainer, weights pushed back), also with the 2 rollout workers as one replica (each
    generates half of every group; the groups reach the trainers whole and once): same
    samples, same updates, same held-out accuracy."""
    runs = {"dp2": run_metrics(two_worker_runs["dp2"])}
    disaggregated = ["runtime.placement=disaggregated", "runtime.train_workers=2", "runtime.rollout_workers=2"]
    four = distflow_sweep({"tp2": ["runtime.num_workers=4", "rollout.replica_size=2"],
                           "disaggregated": disaggregated}, 4, tmp_path, [*SMALL, *PLACEMENTS])
    # a launch of its own: a disaggregated run leaves its workers in their role groups
    four |= distflow_sweep({"disaggregated_tp2": [*disaggregated, "rollout.replica_size=2",
                                                  "trainer.logger=jsonl,mlflow"]}, 4, tmp_path, [*SMALL, *PLACEMENTS])
    # the trackers record the run's settings, not those the train side evaluates under (replica_size 1, hf)
    assert read_mlflow(four["disaggregated_tp2"])[1]["rollout.replica_size"] == "2"
    # torchrun's own entry records each run's config as `distflow train` does (it wrote none)
    assert json.loads((four["tp2"] / "config.json").read_text())["rollout"]["replica_size"] == 2
    runs |= {name: run_metrics(folder) for name, folder in four.items()}
    # 3 steps of 2 mini-batches (so the old log-probs are recomputed): later steps sample from updated, synced weights
    for other in ("tp2", "disaggregated", "disaggregated_tp2"):
        assert runs["dp2"][0]["val/accuracy"] == runs[other][0]["val/accuracy"]
        assert runs["dp2"][-1]["val/accuracy"] == runs[other][-1]["val/accuracy"]
        for a, b in zip(runs["dp2"][1:], runs[other][1:], strict=True):
            for k in ["reward/mean", "reward/accuracy", "response/length_mean", "tokens/total"]:
                assert a[k] == b[k], (other, k, a["step"], a[k], b[k])
            for k in ["actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm", "actor/clip_frac"]:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (other, k, a["step"], a[k], b[k])
    for a, b, c in zip(runs["dp2"][1:], runs["tp2"][1:], runs["disaggregated"][1:]):
        # dp2 moves rows only to balance tokens (none at all in step 1); tp2 also gathers each
        # replica's halves on both of its ranks
        assert b["coordinator/payload_received_bytes"] > a["coordinator/payload_received_bytes"]
        assert c["async/version_lag_max"] == 0 and c["async/version_lag_0"] == 1.0
        assert "time/rollout" in c and "time/actor_update" in c  # both sides' timings in one record
    assert runs["dp2"][1]["coordinator/payload_received_bytes"] == 0


def test_token_budget_micro_batches_train_like_fixed_ones_end_to_end(two_worker_runs):
    """actor.use_dynamic_bsz on 2 workers: micro-batches formed by a token budget give the
    same run as fixed-size ones (the loss is normalised by global counts, so how a
    mini-batch is cut cannot change the update). A rank's 4 rows an update are 2 micro-batches
    of 2 rows, or one under the budget (at most 4 x (192 + 24) padded tokens): the budget path ran."""
    fixed, budget = run_metrics(two_worker_runs["fixed"]), run_metrics(two_worker_runs["budget"])
    _same_training(fixed, budget)
    assert all(f["actor/micro_batches"] == 2 and b["actor/micro_batches"] == 1 for f, b in zip(fixed[1:], budget[1:]))


def _same_training(records: list[dict], others: list[dict]) -> None:
    """The same samples and, to float32 rounding, the same updates, step by step."""
    for a, b in zip(records[1:], others[1:], strict=True):
        for k in ["reward/mean", "reward/accuracy", "response/length_mean", "tokens/total"]:
            assert a[k] == b[k], (k, a["step"], a[k], b[k])
        for k in ["actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm", "actor/clip_frac"]:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a["step"], a[k], b[k])


def test_gradient_checkpointing_trains_like_keeping_the_activations(two_worker_runs):
    """actor.gradient_checkpointing on 2 workers: the same run as without it (whose update
    runs each shared prompt once, where the checkpointed one runs it per row)."""
    _same_training(run_metrics(two_worker_runs["fixed"]), run_metrics(two_worker_runs["checkpointed"]))
    for name, checkpointed in (("fixed", False), ("checkpointed", True)):
        summary = json.loads((two_worker_runs[name] / "summary.json").read_text())
        assert summary["actor_gradient_checkpointing"] is checkpointed and summary["actor_strategy"] == "ddp"


def test_a_chunked_output_head_trains_like_the_whole_logits(two_worker_runs):
    """actor.output_head_chunk_tokens on 2 workers, for the actor's scoring and update and
    the reference's scoring: the same run as with the logits kept whole."""
    _same_training(run_metrics(two_worker_runs["fixed"]), run_metrics(two_worker_runs["head_chunked"]))
    for name, chunk in (("fixed", 0), ("head_chunked", 16)):
        summary = json.loads((two_worker_runs[name] / "summary.json").read_text())
        assert summary["actor_output_head_chunk_tokens"] == chunk


def test_rollout_correction_runs_end_to_end_and_measures_the_mismatch(two_worker_runs):
    """Token-level TIS on 2 workers: the HF engine samples from the trainer's own weights,
    so the measured mismatch is rounding (KV cache vs full forward) and the weights are 1."""
    for record in run_metrics(two_worker_runs["tis"])[1:]:
        assert abs(record["rollout_correction/mismatch_kl"]) < 1e-6  # k3 >= 0, but in float32 rounding
        assert record["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert record["rollout_correction/weight_max"] == pytest.approx(1.0, abs=1e-2)
        assert record["rollout_correction/corrected_fraction"] == 0.0


def test_masking_truncated_responses_changes_the_update_alone(two_worker_runs):
    """algorithm.mask_truncated_responses on 2 workers, with the engine's stop tokens: step 1
    samples what the run without it samples (the same weights), and where some responses were
    cut at the 24-token budget its update differs."""
    fixed, masked = run_metrics(two_worker_runs["fixed"])[1], run_metrics(two_worker_runs["truncated_masked"])[1]
    for k in ["reward/mean", "reward/accuracy", "response/length_mean", "response/clip_ratio", "tokens/total"]:
        assert fixed[k] == masked[k], k
    assert fixed["response/clip_ratio"] > 0 and masked["actor/pg_loss"] != pytest.approx(fixed["actor/pg_loss"])


def test_bf16_compute_trains_on_fp32_master_weights_end_to_end(two_worker_runs):
    """model.dtype=bfloat16 on 2 workers: the run trains (the KL to the reference, which
    computes as the actor does, is 0 in step 1's only update and grows after it) and the
    saved policy is the fp32 master copy."""
    from safetensors.torch import load_file

    out = two_worker_runs["bf16"]
    steps = run_metrics(out)[1:]
    assert len(steps) == 3 and all(s["actor/grad_norm"] > 0 for s in steps)
    assert steps[0]["actor/kl"] == 0 < steps[-1]["actor/kl"]
    weights = load_file(out / "checkpoints" / "final" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}
