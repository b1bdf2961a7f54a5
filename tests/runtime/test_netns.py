"""The loopback-only network namespace that single-machine runs use."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from distflow.runtime import netns

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux namespaces")


def test_a_command_runs_in_a_namespace_whose_only_interface_is_an_up_loopback(tmp_path):
    out = tmp_path / "inside.json"
    probe = ("import json, os, socket, sys\n"
             "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
             "c = socket.create_connection(s.getsockname(), timeout=5)\n"  # the loopback is up
             "ifaces = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]\n"
             f"json.dump({{'ifaces': ifaces, 'netns': os.readlink('/proc/self/ns/net'), 'env': os.environ.get('{netns.ENV}'),"
             " 'uid': os.getuid()}, open(sys.argv[1], 'w'))\n"
             "sys.exit(3)\n")
    try:
        code = netns.run_in_loopback_namespace(["-c", probe, str(out)])
    except netns.NamespaceUnavailable:
        pytest.skip("this machine cannot make network namespaces")
    inside = json.loads(out.read_text())
    assert code == 3  # the command's own exit code comes back
    assert inside["ifaces"] == ["lo"] and inside["netns"] != os.readlink("/proc/self/ns/net")
    assert inside["env"] == "loopback" and inside["uid"] == os.getuid()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_the_run_in_the_namespace_ends_with_the_process_that_started_it(tmp_path, how):
    """`kill` of the command's process (SIGTERM: forwarded; SIGKILL: the run's parent-death
    signal) ends the run inside the namespace too; a run ended by a signal exits 128 + n."""
    import signal
    import time

    pid_file = tmp_path / "inside.pid"
    inner = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    waiter = subprocess.Popen([sys.executable, "-c",
                               "import sys\nfrom distflow.runtime import netns\n"
                               f"try:\n    sys.exit(netns.run_in_loopback_namespace(['-c', {inner!r}]))\n"
                               "except netns.NamespaceUnavailable:\n    sys.exit(77)\n"])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            if waiter.poll() == 77:
                pytest.skip("this machine cannot make network namespaces")
            assert time.monotonic() < deadline, "the command did not start in the namespace"
            time.sleep(0.1)
        inside = int(pid_file.read_text())
        waiter.send_signal(getattr(signal, how))
        code = waiter.wait(30)
        for _ in range(100):  # the run's process is gone (or a zombie until init reaps it)
            try:
                if "zombie" in open(f"/proc/{inside}/status").read():
                    break
            except FileNotFoundError:
                break
            time.sleep(0.1)
        else:
            os.kill(inside, signal.SIGKILL)
            pytest.fail("the run outlived the process that started it")
        if how == "SIGTERM":
            assert code == 128 + signal.SIGTERM  # the run's own end, as the shell reports a signal
    finally:
        if waiter.poll() is None:
            waiter.kill()


def test_network_host_and_a_bad_value_are_config_choices():
    from distflow.config import ConfigError, load_config

    assert load_config(None, ["runtime.network=host"]).runtime.network == "host"
    with pytest.raises(ConfigError, match="runtime.network"):
        load_config(None, ["runtime.network=lan"])


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and util-linux unshare")
def test_loopback_where_no_namespace_can_be_made_is_one_line_and_exit_2(tmp_path):
    """A user namespace whose network-namespace quota is 0: unshare(CLONE_NEWNET) fails
    there, as on a machine without the privilege."""
    script = ("echo 0 > /proc/sys/user/max_net_namespaces && "
              f"exec {sys.executable} -m distflow.cli train runtime.network=loopback")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(
        "distflow: error: runtime.network=loopback: this machine cannot make a network namespace (unshare: "), lines
    assert not (tmp_path / "runs").exists()
