"""A worker killed with SIGKILL mid-run: the launcher names it and its stage, stops the
others and exits non-zero, well within 30 s. Done for real, with processes and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _wait_for(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _status(run_dir, rank: int):
    try:
        return json.loads((run_dir / "status" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def _kill_worker_1_mid_run(cmd: list[str], run_dir, cwd, env) -> tuple[int, str, float]:
    """Start the run, SIGKILL worker 1 once it is at step 2; (exit code, stderr, seconds
    from the kill to the launcher's exit). Cleans up the whole process group."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        status = _wait_for(lambda: (s := _status(run_dir, 1)) and s["step"] >= 2 and s, 240, "worker 1 at step 2")
        os.kill(status["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = proc.communicate(timeout=90)
        return proc.returncode, stderr, time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_sigkilled_worker_is_named_with_its_stage_and_the_run_stops(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "distflow.cli", "train", "trainer.total_steps=500", "trainer.eval_every=0",
           "trainer.progress=false", "trainer.save_final=false", "data.train_batch_size=4",
           "actor.ppo_mini_batch_size=4", "algorithm.group_size=4", "data.val_max_samples=8",
           f"trainer.output_dir={run_dir}"]
    returncode, stderr, elapsed = _kill_worker_1_mid_run(cmd, run_dir, tmp_path, env)
    print(f"\nkilled worker 1 -> launcher exit {returncode} after {elapsed:.1f} s")
    assert returncode == 1, stderr[-3000:]
    assert elapsed < 30, elapsed
    error = [line for line in stderr.splitlines() if line.startswith("distflow: error:")]
    assert len(error) == 1, stderr[-3000:]
    print(error[0])
    assert "worker 1 died in stage '" in error[0] and "of step" in error[0], error[0]
    # where it ran and Ray's exit detail, Ray's whole account in the run folder
    assert f"(pid {_status(run_dir, 1)['pid']} on 127.0.0.1, " in error[0], error[0]
    assert "The actor is dead" in (run_dir / "worker-1-death.txt").read_text()
    # Ray's temp dir is outside the run folder here (the path is long for its sockets): the logs its account
    # points to were deleted with it
    assert len(str(run_dir / "ray")) > 40 and (run_dir / "ray-logs" / "raylet.out").is_file(), stderr[-2000:]
    # the other worker was stopped too: no process of this run is left
    survivor = _status(run_dir, 0)["pid"]
    _wait_for(lambda: not os.path.exists(f"/proc/{survivor}") or
              open(f"/proc/{survivor}/status").read().find("State:\tZ") >= 0, 30, "worker 0 to stop")


def test_torchrun_worker_killed_mid_run_fails_the_run_naming_stages(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "distflow.cli", "train", "runtime.launcher=torchrun", "trainer.total_steps=500",
           "trainer.eval_every=0", "trainer.progress=false", "trainer.save_final=false", "data.train_batch_size=4",
           "actor.ppo_mini_batch_size=4", "algorithm.group_size=4", "data.val_max_samples=8",
           f"trainer.output_dir={run_dir}"]
    returncode, stderr, elapsed = _kill_worker_1_mid_run(cmd, run_dir, tmp_path, env)
    assert returncode == 1 and elapsed < 30, (returncode, elapsed, stderr[-3000:])
    error = [line for line in stderr.splitlines() if line.startswith("distflow: error:")]
    assert len(error) == 1 and "torchrun workers failed" in error[0], stderr[-3000:]
    assert "rank 1 '" in error[0] and "of step" in error[0], error[0]


def test_a_rollout_worker_killed_in_a_disaggregated_run_is_named_and_the_trainer_stops(tmp_path):
    """Rank 1 is the rollout worker of a 1 + 1 asynchronous run: its death is reported as
    its own (not as the train worker's broken stream), with its stage, within 30 s."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "distflow.cli", "train", "runtime.placement=disaggregated",
           "algorithm.max_staleness=1", "trainer.total_steps=500", "trainer.eval_every=0", "trainer.progress=false",
           "trainer.save_final=false", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
           "algorithm.group_size=4", "data.val_max_samples=8", f"trainer.output_dir={run_dir}"]
    returncode, stderr, elapsed = _kill_worker_1_mid_run(cmd, run_dir, tmp_path, env)
    assert returncode == 1 and elapsed < 30, (returncode, elapsed, stderr[-3000:])
    error = [line for line in stderr.splitlines() if line.startswith("distflow: error:")]
    assert len(error) == 1, stderr[-3000:]
    assert "worker 1 died in stage '" in error[0] and "(rollout worker)' of step" in error[0], error[0]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_a_launch_stopped_by_a_signal_says_so_in_one_line_and_stops_its_workers(tmp_path, how):
    """A scheduler's SIGTERM (through the loopback namespace's waiter), or Ctrl-C's SIGINT
    (on the host network: the launcher itself): one line naming the workers' stages, exit
    128 + the signal, no worker left. Ray's own SIGTERM handler exited with 15, silently."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "distflow.cli", "train", "trainer.total_steps=500", "trainer.eval_every=0",
           "trainer.progress=false", "trainer.save_final=false", "data.train_batch_size=4",
           "actor.ppo_mini_batch_size=4", "algorithm.group_size=4", "data.val_max_samples=8",
           f"trainer.output_dir={run_dir}", *(["runtime.network=host"] if how == signal.SIGINT else [])]

    def as_nohup_in_a_terminal():  # a hangup (the terminal closed) must not stop it; Ctrl-C must
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background job (CI's, under `&`) inherits SIGINT ignored

    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=as_nohup_in_a_terminal)
    try:
        _wait_for(lambda: (s := _status(run_dir, 1)) and s["step"] >= 1, 240, "worker 1 at step 1")
        workers = [_status(run_dir, r)["pid"] for r in (0, 1)]
        proc.send_signal(signal.SIGHUP)
        step = _status(run_dir, 1)["step"]
        _wait_for(lambda: (s := _status(run_dir, 1)) and s["step"] > step + 1, 120, "the run to go on after SIGHUP")
        assert proc.poll() is None
        proc.send_signal(how)
        try:
            _, stderr = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:  # it went on: what it said, for the failure
            os.killpg(proc.pid, signal.SIGKILL)
            stderr = proc.communicate(timeout=30)[1]
            raise AssertionError(f"still running 90 s after {how.name}: {stderr[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 128 + how, (proc.returncode, stderr[-3000:])
    error = [line for line in stderr.splitlines() if line.startswith("distflow: error:")]
    assert len(error) == 1 and error[0].startswith(f"distflow: error: stopped by signal {how.name}; last stage "
                                                   "per worker: rank 0 '"), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    for pid in workers:
        _wait_for(lambda: not os.path.exists(f"/proc/{pid}") or
                  open(f"/proc/{pid}/status").read().find("State:\tZ") >= 0, 30, f"worker {pid} to stop")


def test_a_torchrun_worker_that_raises_says_so_in_one_line_and_keeps_its_traceback(tmp_path):
    """Under torchrun every worker's traceback and torchrun's table of them made 120 lines
    for one error; now each worker says why in one line, its traceback in the run folder."""
    (tmp_path / "est.py").write_text("def boom(inputs):\n    raise ValueError('boom: my estimator is broken')\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", "runtime.launcher=torchrun",
                           f"algorithm.estimator={tmp_path / 'est.py'}:boom", "trainer.total_steps=2",
                           "trainer.progress=false", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                           "data.val_max_samples=4", f"trainer.output_dir={run_dir}"],
                          cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for rank in (0, 1):
        line = (f"distflow: worker {rank} failed: NodeFailed: node 'advantage' failed on worker {rank} in step 1: "
                f"ValueError: boom: my estimator is broken (traceback: {run_dir / f'worker-{rank}-traceback.txt'})")
        assert line in proc.stderr.splitlines(), proc.stderr[-3000:]
        assert "raise ValueError('boom" in (run_dir / f"worker-{rank}-traceback.txt").read_text()
    assert proc.stderr.strip().splitlines()[-1].startswith("distflow: error: torchrun workers failed (exit 1); last "
                                                           "stage per worker: rank 0 'advantage' of step 1")
