"""An emulated cluster on one machine: hosts as network namespaces with shaped links.

    distflow cluster up [--hosts 5] [--rate-mbit 400] [--delay-ms 0] [--cpus-per-host 1]
    distflow cluster status
    distflow cluster down

Host i is the network namespace `<name>-h<i>` with one interface, `eth0`, address
198.18.0.<i+1>/24 (the benchmarking range), joined to the others through a veth pair and
the bridge `<name>-br`. Each link is shaped in both directions (`tc tbf` on both ends of
its veth, with `netem` delay first when `--delay-ms` is set), so a host's traffic in and
out is limited like a NIC's. Host 0 runs the Ray head and the driver (no CPUs for
actors); every other host runs a Ray worker node, each with `ray start` and its own
address. The nodes run the Python that makes the cluster (`ray start` through it), so
their workers import what it can: verl, in verl's environment. Every Ray process gets
`RAY_AUTH_MODE=disabled` (the same on all nodes), an explicit `--node-ip-address`, and
`GLOO_SOCKET_IFNAME=eth0` so that gloo advertises the host's address rather than
127.0.0.1.

`down` kills every process inside the namespaces (found by their network namespace,
never by name, so other Ray instances on the machine are untouched), then deletes the
namespaces and the bridge. `EmulatedCluster` does up/down as a context manager, and tears
down on an exception too. It needs root and iproute2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_DIR = Path("/run/distflow-cluster")
RAY_PORT = 6379


class ClusterError(RuntimeError):
    """One line: what is missing or what failed."""


@dataclass
class ClusterSpec:
    hosts: int = 5  # host 0 = Ray head and driver; hosts 1.. = worker nodes
    rate_mbit: float = 400.0
    delay_ms: float = 0.0
    cpus_per_host: int = 1
    name: str = "dfc"

    def ns(self, i: int) -> str:
        return f"{self.name}-h{i}"

    def address(self, i: int) -> str:
        return f"198.18.0.{i + 1}"

    @property
    def ray_address(self) -> str:
        return f"{self.address(0)}:{RAY_PORT}"

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    def veth(self, i: int) -> str:
        return f"{self.name}-v{i}"

    def temp_dir(self, i: int) -> str:
        return f"/tmp/{self.name}-ray{i}"  # short: Ray's unix socket paths are limited


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return proc


def check_prerequisites() -> None:
    if not sys.platform.startswith("linux"):
        raise ClusterError("the emulated cluster needs Linux network namespaces")
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (it creates network namespaces, veths and tc qdiscs)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"'{tool}' not found: install iproute2 (apt-get install iproute2)")
    if importlib.util.find_spec("ray") is None:
        raise ClusterError(f"ray is not installed in this Python ({sys.executable}): pip install ray")


def _shape(device: str, spec: ClusterSpec, netns: str | None = None) -> None:
    prefix = ("ip", "netns", "exec", netns) if netns else ()
    # burst: at least one jiffy's worth of bytes at the rate (and a few MTUs)
    burst = max(int(spec.rate_mbit * 1e6 / 8 / 250), 32 * 1514)
    tbf = ("tbf", "rate", f"{spec.rate_mbit}mbit", "burst", str(burst), "latency", "100ms")
    if spec.delay_ms > 0:
        _run(*prefix, "tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "netem",
             "delay", f"{spec.delay_ms}ms")
        _run(*prefix, "tc", "qdisc", "add", "dev", device, "parent", "1:", "handle", "2:", *tbf)
    else:
        _run(*prefix, "tc", "qdisc", "add", "dev", device, "root", *tbf)


def network_up(spec: ClusterSpec) -> None:
    """The namespaces, veths, bridge, addresses and shaping (no Ray)."""
    _run("ip", "link", "add", spec.bridge, "type", "bridge")
    _run("ip", "link", "set", spec.bridge, "up")
    for i in range(spec.hosts):
        ns, veth = spec.ns(i), spec.veth(i)
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", veth, "master", spec.bridge, "up")
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{spec.address(i)}/24", "dev", "eth0")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _shape(veth, spec)  # towards the host
        _shape("eth0", spec, ns)  # from the host


def ray_env(spec: ClusterSpec) -> dict[str, str]:
    return dict(os.environ, RAY_AUTH_MODE="disabled", GLOO_SOCKET_IFNAME="eth0", RAY_USAGE_STATS_ENABLED="0")


def in_host(spec: ClusterSpec, i: int, cmd: list[str]) -> list[str]:
    """`cmd` run inside host i."""
    return ["ip", "netns", "exec", spec.ns(i), *cmd]


def ray_up(spec: ClusterSpec, timeout_s: float = 120) -> None:
    _start(spec, 0, ["--head", f"--node-ip-address={spec.address(0)}", f"--port={RAY_PORT}", "--num-cpus=0",
                     "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={spec.temp_dir(0)}",
                     '--resources={"host_0": 1000}'])
    for i in range(1, spec.hosts):
        _start(spec, i, [f"--address={spec.ray_address}", f"--node-ip-address={spec.address(i)}",
                         f"--num-cpus={spec.cpus_per_host}", f"--temp-dir={spec.temp_dir(i)}",
                         f'--resources={{"host_{i}": 1000}}'])
    wait_for_nodes(spec, spec.hosts, timeout_s)


def _start(spec: ClusterSpec, i: int, args: list[str]) -> None:
    """`ray start *args` in host i, through this Python (its workers run it too)."""
    cmd = in_host(spec, i, [sys.executable, "-m", "ray.scripts.scripts", "start", *args])
    proc = subprocess.run(cmd, env=ray_env(spec), capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise ClusterError(f"`ray start {args[0]} ...` failed: {(proc.stderr or proc.stdout).strip()[-300:]}")


_COUNT_NODES = """
import ray, sys
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(sum(1 for n in ray.nodes() if n["Alive"]))
ray.shutdown()
"""


def wait_for_nodes(spec: ClusterSpec, count: int, timeout_s: float) -> None:
    end, alive = time.monotonic() + timeout_s, 0
    while time.monotonic() < end:
        proc = subprocess.run(in_host(spec, 0, [sys.executable, "-c", _COUNT_NODES, spec.ray_address]),
                              env=ray_env(spec), capture_output=True, text=True, timeout=120)
        lines = proc.stdout.strip().splitlines()
        alive = int(lines[-1]) if proc.returncode == 0 and lines and lines[-1].isdigit() else 0
        if alive >= count:
            return
        time.sleep(1)
    raise ClusterError(f"only {alive} of {count} Ray nodes joined within {timeout_s:.0f} s")


def _namespace_inodes(spec: ClusterSpec) -> set[int]:
    found = set()
    for i in range(spec.hosts):
        try:
            found.add(os.stat(f"/run/netns/{spec.ns(i)}").st_ino)
        except OSError:
            pass
    return found


def processes_inside(spec: ClusterSpec) -> list[int]:
    """Every process whose network namespace is one of the cluster's hosts."""
    inodes, found = _namespace_inodes(spec), []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{name}/ns/net").st_ino in inodes:
                found.append(int(name))
        except OSError:
            pass
    return [pid for pid in found if pid != os.getpid()]


