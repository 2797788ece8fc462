"""How many CPU threads torch uses for one answer (``--threads``).

Measured with ``experiments/threads_bench.py`` (docs/performance.md, "Threads"): see ``default_threads`` for the
rule and the numbers behind it. The library itself never changes torch's setting; the CLI and
``pced serve`` do, once, before loading a model.
"""

from __future__ import annotations

from ..backends.threads import available_cores, check_thread_count


def default_threads() -> int:
    """The default for ``--threads``: half the available cores (at least one).

    Measured here (2 cores, ``pced demo``, one run each): alone, 1 thread took 20.3 s and 2 threads
    19.2 s; beside one busy core, 1 thread took 22.6 s and 2 threads 45.1 s (OpenMP's threads wait
    for each other at every operation, and one of them keeps losing its core). Half the cores loses
    ~5% on an idle machine and avoids the 2x collapse on a shared one; pass --threads to use more."""
    return max(1, available_cores() // 2)


def check_threads(threads: int | None) -> int:
    """``--threads`` checked, between 1 and ``max_threads()`` (None: ``default_threads()``)."""
    return default_threads() if threads is None else check_thread_count(threads, "--threads")


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (None: ``default_threads()``); returns the number set."""
    import torch

    threads = check_threads(threads)
    torch.set_num_threads(threads)
    return threads
