"""Document caches as llama.cpp sequence states: encoded once, stored like the transformers caches.

Layout of a state directory (``STORE/llamacpp-<cache type>/``, beside the transformers ``kv/``)::

    states.json                        what the states were built for (backend, GGUF, tokenizer,
                                       template, llama.cpp version, KV cache type)
    prefix.safetensors                 the shared prefix's sequence state, positions 0..P-1
    seq/<h[:2]>/<h>.safetensors        one document's cells only, positions P..P+L-1;
                                       h = sha256 of its context text (the same name as in kv/)

A file holds one uint8 tensor ``state``: the bytes of ``llama_state_seq_get_data`` for a
sequence (cell positions, then each layer's keys and values in the context's cache type), and
metadata: the identity above, the content hash, the token count and a CRC-32 of the bytes,
checked on every load. A document's state is encoded as prefix + document in one sequence, then
the prefix's cells are dropped from it (``seq_rm``) before it is saved: each question restores
the prefix into sequence 0 (the amateur) and, joined to each document's cells, into each expert's
KV stream in one restore (``restore_expert``). The bytes are those of a one-stream context whatever
the context that encoded them (``LlamaContext.get_state``), so states stored before contexts had a
stream per sequence still load.
Files are written atomically (``pced.fs``) and named by content, so re-indexing skips what is stored.

On demand (``on_demand``, or a ``budget_bytes``: a store indexed with ``--kv-budget-gb``, the
request cache of documents sent with a question), a state is encoded the first time it is asked
for, and past the budget the least recently used states are evicted by the same ``ByteBudget`` as
the transformers caches (``pced.kv.budget``; the prefix is never evicted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ...fs import atomic_save_tensors, atomic_write_json, sweep_temporaries, vanished
from ...kv.budget import CacheUse
from ...kv.format import CacheError, content_hash, mmap_safetensors, tensor_checksum
from ...text.prompts import PromptBuilder
from . import cells as state_cells
from .model import LlamaContext, LlamaModel

FORMAT_VERSION = 1
MANIFEST = "states.json"


def states_dir(store_root: Path, cache_type: str) -> Path:
    return Path(store_root) / f"llamacpp-{cache_type}"


class SeqState:
    """One stored sequence state: its bytes (memory-mapped) and how many tokens it holds."""

    def __init__(self, data: np.ndarray, n_tokens: int):
        self.data, self.n_tokens = data, n_tokens
        self._cells: state_cells.SeqCells | None = None

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    @property
    def cells(self) -> state_cells.SeqCells:
        """The state's cells, parsed once (the prefix's are joined to every expert's)."""
        if self._cells is None:
            self._cells = state_cells.parse(self.data)
        return self._cells


