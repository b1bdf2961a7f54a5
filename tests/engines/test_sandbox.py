"""The code sandbox against hostile programs, for real: each is contained and scores 0,
and the next program runs normally."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from distflow.engines import sandbox
from distflow.engines.reward import RewardRunner, default_compute_score
from distflow.engines.sandbox import ERROR, KILLED, MEMORY, OK, TIMEOUT, Limits, code_score, run_python

FULL = sandbox.isolation() == "namespaces"
needs_namespaces = pytest.mark.skipif(not FULL, reason="full isolation needs root on Linux (CI has it)")
LIMITS = Limits(time_s=0.5, memory_mb=256, processes=16, file_mb=1)
ECHO_CASES = json.dumps({"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]})
GOOD = "a, b = map(int, input().split())\nprint(a + b)\n"


def _processes(field: str) -> dict[int, int]:
    """Every process's pid -> the number in its /proc status line `field` (Uid: the real uid)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                found[int(pid)] = int(next(line.split()[1] for line in f if line.startswith(f"{field}:")))
        except (OSError, StopIteration):
            continue
    return found


def _sandbox_processes(spawners: set[int]) -> list[int]:
    """Processes running under the uids of the sandboxes that the `spawners` (pids)
    started: not those of tests running beside this one."""
    uids = {uid for pid in spawners for uid in sandbox.sandbox_uids(pid)}
    return [pid for pid, uid in _processes("Uid").items() if uid in uids]


def _children() -> set[int]:
    """This process's child processes."""
    return {pid for pid, parent in _processes("PPid").items() if parent == os.getpid()}


def _no_sandbox_processes_left(spawners: set[int], deadline_s: float = 5.0) -> bool:
    end = time.monotonic() + deadline_s
    while _sandbox_processes(spawners) and time.monotonic() < end:
        time.sleep(0.05)
    return not _sandbox_processes(spawners)


def _ended(pid: int, deadline_s: float = 5.0) -> bool:
    """Whether process `pid` is gone, or a zombie its new parent has not reaped yet."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_correct_program_passes_every_case_and_a_wrong_one_scores_its_fraction():
    assert code_score("codecontests", f"Here:\n```python\n{GOOD}```", ECHO_CASES) == 1.0
    assert code_score("codecontests", "print(5)", ECHO_CASES) == 0.5
    assert default_compute_score("likaixin/TACO", f"```python\n{GOOD}```", ECHO_CASES) == 1.0
    result = run_python("import sys; print(sys.stdin.read().upper())", "abc")
    assert (result.status, result.stdout) == (OK, "ABC\n")


def test_the_program_is_the_last_python_block_not_a_sample_s_output_or_another_language_s():
    """An untagged block after the solution (its sample output) was run as the program, and
    a block of another language before it made the text between the blocks the program."""
    with_output = f"```python\n{GOOD}```\nFor example:\n```\n5\n```\n"
    assert code_score("codecontests", with_output, ECHO_CASES) == 1.0
    after_text = f"Sample input:\n```text\n2 3\n```\n\nSolution:\n```Python\n{GOOD}```\n"
    assert code_score("codecontests", after_text, ECHO_CASES) == 1.0
    assert sandbox.extract_code(f"```cpp\nint main() {{}}\n```\n```\n{GOOD}```") == GOOD  # untagged: the fallback
    assert sandbox.extract_code(f"```py3 title=x\nprint(1)\n```") == "```py3 title=x\nprint(1)\n```"  # not python
    assert sandbox.extract_code(f"Cut at the limit:\n```python\n{GOOD}") == GOOD
    # a closed python block wins over one cut at the limit after it; fences need not start a line
    assert sandbox.extract_code(f"```python\n{GOOD}```\nA brute force:\n```python\ndef brute(a, b):\n    return") == GOOD
    assert sandbox.extract_code("Here:\n```python\nprint(input())```\nDone.") == "print(input())"
    assert sandbox.extract_code(f"Solution: ```python\n{GOOD}```") == GOOD
    assert sandbox.extract_code("print(7)") == "print(7)"


@pytest.mark.parametrize("mode", ["namespaces", "limits"])
def test_exit_and_quit_end_the_program_as_in_plain_python(mode, monkeypatch):
    """The sandbox's `python -S` leaves out the site module, which gives exit() and quit():
    `print(...); exit()`, common in contest solutions, failed its case after a right answer."""
    if mode == "namespaces" and not FULL:
        pytest.skip("full isolation needs root on Linux (CI has it)")
    monkeypatch.setattr(sandbox, "_ISOLATION", [mode])
    early = "n = int(input())\nif n > 0:\n    print('YES')\n    exit()\nprint('NO')\nquit(3)\n"
    assert (run_python(early, "1\n").status, run_python(early, "1\n").stdout) == (OK, "YES\n")
    assert (run_python(early, "0\n").status, run_python(early, "0\n").returncode) == (ERROR, 3)
    assert code_score("codecontests", early, json.dumps({"inputs": ["1\n", "-1\n"], "outputs": ["YES", "NO"]})) == 0.5
    # a traceback still names main.py's own lines
    assert 'File "main.py", line 2' in run_python("x = 1\nraise ValueError(x)\n").stderr


def test_a_parquet_struct_row_without_limits_runs_with_the_defaults():
    """A struct column holds every row's keys: a row without time_limit read it as None."""
    cases = {"inputs": ["2 3\n"], "outputs": ["5\n"], "time_limit": None, "memory_limit_mb": None, "fn_name": None}
    assert code_score("codecontests", GOOD, cases) == 1.0


