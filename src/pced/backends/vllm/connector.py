"""pced's KV connector for vLLM: a PCED row's prefix and document come from the store's caches, so
vLLM prefills only the question.

vLLM loads it by module path (``store_kv.connector_config``) in every process that runs a scheduler
or a worker, and builds one instance per role (``distributed/kv_transfer/kv_connector/v1/base.py``,
``KVConnectorBase_V1``). Each request says which stored KV makes its first tokens
(``kv_transfer_params``, ``store_kv.StoreSpec``; vLLM hands a request's
``SamplingParams.extra_args["kv_transfer_params"]`` to the connector: ``v1/request.py:119-122``);
nothing else is shared with pced's process.

Scheduler side: for a new request vLLM first finds its local prefix-cache hit, then asks the
connector for tokens beyond it, presenting the hit cut to a whole block
(``v1/core/sched/scheduler.py:969-1027``); hot documents thus still come from vLLM's prefix cache,
and the connector supplies the rest of prefix + document from the store. The count need not end on
a block: the scheduler adds it to the computed tokens as is and the KV-cache manager allocates for
the total (``scheduler.py:1044-1047``, ``v1/core/kv_cache_manager.py:481-486``), so the document's
last partial block is loaded, not recomputed. Loads are synchronous (vLLM runs them before the
step's forward: ``v1/worker/kv_connector_model_runner_mixin.py:79-84``, after the step's new blocks
were zeroed: ``v1/worker/gpu_model_runner.py:1199-1202``, ``:3979``, ``:4202``).

Worker side: each attention layer's keys and values are handed to the layer's own writer
(``kv_layout``), for the KV heads this tensor-parallel rank holds. A file that is missing or fails
its checks when loaded is reported as failed blocks, which vLLM recomputes
(``get_block_ids_with_load_errors``; ``store_kv.connector_config``'s failure policy).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from ...kv.format import check_cache_file
from ...kv.segment import DocKV
from .kv_layout import check_writer_rows, prompt_rows, rank_heads, slots_of
from .store_kv import SUPPLIED_KEY, StoreSpec

log = logging.getLogger("pced.vllm")


@dataclass
class StoreLoad:
    """Tokens ``start..end-1`` of one request, from the store, into its blocks."""

    request_id: str
    spec: StoreSpec
    start: int
    block_ids: list[int]


@dataclass
class StoreLoads(KVConnectorMetadata):
    """One step's loads, scheduler -> workers (pickled across processes with the scheduler output)."""

    block_size: int
    loads: list[StoreLoad] = field(default_factory=list)


class PCEDStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("pced's store connector needs one KV cache group (one attention type for every layer)")
        self.block_size = vllm_config.cache_config.block_size
        self._planned: dict[str, StoreLoad] = {}  # scheduler: loads of the step being scheduled
        self._supplied: dict[str, int] = {}  # scheduler: tokens the store supplied, by request
        self._loaded: dict[str, list[tuple[set[int], int]]] = {}  # scheduler: each load's blocks and tokens
        self._layers: list[tuple[int, Any]] = []  # worker: (layer index, attention layer)
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
        (block_ids,) = blocks.get_block_ids()
        # the scheduler loads exactly what get_num_new_matched_tokens offered, ending at spec.tokens
        self._planned[request.request_id] = StoreLoad(request.request_id, spec, spec.tokens - num_external_tokens,
                                                      list(block_ids))
        self._supplied[request.request_id] = self._supplied.get(request.request_id, 0) + num_external_tokens
        first, last = (spec.tokens - num_external_tokens) // self.block_size, (spec.tokens - 1) // self.block_size
        self._loaded.setdefault(request.request_id, []).append((set(block_ids[first:last + 1]), num_external_tokens))

    def build_connector_meta(self, scheduler_output) -> StoreLoads:
        meta = StoreLoads(self.block_size, list(self._planned.values()))
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

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.model_executor.models.utils import extract_layer_index

        context = self._vllm_config.compilation_config.static_forward_context
        self._layers = []
        for name in kv_caches:
            layer = context.get(name)
            if layer is None or getattr(layer, "kv_sharing_target_layer_name", None):
                continue  # a layer reusing another's cache gets it through that layer
            backend = layer.attn_backend
            if backend.forward_includes_kv_cache_update or not hasattr(layer.impl, "do_kv_cache_update"):
                raise ValueError(f"pced's store connector writes through the attention backend's own KV writer; "
                                 f"{backend.get_name()} has none")
            self._layers.append((extract_layer_index(name), layer))
        self._tp = (get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())
        self._dtype = self._vllm_config.model_config.dtype  # what the forward hands the writer

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StoreLoads) or not meta.loads:
            return
        ready = []
        for load in meta.loads:
            try:
                segments = self._files.segments(load.spec)
                self._check(segments, load)
            except Exception as exc:  # a file gone or damaged: vLLM recomputes those tokens
                log.warning("pced store connector: %s; vLLM recomputes these tokens", exc)
                self._failed_blocks.update(load.block_ids[load.start // meta.block_size:
                                                          (load.spec.tokens - 1) // meta.block_size + 1])
                continue
            ready.append((load, segments, slots_of(load.block_ids, meta.block_size, load.start, load.spec.tokens)))
        if not ready:
            return
        slots = torch.cat([s for _, _, s in ready])
        for index, layer in self._layers:
            rows = [prompt_rows(segments, index, self._heads, load.start, load.spec.tokens, self._dtype)
                    for load, segments, _ in ready]
            keys = torch.cat([k for k, _ in rows]) if len(rows) > 1 else rows[0][0]
            values = torch.cat([v for _, v in rows]) if len(rows) > 1 else rows[0][1]
            device = layer.kv_cache.device
            keys, values = keys.to(device), values.to(device)
            check_writer_rows(keys, values, len(slots), layer.impl.num_kv_heads, layer.impl.head_size)
            layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots.to(device))

    def _check(self, segments: list[DocKV], load: StoreLoad) -> None:
        prefix = segments[0]
        layers, heads = prefix.keys.shape[0], prefix.keys.shape[1]
        if sum(s.n_tokens for s in segments) != load.spec.tokens or prefix.n_tokens != load.spec.prefix_tokens:
            raise ValueError(f"the stored caches of {load.spec.document_path or load.spec.prefix_path} hold "
                             f"{sum(s.n_tokens for s in segments)} tokens, the request expects {load.spec.tokens}")
        if self._heads is None:
            self._heads = rank_heads(heads, *self._tp)
        local = self._heads.stop - self._heads.start
        for index, layer in self._layers:
            if index >= layers or layer.impl.num_kv_heads != local or self._heads.stop > heads:
                raise ValueError(f"the store's caches ({layers} layers, {heads} KV heads) do not fit this engine's "
                                 f"layer {index} ({layer.impl.num_kv_heads} KV heads on this rank)")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load finished in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # the store is written by pced index, never by the engine

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


class StoreFiles:
    """A store's files as a worker reads them: the manifest's identity and the prefix once per
    directory (again when the file changes), a document's cache each time it is loaded (memory-
    mapped; its checksum verified once per file per process: ``kv.format.VERIFIED``)."""

    def __init__(self) -> None:
        self._identity: dict[tuple, dict] = {}
        self._prefix: dict[tuple, DocKV] = {}

    @staticmethod
    def _key(path: Path) -> tuple:
        stat = os.stat(path)
        return (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def identity(self, kv_dir: str) -> dict:
        manifest = Path(kv_dir) / "kvstore.json"
        key = self._key(manifest)
        if key not in self._identity:
            identity = json.loads(manifest.read_text())
            self._identity[key] = {k: v for k, v in identity.items() if k != "model"}  # recorded, not checked
        return self._identity[key]

    def segments(self, spec: StoreSpec) -> list[DocKV]:
        identity = self.identity(spec.kv_dir)
        key = self._key(spec.prefix_path)
        if key not in self._prefix:
            self._prefix[key] = check_cache_file(spec.prefix_path, identity, "prefix", spec.prefix_tokens, "once")[0]
        if spec.document_path is None:
            return [self._prefix[key]]
        document = check_cache_file(spec.document_path, identity, spec.digest, spec.tokens - spec.prefix_tokens, "once")[0]
        return [self._prefix[key], document]
