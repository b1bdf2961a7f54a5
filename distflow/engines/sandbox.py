"""Running model-written Python safely, and the code reward built on it.

`run_python(code, stdin)` runs a program in its own process tree with a wall-clock and
CPU time limit, an address-space limit, a cap on file size (and, isolated, on processes),
and stdout and stderr written to files (so a program that prints forever cannot fill our
memory). The sandbox ends with its caller (a reward process killed on its timeout).

As root on Linux where namespaces can be made (CI; not a container without
CAP_SYS_ADMIN), isolation is full:

    reward process --Popen--> launcher (python -I -S, root)
        unshare: new mount, network, PID, IPC and UTS namespaces
        the new root is a private tmpfs: /usr, the Python installation and a few /dev
        nodes bound read-only; /sandbox (the program's folder) and /tmp are tmpfs
        fork --> init (PID 1 of the new PID namespace)
            chroot, resource limits, drop to an unused uid, no new privileges
            fork+exec --> python -S: main.py (the standard library only)

The program sees no network interface but a loopback that is down, none of the run's
files (its filesystem is the new root), and cannot write anywhere but its tmpfs folders.
When init exits (the program ended, or the launcher was killed on timeout: init has a
parent-death signal), the kernel kills everything left in the PID namespace, so a fork
bomb ends with it.

As root where namespaces cannot be made (a container without CAP_SYS_ADMIN, which still
lets root change its uid), the program runs as an unused uid of its own without the new
root ("own-uid"): it cannot read or write the run's private files (ours are root's), it
has the process cap, and when it ends, or on its timeout, every process of its uid is
killed (a child in its own session too). It sees the host's filesystem where that is
readable to anyone, and the network.

Otherwise (not root), the program runs with the time, memory and file limits only (no cap
on processes: a fork bomb is not contained, and a child that starts its own session
outlives the call), as the caller's user ("limits"). Without namespaces, it runs in a
fresh temporary folder with an audit hook refusing sockets and reads and writes outside
it: a Python-level guard that a hostile program can get around (ctypes, for one). Say so
to your users; `isolation()` tells, and the first call prints it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

OK, ERROR, TIMEOUT, MEMORY, KILLED = "ok", "error", "timeout", "memory", "killed"


class SandboxError(RuntimeError):
    """The sandbox itself could not run (not anything the program did)."""


@dataclass(frozen=True)
class Limits:
    time_s: float = 5.0  # wall clock, from the program's start
    memory_mb: int = 512  # address space of each process
    processes: int = 32
    file_mb: int = 16  # largest file (and stdout/stderr) the program may write


@dataclass(frozen=True)
class Result:
    status: str  # ok | error | timeout | memory | killed
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


_ISOLATION: list[str] = []


MODES = ("namespaces", "own-uid", "limits")  # strongest first


def isolation() -> str:
    """'namespaces' where the full isolation works (root on Linux, allowed to unshare),
    else 'own-uid' where root can still change its uid, else 'limits'.
    `DISTFLOW_SANDBOX=own-uid` or `=limits` caps it at that mode."""
    if not _ISOLATION:
        cap = os.environ.get("DISTFLOW_SANDBOX", MODES[0])
        if cap not in MODES:
            raise SandboxError(f"DISTFLOW_SANDBOX={cap!r}: expected one of {', '.join(MODES)}")
        mode = "limits"
        if sys.platform.startswith("linux") and os.geteuid() == 0:
            for candidate in MODES[MODES.index(cap):-1]:
                try:
                    probe = _run("pass", "", Limits(time_s=10), candidate)
                except SandboxError as e:
                    print(f"distflow: the code sandbox cannot use {candidate} ({e})", file=sys.stderr)
                    continue
                if probe.status == OK:
                    mode = candidate
                    break
                # it started but the program did not run (own-uid: a Python its uid cannot reach, under /root)
                why = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.status
                print(f"distflow: the code sandbox cannot use {candidate} ({why})", file=sys.stderr)
        if mode != MODES[0]:
            print(f"distflow: the code sandbox runs programs in its {mode} mode (engines/sandbox.py says what "
                  "that contains)", file=sys.stderr)
        _ISOLATION.append(mode)
    return _ISOLATION[0]


# The launcher runs in a fresh interpreter (single-threaded, so unshare/fork are safe).
# argv[1] is the JSON spec; fd `status_fd` receives one line: "exit N" or "signal N".
_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
spec = json.loads(sys.argv[1])
status = os.fdopen(spec["status_fd"], "w")
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the sandbox ends with its caller (a killed reward process)
if os.getppid() == 1:  # ... which may have gone already
    sys.exit(1)
program = open(spec["program"], "rb").read()

def check(ret, what):
    if ret != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18

def mount(src, dst, fstype, flags, data=None):
    check(libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                     data and data.encode()), f"mount {dst}")

def bind_readonly(path, root, device=False):
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(path, target, None, MS_BIND | MS_REC)
    # MS_NODEV would make a bound device node (/dev/null) unopenable, so devices go without it
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if device else MS_NODEV))

isolate, own_uid, uid, root = spec["mode"] == "namespaces", spec["mode"] != "limits", spec["uid"], spec["root"]
if isolate:
    CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, 0x20000000, 0x40000000
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=755")
    for path in spec["binds"]:
        if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            bind_readonly(path, root)
    for dev in ("null", "zero", "urandom", "random"):
        bind_readonly("/dev/" + dev, root, device=True)
    for folder in ("/tmp", "/sandbox"):
        os.makedirs(root + folder)
        mount("tmpfs", root + folder, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['file_mb'] * 4}m,mode=1777")
    workdir = "/sandbox"
else:
    workdir = os.path.join(root, "sandbox")
    os.makedirs(workdir)
    if own_uid:  # its folder is its own; the folders above it (root's, 0700) it may only pass through
        os.chown(workdir, uid, uid)
        for folder in (root, os.path.dirname(root)):
            os.chmod(folder, 0o711)
with open((root if isolate else "") + workdir + "/main.py", "wb") as f:
    f.write(program)

def limit(cpu_s, memory_mb, processes, file_mb, own_uid):
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    if own_uid:  # RLIMIT_NPROC counts all processes of the uid
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))

PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
init = os.fork() if isolate else 0
if init:  # the launcher: wait for init, report, leave
    os.waitpid(init, 0)
    sys.exit(0)
if isolate:
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    os.chroot(root)
os.chdir(workdir)
if own_uid:  # an unused uid: no access to anyone's private files, and a process cap of its own
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # clears the parent-death signal: set it again
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
limit(spec["cpu_s"], spec["memory_mb"], spec["processes"], spec["file_mb"], own_uid)
env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": "/tmp" if isolate else workdir, "LANG": "C.UTF-8"}
runs_main = spec["run_main"] if isolate else spec["guard"] + spec["run_main"]  # without namespaces: the guard first
argv = [spec["python"], "-I", "-S", "-B", "-c", runs_main, workdir]
os.set_inheritable(status.fileno(), False)
child = os.fork()
if child == 0:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # without namespaces: it ends with the launcher
    os.execve(spec["python"], argv, env)
while True:  # PID 1 reaps every orphan until the program itself has ended
    pid, code = os.wait()
    if pid == child:
        break
if own_uid and not isolate:  # what the program left running, in its own session too (no namespace ends it)
    try:
        os.kill(-1, signal.SIGKILL)  # every process of the uid but this one
    except ProcessLookupError:
        pass
status.write(f"signal {-os.waitstatus_to_exitcode(code)}\n" if os.WIFSIGNALED(code)
             else f"exit {os.waitstatus_to_exitcode(code)}\n")
status.flush()
os._exit(0)
"""