def test_apps_and_taco_forms_call_based_problems_lists_and_tolerant_outputs():
    call = json.dumps({"fn_name": "add", "inputs": [[1, 2], [5, 7]], "outputs": [[3], 12]})  # APPS wraps returns
    assert code_score("apps", "def add(a, b):\n    return a + b\n", call) == 1.0
    assert code_score("taco", "class Solution:\n    def add(self, a, b):\n        return a + b\n", call) == 1.0
    assert code_score("apps", "def add(a, b):\n    print(a + b)\n    return a - b\n", call) == 0.0  # prints: no
    lines = json.dumps({"inputs": [["1 2", "3 4"]], "outputs": [["3", "7"]]})  # stdin and stdout as lists of lines
    two_sums = "for _ in range(2):\n    a, b = map(int, input().split())\n    print(a + b)"
    assert code_score("apps", two_sums, lines) == 1.0
    loose = json.dumps({"inputs": [""], "outputs": ["1 2\n0.5\n"]})  # APPS's checker: tokens, numbers to 1e-6
    assert code_score("apps", "print('1  2')\nprint(0.5000001)", loose) == 1.0
    assert code_score("apps", "print('1 3')\nprint(0.5)", loose) == 0.0


@needs_namespaces
def test_a_fork_bomb_is_contained_and_leaves_no_process_behind():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_python(bomb, limits=LIMITS)
    assert result.status == TIMEOUT and result.seconds < LIMITS.time_s + 3
    assert _no_sandbox_processes_left({os.getpid()})
    assert run_python(GOOD, "1 1\n").stdout == "2\n"  # the machine is still usable


@needs_namespaces
def test_programs_running_at_once_each_hold_a_uid_of_their_own():
    """Tool calls on several threads: eight programs at once run under eight different
    sandbox uids (a uid drawn by the clock was shared by two of eight at once almost
    always, and with it their process cap); a ninth waits for one to be free."""
    from concurrent.futures import ThreadPoolExecutor

    program = "import os, time; start = time.time(); time.sleep(0.3); print(os.getuid(), start, time.time())"
    with ThreadPoolExecutor(9) as pool:
        results = list(pool.map(lambda _: run_python(program), range(9)))
    assert all(r.status == OK for r in results)
    runs = [(int(uid), float(a), float(b)) for uid, a, b in (r.stdout.split() for r in results)]
    assert {uid for uid, _, _ in runs} <= set(sandbox.sandbox_uids(os.getpid()))
    for i, (uid, a0, a1) in enumerate(runs):  # two programs with one uid never ran at the same time
        for other, b0, b1 in runs[i + 1:]:
            assert uid != other or a1 <= b0 or b1 <= a0


