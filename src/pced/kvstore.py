"""Per-document KV caches: encode once (attending to the shared prefix), store as safetensors, load lazily.

Layout of a store directory::

    kvstore.json                      what the caches were built for (model, tokenizer, template, dtype)
    prefix.safetensors                the shared prefix's KV, positions 0..P-1
    kv/<h[:2]>/<h>.safetensors        one document's KV, positions P..P+L-1; h = sha256 of its context text

Files are content-addressed, so re-indexing skips documents already stored and two ids with the
same text share one file. Every file is written to a temporary name and renamed, so a killed
run leaves either a complete file or none. Keys are stored after RoPE, at the absolute positions
the document has in the sequential prompt prefix + document + suffix. Each file's metadata
carries a CRC-32 of its tensor bytes, checked whenever the file is loaded (``verify``) and by
``pced verify``; files written before checksums existed load without that check.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .cache import BufferCache, forward_slots
from .fs import atomic_save_tensors, atomic_write_json, sweep_temporaries
from .kvdata import DocKV
from .kvpool import CacheTiers
from .llm import LoadedModel
from .options import DEFAULT_STORAGE_DTYPE, STORAGE_DTYPES
from .prompts import PromptBuilder

FORMAT_VERSION = 1


class CacheError(RuntimeError):
    """A stored cache that cannot be used: built for another model/template, or damaged."""


def content_hash(context_text: str) -> str:
    return hashlib.sha256(context_text.encode("utf-8")).hexdigest()


def _kv_from_cache(cache: BufferCache, row: int, start: int, end: int) -> DocKV:
    return DocKV(
        keys=cache.key_buffer[:, row, :, start:end].clone(),
        values=cache.value_buffer[:, row, :, start:end].clone(),
    )


@torch.inference_mode()
def encode_prefix(llm: LoadedModel, prefix_ids: list[int]) -> DocKV:
    cache = BufferCache.allocate(llm.model, 1, len(prefix_ids))
    valid = torch.ones(1, len(prefix_ids), dtype=torch.bool, device=llm.device)
    ids = torch.tensor([prefix_ids], device=llm.device)
    positions = torch.arange(len(prefix_ids), device=llm.device)[None]
    forward_slots(llm.model, cache, valid, ids, positions)
    return _kv_from_cache(cache, 0, 0, len(prefix_ids))


@torch.inference_mode()
def encode_documents(llm: LoadedModel, prefix: DocKV, documents: list[list[int]]) -> list[DocKV]:
    """Encode a batch of documents after the shared prefix in one forward (right-padded)."""
    prefix_len, longest = prefix.n_tokens, max(len(ids) for ids in documents)
    batch = len(documents)
    cache = BufferCache.allocate(llm.model, batch, prefix_len + longest)
    keys, values = prefix.on(llm.device)
    cache.key_buffer[:, :, :, :prefix_len] = keys[:, None]
    cache.value_buffer[:, :, :, :prefix_len] = values[:, None]
    cache.set_length(prefix_len)
    valid = torch.ones(batch, prefix_len + longest, dtype=torch.bool, device=llm.device)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    ids = torch.full((batch, longest), pad, dtype=torch.long, device=llm.device)
    for row, doc in enumerate(documents):
        ids[row, : len(doc)] = torch.tensor(doc, device=llm.device)
    positions = torch.arange(prefix_len, prefix_len + longest, device=llm.device)[None].expand(batch, -1)
    # Right padding: a real token never sees a later pad, so the stored part is exact.
    forward_slots(llm.model, cache, valid, ids, positions)
    return [_kv_from_cache(cache, row, prefix_len, prefix_len + len(doc)) for row, doc in enumerate(documents)]


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8}
_NUMPY_CARRIER = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I8": np.int8}


def mmap_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Zero-copy views of a safetensors file's tensors (memory-mapped; pages are read on first touch).

    safetensors' own loader copies every tensor into fresh memory; the decoder copies the cache
    into its batch buffer anyway, so mapping the file saves one full copy per document.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if size < 8:
            raise ValueError(f"the file is truncated ({size} bytes)")
        header_len = struct.unpack("<Q", handle.read(8))[0]
        if header_len > size - 8:
            raise ValueError(f"the file is truncated (its header alone needs {header_len + 8} bytes, it has {size})")
        header = json.loads(handle.read(header_len))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + header_len
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = info["dtype"]
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, not one pced stores")
        if base + end > size or start > end:
            raise ValueError(f"the file is truncated (tensor {name!r} ends at byte {base + end}, the file has {size})")
        carrier = mapped[base + start : base + end].view(_NUMPY_CARRIER[dtype])
        with warnings.catch_warnings():  # read-only mapping: we never write through it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(carrier)
        tensors[name] = tensor.view(_SAFETENSORS_DTYPES[dtype]).view(info["shape"])
    return meta, tensors


def tensor_checksum(tensors: list[torch.Tensor]) -> str:
    """CRC-32 of the tensors' bytes as stored (about 3 GB/s on one core): catches bytes changed on
    disk, which no shape or metadata check can."""
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(tensor.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return f"crc32:{crc:08x}"


def check_cache_file(path: Path, identity: dict, digest: str, expected_tokens: int | None = None,
                     verify: bool = True) -> tuple[DocKV, dict[str, str]]:
    """A stored cache, memory-mapped, after every check that needs no model: readable, built for
    ``identity``, holding the document ``digest`` with the tokens its metadata says, and (``verify``)
    bytes matching its checksum; with its metadata. Any failure is a one-line ``CacheError`` naming the file."""
    fix = "remove it (pced verify STORE --remove) and re-index"
    try:
        meta, tensors = mmap_safetensors(path)
        keys, values = tensors["keys"], tensors["values"]
    except Exception as exc:  # any malformed header, size or dtype
        raise CacheError(f"cache file {path} is damaged or not a pced cache: {exc}; {fix}") from exc
    for key, expected in identity.items():
        if meta.get(key) != str(expected):
            raise CacheError(f"cache file {path} was built for {key}={meta.get(key)!r}, expected {expected!r}")
    if meta.get("content_hash") != digest or keys.shape != values.shape or keys.dim() != 4:
        raise CacheError(f"cache file {path} does not hold the document it is named after; {fix}")
    n_tokens = int(meta.get("n_tokens", -1))
    if keys.shape[2] != n_tokens or (expected_tokens is not None and n_tokens != expected_tokens):
        raise CacheError(f"cache file {path} has {keys.shape[2]} tokens, its metadata says {n_tokens}; {fix}")
    kv = DocKV(keys=keys, values=values, key_scale=tensors.get("key_scale"), value_scale=tensors.get("value_scale"))
    layers, heads, tokens, head_dim = keys.shape
    int8 = identity.get("storage_dtype") == "int8"
    if int8 != (keys.dtype == torch.int8) or (int8 and (
            kv.key_scale is None or kv.value_scale is None
            or tuple(kv.key_scale.shape) != (layers, heads, 1, head_dim)
            or tuple(kv.value_scale.shape) != (layers, heads, tokens, 1))):
        raise CacheError(f"cache file {path} does not have the tensors of a {identity.get('storage_dtype')} cache; {fix}")
    if verify and "checksum" in meta and tensor_checksum(list(kv.tensors().values())) != meta["checksum"]:
        raise CacheError(f"cache file {path} is damaged: its bytes do not match its checksum; {fix}")
    return kv, meta


def verify_cache_dir(root: Path, remove: bool = False) -> dict:
    """Check every cache of a KV store directory without loading a model (``pced verify``): each
    file fully, finiteness included. Returns counts and one line per damaged file; ``remove``
    deletes damaged files so that the next ``pced index`` (or a lazy store's next answer) re-encodes them."""
    try:
        identity = json.loads((root / "kvstore.json").read_text())
    except (OSError, ValueError) as exc:
        raise CacheError(f"{root} has no readable kvstore.json ({exc}); not a KV store") from None
    report = {"checked": 0, "damaged": [], "without_checksum": 0, "removed": 0}
    files = [(root / "prefix.safetensors", "prefix")] if (root / "prefix.safetensors").is_file() else []
    files += [(path, path.stem) for path in sorted((root / "kv").glob("*/*.safetensors"))]
    for path, digest in files:
        report["checked"] += 1
        try:
            kv, meta = check_cache_file(path, identity, digest)
            if not all(bool(torch.isfinite(t).all()) for t in kv.tensors().values()):
                raise CacheError(f"cache file {path} holds non-finite values (NaN or infinity)")
            report["without_checksum"] += "checksum" not in meta
        except CacheError as exc:
            report["damaged"].append(str(exc))
            if remove:
                path.unlink(missing_ok=True)
                report["removed"] += 1
    return report


class KVStore:
    """A directory of per-document caches for one (model, tokenizer, template, storage dtype)."""

    def __init__(self, root: str | os.PathLike, llm: LoadedModel, builder: PromptBuilder,
                 storage_dtype: str = DEFAULT_STORAGE_DTYPE, verify: bool = True, tiers: CacheTiers = CacheTiers()):
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {', '.join(STORAGE_DTYPES)}, got {storage_dtype!r}")
        self.root = Path(root)
        self.llm, self.builder = llm, builder
        self.storage_dtype = storage_dtype
        self.identity = {
            "format": FORMAT_VERSION,
            "model": llm.name,
            "model_fingerprint": llm.fingerprint,
            "tokenizer_hash": llm.tokenizer_hash,
            "template": builder.template.name,
            "template_hash": builder.digest(),
            "storage_dtype": storage_dtype,
        }
        self._check_or_create_manifest()
        self._prefix: DocKV | None = None
        self.last_encoded = 0
        self.verify = verify  # check each cache's checksum when it is loaded (about 3 GB/s)
        # the device tier (pced.kvpool): None on a CPU model without --gpu-cache-gb (mapped caches go
        # straight into the batch buffer)
        self.pool = tiers.pool_for(llm.device, next(llm.model.parameters()).dtype)

    # -- identity -------------------------------------------------------------------------
    def _check_or_create_manifest(self) -> None:
        manifest = self.root / "kvstore.json"
        if manifest.is_file():
            try:
                stored = json.loads(manifest.read_text())
            except json.JSONDecodeError as exc:
                raise CacheError(f"{manifest} is not valid JSON ({exc.msg}); the store is damaged") from exc
            for key, expected in self.identity.items():
                if stored.get(key) != expected:
                    raise CacheError(
                        f"KV store {self.root} was built for {key}={stored.get(key)!r}, this run uses {expected!r}; "
                        "use another directory or rebuild it"
                    )
            return
        atomic_write_json(manifest, self.identity)

    def _metadata(self, content: str, kv: DocKV) -> dict[str, str]:
        meta = {k: str(v) for k, v in self.identity.items()}
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
        """Encode and store the documents not stored yet; returns every document's content hash."""
        texts = self.context_texts(documents)
        digests = [content_hash(text) for text in texts]
        todo = {digest: text for digest, text in zip(digests, texts) if not self.has(digest)}
        self.last_encoded = len(todo)  # how many this call had to encode (the rest were stored)
        if todo:
            prefix = self.prefix()
            items = sorted(todo.items(), key=lambda item: len(item[1]))  # similar lengths pad less
            with tqdm(total=len(items), desc="encoding documents", unit="doc", disable=not progress) as bar:
                for start in range(0, len(items), batch_size):
                    chunk = items[start : start + batch_size]
                    token_ids = [self.builder.encode(text) for _, text in chunk]
                    for (digest, _), kv in zip(chunk, encode_documents(self.llm, prefix, token_ids)):
                        self._save(kv, digest, self.path_for(digest))
                    bar.update(len(chunk))
        return digests

    def remove_stale_temporaries(self) -> None:
        """Temporary files of a run that was killed mid-write. Only the single indexing writer may
        call this: ``add`` also runs on every answer (readers, the server), where it could delete
        another process's file in flight."""
        sweep_temporaries(self.root)
        sweep_temporaries(self.root / "kv", "*/")

    def _save(self, kv: DocKV, digest: str, path: Path) -> None:
        stored = kv.stored_as(self.storage_dtype)
        atomic_save_tensors(path, stored.tensors(), self._metadata(digest, stored))

    def load(self, digest: str) -> DocKV:
        """A document's cache: memory-mapped from disk (read-only views of the file), or, with a device
        tier, dense on the model's device (from the pool when it holds it)."""
        path = self.path_for(digest)
        if not path.is_file():
            raise CacheError(f"no cache for document {digest[:12]} in {self.root}; run the indexing step")
        if self.pool is not None:
            return self.pool.get(digest, lambda: self._read(path, digest, None))
        return self._read(path, digest, None)

    def _read(self, path: Path, digest: str, expected_tokens: int | None) -> DocKV:
        return check_cache_file(path, self.identity, digest, expected_tokens, self.verify)[0]
