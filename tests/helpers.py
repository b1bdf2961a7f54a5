"""Test helpers: run a function on N gloo processes and collect what each returns; a
rollout engine that answers from a script (for replies the tiny model would not write);
`distflow train` runs and sweeps; a user's environment file for multi-turn runs."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distflow.data.batch import Batch
from distflow.engines.rollout import response_mask_from


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        import torch

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        # plain pickle: torch's queue pickling shares tensors through fds that die with us
        queue.put((rank, pickle.dumps(fn(rank, world, *args)), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def distflow_train(args: list[str], cwd: Path, timeout: int = 420) -> subprocess.CompletedProcess:
    """`distflow train ARGS` in a subprocess; asserts it succeeded (its output tail if not)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def distflow_sweep(runs: dict[str, list[str]], workers: int, cwd: Path, common: list[str] = (),
                   timeout: int = 900) -> dict[str, Path]:
    """Several training configurations in one torchrun launch of `workers` workers
    (`python -m distflow.train --runs`: the start-up is paid once); `common` applies to
    all. Returns each run's folder by name; asserts the launch succeeded."""
    folders = {name: cwd / name for name in runs}
    spec = cwd / f"runs-{workers}.json"
    spec.write_text(json.dumps([[*args, f"trainer.output_dir={folders[name]}"] for name, args in runs.items()]))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={workers}", "-m", "distflow.train", "--runs", str(spec), *common],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return folders


def run_metrics(run_dir: Path) -> list[dict]:
    """A run folder's metrics.jsonl records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_gloo(fn, world: int, *args, timeout: float = 120.0) -> list:
    """fn(rank, world, *args) on `world` processes in one gloo group; results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, value, err = queue.get(timeout=timeout)
            results[rank] = pickle.loads(value) if value is not None else None
            if err:
                errors.append(f"rank {rank}:\n{err}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world)]


class ScriptedEngine:
    """Answers each episode's turn t with script[episode][t]; an episode is known by its
    prompt's first token. Records every call's contexts, so tests see what it was shown."""

    weight_version, tensor_parallel_size, batches_continuously = 0, 1, False

    def __init__(self, tok, scripts: dict[int, list[str]]):
        self.tok, self.scripts, self.calls = tok, scripts, []
        self.stop_token_ids = (tok.eos_token_id,)

    def generate(self, prompts, seeds, params):
        self.calls.append([list(p) for p in prompts])
        texts = []
        for p in prompts:
            turn = sum(1 for call in self.calls[:-1] for q in call if q[0] == p[0])
            texts.append(self.scripts[p[0]][turn])
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in texts]
        resp = torch.full((len(ids), params.max_new_tokens), self.tok.pad_token_id, dtype=torch.long)
        for i, r in enumerate(ids):
            resp[i, :min(len(r), params.max_new_tokens)] = torch.tensor(r[:params.max_new_tokens])
        mask = response_mask_from(resp, [self.tok.eos_token_id])
        return Batch({"responses": resp, "response_mask": mask,
                      "rollout_log_probs": -0.5 * mask.float()})  # every sampled token: -0.5


# A user's environment file (rollout.env=env.py:CheckOnce) for multi-turn runs: every episode
# is asked to check its answer once, so every trajectory holds an observation.
CHECK_ONCE_ENV = '''
from distflow.engines.agent import EnvStep


class CheckOnce:
    """Asks for a check after the first answer; the second answer is final."""

    def __init__(self, toolbox):
        self.toolbox, self.asked = toolbox, False

    def reset(self, task):
        self.asked = False

    def step(self, text):
        if self.asked:
            return EnvStep([], True)
        self.asked = True
        return EnvStep([{"role": "user", "content": "Check it. Answer with ####."}], False,
                       {"tool_calls": len(self.toolbox.calls(text))})


class FailsOneInEight(CheckOnce):
    """CheckOnce whose check raises in about one episode in eight (by the episode's seed; in
    greedy evaluation, by the answer): an environment's infrastructure failing under some
    samples of a group."""

    def reset(self, task):
        super().reset(task)
        self.fails = (task["seed"] if task["seed"] is not None else int(task["ground_truth"])) % 8 == 0

    def step(self, text):
        if self.fails:
            raise ConnectionError("the checker went away")
        return super().step(text)


def by_length(data_source, solution_str, ground_truth, extra_info):
    """A reward that differs within groups (the tiny model has never seen a check turn, so
    the task's own reward is 0 for all): the updates are non-trivial."""
    return (len(solution_str) % 5) / 4
'''
