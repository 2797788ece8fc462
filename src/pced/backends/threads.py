"""CPU threads an engine computes with: the cores this process may run on, and the most threads a
setting may ask for. Past a few threads a CPU, torch's OpenMP pool and llama.cpp only wait for
each other (docs/performance.md, "Threads"), and a count in the millions makes the pool itself
fail mid-run; such a count is refused in one line before anything starts."""

from __future__ import annotations

import os

from ..errors import UserError

# Threads a CPU may be given: room for SMT siblings and deliberate oversubscription, far below what
# exhausts a process's threads.
THREADS_PER_CPU = 4


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_threads() -> int:
    """The most threads a setting may ask for: ``THREADS_PER_CPU`` for each CPU of the machine (all
    of them, so that a narrowed affinity mask does not refuse what the machine can run)."""
    return THREADS_PER_CPU * max(os.cpu_count() or 1, available_cores())


def check_thread_count(threads: int, name: str) -> int:
    """``threads`` if it lies between 1 and ``max_threads()``; a one-line UserError naming the setting otherwise."""
    if threads < 1:
        raise UserError(f"{name} must be at least 1, got {threads}")
    if threads > max_threads():
        raise UserError(f"{name} must be at most {max_threads()} ({THREADS_PER_CPU} for each of this machine's "
                        f"{max_threads() // THREADS_PER_CPU} CPUs), got {threads}")
    return threads


__all__ = ["THREADS_PER_CPU", "available_cores", "check_thread_count", "max_threads"]
