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
from typing import Any, Sequence

import numpy as np

PARAMS_KEY = "pced_store"  # kv_transfer_params[PARAMS_KEY] = StoreSpec fields
SUPPLIED_KEY = "pced_store_tokens"  # in a finished request's kv_transfer_params: tokens the store supplied
CONNECTOR = "PCEDStoreConnector"
CONNECTOR_MODULE = "pced.backends.vllm.connector"
MULTI = "MultiConnector"  # vLLM's chain of connectors (distributed/kv_transfer/kv_connector/v1/multi_connector.py)


def connector_config() -> dict:
    """The ``kv_transfer_config`` that loads pced's connector by module path (no vLLM patch or
    registration: ``distributed/kv_transfer/kv_connector/factory.py:103-118``). It only reads
    (``kv_consumer``). A file that fails to load is recomputed by vLLM, not failed
    (``kv_load_failure_policy``, ``config/kv_transfer.py:88``; ``v1/core/sched/scheduler.py:3237-3354``)."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute"}


def tiered_config(front: dict) -> dict:
    """``front`` (a user's ``kv_transfer_config``: vLLM's ``OffloadingConnector``, LMCache, or a
    ``MultiConnector`` of them) with pced's connector after it, as vLLM's ``MultiConnector``: the hot
    tiers first, the store last (docs/vllm.md, "Deployment"). For each new request MultiConnector asks
    every child for tokens beyond the prefix-cache hit and the first that offers any loads them all
    (``multi_connector.py:434-453``); the others are told 0 (``:467-477``), so the store loads only
    what no tier before it holds. The failure policy is the scheduler's, read from the top-level
    config (``v1/core/sched/scheduler.py:183-184``): ``recompute`` unless ``front`` says otherwise, so
    a store file that fails is recomputed as with pced's connector alone."""
    if reads_store(front):
        return front
    if front.get("kv_connector") == MULTI:
        extra = dict(front.get("kv_connector_extra_config") or {})
        children, top = list(extra.get("connectors") or []), dict(front)
    else:
        extra, children, top = {}, [front], {"kv_connector": MULTI}
    roles = {child.get("kv_role") for child in children} | {top.get("kv_role")}
    top["kv_role"] = "kv_consumer" if roles <= {"kv_consumer", None} else "kv_both"  # pced's child only reads
    top["kv_load_failure_policy"] = front.get("kv_load_failure_policy", "recompute")
    top["kv_connector_extra_config"] = {**extra, "connectors": children + [connector_config()]}
    return top


def connector_names(kv_transfer_config: dict | None) -> set[str]:
    """The connectors an engine with this ``kv_transfer_config`` runs: the one it names, or a
    ``MultiConnector``'s children."""
    config = kv_transfer_config or {}
    if config.get("kv_connector") == MULTI:
        children = (config.get("kv_connector_extra_config") or {}).get("connectors") or []
        return set().union(*(connector_names(child) for child in children))
    return {config["kv_connector"]} if config.get("kv_connector") else set()


def reads_store(kv_transfer_config: dict | None) -> bool:
    """Whether an engine with this ``kv_transfer_config`` runs pced's connector, alone or as one of a
    ``MultiConnector``'s children; its requests then name the store's caches."""
    return CONNECTOR in connector_names(kv_transfer_config)


ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")  # layer kinds whose state is KV
RECURRENT_KEYS = ("ssm_state_size", "mamba_d_state", "linear_conv_kernel_dim")


def _read(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def store_kv_support(config: Any) -> tuple[bool, str]:
    """Whether pced's connector can load this model's KV from the store, and why not (one line), or a
    note on what it costs. ``config``: a transformers config, its ``config.json`` as a dict, or vLLM's
    ``ModelConfig``. Call it before an engine starts: with False, start the engine without the
    connector (vLLM's prefix cache still serves repeated documents); the connector itself raises the
    same reason when it is built for such a model.

    - Multi-head latent attention (DeepSeek V2/V3, Kimi K2, ...): vLLM's MLA backends cache one
      compressed latent and one RoPE key per token, written inside the attention's forward
      (``forward_includes_kv_cache_update`` is ``AttentionBackend``'s default ``True``,
      ``v1/attention/backend.py:70``, which no MLA backend overrides; the writer
      ``concat_and_cache_mla`` takes ``kv_c_normed`` and ``k_pe``: ``:1090-1110``,
      ``model_executor/layers/attention/mla_attention.py:769-803``). pced's store holds per-head keys and
      values, from which that latent cannot be recovered exactly: refused.
    - Recurrent layers (Mamba, linear attention): their state is not KV, and the store holds none: refused.
    - Sliding-window layers beside full-attention ones (Gemma 2 and 3): served. The connector supports
      vLLM's hybrid KV cache manager (``SupportsHMA``), so on a GPU a sliding-window layer keeps only its
      window's blocks (``v1/core/single_type_kv_cache_manager.py:294-311``). Without that support vLLM
      turns the manager off for the connector (``config/vllm.py:2170-2192``) and makes every
      sliding-window layer a full-attention one (``v1/core/kv_cache_utils.py:2173-2174``, ``:1799-1822``;
      the window still bounds their compute): they would hold every token, for Gemma 3 (five local
      layers in six, a 1024-token window) 6 x 32768 token-layers at 32k tokens instead of
      32768 + 5 x 1024, 5.2x the KV memory, so 5.2x fewer such sequences fit. vLLM's CPU build never
      runs the manager (``config/vllm.py:2145-2147``).
    """
    if getattr(config, "use_mla", False) is True:
        return False, _mla_refusal(config)
    text = _read(config, "hf_text_config") or config
    if hasattr(text, "get_text_config"):
        text = text.get_text_config(decoder=True)
    elif isinstance(text, dict) and isinstance(text.get("text_config"), dict):
        text = text["text_config"]
    if _read(text, "kv_lora_rank") is not None:
        return False, _mla_refusal(text)
    kinds = set(_read(text, "layer_types") or ())
    if kinds - set(ATTENTION_LAYERS) or any(_read(text, key) for key in RECURRENT_KEYS):
        return False, (f"pced's store connector cannot serve {_read(text, 'model_type') or 'this model'}: its "
                       f"recurrent layers ({', '.join(sorted(kinds - set(ATTENTION_LAYERS))) or 'state space'}) keep "
                       "a state the store does not hold; vLLM prefills the documents (its prefix cache serves repeats)")
    if "sliding_attention" in kinds:
        return True, ("sliding-window layers: served with vLLM's hybrid KV cache manager on a GPU (each keeps its "
                      "window's blocks); vLLM's CPU build keeps every token in them")
    return True, ""


def _mla_refusal(config: Any) -> str:
    text = _read(config, "hf_text_config") or config
    return (f"pced's store connector cannot serve {_read(text, 'model_type') or 'this model'}'s multi-head latent "
            f"attention: vLLM caches one compressed latent per token, written inside its attention, and pced's "
            f"store holds per-head keys and values; vLLM prefills the documents (its prefix cache serves repeats)")


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
