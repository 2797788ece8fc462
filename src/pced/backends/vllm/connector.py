"""pced's KV connector for vLLM: a PCED row's prefix and document come from the store's caches, so
vLLM prefills only the question.

vLLM loads it by module path (``store_kv.connector_config``) in every process that runs a scheduler
or a worker, and builds one instance per role (``distributed/kv_transfer/kv_connector/v1/base.py``,
``KVConnectorBase_V1``). Each request says which stored KV makes its first tokens
(``kv_transfer_params``, ``store_kv.StoreSpec``; vLLM hands a request's
``SamplingParams.extra_args["kv_transfer_params"]`` to the connector: ``v1/request.py:119-122``);
nothing else is shared with pced's process. A model whose KV the store cannot hold (latent
attention, recurrent layers) is refused when the connector is built (``store_kv.store_kv_support``).

Scheduler side: for a new request vLLM first finds its local prefix-cache hit, then asks the
connector for tokens beyond it, presenting the hit cut to a whole block
(``v1/core/sched/scheduler.py:969-1027``); hot documents thus still come from vLLM's prefix cache,
and the connector supplies the rest of prefix + document from the store. The count need not end on
a block: the scheduler adds it to the computed tokens as is and the KV-cache manager allocates for
the total (``scheduler.py:1044-1047``, ``v1/core/kv_cache_manager.py:481-486``), so the document's
last partial block is loaded, not recomputed.

Hybrid models (sliding-window and full-attention layers, e.g. Gemma 3) keep vLLM's hybrid KV cache
manager: the connector declares ``SupportsHMA`` (without it vLLM turns the manager off for any
connector: ``config/vllm.py:2170-2192``, and every sliding-window layer then holds every token:
``v1/core/kv_cache_utils.py:2173-2174``). Each KV cache group has its own blocks; a sliding-window
group's blocks before its window are vLLM's null block (id 0: ``v1/core/block_pool.py:184-188``,
``v1/core/single_type_kv_cache_manager.py:294-311``), whose tokens are not written (slot -1, which
every writer skips).

Worker side (``loader``): loads are synchronous, queued before the step's forward and waited for
layer by layer; each attention layer's keys and values are handed to the layer's own writer
(``kv_layout``), for the KV heads this tensor-parallel rank holds. A file that is missing or fails
its checks when loaded is reported as failed blocks, which vLLM recomputes
(``get_block_ids_with_load_errors``; ``store_kv.connector_config``'s failure policy).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)

from ...kv.segment import DocKV
from .kv_layout import rank_heads, segment_chunks, slots_of
from .loader import Job, LayerSlot, StoreLoader
from .store_files import StoreFiles
from .store_kv import SUPPLIED_KEY, StoreSpec, store_kv_support

log = logging.getLogger("pced.vllm")
NULL_BLOCK = 0  # vLLM's placeholder block (v1/core/block_pool.py:184-188): never written, never failed


@dataclass
class StoreLoad:
    """Tokens ``start..spec.tokens-1`` of one request, from the store, into its blocks (one list per
    KV cache group)."""

    request_id: str
    spec: StoreSpec
    start: int
    block_ids: list[list[int]]


@dataclass
class StoreLoads(KVConnectorMetadata):
    """One step's loads, scheduler -> workers (pickled across processes with the scheduler output)."""

    block_sizes: list[int]
    loads: list[StoreLoad] = field(default_factory=list)


