"""The processes of a running vLLM engine: which is which, what memory each holds, and how one ended.

vLLM runs an engine core process and one worker process per rank (the CPU build's ``mp``
executor, even for one rank: ``platforms/cpu.py:333-341``), started with ``spawn`` from pced's
process and from the engine core. Each names itself with ``setproctitle``: ``VLLM::EngineCore``
(``v1/engine/core.py:1411``), ``VLLM::Worker`` for one rank and ``VLLM::Worker_TP<r>`` for rank r
of several (``v1/executor/multiproc_executor.py:1074-1102``), which is how they are told apart here.

When the engine dies, ``death()`` says in one line which of them is gone and how: the signal that
ended it, read from a pidfd opened while it ran (``PIDFD_GET_INFO``, Linux 6.15 and later; on an
older kernel from ``/proc/<pid>/stat`` while it is a zombie, else unknown), and whether the
kernel's out-of-memory killer killed it: the ``oom_kill`` count of pced's memory cgroup
(``memory.events`` on cgroup v2, ``memory.oom_control`` on v1, both counting global and cgroup
OOM kills of the cgroup's processes), and the kernel log where it is readable.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30
TITLE = re.compile(r"^VLLM::(EngineCore|Worker(?:_TP(\d+))?)\b")
# struct pidfd_info of include/uapi/linux/pidfd.h as first published (PIDFD_INFO_SIZE_VER0: 64 bytes):
# mask, cgroupid, 11 ids, exit_code; PIDFD_GET_INFO = _IOWR(0xFF, 11, struct pidfd_info)
PIDFD_INFO = struct.Struct("=QQ11Ii")
PIDFD_GET_INFO = (3 << 30) | (PIDFD_INFO.size << 16) | (0xFF << 8) | 11
PIDFD_INFO_EXIT = 1 << 3
EXIT_WAIT_S = 2.0  # how long death() waits for the engine core to reap a dead worker


@dataclass
class EngineProcess:
    pid: int
    role: str  # "engine core" or "rank <r>"
    created: float
    pidfd: int | None = None

    def alive(self) -> bool:
        try:
            import psutil

            process = psutil.Process(self.pid)
            return process.create_time() == self.created and process.status() != psutil.STATUS_ZOMBIE
        except Exception:  # gone, or no longer ours to read
            return False

    def rss(self) -> int:
        try:
            import psutil

            return psutil.Process(self.pid).memory_info().rss
        except Exception:
            return 0

    def exit_status(self) -> int | None:
        """Its wait status (as ``os.waitpid`` gives it) once it has ended, where the kernel says."""
        if self.pidfd is not None:
            try:
                buffer = bytearray(PIDFD_INFO.size)
                struct.pack_into("=Q", buffer, 0, PIDFD_INFO_EXIT)
                fcntl.ioctl(self.pidfd, PIDFD_GET_INFO, buffer)
                values = PIDFD_INFO.unpack(buffer)
                if values[0] & PIDFD_INFO_EXIT:
                    return values[-1]
            except OSError:  # ESRCH: not reaped yet; ENOTTY/EINVAL: a kernel before 6.15
                pass
        try:  # a zombie's status, field 52 (after the command's closing parenthesis: field 3 is the first)
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[49]) if fields[0] == "Z" else None
        except (OSError, IndexError, ValueError):
            return None


@dataclass
class EngineProcesses:
    """The engine's processes, found once it has started (``find``)."""

    processes: list[EngineProcess] = field(default_factory=list)
    oom_kills: int | None = None  # the cgroup's count when the engine had started

    @classmethod
    def find(cls, cores: list[int] | None = None, watch: bool = True) -> "EngineProcesses":
        """The engine processes among this process's descendants, or, given ``cores`` (engine core
        pids), that engine's own: its cores and their workers. ``watch``: open a pidfd on each, to
        read how it ended (``close`` releases them)."""
        import psutil

        found = []
        if cores is None:
            candidates = psutil.Process().children(recursive=True)
        else:
            candidates = []
            for pid in cores:
                try:
                    core = psutil.Process(pid)
                    candidates += [core, *core.children(recursive=True)]
                except psutil.Error:
                    continue
        for process in candidates:
            try:
                match = TITLE.match(" ".join(process.cmdline()))
                if match is None:
                    continue
                role = "engine core" if match.group(1) == "EngineCore" else f"rank {int(match.group(2) or 0)}"
                found.append(EngineProcess(process.pid, role, process.create_time(), _pidfd(process.pid) if watch else None))
            except psutil.Error:
                continue
        found.sort(key=lambda p: (p.role != "engine core", len(p.role), p.role))
        return cls(found, oom_kill_count() if watch else None)

    def close(self) -> None:
        for process in self.processes:
            if process.pidfd is not None:
                os.close(process.pidfd)
                process.pidfd = None

    def memory(self) -> dict[str, int]:
        """Resident bytes of each process, by role."""
        return {p.role: p.rss() for p in self.processes}

    def death(self, advice: str) -> str | None:
        """One line on the first of the engine's processes found gone: its role, pid, the signal that
        ended it, and whether the kernel's OOM killer did it (then ``advice``: what to lower); None when
        all still run."""
        gone = [p for p in self.processes if not p.alive()]
        if not gone:
            return None
        # a worker's death takes its engine core down after it: blame the worker
        dead = next((p for p in gone if p.role != "engine core"), gone[0])
        status, deadline = dead.exit_status(), time.monotonic() + EXIT_WAIT_S
        while status is None and time.monotonic() < deadline:  # its parent reaps it within moments
            time.sleep(0.05)
            status = dead.exit_status()
        how = ("exited" if status is None else f"was killed by {signal_name(os.WTERMSIG(status))}"
               if os.WIFSIGNALED(status) else f"exited with status {os.WEXITSTATUS(status)}")
        what = f"its {dead.role} (pid {dead.pid}) {how}"
        killed = status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not killed and status is not None:
            return what
        oom = self.oom_killed(dead.pid)
        if oom is True:
            return f"{what}, sent by the kernel's out-of-memory killer: {advice}"
        if oom is False:
            return f"{what}, not sent by the kernel's out-of-memory killer (its count in pced's memory cgroup is unchanged)"
        return f"{what}; SIGKILL is what the kernel's out-of-memory killer sends: if memory ran out, {advice}"

    def oom_killed(self, pid: int) -> bool | None:
        """Whether the kernel's OOM killer killed ``pid`` (None: not readable here)."""
        log = kernel_log()
        if log is not None and re.search(rf"Killed process {pid}\b", log):
            return True
        now = oom_kill_count()
        if now is not None and self.oom_kills is not None:
            return now > self.oom_kills
        return None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def engine_cores(llm) -> list[int]:
    """The pids of a ``vllm.LLM``'s engine core processes, from its client's process manager
    (``CoreEngineProcManager.processes``: v1/engine/utils.py:273; core_client.py:494, :686)."""
    resources = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", []) if p.pid is not None]


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def oom_kill_count() -> int | None:
    """The ``oom_kill`` count of this process's memory cgroup (v2, else v1), or None where unreadable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidate = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            candidate = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        try:
            match = re.search(r"^oom_kill (\d+)$", candidate.read_text(), re.MULTILINE)
        except OSError:
            continue
        if match:
            return int(match.group(1))
    return None


def kernel_log() -> str | None:
    """The kernel's ring buffer where this process may read it (``dmesg``), else None."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None