def test_a_return_value_that_is_not_json_fails_its_case_not_the_sample():
    from distflow.engines.sandbox import _same_return

    assert _same_return('<<distflow-return>>[1, 2]\n', [1, 2])
    assert not _same_return('<<distflow-return>>[1, 2]\nbye from atexit\n', [1, 2])


@needs_namespaces
def test_a_huge_allocation_hits_the_memory_limit():
    result = run_python("x = bytearray(8 * 1024 ** 3)\nprint('allocated')\n", limits=LIMITS)
    assert result.status == MEMORY and "allocated" not in result.stdout
    caught = ("import sys\ntry:\n    x = bytearray(8 * 1024 ** 3)\nexcept MemoryError as e:\n"
              "    print(repr(e), file=sys.stderr)\nprint('fine')\n")
    result = run_python(caught, limits=LIMITS)  # caught, and the program went on: it ran fine
    assert (result.status, result.stdout, "MemoryError" in result.stderr) == (OK, "fine\n", True)


@needs_namespaces
def test_the_program_cannot_read_the_runs_files(tmp_path):
    secret = tmp_path / "checkpoint.safetensors"
    secret.write_text("the run's weights")
    result = run_python(f"print(open({str(secret)!r}).read())\n", limits=LIMITS)
    assert "the run's weights" not in result.stdout and "FileNotFoundError" in result.stderr


@needs_namespaces
@pytest.mark.parametrize("target", [os.path.join(sys.base_prefix, "distflow-escaped.txt"), "/usr/distflow-escaped.txt"])
def test_the_root_it_sees_is_read_only(target):
    """Folders that exist both inside (bound from the host) and on the host: a write
    there is refused inside, and nothing appears on the host."""
    result = run_python(f"open({target!r}, 'w').write('out')\nprint('wrote')\n", limits=LIMITS)
    assert result.status != OK and "wrote" not in result.stdout
    assert "Read-only file system" in result.stderr
    assert not os.path.exists(target)


@needs_namespaces
def test_tmp_is_private_to_each_program():
    name = f"/tmp/distflow-private-{os.getpid()}.txt"
    wrote = run_python(f"open({name!r}, 'w').write('mine')\nprint(open({name!r}).read())\n", limits=LIMITS)
    assert (wrote.status, wrote.stdout) == (OK, "mine\n")  # its own /tmp is writable ...
    assert not os.path.exists(name)  # ... and not the host's
    again = run_python(f"import os\nprint(os.path.exists({name!r}))\n", limits=LIMITS)
    assert again.stdout == "False\n"  # nor the next program's


@needs_namespaces
def test_its_own_folder_is_writable():
    inside = run_python("open('notes.txt', 'w').write('x'); import os; print(os.getcwd(), os.listdir('.'))")
    assert inside.status == OK and "notes.txt" in inside.stdout


@needs_namespaces
def test_the_few_device_nodes_it_has_work():
    result = run_python("open('/dev/null', 'w').write('x')\nprint(len(open('/dev/urandom', 'rb').read(16)))\n",
                        limits=LIMITS)
    assert (result.status, result.stdout) == (OK, "16\n"), result.stderr


@needs_namespaces
def test_open_files_are_capped():
    result = run_python("files = [open(f'f{i}', 'w') for i in range(200)]\nprint('opened', len(files))\n",
                        limits=LIMITS)
    assert result.status != OK and "opened" not in result.stdout
    assert "Too many open files" in result.stderr


@needs_namespaces
def test_the_program_has_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                            "print('connected')\n", limits=LIMITS)
        assert result.status != OK and "connected" not in result.stdout
        assert "Network is unreachable" in result.stderr
        with pytest.raises(socket.timeout):
            server.accept()  # nothing ever reached the test's server
    finally:
        server.close()


@needs_namespaces
def test_output_over_the_file_size_limit_fails_inside_the_program():
    """Measured by the program itself (our reader stops at the limit, so the length of
    what we read proves nothing): a 3 MiB write against a 1 MiB cap fails there."""
    result = run_python("import sys\ntry:\n    sys.stdout.write('x' * (3 << 20)); sys.stdout.flush()\n"
                        "    sys.stderr.write('WROTE-ALL')\nexcept OSError as e:\n    sys.stderr.write(str(e))\n",
                        limits=LIMITS)
    assert "WROTE-ALL" not in result.stderr and "File too large" in result.stderr