def load_blocks(load: StoreLoad, block_sizes: list[int]) -> set[int]:
    """The blocks a load writes, over every group."""
    out = set()
    for ids, size in zip(load.block_ids, block_sizes):
        out.update(ids[load.start // size:(load.spec.tokens - 1) // size + 1])
    return out - {NULL_BLOCK}


class PCEDStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        model = getattr(vllm_config.model_config, "hf_config", None)
        allowed, reason = store_kv_support(vllm_config.model_config) if model is not None else (True, "")
        if not allowed:
            raise ValueError(reason)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        self.block_sizes = [g.kv_cache_spec.block_size for g in groups] or [vllm_config.cache_config.block_size]
        self._group_of = {name: i for i, g in enumerate(groups) for name in g.layer_names}
        self._planned: dict[str, StoreLoad] = {}  # scheduler: loads of the step being scheduled
        self._supplied: dict[str, int] = {}  # scheduler: tokens the store supplied, by request
        self._loaded: dict[str, list[tuple[set[int], int]]] = {}  # scheduler: each load's blocks and tokens
        self._layers: list[LayerSlot] = []  # worker
        self._loader: StoreLoader | None = None
        self._heads: slice | None = None
        self._failed_blocks: set[int] = set()
        self._files = StoreFiles()

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        spec = StoreSpec.from_params(request.kv_transfer_params)
        if spec is None or num_computed_tokens >= spec.tokens or not spec.available(request.prompt_token_ids):
            return 0, False
        return spec.tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        spec = StoreSpec.from_params(request.kv_transfer_params)
        # the scheduler loads exactly what get_num_new_matched_tokens offered, ending at spec.tokens
        load = StoreLoad(request.request_id, spec, spec.tokens - num_external_tokens,
                         [list(ids) for ids in blocks.get_block_ids()])
        self._planned[request.request_id] = load
        self._supplied[request.request_id] = self._supplied.get(request.request_id, 0) + num_external_tokens
        self._loaded.setdefault(request.request_id, []).append((load_blocks(load, self.block_sizes),
                                                                num_external_tokens))

    def build_connector_meta(self, scheduler_output) -> StoreLoads:
        meta = StoreLoads(self.block_sizes, list(self._planned.values()))
        self._planned.clear()
        return meta

    def update_connector_output(self, connector_output) -> None:
        """A load the workers could not make (its blocks reported invalid) supplied nothing: vLLM
        recomputes those tokens (``scheduler.py:3356-3430``), and the count says so."""
        failed = connector_output.invalid_block_ids
        if not failed:
            return
        for request_id, loads in self._loaded.items():
            for blocks, tokens in loads:
                if blocks & failed:
                    self._supplied[request_id] -= tokens
                    blocks.clear()  # counted once

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self._loaded.pop(request.request_id, None)
        supplied = self._supplied.pop(request.request_id, 0)
        if StoreSpec.from_params(request.kv_transfer_params) is None:
            return False, None
        return False, {SUPPLIED_KEY: supplied}  # reaches the caller in RequestOutput.kv_transfer_params

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self.request_finished(request, block_ids)  # nothing is sent: no block is held back

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.model_executor.models.utils import extract_layer_index

        context = self._vllm_config.compilation_config.static_forward_context
        layers = []
        for name in kv_caches:
            layer = context.get(name)
            if layer is None or getattr(layer, "kv_sharing_target_layer_name", None):
                continue  # a layer reusing another's cache gets it through that layer
            backend = layer.attn_backend
            if backend.forward_includes_kv_cache_update or not hasattr(layer.impl, "do_kv_cache_update"):
                raise ValueError(f"pced's store connector writes through the attention backend's own KV writer; "
                                 f"{backend.get_name()} has none")
            layers.append(LayerSlot(extract_layer_index(name), name, layer, self._group_of.get(name, 0)))
        self._tp = (get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())
        self._layers = layers
        self._dtype = self._vllm_config.model_config.dtype  # what the forward hands the writer

    @property
    def loader(self) -> StoreLoader:
        if self._loader is None:  # built at the first load: the rank's heads come from the store's caches
            self._loader = StoreLoader(self._layers, self._heads, self._dtype)
        return self._loader

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StoreLoads) or not meta.loads:
            return
        chunks, slots, blocks = [], [[] for _ in meta.block_sizes], set()
        for load in meta.loads:
            try:
                segments = self._files.segments(load.spec)
                self._check(segments, load)
            except Exception as exc:  # a file gone or damaged: vLLM recomputes those tokens
                log.warning("pced store connector: %s; vLLM recomputes these tokens", exc)
                self._failed_blocks.update(load_blocks(load, meta.block_sizes))
                continue
            chunks += segment_chunks(segments, load.start, load.spec.tokens)
            for group, (ids, size) in enumerate(zip(load.block_ids, meta.block_sizes)):
                slots[group].append(slots_of(ids, size, load.start, load.spec.tokens, skip=NULL_BLOCK))
            blocks |= load_blocks(load, meta.block_sizes)
        if chunks:
            self.loader.start(Job(chunks, [torch.cat(s) for s in slots], blocks))

    def _check(self, segments: list[DocKV], load: StoreLoad) -> None:
        prefix = segments[0]
        layers, heads = prefix.keys.shape[0], prefix.keys.shape[1]
        if sum(s.n_tokens for s in segments) != load.spec.tokens or prefix.n_tokens != load.spec.prefix_tokens:
            raise ValueError(f"the stored caches of {load.spec.document_path or load.spec.prefix_path} hold "
                             f"{sum(s.n_tokens for s in segments)} tokens, the request expects {load.spec.tokens}")
        if self._heads is None:
            self._heads = rank_heads(heads, *self._tp)
        local = self._heads.stop - self._heads.start
        for slot in self._layers:
            if slot.index >= layers or slot.layer.impl.num_kv_heads != local or self._heads.stop > heads:
                raise ValueError(f"the store's caches ({layers} layers, {heads} KV heads) do not fit this engine's "
                                 f"layer {slot.index} ({slot.layer.impl.num_kv_heads} KV heads on this rank)")

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._loader is not None:
            self._loader.wait(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # the store is written by pced index, never by the engine

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        if self._loader is not None:
            failed |= self._loader.finish()
        return failed