# Without namespaces: refuse sockets, starting programs, writes outside the folder and
# reads outside it and the Python installation, at the Python level; then run main.py.
_GUARD = r"""
import os, sys
folder = os.path.realpath(sys.argv[1])
readable = (folder, os.path.realpath(sys.base_prefix), "/usr", "/dev/null", "/dev/urandom")
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def inside(path, roots):
    path = os.path.realpath(os.fsdecode(path))
    return any(path == r or path.startswith(r + os.sep) for r in roots)
def guard(event, args):
    if event.startswith("socket.") or event in ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
                                                "os.kill", "os.killpg", "signal.pthread_kill"):
        raise PermissionError(f"{event} is not allowed in the sandbox")
    if event == "open" and isinstance(args[0], (str, bytes)):
        mode, flags = args[1], args[2]
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & WRITE)
        if not inside(args[0], (folder,) if writes else readable):
            raise PermissionError(f"the sandbox may not {'write' if writes else 'read'} {args[0]}")
    if event in ("os.listdir", "os.scandir") and not inside(args[0] if args[0] is not None else ".", readable):
        raise PermissionError(f"the sandbox may not list {args[0]}")
sys.addaudithook(guard)
"""
# main.py as `python main.py` would run it (its __file__, its module as __main__), with exit()
# and quit(), which the site module gives and `-S` (no site-packages: the standard library
# only) leaves out.
_RUN_MAIN = r"""
import builtins, runpy, sys
builtins.exit = builtins.quit = sys.exit
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


def _python() -> str:
    """The interpreter the sandbox runs (this one's base, not a virtual environment's link)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _binds() -> list[str]:
    """What the program's root holds, read-only: the system's libraries and this Python."""
    prefix = os.path.realpath(sys.base_prefix)
    python = _python()
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", prefix]
    if not python.startswith(prefix + os.sep) and not python.startswith("/usr/"):
        paths.append(os.path.dirname(python))
    return paths


