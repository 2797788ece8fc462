"""Per-document KV caches: encode once (attending to the shared prefix), store as safetensors, load lazily.

Layout of a store directory::

    kvstore.json                      what the caches were built for (model, tokenizer, template, dtype)
    prefix.safetensors                the shared prefix's KV, positions 0..P-1
    kv/<h[:2]>/<h>.safetensors        one document's KV, positions P..P+L-1; h = sha256 of its context text
    budget.json                       hits, misses, evictions of an on-demand store (pced.kv.budget)

Files are content-addressed, so re-indexing skips documents already stored and two ids with the
same text share one file. Every file is written to a temporary name and renamed, so a killed
run leaves either a complete file or none. Keys are stored after RoPE, at the absolute positions
the document has in the sequential prompt prefix + document + suffix. Each file's metadata
carries a CRC-32 of its tensor bytes, checked when the file is written (read back once), by
``pced verify``, and on load at most once per file per process (``verify="once"``: re-reading
every byte of every document on every question cost ~90 ms per 2048-token 8B document of time to
first token); files written before checksums existed load without that check.

On demand (``on_demand``, or a ``budget_bytes``): documents are encoded when first asked for and,
with a budget, the least recently used caches are evicted past it (``pced.kv.budget``); a cache
found missing when it is loaded, or gone while it is read (evicted, swept by an index run, or
removed by another host: ENOENT, NFS's ESTALE), is encoded again.
A store's directory writes a cache only where its owner's guard lets it (``CacheUse.write_guard``);
one it refuses is used from memory for that answer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm.auto import tqdm

from ..fs import atomic_save_tensors, atomic_write_json, sweep_temporaries
from ..llm import LoadedModel
from ..options import DEFAULT_STORAGE_DTYPE, STORAGE_DTYPES
from ..text.prompts import PromptBuilder
from .budget import CacheUse
from .encode import encode_documents, encode_prefix
from .format import FORMAT_VERSION, CacheError, check_cache_file, content_hash, tensor_checksum
from .segment import DocKV
from .tiers import CacheTiers, device_pool


class KVStore:
    """A directory of per-document caches for one (model, tokenizer, template, storage dtype)."""

    def __init__(self, root: str | os.PathLike, llm: LoadedModel, builder: PromptBuilder,
                 storage_dtype: str = DEFAULT_STORAGE_DTYPE, verify: bool | str = "once", tiers: CacheTiers = CacheTiers(),
                 budget_bytes: int | None = None, on_demand: bool = False, recorded_model_path: str | None = None):
        """``recorded_model_path``: the model folder a store's manifest recorded (recognises caches
        built before model identities were path-free); ``budget_bytes``/``on_demand``: see above."""
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {', '.join(STORAGE_DTYPES)}, got {storage_dtype!r}")
        self.root = Path(root)
        self.llm, self.builder = llm, builder
        self.storage_dtype = storage_dtype
        # what every cache must have been built for; the model's folder name is recorded, not checked
        # (a moved or renamed model keeps its fingerprint)
        self.identity = {
            "format": FORMAT_VERSION,
            "model_fingerprint": llm.fingerprint,
            "tokenizer_hash": llm.tokenizer_hash,
            "template": builder.template.name,
            "template_hash": builder.digest(),
            "storage_dtype": storage_dtype,
        }
        self._check_or_create_manifest(recorded_model_path)
        self._prefix: DocKV | None = None
        self.last_encoded = 0
        self.use = CacheUse(self.root, self.root / "kv", budget_bytes, on_demand)
        self.on_demand, self.budget = self.use.on_demand, self.use.budget
        self.verify = verify  # check a cache's checksum on load: "once" per file per process, True every time
        # the device tier (pced.kv.tiers): None on a CPU model without --gpu-cache-gb (mapped caches go
        # straight into the batch buffer)
        self.pool = device_pool(tiers, llm.device, next(llm.model.parameters()).dtype)

    # -- identity -------------------------------------------------------------------------
    def _check_or_create_manifest(self, recorded_model_path: str | None) -> None:
        manifest = self.root / "kvstore.json"
        if manifest.is_file():
            try:
                stored = json.loads(manifest.read_text())
            except json.JSONDecodeError as exc:
                raise CacheError(f"{manifest} is not valid JSON ({exc.msg}); the store is damaged") from exc
            old = stored.get("model_fingerprint")
            legacy = self.llm.legacy_fingerprint
            if old != self.llm.fingerprint and legacy is not None and old in {
                    legacy(recorded_model_path or self.llm.path), legacy(self.llm.path)}:
                # caches built before path-free identities, by these weights: keep their recorded value
                self.identity["model_fingerprint"] = old
            for key, expected in self.identity.items():
                if stored.get(key) != expected:
                    raise CacheError(
                        f"KV store {self.root} was built for {key}={stored.get(key)!r}, this run uses {expected!r}; "
                        "use another directory or rebuild it"
                    )
            return
        atomic_write_json(manifest, {**self.identity, "model": self.llm.name})

    def _metadata(self, content: str, kv: DocKV) -> dict[str, str]:
        meta = {k: str(v) for k, v in self.identity.items()}
        meta["model"] = self.llm.name
        meta.update(content_hash=content, n_tokens=str(kv.n_tokens), checksum=tensor_checksum(list(kv.tensors().values())))
        return meta

    # -- paths ----------------------------------------------------------------------------
    def path_for(self, digest: str) -> Path:
        return self.root / "kv" / digest[:2] / f"{digest}.safetensors"

    def has(self, digest: str) -> bool:
        return self.path_for(digest).is_file()

    # -- prefix ---------------------------------------------------------------------------
    def prefix(self) -> DocKV:
        if self._prefix is None:
            path = self.root / "prefix.safetensors"
            if not path.is_file():
                kv = encode_prefix(self.llm, self.builder.prefix_ids)
                self._save(kv, "prefix", path)
            self._prefix = self._read(path, "prefix", len(self.builder.prefix_ids))
            if self.pool is not None:  # every question reads it: keep it on the device, outside the budget
                self._prefix = self._prefix.dense(self.pool.device, self.pool.dtype, self.pool.staging)
        return self._prefix

    # -- documents ------------------------------------------------------------------------
    def context_texts(self, documents: list[str]) -> list[str]:
        return [self.builder.context_text([doc]) for doc in documents]

    def digests(self, documents: list[str]) -> list[str]:
        """The content hash (cache file name) of each document."""
        return [content_hash(text) for text in self.context_texts(documents)]

    def remove_unreferenced(self, keep: list[str]) -> int:
        """Delete the caches of every document not in ``keep`` (digests); the indexing writer only."""
        keep_set, removed = set(keep), 0
        for path in (self.root / "kv").glob("*/*.safetensors"):
            if path.stem not in keep_set:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def add(self, documents: list[str], batch_size: int = 4, progress: bool = True) -> list[str]:
        """Encode and store the documents not stored yet; returns every document's content hash.
        On demand, counts hits and misses and keeps the directory within its budget (never
        evicting these documents' caches)."""
        texts = self.context_texts(documents)
        digests = [content_hash(text) for text in texts]
        # how many this call had to encode (the rest were stored)
        self.last_encoded = self.use.add(digests, texts, self.has, self.path_for,
                                         lambda todo: self._encode(todo, batch_size, progress))
        return digests

    def _encode(self, todo: dict[str, str], batch_size: int = 4, progress: bool = False) -> None:
        if not todo:
            return
        prefix = self.prefix()
        items = sorted(todo.items(), key=lambda item: len(item[1]))  # similar lengths pad less
        with tqdm(total=len(items), desc="encoding documents", unit="doc", disable=not progress) as bar:
            for start in range(0, len(items), batch_size):
                chunk = items[start : start + batch_size]
                token_ids = [self.builder.encode(text) for _, text in chunk]
                for (digest, _), kv in zip(chunk, encode_documents(self.llm, prefix, token_ids)):
                    stored = kv.stored_as(self.storage_dtype)
                    self.use.keep(digest, stored, lambda: self._write(stored, digest, self.path_for(digest)))
                bar.update(len(chunk))

    def stats(self) -> dict:
        """The caches' budget (bytes or None), bytes and files held, and the counters of on-demand
        use persisted across processes: hits, misses (encoded when asked for), evictions."""
        return self.use.stats()

    def remove_stale_temporaries(self) -> None:
        """Temporary files of a run that was killed mid-write. Only the single indexing writer may
        call this: ``add`` also runs on every answer (readers, the server), where it could delete
        another process's file in flight."""
        # readers of an on-demand store write caches and counters too: leave those of live processes
        sweep_temporaries(self.root, keep_live=True)
        sweep_temporaries(self.root / "kv", "*/", keep_live=True)

    def _save(self, kv: DocKV, digest: str, path: Path) -> None:
        self._write(kv.stored_as(self.storage_dtype), digest, path)

    def _write(self, stored: DocKV, digest: str, path: Path) -> None:
        """Write the file, then read it back once against its checksum: a file that loads later was
        verified when written (in this process, its loads skip the check)."""
        atomic_save_tensors(path, stored.tensors(), self._metadata(digest, stored))
        check_cache_file(path, self.identity, digest, stored.n_tokens, verify=True)

    def load(self, digest: str) -> DocKV:
        """A document's cache: memory-mapped from disk (read-only views of the file), or, with a device
        tier, dense on the model's device (from the pool when it holds it)."""
        path = self.path_for(digest)

        def read() -> DocKV:
            kv = self.use.read_or_encode(digest, path, lambda: self._read(path, digest, None), self._encode)
            if kv is None:
                raise CacheError(f"no cache for document {digest[:12]} in {self.root}; run the indexing step")
            return kv

        return self.pool.get(digest, read) if self.pool is not None else read()

    def _read(self, path: Path, digest: str, expected_tokens: int | None) -> DocKV:
        return check_cache_file(path, self.identity, digest, expected_tokens, self.verify)[0]
