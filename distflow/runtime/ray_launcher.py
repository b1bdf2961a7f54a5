"""The Ray launcher: starts N identical workers as Ray actors, watches them, reports.

It never touches a batch. Everything it receives from Ray and every file it reads goes
through a `LauncherMeter` (runtime/meter.py), which measures payload (batch data) and
control bytes; the launcher writes both to `launcher.json`, and a test asserts the
payload stays 0.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from distflow.runtime.meter import LauncherMeter
from distflow.runtime.process_group import WORKER_ENV, free_port, headline, run_in_group

# AF_UNIX socket paths are limited to 107 bytes; Ray puts its sockets at
# <temp>/session_<date>_<pid>/sockets/plasma_store, which leaves about 44 for <temp>
# with a 6-digit pid; 40 leaves room for the 7-digit pids of a large pid_max.
_MAX_RAY_TEMP_LEN = 40


# What a cluster's workers take from the launcher's environment (a local Ray's inherit all of
# it): where the user's modules and the models are, and the settings of the libraries the
# workers run (rank 0 logs to W&B or MLflow from its node; their keys travel in the job's
# runtime_env, which Ray's dashboard shows). Networking (NCCL_*, GLOO_*) and what names a
# host (DISTFLOW_HOST_ID) are each node's own, as `ray start` set them there.
FORWARDED_ENV_PREFIXES = ("HF_", "TRANSFORMERS_", "TORCH_", "TORCHINDUCTOR_", "TRITON_", "PYTORCH_", "VLLM_",
                          "WANDB_", "MLFLOW_")
FORWARDED_ENV_NAMES = ("DISTFLOW_SANDBOX", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS")
# Set by Ray's job supervisor for a `ray job submit` entrypoint (ray._private.runtime_env.constants):
# the job's runtime_env, which Ray merges with the one `ray.init` is given
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def forwarded_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables of `environ` that a cluster's workers are given (the launcher's); its
    PYTHONPATH goes before the node's own (Ray expands `${PYTHONPATH}` on the node)."""
    out = {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV_NAMES}
    if environ.get("PYTHONPATH"):
        out["PYTHONPATH"] = f"{environ['PYTHONPATH']}:${{PYTHONPATH}}"
    return out


class WorkerFailed(RuntimeError):
    pass


class Stopped(Exception):
    """The launch was stopped by a signal: Ctrl-C's SIGINT, or SIGTERM or SIGHUP (a
    scheduler's stop, a closed terminal); the workers were stopped on the way out."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_signals_received: list[int] = []


def _record(signum: int, _frame) -> None:
    """Ctrl-C, SIGTERM or SIGHUP during the launch: noted here and acted on where the launcher
    waits for its workers (`_stop_if_signalled`, every poll). Raised from the handler, the
    interrupt could land inside Ray's own code, which then hung the clean-up."""
    _signals_received.append(signum)


def _stop_if_signalled() -> None:
    if _signals_received:
        raise Stopped(_signals_received[-1])


def _get_or_stop(ref, timeout_s: float, poll_s: float = 0.5):
    """ray.get(ref, timeout=timeout_s) that a signal stops within poll_s (`Stopped`)
    instead of at the timeout; GetTimeoutError at the timeout, as ray.get."""
    import ray
    from ray.exceptions import GetTimeoutError

    deadline = time.monotonic() + timeout_s
    while True:
        _stop_if_signalled()
        left = deadline - time.monotonic()
        if left <= 0:
            raise GetTimeoutError(f"not ready within {timeout_s:.0f} s")
        ready, _ = ray.wait([ref], timeout=min(poll_s, left))
        if ready:
            return ray.get(ref, timeout=60)


class ClusterTooSmall(ValueError):
    """The Ray cluster has fewer free slots than the run has workers."""


class WorkerError(RuntimeError):
    """Raised inside a worker: a one-line headline plus the full traceback."""

    def __init__(self, rank: int, headline: str, traceback_text: str):
        super().__init__(headline)
        self.rank, self.headline, self.traceback_text = rank, headline, traceback_text

    def __reduce__(self):  # Ray pickles exceptions back to the launcher
        return (WorkerError, (self.rank, self.headline, self.traceback_text))