def down(spec: ClusterSpec) -> None:
    """Kill everything inside, delete the namespaces and the bridge. Idempotent."""
    for _ in range(20):
        pids = processes_inside(spec)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    for i in range(spec.hosts):
        _run("ip", "link", "del", spec.veth(i), check=False)  # and its peer inside the namespace
        _run("ip", "netns", "del", spec.ns(i), check=False)
        shutil.rmtree(spec.temp_dir(i), ignore_errors=True)
    _run("ip", "link", "del", spec.bridge, check=False)
    (STATE_DIR / f"{spec.name}.json").unlink(missing_ok=True)


def up(spec: ClusterSpec, with_ray: bool = True) -> None:
    check_prerequisites()
    if Path(f"/run/netns/{spec.ns(0)}").exists():
        raise ClusterError(f"a cluster named {spec.name!r} is already up; `distflow cluster down` first")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / f"{spec.name}.json").write_text(json.dumps(asdict(spec)))
    try:
        network_up(spec)
        if with_ray:
            ray_up(spec)
    except BaseException:
        down(spec)
        raise


def leftovers(spec: ClusterSpec) -> list[str]:
    """What of the cluster still exists (empty after `down`)."""
    out = [f"netns {spec.ns(i)}" for i in range(spec.hosts) if Path(f"/run/netns/{spec.ns(i)}").exists()]
    if Path(f"/sys/class/net/{spec.bridge}").exists():
        out.append(f"bridge {spec.bridge}")
    out += [f"veth {spec.veth(i)}" for i in range(spec.hosts) if Path(f"/sys/class/net/{spec.veth(i)}").exists()]
    out += [f"process {pid}" for pid in processes_inside(spec)]
    return out


