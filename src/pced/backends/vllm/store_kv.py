"""What a vLLM engine needs to read a pced KV store through pced's connector (``connector.py``):
the engine's ``kv_transfer_config``, and each request's ``kv_transfer_params``. No vLLM import:
these are built in pced's process, the connector reads them wherever vLLM runs it.

A PCED row's prompt is exactly ``prefix + context(document) + suffix`` (``engine.group_prompts``),
and the store holds the KV of ``prefix`` (``prefix.safetensors``) and of ``context(document)`` after
it (``kv/<h[:2]>/<h>.safetensors``, h = ``content_hash(context_text)``). So a row's first
``P + L`` tokens can come from the store and vLLM computes only the question's suffix; the
amateur's first ``P`` (the prefix) likewise. A document the store does not hold (sent with the
request, or not encoded yet) is prefilled by vLLM as before; its row still takes the prefix.

Each request names its store directory, so one engine serves any number of stores (a server's
store and its request cache, replicas sharing a directory), and the connector needs no state
shared with pced's process: it runs where vLLM runs its scheduler and workers, in other
processes with the multiprocess engine.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

PARAMS_KEY = "pced_store"  # kv_transfer_params[PARAMS_KEY] = StoreSpec fields
SUPPLIED_KEY = "pced_store_tokens"  # in a finished request's kv_transfer_params: tokens the store supplied
CONNECTOR = "PCEDStoreConnector"
CONNECTOR_MODULE = "pced.backends.vllm.connector"


def connector_config() -> dict:
    """The ``kv_transfer_config`` that loads pced's connector by module path (no vLLM patch or
    registration: ``distributed/kv_transfer/kv_connector/factory.py:103-118``). It only reads
    (``kv_consumer``). A file that fails to load is recomputed by vLLM, not failed
    (``kv_load_failure_policy``, ``config/kv_transfer.py:88``; ``v1/core/sched/scheduler.py:3237-3354``)."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute"}


def ids_digest(token_ids: Sequence[int]) -> str:
    """A request's first tokens, hashed: the connector supplies KV only for exactly these tokens."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


@dataclass(frozen=True)
class StoreSpec:
    """Which stored KV makes a request's first ``tokens`` prompt tokens."""

    kv_dir: str  # the KV store directory (kvstore.json, prefix.safetensors, kv/)
    digest: str | None  # the document's cache (None: the prefix alone)
    prefix_tokens: int
    tokens: int  # prefix + document tokens
    ids: str  # ids_digest of the prompt's first ``tokens`` token ids

    def to_params(self) -> dict:
        return {PARAMS_KEY: asdict(self)}

    @classmethod
    def from_params(cls, params: dict | None) -> StoreSpec | None:
        spec = (params or {}).get(PARAMS_KEY)
        if not isinstance(spec, dict):
            return None
        try:
            return cls(str(spec["kv_dir"]), None if spec["digest"] is None else str(spec["digest"]),
                       int(spec["prefix_tokens"]), int(spec["tokens"]), str(spec["ids"]))
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def prefix_path(self) -> Path:
        return Path(self.kv_dir) / "prefix.safetensors"

    @property
    def document_path(self) -> Path | None:  # as pced.kv.store.KVStore.path_for
        return None if self.digest is None else Path(self.kv_dir) / "kv" / self.digest[:2] / f"{self.digest}.safetensors"

    def available(self, prompt_token_ids: Sequence[int]) -> bool:
        """The files are there and the prompt starts with the tokens they were made for."""
        if len(prompt_token_ids) <= self.tokens or not self.prefix_path.is_file():
            return False
        if self.document_path is not None and not self.document_path.is_file():
            return False
        return ids_digest(prompt_token_ids[: self.tokens]) == self.ids


def group_params(store, prompts: Sequence[list[int]], documents: Sequence[str | None]) -> list[dict]:
    """``kv_transfer_params`` for each prompt of a group (``documents[i]``: the text of prompt i's
    document, None for the amateur) from a ``pced.kv.store.KVStore``: the prefix and, where the
    store holds it, the document."""
    prefix = len(store.builder.prefix_ids)
    kv_dir = str(Path(store.root).resolve())
    out = []
    for prompt, document in zip(prompts, documents):
        digest = store.digests([document])[0] if document is not None else None
        if digest is not None and not store.has(digest):
            digest = None
        tokens = prefix + (len(store.builder.context_ids([document])) if digest is not None else 0)
        out.append(StoreSpec(kv_dir, digest, prefix, tokens, ids_digest(prompt[:tokens])).to_params())
    return out