def test_the_limits_only_mode_refuses_sockets_and_writes_outside_at_the_python_level(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "_ISOLATION", ["limits"])
    net = run_python("import socket\nsocket.socket().connect(('127.0.0.1', 9))\n", limits=LIMITS)
    assert net.status != OK and "socket" in net.stderr and "not allowed" in net.stderr
    write = run_python(f"open({str(tmp_path / 'escaped.txt')!r}, 'w').write('x')\n", limits=LIMITS)
    assert write.status != OK and not (tmp_path / "escaped.txt").exists()
    assert run_python("while True:\n    pass\n", limits=LIMITS).status == TIMEOUT
    assert run_python("x = bytearray(8 * 1024 ** 3)\n", limits=LIMITS).status == MEMORY
    assert run_python(GOOD, "4 5\n").stdout == "9\n"
    signals = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", limits=LIMITS)
    assert signals.status == ERROR and "os.kill is not allowed" in signals.stderr
    # past the guard (ctypes), a program that kills its launcher is killed: the scoring went down with it
    killer = run_python("import ctypes, os\nctypes.CDLL(None).kill(os.getppid(), 9)\nimport time\ntime.sleep(5)\n",
                        limits=LIMITS)
    assert killer.status == KILLED and killer.returncode == -9


# own-uid mode runs Python as the program's uid, so that Python must be readable to anyone: this
# machine's (under /root, 0700) is not, the system's is, as in the containers the mode is for
SYSTEM_PYTHON = "/usr/bin/python3"
OWN_UID_SCRIPT = """
import ctypes, json, os, sys, time
from distflow.engines import sandbox
from distflow.engines.sandbox import Limits, run_python
secret, limits = sys.argv[1], Limits(time_s=1.0, memory_mb=256, processes=16, file_mb=1)
out = {"mode": sandbox.isolation(), "pid": os.getpid()}  # found by the probe, capped by DISTFLOW_SANDBOX
out["uid"] = int(run_python("import os\\nprint(os.getuid())").stdout)
# past the audit hook (ctypes), the kernel refuses: the file is root's, 0600
out["read"] = run_python(f"import ctypes\\nprint(ctypes.CDLL(None).open({secret!r}.encode(), 0))").stdout.strip()
out["write_own"] = run_python("open('out.txt', 'w').write('x')\\nprint(open('out.txt').read())").stdout.strip()
# the input file two folders up (another program's alike; the program may pass through, /tmp lists the names)
out["peek"] = run_python("import ctypes\\nprint(ctypes.CDLL(None).open(b'../../stdin', 0))").stdout.strip()
bomb = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n"
out["bomb"] = run_python(bomb, limits=limits).status
escape = ("import os, sys, time\\nchild = os.fork()\\nif child == 0:\\n    os.setsid()\\n    time.sleep(60)\\n"
          "    os._exit(0)\\nprint(child, flush=True)\\n")
out["escaped"] = int(run_python(escape, limits=limits).stdout)  # returned, its child in its own session
timed = run_python(escape + "time.sleep(60)\\n", limits=limits)  # cut by the wall clock
out["escaped_timed_out"], out["timed_out"] = int(timed.stdout), timed.status
out["good"] = run_python("print(sum(map(int, input().split())))", "2 3\\n").stdout.strip()
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs root and a system Python")
def test_own_uid_mode_as_root_without_namespaces_runs_the_program_as_its_uid_and_ends_what_it_leaves(tmp_path):
    """Root where namespaces cannot be made (DISTFLOW_SANDBOX=own-uid stands for that
    container): the program is an unused uid's, so the kernel keeps it from root's files
    where ctypes gets past the audit hook; its processes are capped; what it leaves
    running, in its own session too, ends with it."""
    import subprocess

    secret = tmp_path / "secret.txt"
    secret.write_text("the run's")
    secret.chmod(0o600)
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([SYSTEM_PYTHON, "-c", OWN_UID_SCRIPT, str(secret)], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo),
                                            "DISTFLOW_SANDBOX": "own-uid"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["mode"] == "own-uid" and out["uid"] in sandbox.sandbox_uids(out["pid"])
    assert out["read"] == "-1" and out["peek"] == "-1" and out["write_own"] == "x" and out["good"] == "5"
    assert out["bomb"] == TIMEOUT and out["timed_out"] == TIMEOUT
    for child in (out["escaped"], out["escaped_timed_out"]):
        assert _ended(child), child
    assert _no_sandbox_processes_left({out["pid"]})


def _reachable_by_others(path: str) -> bool:
    """Whether a uid other than the owner's can pass through every folder above `path`."""
    import stat

    folder = os.path.dirname(os.path.realpath(path))
    while True:
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return False
        if folder == "/":
            return True
        folder = os.path.dirname(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="own-uid mode is root's")