class StateStore:
    """A directory of llama.cpp sequence states for one (GGUF, tokenizer, template, cache type)."""

    def __init__(self, root: str | os.PathLike, llm: LlamaModel, builder: PromptBuilder, verify: bool = True,
                 budget_bytes: int | None = None, on_demand: bool = False):
        self.root, self.llm, self.builder, self.verify = Path(root), llm, builder, verify
        self.identity = {"format": FORMAT_VERSION, **llm.identity(), "template": builder.template.name,
                         "template_hash": builder.digest()}
        self._check_or_create_manifest()
        self._prefix: SeqState | None = None
        self.last_encoded = 0
        self.use = CacheUse(self.root, self.root / "seq", budget_bytes, on_demand)
        self.on_demand, self.budget = self.use.on_demand, self.use.budget

    def _check_or_create_manifest(self) -> None:
        manifest = self.root / MANIFEST
        if manifest.is_file():
            try:
                stored = json.loads(manifest.read_text())
            except json.JSONDecodeError as exc:
                raise CacheError(f"{manifest} is not valid JSON ({exc.msg}); the state store is damaged") from exc
            for key, expected in self.identity.items():
                if stored.get(key) != expected:
                    raise CacheError(f"llama.cpp states in {self.root} were built for {key}={stored.get(key)!r}, this run "
                                     f"uses {expected!r}; use another directory or rebuild it")
            return
        atomic_write_json(manifest, self.identity)

    # -- paths ----------------------------------------------------------------------------
    def path_for(self, digest: str) -> Path:
        return self.root / "seq" / digest[:2] / f"{digest}.safetensors"

    def has(self, digest: str) -> bool:
        return self.path_for(digest).is_file()

    def digests(self, documents: Sequence[str]) -> list[str]:
        return [content_hash(self.builder.context_text([doc])) for doc in documents]

    # -- reading --------------------------------------------------------------------------
    def prefix(self) -> SeqState:
        if self._prefix is None:
            path = self.root / "prefix.safetensors"
            if not path.is_file():
                ids = self.builder.prefix_ids
                with self.llm.lock:
                    ctx = self.llm.context(len(ids), 1, role="encode")
                    ctx.decode(ids, range(len(ids)), [0] * len(ids), [False] * len(ids))
                    self._save(ctx.get_state(0), "prefix", len(ids), path)
            self._prefix = self._read(path, "prefix", len(self.builder.prefix_ids))
        return self._prefix

    def load(self, digest: str) -> SeqState:
        path = self.path_for(digest)
        # held: encoded for a document its store no longer holds (CacheUse.write_guard); a file gone is encoded again
        state = self.use.read_or_encode(digest, path, lambda: self._read(path, digest, None), self._encode)
        if state is None:
            raise CacheError(f"no llama.cpp state for document {digest[:12]} in {self.root}; run the indexing step")
        return state

    def _read(self, path: Path, digest: str, expected_tokens: int | None) -> SeqState:
        fix = "remove it and re-index (pced index --backend llamacpp)"
        try:
            meta, tensors = mmap_safetensors(path)
            state = tensors["state"]
        except Exception as exc:
            if vanished(exc):  # removed or replaced meanwhile, not damaged: load encodes it again
                raise
            raise CacheError(f"state file {path} is damaged or not a pced llama.cpp state: {exc}; {fix}") from exc
        for key, expected in self.identity.items():
            if meta.get(key) != str(expected):
                raise CacheError(f"state file {path} was built for {key}={meta.get(key)!r}, expected {expected!r}")
        n_tokens = int(meta.get("n_tokens", -1))
        if meta.get("content_hash") != digest or state.dim() != 1 or state.dtype != torch.uint8 or n_tokens < 0 \
                or (expected_tokens is not None and n_tokens != expected_tokens):
            raise CacheError(f"state file {path} does not hold the document it is named after; {fix}")
        if self.verify and tensor_checksum([state]) != meta.get("checksum"):
            raise CacheError(f"state file {path} is damaged: its bytes do not match its checksum; {fix}")
        return SeqState(state.numpy(), n_tokens)

    # -- writing --------------------------------------------------------------------------
    def _save(self, data: np.ndarray, digest: str, n_tokens: int, path: Path) -> None:
        tensor = torch.from_numpy(np.ascontiguousarray(data))
        meta = {k: str(v) for k, v in self.identity.items()}
        meta.update(content_hash=digest, n_tokens=str(n_tokens), checksum=tensor_checksum([tensor]))
        atomic_save_tensors(path, {"state": tensor}, meta)

    def add(self, documents: Sequence[str], batch_size: int = 4, progress: bool = False) -> list[str]:
        """Encode and store the documents not stored yet (``batch_size`` sequences per batch);
        returns every document's content hash. On demand, counts hits and misses and keeps the
        directory within its budget (never evicting these documents' states)."""
        texts = [self.builder.context_text([doc]) for doc in documents]
        digests = [content_hash(text) for text in texts]
        self.last_encoded = self.use.add(digests, texts, self.has, self.path_for,
                                         lambda todo: self._encode(todo, batch_size, progress))
        return digests

    def _encode(self, todo: dict[str, str], batch_size: int = 4, progress: bool = False) -> None:
        from tqdm.auto import tqdm

        if not todo:
            return
        prefix = self.prefix()
        items = sorted(todo.items(), key=lambda item: len(item[1]))
        with self.llm.lock, tqdm(total=len(items), desc="encoding documents (llama.cpp)", unit="doc",
                                 disable=not progress) as bar:
            for start in range(0, len(items), batch_size):
                chunk = [(digest, self.builder.encode(text)) for digest, text in items[start : start + batch_size]]
                for (digest, ids), data in zip(chunk, encode_states(self.llm, prefix, [ids for _, ids in chunk])):
                    self.use.keep(digest, SeqState(data, len(ids)),
                                  lambda: self._save(data, digest, len(ids), self.path_for(digest)))
                bar.update(len(chunk))

    def stats(self) -> dict:
        """The states' budget (bytes or None), bytes and files held, and the on-demand counters
        (hits, misses, evictions) persisted across processes."""
        return self.use.stats()

    def remove_unreferenced(self, keep: Sequence[str]) -> int:
        keep_set, removed = set(keep), 0
        for path in (self.root / "seq").glob("*/*.safetensors"):
            if path.stem not in keep_set:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def remove_stale_temporaries(self) -> None:
        """A killed run's temporary files (the single indexing writer only)."""
        sweep_temporaries(self.root)
        sweep_temporaries(self.root / "seq", "*/")


def restore_prefix(ctx: LlamaContext, prefix: SeqState) -> None:
    ctx.set_state(0, prefix.data)


def restore_expert(ctx: LlamaContext, seq: int, prefix: SeqState, state: SeqState | None = None) -> None:
    """Sequence ``seq`` holds the prefix's cells, then the document's (``state``; None: the prefix
    alone). In streams of their own, the prefix's stored bytes and the document's go into the row's
    stream in one restore, in the order a fresh decode of prefix + document fills it: no stream
    buffer is copied (llama.cpp's cross-stream ``seq_cp`` copies whole buffers). In one unified
    cache, the prefix restored into sequence 0 is shared (``seq_cp``, no memory copied)."""
    if ctx.split:
        if state is None:
            ctx.set_state(seq, prefix.data)
        else:
            ctx.set_states(seq, prefix.cells, state.data)
        return
    if state is not None:
        ctx.set_state(seq, state.data)
    ctx.seq_cp(0, seq, 0, prefix.n_tokens)


def encode_states(llm: LlamaModel, prefix: SeqState, documents: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Each document's cells as a sequence state: prefix (restored) + document in sequence i + 1,
    all documents in one batch, then the prefix's cells dropped from each before it is saved."""
    p = prefix.n_tokens
    ctx = llm.context(p + sum(map(len, documents)), len(documents) + 1, role="encode",
                      seq_cells=p + max(map(len, documents), default=0))
    restore_prefix(ctx, prefix)
    tokens, positions, seqs = [], [], []
    for i, ids in enumerate(documents):
        if not ids:
            raise ValueError("a document has no tokens")
        restore_expert(ctx, i + 1, prefix)
        tokens += ids
        positions += range(p, p + len(ids))
        seqs += [i + 1] * len(ids)
    ctx.decode(tokens, positions, seqs, [False] * len(tokens))
    states = []
    for i in range(len(documents)):
        ctx.seq_rm(i + 1, 0, p)
        states.append(ctx.get_state(i + 1))
        ctx.seq_rm(i + 1)
    return states