def sandbox_uids(pid: int) -> range:
    """The uids the sandboxes that process `pid` starts run under: eight unused ones of
    its own (200000 and up), each held by one running program at a time (`_held_uid`),
    so that a program's process cap (RLIMIT_NPROC counts the uid's processes) is its alone."""
    first = 200_000 + pid * 8  # pids reach 4194304 (Linux's pid_max): no two processes share a range
    return range(first, first + 8)


_free_uids: dict[int, queue.Queue] = {}  # this process's sandbox uids no program holds (by pid: a fork has its own)
_free_uids_lock = threading.Lock()


@contextlib.contextmanager
def _held_uid() -> Iterator[int]:
    """A sandbox uid of this process that no running program holds, for one program; a
    ninth program at once (tool calls on several threads) waits for one."""
    pid = os.getpid()
    with _free_uids_lock:
        if pid not in _free_uids:
            _free_uids[pid] = queue.Queue()
            for uid in sandbox_uids(pid):
                _free_uids[pid].put(uid)
        free = _free_uids[pid]
    uid = free.get()
    try:
        yield uid
    finally:
        free.put(uid)


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> Result:
    """Run `code` as a Python program in the sandbox with `stdin`; never raises for
    anything the program does."""
    return _run(code, stdin, limits, isolation())


def _run(code: str, stdin: str, limits: Limits, mode: str) -> Result:
    python = _python()
    with _held_uid() as uid, tempfile.TemporaryDirectory(prefix=_folder_prefix(os.getpid()),
                                                          ignore_cleanup_errors=True) as tmp:
        with open(os.path.join(tmp, "main.py"), "w", opener=_private) as f:
            f.write(code)
        os.makedirs(os.path.join(tmp, "root"))
        files = {name: open(os.path.join(tmp, name), "w+b", opener=_private)
                 for name in ("stdin", "stdout", "stderr", "status")}
        try:
            files["stdin"].write(stdin.encode())
            files["stdin"].seek(0)
            spec = {"program": os.path.join(tmp, "main.py"), "root": os.path.join(tmp, "root"), "python": python,
                    "mode": mode, "binds": _binds(), "status_fd": files["status"].fileno(),
                    "uid": uid,
                    "cpu_s": int(limits.time_s) + 1, "guard": _GUARD, "run_main": _RUN_MAIN} | asdict(limits)
            start = time.perf_counter()
            proc = subprocess.Popen([python, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(spec)],
                                    stdin=files["stdin"], stdout=files["stdout"], stderr=files["stderr"],
                                    pass_fds=[files["status"].fileno()], start_new_session=True, cwd=tmp,
                                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            timed_out = False
            try:
                proc.wait(timeout=limits.time_s + 1.0)  # +1 s: the launcher's own start-up
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc)  # also what a program that returned left running (a forked child)
            if mode == "own-uid" and (timed_out or proc.returncode != 0):  # the launcher did not end them
                _kill_uid(uid, python)
            seconds = time.perf_counter() - start
            out, err, status = (_read(files[n], limits.file_mb << 20) for n in ("stdout", "stderr", "status"))
        finally:
            for f in files.values():
                f.close()
    if not timed_out and _returncode(status) is None:  # the launcher wrote no status line
        if proc.returncode >= 0:  # it exited on its own: it failed to start the program
            raise SandboxError(f"the sandbox did not start: "
                               f"{err.strip().splitlines()[-1] if err.strip() else 'no output'}")
        status = f"signal {-proc.returncode}"  # the program killed it (only a program can send it a signal)
    return Result(_status(timed_out, status, err), _returncode(status), out, err, seconds)


