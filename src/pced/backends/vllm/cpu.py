"""Tensor parallelism on vLLM's CPU build: where each rank's threads run.

Left to itself (``VLLM_CPU_OMP_THREADS_BIND=auto``), the CPU build gives every rank the CPUs of a
NUMA node of its own and refuses to start with more ranks than nodes
(``vllm/utils/ompmultiprocessing.py:216-223``); a laptop or a small VM has one node. The explicit
form of the same variable is one CPU list per rank, ``"0|1"`` (``:152-170``; each rank's OpenMP
threads are pinned to its list, ``:70-102``). ``bind_threads`` writes that form for a machine with
fewer nodes than ranks, unless the variable is set: equal, contiguous shares of the CPUs this
process may use, so ranks never share a core when there are enough of them.
"""

from __future__ import annotations

import os

BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_shares(cpus: list[int], ranks: int) -> str:
    """One CPU list per rank, ``|``-separated: equal contiguous shares (the remainder unused), or,
    with fewer CPUs than ranks, one CPU each, taken in turn."""
    if len(cpus) >= ranks:
        size = len(cpus) // ranks
        return "|".join(",".join(map(str, cpus[r * size:(r + 1) * size])) for r in range(ranks))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))


def bind_threads(tensor_parallel_size: int) -> None:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` for a tensor-parallel engine on the CPU build, when the
    machine has fewer NUMA nodes than ranks and the variable is not set. Read by vLLM's engine
    process when it starts the workers, so this runs before the engine starts."""
    if tensor_parallel_size < 2 or BIND in os.environ:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) < tensor_parallel_size:
        os.environ[BIND] = cpu_shares(sorted(os.sched_getaffinity(0)), tensor_parallel_size)
