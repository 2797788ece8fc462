"""What pced says while a vLLM engine starts (45-90 s on two cores: the engine core and each
worker start a Python process of their own, import vLLM and torch, then load the weights and size
the KV cache), and the engine's figures once it has: its KV cache and the memory it holds.

``StartProgress`` prints a line when it starts, one when the engine core's process has imported vLLM
(it then names itself ``VLLM::EngineCore``), one when the workers have too (``VLLM::Worker...``:
from there they load the weights and size the KV cache), and, while nothing changes, one every
``EVERY_S`` seconds with the memory the processes hold so far; each with the seconds since the
start. What vLLM does after loading the weights is said beforehand from the settings: on the CPU
build with no KV cache size given it runs a warm-up forward to measure memory
(``v1/worker/cpu_worker.py:191-207``); with ``enforce_eager`` off (CUDA's default) it compiles the
model and captures CUDA graphs.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

from .processes import GIB, TITLE, EngineProcess

EVERY_S = 15.0
POLL_S = 0.5


def say(line: str) -> None:
    print(f"pced: {line}", file=sys.stderr, flush=True)


def plan_line(model: str, engine_args: dict) -> str:
    """What the engine will do to start, from its arguments."""
    ranks = engine_args.get("tensor_parallel_size", 1)
    kv = engine_args.get("kv_cache_memory_bytes")
    sizing = (f"a KV cache of {kv * ranks / GIB:.2f} GiB" if kv is not None else
              f"its KV cache sized from {engine_args.get('gpu_memory_utilization')} of the memory a rank, measured "
              "with a warm-up forward")
    compiling = "no compilation" if engine_args.get("enforce_eager") else "compiling the model and capturing CUDA graphs"
    return (f"starting vLLM's engine for {model}: an engine core and {ranks} worker process(es) import vLLM, then load "
            f"the weights; {sizing}; {compiling}")


class StartProgress:
    """Prints the engine's start as it goes, from a thread of its own, until ``stop``."""

    def __init__(self, plan: str, ranks: int, out: Callable[[str], None] = say):
        self.out, self.ranks, self.started = out, ranks, time.perf_counter()
        self.earlier = set(vllm_processes())  # another engine's, already running in this process
        self._stopped = threading.Event()
        self.out(plan)
        self._thread = threading.Thread(target=self._watch, name="pced-vllm-start", daemon=True)
        self._thread.start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        said: set[str] = set()
        last = time.perf_counter()
        while not self._stopped.wait(POLL_S):
            mine = {pid: title for pid, title in vllm_processes().items() if pid not in self.earlier}
            titles = list(mine.values())
            if "EngineCore" in titles and "core" not in said:
                said.add("core")
                self.out(f"vLLM engine core started ({self.elapsed():.0f} s)")
                last = time.perf_counter()
            if sum(t.startswith("Worker") for t in titles) >= self.ranks and "workers" not in said:
                said.add("workers")
                self.out(f"vLLM's {self.ranks} worker process(es) started, loading the weights ({self.elapsed():.0f} s)")
                last = time.perf_counter()
            if time.perf_counter() - last >= EVERY_S:
                held = sum(EngineProcess(pid, title, 0.0).rss() for pid, title in mine.items())
                self.out(f"vLLM engine still starting ({self.elapsed():.0f} s; its processes hold {held / GIB:.2f} GiB)")
                last = time.perf_counter()


def vllm_processes() -> dict[int, str]:
    """This process's descendants that vLLM has titled, by pid (``EngineCore``, ``Worker_TP0``, ...)."""
    import psutil

    found = {}
    for process in psutil.Process().children(recursive=True):
        try:
            match = TITLE.match(" ".join(process.cmdline()))
        except psutil.Error:
            continue
        if match:
            found[process.pid] = match.group(0).split("::", 1)[1]
    return found


def kv_cache_figure(llm: Any) -> dict:
    """The KV cache vLLM allocated, as its engine core reported it back to pced's process
    (``cache_config.num_gpu_blocks``: v1/engine/core_client.py:851-855; ``block_size``: :857-860):
    blocks, tokens, and bytes for the whole engine (a block's keys and values of every layer and
    KV head, ``v1/kv_cache_interface.py:545-553``; None for a model with other than full
    attention, whose layers hold other amounts)."""
    from .fit import full_attention

    config = llm.llm_engine.vllm_config
    cache, model = config.cache_config, config.model_config
    blocks, block = int(cache.num_gpu_blocks or 0), int(cache.block_size)
    figure = {"blocks": blocks, "block_size": block, "tokens": blocks * block, "bytes": None}
    if full_attention(model.hf_text_config):
        import torch

        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

        dtype = model.dtype if cache.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
        per_token = (model.get_num_layers(config.parallel_config) * model.get_total_num_kv_heads() * 2
                     * model.get_head_size() * torch.tensor([], dtype=dtype).element_size())
        figure["bytes"] = blocks * block * per_token
    return figure


def ready_line(start_s: float, figure: dict, memory: dict[str, int]) -> str:
    """The engine's ready line: its KV cache (vLLM's figure) and the memory its processes hold."""
    size = f", {figure['bytes'] / GIB:.2f} GiB" if figure.get("bytes") else ""
    parts = ", ".join(f"{role} {held / GIB:.2f}" for role, held in memory.items())
    return (f"vLLM engine ready in {start_s:.1f} s: KV cache {figure['blocks']:,} blocks of {figure['block_size']} tokens "
            f"({figure['tokens']:,} tokens{size}); its processes hold {sum(memory.values()) / GIB:.2f} GiB resident "
            f"({parts})")