def ray_temp_dir(run_dir: Path) -> tuple[str, str | None]:
    """Ray's temp dir inside the run folder; through a short link when the path is too
    long for Ray's unix sockets. Returns (path for ray.init, dir to remove afterwards)."""
    wanted = run_dir / "ray"
    if len(str(wanted)) <= _MAX_RAY_TEMP_LEN:
        wanted.mkdir(parents=True, exist_ok=True)
        return str(wanted), None
    short = tempfile.mkdtemp(prefix="dfray-", dir="/tmp")
    if wanted.is_symlink():  # an earlier run's link (resuming in the same folder): its target is gone
        wanted.unlink()
    if not wanted.exists():
        wanted.symlink_to(short, target_is_directory=True)
    return short, short


class _Worker:
    """The Ray actor: a process that joins the group and runs the worker program."""

    def rendezvous(self) -> tuple[str, int]:
        """(this node's address, a free port on it): rank 0's become the group's master."""
        import ray

        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def run(self, entry: str, args: tuple, rank: int, world_size: int, master_addr: str,
            master_port: int, device: str, timeout_s: int, threads: int, workers_on_node: int) -> Any:
        import ray

        if device != "cpu" and ray.get_gpu_ids():  # the GPU Ray gave this actor, as the device index it uses
            os.environ["LOCAL_RANK"] = str(gpu_index(ray.get_gpu_ids()[0], os.environ.get("CUDA_VISIBLE_DEVICES")))
        elif device == "cpu":  # CPU workers share their node's cores and memory (overlap=auto, strategy=auto)
            os.environ["LOCAL_WORLD_SIZE"] = str(workers_on_node)
        try:
            return run_in_group(entry, args, rank, world_size, master_addr, master_port, device, timeout_s, threads)
        except Exception as e:
            raise WorkerError(rank, headline(e), traceback.format_exc()) from None


def gpu_index(assigned, visible: str | None) -> int:
    """The device index of the GPU Ray `assigned` an actor, in the process's own numbering: its
    place in CUDA_VISIBLE_DEVICES (Ray narrows that to the actor's GPU, so 0, unless
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES keeps the node's list), or its id where the
    variable is not set. Not the worker's local rank: under NOSET every actor would take cuda:0."""
    gpu = str(assigned)
    listed = [v.strip() for v in visible.split(",")] if visible else []
    if not listed:
        return int(gpu)
    if gpu not in listed:
        raise RuntimeError(f"Ray gave this worker GPU {gpu}, which CUDA_VISIBLE_DEVICES={visible!r} does not list")
    return listed.index(gpu)


def check_ray_address(address: str, timeout_s: float = 10.0) -> str:
    """The local address this machine reaches the Ray head `host:port` from; a one-line
    ValueError when nothing answers there within `timeout_s`."""
    if "://" in address:  # a Ray client's ray:// or the dashboard's (jobs API) http:// address, as RAY_ADDRESS may be
        raise ValueError(f"runtime.ray_address={address!r}: a {address.split('://')[0]}:// address; give the cluster's "
                         "GCS address, host:port (what `ray start --head` prints, port 6379 by default)")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"runtime.ray_address={address!r}: expected host:port, e.g. 198.18.0.1:6379")
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 address, [::1]:6379
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
            return s.getsockname()[0]
    except OSError as e:
        raise ValueError(f"runtime.ray_address={address!r}: nothing answers there within {timeout_s:.0f} s "
                         f"({e.strerror or e})") from None


