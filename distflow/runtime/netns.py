"""Loopback only: a single-machine run inside its own network namespace.

Ray's servers (GCS, raylet, object manager, every worker's gRPC server) bind to all
interfaces, whatever address they are given, and so may gloo's and the TCPStore's
listeners. Rather than trust each of them, `run_in_loopback_namespace` re-runs the
command in a fresh network namespace whose only interface is the loopback: Ray and
`torch.distributed` still talk over 127.0.0.1, and nothing outside the run (no other
machine, no other process on this one) can reach any of their ports.

As root this is `unshare(CLONE_NEWNET)`; otherwise an unprivileged user namespace, same
uid and gid inside, where the kernel allows it. The namespace is made by a fresh,
single-threaded interpreter, which then execs the command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

ENV = "DISTFLOW_NETNS"  # set inside the namespace: the command does not isolate twice

_ENTER = r"""
import ctypes, fcntl, os, socket, struct, sys
ready, argv = int(sys.argv[1]), sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
uid, gid = os.getuid(), os.getgid()
as_root = os.geteuid() == 0
if libc.unshare(CLONE_NEWNET if as_root else CLONE_NEWUSER | CLONE_NEWNET) != 0:
    os.write(ready, f"0unshare: {os.strerror(ctypes.get_errno())}".encode())
    sys.exit(1)
if not as_root:  # keep the same uid and gid inside the user namespace
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # bring the loopback up
    flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
    fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))
PR_SET_PDEATHSIG, SIGTERM = 1, 15
libc.prctl(PR_SET_PDEATHSIG, SIGTERM)  # the run ends with the process that started it (kept across exec)
if os.getppid() == 1:  # ... which may have gone already
    sys.exit(1)
os.write(ready, b"1")
os.close(ready)
os.execve(sys.executable, [sys.executable, *argv], dict(os.environ, DISTFLOW_NETNS="loopback"))
"""


def inside() -> bool:
    return bool(os.environ.get(ENV))


class NamespaceUnavailable(RuntimeError):
    """No network namespace can be made here; the message says why (one line)."""


def run_in_loopback_namespace(argv: list[str]) -> int:
    """Run `python argv...` in a loopback-only network namespace and return its exit
    code; NamespaceUnavailable (having run nothing) where no namespace can be made here."""
    if not sys.platform.startswith("linux"):
        raise NamespaceUnavailable(f"network namespaces are Linux only, this is {sys.platform}")
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _ENTER, str(write_end), *argv],
                                pass_fds=[write_end])
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as ready:  # b"1", or b"0" and why not (EOF: it crashed)
        answer = ready.read()
    if answer[:1] != b"1":
        proc.wait()
        raise NamespaceUnavailable(answer[1:].decode(errors="replace") or f"set-up exited with {proc.returncode}")
    # a `kill` of this process stops the run, not just this waiter; a signal it ignores (SIGHUP under `nohup`)
    # the run ignores too, as it inherited
    forwarded = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN]
    previous = ({s: signal.signal(s, lambda signum, _: proc.send_signal(signum)) for s in forwarded}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # the run got the same Ctrl-C: let it stop cleanly
            code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code if code >= 0 else 128 - code  # killed by signal n: the shell's 128 + n