def _private(path: str, flags: int) -> int:
    """Opens a file only root may read: in own-uid mode a program may pass through the
    folders above its own, also another program's, and these names are known."""
    return os.open(path, flags, 0o600)


def _folder_prefix(pid: int) -> str:
    return f"distflow-sandbox-{pid}-"


def remove_leftovers(pid: int) -> None:
    """The sandbox folders of process `pid`, which was killed while a program ran (its
    sandboxes end with it: their parent-death signal; their folders stay behind), and,
    as root, what the programs left running under its sandbox uids (in own-uid mode no
    namespace's end takes a child that started its own session)."""
    for folder in Path(tempfile.gettempdir()).glob(_folder_prefix(pid) + "*"):
        shutil.rmtree(folder, ignore_errors=True)
    if os.geteuid() == 0 and sys.platform.startswith("linux"):
        python = _python()
        for uid in set(sandbox_uids(pid)) & _uids_running():
            _kill_uid(uid, python)


def _uids_running() -> set[int]:
    """The real uids of the processes running now (from /proc)."""
    uids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uids.add(int(next(line.split()[1] for line in f if line.startswith("Uid:"))))
        except (OSError, StopIteration):  # it ended meanwhile
            continue
    return uids


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # with namespaces, init's parent-death signal ends the rest
    except ProcessLookupError:
        pass
    proc.wait()


_KILL_UID = """
import os, signal, sys
uid = int(sys.argv[1])
os.setgroups([]); os.setgid(uid); os.setuid(uid)  # after start-up: this Python may be where uid cannot read
try:
    os.kill(-1, signal.SIGKILL)  # every process of the uid but this one
except ProcessLookupError:
    pass
"""


def _kill_uid(uid: int, python: str) -> None:
    """Every process running as `uid` (a sandbox's: one program's at a time), in its own session too."""
    subprocess.run([python, "-I", "-S", "-c", _KILL_UID, str(uid)], cwd="/", env={}, check=True, timeout=30)


def _read(f, cap: int) -> str:
    f.seek(0)
    return f.read(cap).decode("utf-8", errors="replace")


def _returncode(status: str) -> int | None:
    m = re.match(r"(exit|signal) (-?\d+)", status)
    if not m:
        return None
    return int(m.group(2)) if m.group(1) == "exit" else -int(m.group(2))


def _status(timed_out: bool, status: str, stderr: str) -> str:
    code = _returncode(status)
    if timed_out or code == -signal.SIGXCPU:
        return TIMEOUT
    if code != 0 and "MemoryError" in stderr:  # a program that caught one, or printed the word, and went on is OK
        return MEMORY
    return OK if code == 0 else (KILLED if code < 0 else ERROR)


# ---------------------------------------------------------------------------- the code reward