def test_own_uid_mode_is_taken_only_where_its_probe_program_ran(monkeypatch, capsys):
    """Its uid must reach this Python: under /root (0700, as here: pyenv) the probe's
    program failed to start, yet the mode was taken and every code reward scored 0."""
    monkeypatch.setattr(sandbox, "_ISOLATION", [])
    monkeypatch.setenv("DISTFLOW_SANDBOX", "own-uid")
    python = getattr(sys, "_base_executable", sys.executable)
    reachable = _reachable_by_others(python)
    assert sandbox.isolation() == ("own-uid" if reachable else "limits")
    if not reachable:
        assert "the code sandbox cannot use own-uid (PermissionError" in capsys.readouterr().err
        assert run_python(GOOD, "2 3\n").stdout == "5\n"  # the fallback runs programs


def test_an_unknown_sandbox_mode_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(sandbox, "_ISOLATION", [])
    monkeypatch.setenv("DISTFLOW_SANDBOX", "none")
    with pytest.raises(sandbox.SandboxError, match="DISTFLOW_SANDBOX='none': expected one of namespaces, own-uid, "
                                                   "limits"):
        sandbox.isolation()


@needs_namespaces
def test_hostile_programs_score_zero_through_the_reward_runner_and_scoring_goes_on(tmp_path):
    """The path a training run takes: the reward node calls RewardRunner, which calls the
    default reward in its child process, which runs each program in the sandbox."""
    hostile = {
        "loop": "while True:\n    pass\n",
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "allocation": "x = bytearray(8 * 1024 ** 3)\n",
        "write outside": f"open({str(tmp_path / 'escaped.txt')!r}, 'w').write('x')\n",
        "socket": "import socket\nsocket.create_connection(('198.18.0.1', 80), timeout=1)\n",
    }
    cases = json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"], "time_limit": 0.5, "memory_limit_mb": 256})
    runner = RewardRunner(None, timeout_s=30)
    try:
        # status 0 each time: the reward process never hung or died, so one process ran every program
        for name, program in hostile.items():
            assert runner("codecontests", f"```python\n{program}```", cases) == (0.0, 0), name
        assert runner("codecontests", f"```python\n{GOOD}```", cases) == (1.0, 0)
        spawners = {os.getpid(), *_children()}  # the reward process among them
    finally:
        runner.close()
    assert not (tmp_path / "escaped.txt").exists()
    assert _no_sandbox_processes_left(spawners)


def test_a_child_the_program_leaves_running_is_ended_with_it():
    """Without namespaces too (no root): a child the program forks and leaves behind is
    ended when the program returns (with them, the PID namespace's end ends it)."""
    forks = "import os, time\nchild = os.fork()\nif child == 0:\n    time.sleep(60)\n    os._exit(0)\nprint(child)\n"
    result = sandbox._run(forks, "", LIMITS, "limits")
    assert result.status == OK, result.stderr
    assert _ended(int(result.stdout))


@needs_namespaces
def test_no_two_processes_share_sandbox_uids():
    """pid % 100000 gave processes 100000 apart the same eight uids, and so one process cap."""
    ranges = [sandbox.sandbox_uids(pid) for pid in (7, 100_007, 4_194_303)]
    assert len({u for r in ranges for u in r}) == 24 and max(ranges[-1]) < 2 ** 31


