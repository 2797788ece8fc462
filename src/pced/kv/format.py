"""The cache file format: one document's (or the prefix's) keys and values as safetensors, with
the identity it was built for and a CRC-32 of its bytes; memory-mapped reads and checks that need no model."""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from ..fs import NotRegularFile, open_regular, vanished
from .file_check import CacheError, check_cache_bytes, read_header, read_identity
from .segment import DocKV

FORMAT_VERSION = 1
__all__ = ["CacheError", "FORMAT_VERSION", "check_cache_file", "content_hash", "mmap_safetensors", "tensor_checksum",
           "verify_cache_dir", "verify_files"]


def content_hash(context_text: str) -> str:
    return hashlib.sha256(context_text.encode("utf-8")).hexdigest()


# U8: a backend's cache kept as opaque bytes (a sequence state of an engine that serializes its own)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8, "U8": torch.uint8}
_NUMPY_CARRIER = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I8": np.int8, "U8": np.uint8}


def mmap_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Zero-copy views of a safetensors file's tensors (memory-mapped; pages are read on first touch).

    safetensors' own loader copies every tensor into fresh memory; the decoder copies the cache
    into its batch buffer anyway, so mapping the file saves one full copy per document. Only a
    regular file is opened (``pced.fs.open_regular``), and every tensor is checked to lie inside it.
    """
    with open_regular(path) as handle:
        meta, header, base = read_header(handle, os.fstat(handle.fileno()).st_size)
        mapped = np.memmap(handle, dtype=np.uint8, mode="r")
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        carrier = mapped[base + start : base + end].view(_NUMPY_CARRIER[info["dtype"]])
        with warnings.catch_warnings():  # read-only mapping: we never write through it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(carrier)
        tensors[name] = tensor.view(_SAFETENSORS_DTYPES[info["dtype"]]).view(info["shape"])
    return meta, tensors


def tensor_checksum(tensors: list[torch.Tensor]) -> str:
    """CRC-32 of the tensors' bytes as stored (about 3 GB/s on one core): catches bytes changed on
    disk, which no shape or metadata check can."""
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(tensor.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return f"crc32:{crc:08x}"


class VerifiedFiles:
    """The cache files whose checksum this process has matched (or written), by path and the file's
    identity on disk (inode, size, modification time): a file replaced or rewritten is checked again.
    A load then verifies each file at most once per process instead of on every question."""

    def __init__(self) -> None:
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()

    @staticmethod
    def key(path: Path) -> tuple:
        stat = os.stat(path)
        return (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def __contains__(self, path: Path) -> bool:
        with self._lock:
            return self.key(path) in self._seen

    def add(self, path: Path) -> None:
        key = self.key(path)
        with self._lock:
            self._seen.add(key)

    def forget(self) -> None:
        """Check every file again on its next load, as a fresh process does (a benchmark's cold reads)."""
        with self._lock:
            self._seen.clear()


VERIFIED = VerifiedFiles()  # facts about files, shared by every store of this process


def check_cache_file(path: Path, identity: dict, digest: str, expected_tokens: int | None = None,
                     verify: bool | str = True) -> tuple[DocKV, dict[str, str]]:
    """A stored cache, memory-mapped, after every check that needs no model: readable, built for
    ``identity``, holding the document ``digest`` with the tokens its metadata says, and bytes
    matching its checksum (``verify``: True every time, "once" once per file per process, False
    never); with its metadata. Any failure is a one-line ``CacheError`` naming the file."""
    fix = "remove it (pced verify STORE --remove) and re-index"
    try:
        meta, tensors = mmap_safetensors(path)
        keys, values = tensors["keys"], tensors["values"]
    except NotRegularFile as exc:
        raise CacheError(f"cache file {path} is {exc.strerror}; {fix}") from None
    except Exception as exc:  # any malformed header, size or dtype
        if vanished(exc):  # removed or replaced meanwhile, not damaged: the caller encodes it again
            raise
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
    if verify and "checksum" in meta and not (verify == "once" and path in VERIFIED):
        if tensor_checksum(list(kv.tensors().values())) != meta["checksum"]:
            raise CacheError(f"cache file {path} is damaged: its bytes do not match its checksum; {fix}")
        VERIFIED.add(path)
    return kv, meta


def cache_checker(root: Path):
    """``check(path, digest)``: everything ``pced verify`` checks of one file of the KV store
    directory ``root`` (its bytes as ``pced store show`` checks them, then shapes and finiteness);
    the file's metadata, or a one-line CacheError."""
    identity = read_identity(root, "kvstore.json", recorded=("model",))  # the folder's name: recorded, not checked

    def check(path: Path, digest: str) -> dict:
        meta = check_cache_bytes(path, identity, digest)
        kv, _ = check_cache_file(path, identity, digest, verify=False)
        if not all(bool(torch.isfinite(t).all()) for t in kv.tensors().values()):
            raise CacheError(f"cache file {path} holds non-finite values (NaN or infinity)")
        return meta

    return check


def verify_cache_dir(root: Path, remove: bool = False, referenced: set[str] | None = None) -> dict:
    """Check every cache of a KV store directory without loading a model (``pced verify``): each
    file fully, finiteness included. Returns counts and one line per damaged file; ``remove``
    deletes damaged files so that the next ``pced index`` (or a lazy store's next answer) re-encodes
    them. ``referenced``: see ``verify_files``."""
    return verify_files(root, "kv", cache_checker(root), remove, referenced)


def verify_files(root: Path, files_dir: str, check, remove: bool = False, referenced: set[str] | None = None) -> dict:
    """Run ``check(path, digest)`` (a file's metadata, or a CacheError) over a cache directory's prefix
    and its per-document files under ``files_dir``: counts and one line per damaged file; ``remove``
    deletes damaged files. A file whose name is not in ``referenced`` (the content hashes a store's
    documents name; None: every file counts) is an orphan: counted apart, not checked, deleted by
    ``remove``. Whatever sits under a cache file's name is checked, a FIFO or a link included (the
    check opens regular files only). Shared by every backend's cache directory (``Backend.verify_caches``)."""
    report = {"checked": 0, "damaged": [], "without_checksum": 0, "removed": 0, "orphans": 0, "orphans_removed": 0}
    prefix = root / "prefix.safetensors"
    files = [(prefix, "prefix")] if os.path.lexists(prefix) else []
    for path in sorted((root / files_dir).glob("*/*.safetensors")):
        if referenced is None or path.stem in referenced:
            files.append((path, path.stem))
            continue
        report["orphans"] += 1
        if remove:
            path.unlink(missing_ok=True)
            report["orphans_removed"] += 1
    for path, digest in files:
        report["checked"] += 1
        try:
            report["without_checksum"] += "checksum" not in check(path, digest)
        except CacheError as exc:
            report["damaged"].append(str(exc))
            if remove:
                path.unlink(missing_ok=True)
                report["removed"] += 1
    return report
