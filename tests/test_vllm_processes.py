"""Which of a vLLM engine's processes died and how, said in one line (``pced.backends.vllm.processes``),
on stand-in processes titled as vLLM titles its own: no engine starts here."""

import os
import signal
import subprocess
import time

import pytest

from pced.backends.vllm.processes import EngineProcesses, oom_kill_count

ADVICE = "lower --kv-cache-gb"


def titled_grandchild(title: str) -> tuple[subprocess.Popen, int]:
    """A process titled ``title`` whose parent is a shell of ours (as a rank is the engine core's child)."""
    shell = subprocess.Popen(["bash", "-c", f"(exec -a {title} sleep 60) & echo $!; wait $!; sleep 5"],
                             stdout=subprocess.PIPE, text=True)
    pid = int(shell.stdout.readline())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not open(f"/proc/{pid}/cmdline").read().startswith(title):
        time.sleep(0.01)
    return shell, pid


def dead(processes: EngineProcesses) -> str | None:
    """The line once a process is found gone (the kernel delivers the signal in its own time)."""
    deadline = time.monotonic() + 10
    while (line := processes.death(ADVICE)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return line


def test_a_killed_rank_is_named_with_its_signal_and_whether_memory_ran_out():
    shell, pid = titled_grandchild("VLLM::Worker_TP1")
    try:
        processes = EngineProcesses.find()
        assert [(p.pid, p.role) for p in processes.processes] == [(pid, "rank 1")]
        assert processes.death(ADVICE) is None  # all still run
        os.kill(pid, signal.SIGKILL)
        line = dead(processes)
        if line.endswith(" exited"):
            pytest.skip("this kernel keeps no exit status of another's child (PIDFD_GET_INFO: Linux 6.15)")
        assert line.startswith(f"its rank 1 (pid {pid}) was killed by SIGKILL"), line
        if oom_kill_count() is not None:  # nothing was killed for memory here, and the cgroup's count says so
            assert line.endswith("not sent by the kernel's out-of-memory killer (its count in pced's memory cgroup is "
                                 "unchanged)"), line
        else:
            assert line.endswith(f"if memory ran out, {ADVICE}"), line
    finally:
        shell.kill()
        shell.wait()
        processes.close()


def test_a_rank_that_exits_is_said_with_its_status_and_no_memory_advice():
    shell = subprocess.Popen(["bash", "-c", "(exec -a VLLM::Worker sleep 0.5) & echo $!; wait $!; sleep 5"],
                             stdout=subprocess.PIPE, text=True)
    pid = int(shell.stdout.readline())
    try:
        time.sleep(0.1)
        processes = EngineProcesses.find()
        assert [p.role for p in processes.processes] == ["rank 0"]  # one rank: vLLM titles it Worker alone
        line = dead(processes)
        assert line.startswith(f"its rank 0 (pid {pid}) "), line
        assert ADVICE not in line
    finally:
        shell.kill()
        shell.wait()
        processes.close()