def launch_ray(entry: str, args: tuple, *, run_dir: Path, num_workers: int, device: str,
               collective_timeout_s: int, threads: int, on_poll: Callable[[], None] | None = None,
               poll_s: float = 0.5, ray_address: str | None = None, centralized: list | None = None,
               centralized_wire: str = "numpy", balance_within: str | None = None,
               meter: LauncherMeter | None = None) -> list[Any]:
    """Run `entry(*args)` on `num_workers` Ray actors in one process group; return their
    results in rank order. A worker that fails fails the launch, naming its rank.

    Without `ray_address` Ray starts here on 127.0.0.1. With one, the launcher joins that
    cluster; the workers are packed onto its nodes, consecutive ranks together
    (`_packed_by_node`), and rank 0's node address is the process group's master.
    `centralized` (runtime.mode=centralized, a list of `centralized.NodeSpec`): the driver
    runs that graph every step and every stage's data goes through it
    (`runtime/centralized.py`), as `centralized_wire`; each worker's end of it is passed to
    `entry` as its last argument; its moves balance `balance_within`'s labels as the
    workers' do (`Placement.balance_within`). `meter` counts everything received (the caller's
    `on_poll` may read files through the same meter)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    wire, env, group = None, {}, None
    # Ctrl-C, SIGTERM and SIGHUP stop the launch (`Stopped`), unless they were ignored (SIGHUP under `nohup`);
    # during the clean-up they are ignored; then what was there before ray.init (which sets its own) is put back
    main_thread = threading.current_thread() is threading.main_thread()
    before_ray = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} if main_thread else {}
    stop_signals = [s for s, handler in before_ray.items() if handler != signal.SIG_IGN]
    _signals_received.clear()
    if centralized is not None:
        from distflow.runtime.centralized import make_wire, wire_env

        wire, env = make_wire(centralized_wire), wire_env(centralized_wire)  # env: the driver's too, it runs here
    temp_dir, cleanup = ray_temp_dir(run_dir) if ray_address is None else (None, None)
    meter = meter if meter is not None else LauncherMeter()
    actors: list[Any] = []
    relay = driver = None
    finished = False  # the workers returned: the launch's Ray logs are not kept
    # A local Ray instance and its workers inherit this process's environment, so the
    # workers' variables are set here for the launch (a runtime_env would keep Ray from
    # using the workers it prestarts: a slower start); a cluster's workers get them, and
    # the launcher's `forwarded_env`, through Ray's runtime_env.
    worker_env = WORKER_ENV | env
    set_here = worker_env if ray_address is None else env
    if RAY_JOB_CONFIG_ENV in os.environ:  # the job's env_vars reach the workers too: where both name one, ours
        set_here = set_here | {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}  # (Ray refuses the launch otherwise)
    before = {k: os.environ.get(k) for k in set_here}
    os.environ.update(set_here)
    try:
        if ray_address is None:
            # a new local instance, whatever $RAY_ADDRESS names (verl users often export one)
            ray.init(address="local", num_cpus=num_workers, include_dashboard=False, _temp_dir=temp_dir,
                     _node_ip_address="127.0.0.1", log_to_driver=True, configure_logging=False)
        else:
            ray.init(address=ray_address, _node_ip_address=check_ray_address(ray_address), log_to_driver=True,
                     configure_logging=False, runtime_env={"env_vars": forwarded_env(dict(os.environ)) | worker_env})
            slots = int(ray.available_resources().get("CPU", 0))
            if slots < num_workers:
                raise ClusterTooSmall(f"runtime.num_workers={num_workers}: the Ray cluster at {ray_address} has "
                                 f"{slots} free CPU slots for workers")
        for s in stop_signals:  # ray.init's own SIGTERM handler exits with code 15 and no word of the run
            signal.signal(s, _record)
        # the cluster's GPUs, busy or not (a GPU cluster that is busy now is waited for below, not run on CPUs)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        use_gpu = device != "cpu" and gpus >= num_workers  # one each; else every worker on CPU, GPUs hidden or not
        if device == "cuda" and not use_gpu:
            raise ClusterTooSmall(f"runtime.device=cuda: runtime.num_workers={num_workers} workers need a GPU each; "
                                  f"Ray sees {gpus}")
        device = device if use_gpu else "cpu"
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0)(_Worker)
        strategies: list[dict] = [{}] * num_workers
        workers_on_node = [num_workers] * num_workers  # each rank's node's workers (LOCAL_WORLD_SIZE)
        if ray_address is not None:
            group, strategies, workers_on_node = _packed_by_node(num_workers, use_gpu, ray_address)
        actors = [actor_cls.options(name=f"distflow-worker-{r}", **strategies[r]).remote() for r in range(num_workers)]
        master, port = ("127.0.0.1", free_port()) if ray_address is None else \
            meter.received(_get_or_stop(actors[0].rendezvous.remote(), 120), "rendezvous")
        if centralized is not None:
            from distflow.coordinator.layout import Layout
            from distflow.coordinator.placement import Placement
            from distflow.runtime.centralized import DriverRelay

            # the workers' placement: rollout rows, then data-parallel training (no TP groups here)
            relay = DriverRelay(num_workers, collective_timeout_s, centralized,
                                Placement(Layout(num_workers), Layout(num_workers), balance_within=balance_within),
                                wire)
            driver = relay.start()
        pending = {actors[r].run.remote(entry, args + ((relay.endpoint(r),) if relay else ()), r, num_workers,
                                        master, port, device, collective_timeout_s, threads, workers_on_node[r]): r
                   for r in range(num_workers)}
        results: dict[int, Any] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=poll_s)
            _stop_if_signalled()
            if relay is not None and relay.error is not None:
                raise WorkerFailed(f"the driver failed: {type(relay.error).__name__}: {relay.error}")
            if on_poll is not None:
                on_poll()
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = meter.received(ray.get(ref, timeout=60), "result")
                except Exception as e:
                    raise WorkerFailed(_root_cause(rank, e, pending, run_dir, meter)) from None
        if on_poll is not None:  # what the workers wrote last
            on_poll()
        finished = True
        return [results[r] for r in range(num_workers)]
    except KeyboardInterrupt:  # Ctrl-C before `_record` took it over (while Ray started)
        raise Stopped(signal.SIGINT) from None
    finally:
        for s in before_ray:  # the stop is under way: a second signal (a second Ctrl-C) must not cut it short
            signal.signal(s, signal.SIG_IGN)
        try:
            _clean_up(ray, driver, relay, actors, group)
            (run_dir / "launcher.json").write_text(json.dumps(
                meter.summary() | {"mode": "centralized" if centralized is not None else "distributed"}
                | ({"centralized_wire": centralized_wire} if centralized is not None else {})
                | (relay.stats() if relay else {})))
            if cleanup:
                if not finished:  # the logs a worker's death points to outlive the short temp dir
                    _keep_ray_logs(Path(cleanup), run_dir)
                shutil.rmtree(cleanup, ignore_errors=True)
        finally:  # even where the clean-up failed: this process does not go on ignoring Ctrl-C
            for s, handler in before_ray.items():
                if handler is not None:  # None: one set outside Python, which cannot be put back
                    signal.signal(s, handler)
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _keep_ray_logs(temp_dir: Path, run_dir: Path) -> None:
    """A failed launch's Ray logs (the workers' output, the raylet's, a native crash's
    stack) copied into run_dir/ray-logs before its temp dir outside the run folder goes."""
    logs, kept = temp_dir / "session_latest" / "logs", run_dir / "ray-logs"
    if not logs.is_dir():
        return
    shutil.rmtree(kept, ignore_errors=True)  # an earlier failed launch's
    try:
        shutil.copytree(logs, kept, symlinks=False, ignore_dangling_symlinks=True)
    except (OSError, shutil.Error) as e:
        print(f"distflow: Ray's logs of this launch were not all kept in {kept}: {e}", file=sys.stderr)
        return
    print(f"distflow: Ray's logs of this launch are kept in {kept}", file=sys.stderr)


def _clean_up(ray, driver, relay, actors: list, group) -> None:
    """The driver stopped, the workers killed, the placement group freed, Ray shut down."""
    if driver is not None:
        relay.stop(driver)
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:
            pass
    if group is not None:
        try:
            ray.util.remove_placement_group(group)
        except Exception:  # the cluster is gone: nothing left to free, and the run's own error comes first
            pass
    ray.shutdown()


def _packed_by_node(num_workers: int, use_gpu: bool, ray_address: str, timeout_s: float = 120.0):
    """(a placement group of one bundle per worker, PACK: the workers on as few of the
    cluster's nodes as fit them; each rank's scheduling option; the number of workers on
    each rank's node), ranks given out node by node, so that each node holds a run of
    consecutive ranks: a TP group or a rollout replica's members (consecutive ranks)
    share a node where one fits them."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1} | ({"GPU": 1} if use_gpu else {})] * num_workers, strategy="PACK")
    try:
        _get_or_stop(group.ready(), timeout_s)  # a busy cluster is waited for; Ctrl-C stops the wait
        node_of = placement_group_table(group)["bundles_to_node_id"]
    except GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise ClusterTooSmall(f"runtime.num_workers={num_workers}: the Ray cluster at {ray_address} could not "
                              f"place {num_workers} workers within {timeout_s:.0f} s (busy, or too small)") from None
    except BaseException:
        ray.util.remove_placement_group(group)
        raise
    bundles = bundles_by_node(node_of, num_workers)
    per_node = collections.Counter(node_of[b] for b in bundles)
    return group, [{"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=b)}
                   for b in bundles], [per_node[node_of[b]] for b in bundles]


def bundles_by_node(node_of: dict[int, str], count: int) -> list[int]:
    """The bundle each rank takes: a node's bundles in a run of consecutive ranks, the nodes
    in the order their first bundle comes (Ray may interleave a PACK group's bundles)."""
    first_seen: dict[str, int] = {}
    for b in range(count):
        first_seen.setdefault(node_of[b], len(first_seen))
    return sorted(range(count), key=lambda b: (first_seen[node_of[b]], b))


def _root_cause(rank: int, error: Exception, pending: dict, run_dir: Path, meter: LauncherMeter,
                grace_s: float = 5.0) -> str:
    """When one worker fails the others usually fail right after it (their collectives
    lose a peer). Collect what fails within a short grace period and report a worker
    that *died* first, since a surviving worker's 'connection closed' is only an echo.
    Workers still running then are named with their stage: where a worker hangs, the
    others fail at the collective timeout waiting for it, and the hung one is the cause."""
    import ray

    failures = {rank: meter.received(error, "worker error")}
    done, running = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s) if pending else ([], [])
    for ref in done:
        try:
            meter.received(ray.get(ref, timeout=10), "result")
        except Exception as e:
            failures[pending[ref]] = meter.received(e, "worker error")
    died = sorted(r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError))
    first = died[0] if died else rank
    others = len(failures) - 1
    suffix = f"; {others} other worker(s) failed after it" if others else ""
    if running:
        suffix += "; still running: " + ", ".join(f"worker {r}{_where(run_dir, r, meter)}"
                                                  for r in sorted(pending[ref] for ref in running))
    return _describe(first, failures[first], run_dir, meter) + suffix