CODE_SOURCES = ("codecontests", "apps", "taco", "codeforces", "livecodebench", "primeintellect", "code")
# a closed fenced block: its opening fence's info string, its text up to the next fence (at a
# line's start or not: small models close one at the end of the code's last line)
_FENCED = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)```", re.DOTALL)
_OPENED = re.compile(r"```[ \t]*([^\n`]*)\n(.*)\Z", re.DOTALL)  # one left open: a response cut at its token limit
_PYTHON_TAGS = ("python", "py", "python3")


def extract_code(solution_str: str) -> str:
    """The program of a response: its last closed fenced block tagged python (py, python3,
    any case), else a python block left open at the end (cut at the token limit), else its
    last closed untagged block, else the whole response. A block tagged as another language,
    or an untagged one after a python block (a sample's output), is never run."""
    closed = list(_FENCED.finditer(solution_str))
    blocks = [(_tag(m[1]), m[2]) for m in closed]
    cut = _OPENED.search(solution_str, closed[-1].end() if closed else 0)
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: not tag):
        chosen = [text for tag, text in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
        if cut is not None and wanted(_tag(cut[1])):
            return cut[2]
    return solution_str


def _tag(info: str) -> str:
    """A fence's language: its info string's first word, lower-cased."""
    return (info.split() or [""])[0].lower()


def code_score(data_source: str, solution_str: str, ground_truth: str | dict,
               extra_info: dict[str, Any] | None = None, *, time_budget_s: float | None = None) -> float:
    """The fraction of test cases the response's program passes, run in the sandbox.

    `ground_truth` is JSON (or the mapping it holds) in the format of APPS / TACO / verl's code datasets:
    `{"inputs": [...], "outputs": [...]}`, optionally with `"fn_name"`, `"time_limit"`
    (seconds per case) and `"memory_limit_mb"`. Without `fn_name` each input is the
    program's stdin and each output its expected stdout (a list of lines is joined); they
    match line by line after stripping, or token by token with numbers equal to 1e-6
    (APPS's checker). With `fn_name` (call-based problems) each input is the argument
    list of `fn_name` (a method of `Solution` where the program defines one) and the
    value it returns must equal the output (or, as APPS wraps them, its only item). A
    program that crashes, times out or is killed fails that case; the call itself never
    raises for anything the program does. The cases run one after another; with
    `time_budget_s` one is started only while its time limit (and a second to start) fits
    in what is left, and those not run fail: a slow program scores what it passed in time,
    rather than the caller's limit cutting the whole call to nothing."""
    cases = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    inputs, outputs, fn_name = cases["inputs"], cases["outputs"], cases.get("fn_name")
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError("ground truth needs as many 'inputs' as 'outputs', at least one")
    # a parquet struct column holds every row's keys: a row without a limit reads it as None
    time_limit, memory_limit = cases.get("time_limit"), cases.get("memory_limit_mb")
    limits = Limits(time_s=Limits.time_s if time_limit is None else float(time_limit),
                    memory_mb=Limits.memory_mb if memory_limit is None else int(memory_limit))
    case_s = limits.time_s + 1.0  # the most one case takes: its limit, and a second to start
    if time_budget_s is not None and case_s > time_budget_s:
        raise ValueError(f"a test case's time_limit of {limits.time_s:g} s does not fit in the reward call's limit "
                         f"(reward.timeout_s); raise reward.timeout_s above {limits.time_s + 2:g}")
    code, passed, start = extract_code(solution_str), 0, time.monotonic()
    for given, expected in zip(inputs, outputs):
        if time_budget_s is not None and time.monotonic() - start + case_s > time_budget_s:
            break
        if fn_name:
            result = run_python(code + _CALL.format(fn=json.dumps(fn_name)), json.dumps(given), limits)
            passed += result.status == OK and _same_return(result.stdout, expected)
        else:
            result = run_python(code, _text(given), limits)
            passed += result.status == OK and _same_output(result.stdout, _text(expected))
    return passed / len(inputs)


_CALL = """

def _distflow_call():
    import json as _json, sys as _sys
    _args = _json.loads(_sys.stdin.read())
    _fn = getattr(Solution(), {fn}) if "Solution" in globals() else globals()[{fn}]
    _value = _fn(*_args)
    _sys.stdout.write("\\n<<distflow-return>>" + _json.dumps(_value, default=list))

_distflow_call()
"""


def _text(value: Any) -> str:
    """A stdin or stdout given as text, or as a list of lines."""
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _same_return(stdout: str, expected: Any) -> bool:
    _, marker, value = stdout.rpartition("<<distflow-return>>")
    if not marker:
        return False
    try:
        got = json.loads(value)
    except ValueError:  # something printed after the value (an atexit hook, a thread), or output cut short
        return False
    return got == expected or (isinstance(expected, list) and len(expected) == 1 and got == expected[0])


def _same_output(got: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.strip() for line in text.strip().splitlines()]
    if lines(got) == lines(expected):
        return True
    mine, theirs = got.split(), expected.split()
    return len(mine) == len(theirs) and all(a == b or _close_numbers(a, b) for a, b in zip(mine, theirs))


def _close_numbers(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isfinite(x) and math.isfinite(y) and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)
