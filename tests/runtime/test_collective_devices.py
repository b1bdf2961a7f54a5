"""No collective is ever issued on a group whose backend cannot take the tensor's device.

Every `torch.distributed` call the framework makes in real 2-rank training runs (the
coordinator's reshard over the wire, micro-batch agreement, batch-wide whitening, KL
control, metrics, evaluation, checkpoints) is recorded with the devices of its tensors
and the backends of its group. Each record is checked twice: against the group the run
really used, and replayed against the group a GPU run makes (`group_backend(True)`),
where NCCL takes only CUDA tensors: a CPU tensor there would be refused at run time.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from distflow.runtime.process_group import group_backend
from helpers import run_gloo

pytestmark = pytest.mark.slow

TENSOR_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_to_all_single",
              "reduce_scatter_tensor", "isend", "irecv", "send", "recv", "reduce", "gather", "scatter")
OBJECT_OPS = ("all_gather_object", "broadcast_object_list", "gather_object", "barrier")
# the devices each backend takes (NCCL refuses CPU tensors; the CPU wheel's gloo takes CPU)
TAKES = {"gloo": {"cpu"}, "nccl": {"cuda"}}


def device_map(group) -> dict[str, str]:
    return BackendConfig(dist.get_backend_config(group)).get_device_backend_map()


def refused(op: str, device: str, backends: dict[str, str]) -> str | None:
    """Why `op` on a `device` tensor fails on a group with `backends` (device -> backend),
    or None. Object collectives and barriers run on the CPU where the group has a CPU
    backend (torch's rule), else on its device."""
    if op in OBJECT_OPS:
        device = "cpu" if "cpu" in backends else next(iter(backends))
    backend = backends.get(device)
    if backend is None:
        return f"{op}: a {device} tensor on a group with no {device} backend ({backends})"
    if device not in TAKES.get(backend, {device}):
        return f"{op}: a {device} tensor on {backend}, which takes {sorted(TAKES[backend])} only"
    return None


def _tensors(args, kwargs):
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _record_into(records: list):
    """Wrap the torch.distributed functions so that every call appends
    (op, device type, the group's device -> backend map)."""
    for op in TENSOR_OPS + OBJECT_OPS:
        original = getattr(dist, op)

        @functools.wraps(original)
        def wrapped(*args, __op=op, __original=original, **kwargs):
            backends = device_map(kwargs.get("group"))
            devices = {t.device.type for t in _tensors(args, kwargs)} if __op in TENSOR_OPS else {"object"}
            records.extend((__op, d, backends) for d in devices)
            return __original(*args, **kwargs)

        setattr(dist, op, wrapped)


def _train_recorded(rank, world, runs, root):
    import os

    from distflow.config import load_config
    from distflow.trainer.loop import run_worker

    # a host per rank: the coordinator's payloads take the wire (isend/irecv), not shared memory
    os.environ["DISTFLOW_HOST_ID"] = str(rank)
    records: list = []
    _record_into(records)
    for i, overrides in enumerate(runs):
        cfg = load_config(None, [*overrides, f"runtime.num_workers={world}", "runtime.launcher=torchrun",
                                 f"trainer.output_dir={root}/run{i}"])
        os.makedirs(f"{root}/run{i}", exist_ok=True)
        run_worker(cfg.to_dict(), f"{root}/run{i}")
    return records


SMALL = ["trainer.total_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
         "algorithm.group_size=4", "data.val_max_samples=8", "rollout.max_new_tokens=16",
         "trainer.eval_every=1", "trainer.progress=false", "trainer.save_every=1"]
RUNS = [
    # GRPO on one 2-rank rollout replica: each replica's shares gathered on both members
    # (payload over the wire), then resharded to the data-parallel training layout
    ["algorithm.name=grpo", "rollout.replica_size=2", *SMALL],
    # PPO: critic and GAE; KL in the reward with its adaptive controller; token-budget micro-batches
    ["algorithm.name=ppo", "algorithm.use_kl_in_reward=true", "algorithm.reward_kl_ctrl=adaptive",
     "actor.use_dynamic_bsz=true", "actor.max_tokens_per_micro_batch=256", *SMALL],
    # batch-wide whitening over all ranks
    ["algorithm.name=reinforce_plus_plus", *SMALL],
    # dynamic sampling: the refill count agreed across ranks
    ["algorithm.name=dapo", *SMALL],
]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("collectives")
    return [r for rank_records in run_gloo(_train_recorded, 2, RUNS, str(root), timeout=600) for r in rank_records]


def test_every_collective_of_a_run_is_recorded(records):
    ops = Counter(op for op, _, _ in records)
    # the coordinator (metadata all-gather, size exchange, wire payloads), the metrics and
    # the micro-batch agreement (all_reduce), object gathers and the closing barrier
    for op in ("all_reduce", "all_gather", "all_to_all_single", "isend", "irecv", "all_gather_object"):
        assert ops[op] > 0, (op, ops)


def test_no_collective_uses_a_group_without_a_backend_for_its_device(records):
    bad = {refused(op, d, backends) for op, d, backends in records} - {None}
    assert not bad, sorted(bad)


def test_replayed_on_a_gpu_group_no_collective_is_refused(records):
    gpu = BackendConfig(group_backend(use_cuda=True)).get_device_backend_map()
    bad = {refused(op, d, gpu) for op, d, _ in records} - {None}
    assert not bad, sorted(bad)


def test_the_check_refuses_cpu_tensors_on_nccl():
    nccl_only = BackendConfig("nccl").get_device_backend_map()
    assert refused("all_reduce", "cpu", nccl_only) == "all_reduce: a cpu tensor on a group with no cpu backend " \
                                                      "({'cuda': 'nccl'})"
    # object collectives run on the group's own device where it has no CPU backend
    assert refused("all_gather_object", "object", nccl_only) is None
    assert refused("isend", "cpu", {"cpu": "nccl"}) == "isend: a cpu tensor on nccl, which takes ['cuda'] only"
    assert refused("all_reduce", "cpu", {"cpu": "gloo", "cuda": "nccl"}) is None