def test_a_worker_killed_while_its_reward_process_runs_a_program_leaves_no_sandbox_or_folder_behind(tmp_path):
    """The worker is SIGKILLed while its reward process's sandbox runs a program that
    sleeps: the reward process exits (it watches its parent), the sandbox ends with it,
    and the sandbox's folder is removed."""
    import signal
    import subprocess
    import tempfile

    slow = json.dumps({"inputs": [""], "outputs": ["1\n"], "time_limit": 60})
    program = "```python\nimport time\ntime.sleep(60)\nprint(1)\n```"
    worker = subprocess.Popen([sys.executable, "-c", f"""
import threading, time
from distflow.engines.reward import RewardRunner
runner = RewardRunner(None, 3600.0)
runner("codecontests", "", {slow!r})  # the reward process is up
threading.Thread(target=runner, args=("codecontests", {program!r}, {slow!r}), daemon=True).start()
print(runner._proc.pid, flush=True)
time.sleep(3600)
"""], stdout=subprocess.PIPE, text=True)
    reward_pid = None
    try:
        reward_pid = int(worker.stdout.readline())
        folders = f"distflow-sandbox-{reward_pid}-*"
        deadline = time.monotonic() + 30
        while not list(Path(tempfile.gettempdir()).glob(folders)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(Path(tempfile.gettempdir()).glob(folders)), "the program never started"
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{reward_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _no_sandbox_processes_left({reward_pid})
        assert not list(Path(tempfile.gettempdir()).glob(folders))
    finally:
        worker.kill()
        worker.wait(10)
        if reward_pid is not None and Path(f"/proc/{reward_pid}").exists():
            os.kill(reward_pid, signal.SIGKILL)


def test_a_reward_call_cut_by_its_timeout_leaves_no_sandbox_or_folder_behind():
    """The reward process is killed while its code sandbox runs a program that sleeps (no
    CPU limit ends it): the sandbox ends with it and its folder goes. (A custom function
    calling the sandbox: the default reward would not start a test whose limit, 20 s, is
    beyond its call's.)"""
    import tempfile

    slow = json.dumps({"inputs": [""], "outputs": ["1\n"], "time_limit": 20})
    runner = RewardRunner("distflow.engines.sandbox:code_score", timeout_s=1.5)
    try:
        assert runner("codecontests", "", slow)[1] == 0  # the reward process is up (an empty program scores 0)
        reward_pid = runner._proc.pid
        assert runner("codecontests", "```python\nimport time\ntime.sleep(15)\nprint(1)\n```", slow) == (0.0, 2)
    finally:
        runner.close()
    assert _no_sandbox_processes_left({reward_pid})
    assert not list(Path(tempfile.gettempdir()).glob(f"distflow-sandbox-{reward_pid}-*"))


def test_a_code_sample_scores_the_tests_it_ran_within_the_reward_s_limit():
    """The default reward runs a code sample's tests one after another. A slow program was
    cut at reward.timeout_s and scored 0 as timed out, whatever it had passed; its tests now
    start only while their own limit fits in the call's, and it scores those it passed."""
    from distflow.engines.reward import FAILED, OK, RewardRunner

    slow = "```python\nimport time\ntime.sleep(1.2)\nprint(input())\n```"
    cases = json.dumps({"inputs": [f"{i}\n" for i in range(6)], "outputs": [str(i) for i in range(6)], "time_limit": 3})
    # 6 x 1.2 s of tests is more than 7 s; of the 6 s left for them, a test starts while 3 + 1 s fit: the first two
    runner = RewardRunner(None, timeout_s=7.0)
    try:
        assert runner("codecontests", slow, cases, {}) == (pytest.approx(2 / 6), OK)
        # a time limit that no test could run within is a failure that says so, not a score of 0
        assert runner("codecontests", slow, json.dumps({"inputs": ["1"], "outputs": ["1"], "time_limit": 9})) == \
            (0.0, FAILED)
    finally:
        runner.close()