class EmulatedCluster:
    """`with EmulatedCluster(spec) as c:` ... torn down on exit, an exception or SIGTERM."""

    def __init__(self, spec: ClusterSpec, with_ray: bool = True):
        self.spec, self.with_ray = spec, with_ray

    def __enter__(self) -> "EmulatedCluster":
        self._previous = signal.signal(signal.SIGTERM, self._on_term)
        up(self.spec, self.with_ray)
        return self

    def _on_term(self, signum, frame) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, *exc) -> None:
        try:
            down(self.spec)
        finally:
            signal.signal(signal.SIGTERM, self._previous)

    def run(self, host: int, cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run `cmd` inside host `host` with the cluster's environment and `env`."""
        return subprocess.run(in_host(self.spec, host, cmd), env=ray_env(self.spec) | (env or {}), **kwargs)


# ---------------------------------------------------------------------------- command line


def status(spec: ClusterSpec) -> str:
    state = STATE_DIR / f"{spec.name}.json"
    if not state.exists():
        return f"no cluster named {spec.name!r} is up"
    spec = ClusterSpec(**json.loads(state.read_text()))
    lines = [f"cluster {spec.name!r}: {spec.hosts} hosts, links {spec.rate_mbit:g} Mbit/s each way"
             + (f", +{spec.delay_ms:g} ms" if spec.delay_ms else "") + f"; Ray at {spec.ray_address}"]
    for i in range(spec.hosts):
        role = "Ray head + driver" if i == 0 else f"Ray worker node ({spec.cpus_per_host} CPU)"
        lines.append(f"  host {i}: netns {spec.ns(i)}, {spec.address(i)}, {role}")
    lines.append(f"  processes inside: {len(processes_inside(spec))}")
    lines.append(f"run the launcher on host 0: ip netns exec {spec.ns(0)} env RAY_AUTH_MODE=disabled "
                 f"GLOO_SOCKET_IFNAME=eth0 distflow train runtime.ray_address={spec.ray_address}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--hosts", type=int, default=5)
    parser.add_argument("--rate-mbit", type=float, default=400.0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--cpus-per-host", type=int, default=1)
    parser.add_argument("--name", default="dfc")
    args = parser.parse_args(argv)
    spec = ClusterSpec(args.hosts, args.rate_mbit, args.delay_ms, args.cpus_per_host, args.name)
    try:
        if args.action == "up":
            up(spec)
            print(status(spec))
        elif args.action == "down":
            state = STATE_DIR / f"{spec.name}.json"
            down(ClusterSpec(**json.loads(state.read_text())) if state.exists() else spec)
        else:
            print(status(spec))
    except ClusterError as e:
        print(f"distflow cluster: error: {e}", file=sys.stderr)
        return 2
    return 0