def _where(run_dir: Path, rank: int, meter: LauncherMeter) -> str:
    """' in stage X of step N' from the worker's status file, if it wrote one."""
    try:
        status = json.loads(meter.read_text(run_dir / "status" / f"rank-{rank}.json"))
        return f" in stage '{status['stage']}' of step {status['step']}"
    except (OSError, ValueError, KeyError):
        return ""


def death_detail(message: str) -> str:
    """'pid P on IP, <Ray's exit detail>' from a Ray actor-death message (an OOM kill, a
    lost node, a segfault read apart there), or '' where it names none of them."""
    pid, ip = re.search(r"^\s*pid: (\d+)$", message, re.M), re.search(r"^\s*ip: (\S+)$", message, re.M)
    detail = re.search(r"Worker exit detail: (.+?\.)(?: |$)", message)
    where = f"pid {pid.group(1)} on {ip.group(1)}" if pid and ip else ""
    return ", ".join(part for part in (where, detail.group(1) if detail else "") if part)


def _describe(rank: int, e: Exception, run_dir: Path, meter: LauncherMeter) -> str:
    """One line for the user; the worker's full traceback goes to a file in the run folder."""
    import ray

    cause = getattr(e, "cause", None)
    if isinstance(cause, WorkerError):
        path = run_dir / f"worker-{rank}-traceback.txt"
        path.write_text(cause.traceback_text)
        return f"worker {rank} failed: {cause.headline} (traceback: {path})"
    if isinstance(e, ray.exceptions.RayActorError):
        path = run_dir / f"worker-{rank}-death.txt"
        path.write_text(str(e))  # Ray's whole account: its guesses at the cause, the node's log to look in
        return (f"worker {rank} died{_where(run_dir, rank, meter)}: its process exited unexpectedly "
                f"({death_detail(str(e)) or type(e).__name__}; Ray's account: {path})")
    return f"worker {rank} failed: {headline(e)}"

