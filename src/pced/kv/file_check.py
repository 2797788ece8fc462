"""A cache file checked from its bytes alone, without torch or a model: a regular file, a whole
safetensors header, every tensor inside the file at the size its dtype and shape give, built for
its directory's identity, holding the document it is named after, and bytes matching its CRC-32.

``pced store show`` reports a document's cache state from this check; ``pced verify`` and every
load run the same check and then look into the tensors (shapes, finiteness; ``pced.kv.format``)."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from ..errors import DataError
from ..fs import NotRegularFile, open_regular, read_regular, vanished

ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}  # the dtypes pced stores
# the order writers checksum their tensors in (``DocKV.tensors``: keys, values, scales; a llama.cpp state)
CHECKSUM_ORDER = ("keys", "values", "key_scale", "value_scale", "state")
FIX = "remove it (pced verify STORE --remove) and re-index"


class CacheError(DataError):
    """A stored cache that cannot be used: built for another model/template, or damaged."""

    code = "damaged_cache"


def bytes_checksum(chunks: Iterable) -> str:
    """CRC-32 over buffers in order, as ``pced.kv.format.tensor_checksum`` computes it over tensors."""
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


def read_header(handle: BinaryIO, size: int) -> tuple[dict[str, str], dict[str, dict], int]:
    """A safetensors file's metadata, its tensors' entries (dtype, shape, data offsets, each checked
    to lie inside the file at the size its dtype and shape give) and where the data starts; a
    ValueError saying what is wrong."""
    if size < 8:
        raise ValueError(f"the file is truncated ({size} bytes)")
    header_len = struct.unpack("<Q", handle.read(8))[0]
    if header_len > size - 8:
        raise ValueError(f"the file is truncated (its header alone needs {header_len + 8} bytes, it has {size})")
    header = json.loads(handle.read(header_len))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError("its metadata is not a JSON object")
    base = 8 + header_len
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            whole = all(isinstance(n, int) and n >= 0 for n in (start, end, *shape))
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"tensor {name!r} has no whole entry in the header") from None
        if dtype not in ITEM_BYTES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, not one pced stores")
        if not whole or start > end or end - start != math.prod(shape) * ITEM_BYTES[dtype]:
            raise ValueError(f"tensor {name!r} has offsets that do not fit its shape {shape}")
        if base + end > size:
            raise ValueError(f"the file is truncated (tensor {name!r} ends at byte {base + end}, the file has {size})")
    return meta, header, base


def read_identity(directory: Path, name: str, recorded: tuple[str, ...] = ()) -> dict:
    """What every file of a cache directory must have been built for (its ``name``: kvstore.json,
    states.json), without the ``recorded`` keys (written down, never checked)."""
    try:
        identity = json.loads(read_regular(Path(directory) / name))
        if not isinstance(identity, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CacheError(f"{directory} has no readable {name} ({why}); not a cache directory pced wrote") from None
    return {k: v for k, v in identity.items() if k not in recorded}


def check_cache_bytes(path: Path, identity: dict, digest: str, what: str = "cache file", fix: str = FIX) -> dict:
    """The file's metadata if its bytes are a whole cache of ``digest`` built for ``identity``
    (checksum included, where it has one); else a one-line ``CacheError`` naming it."""
    try:
        with open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            meta, tensors, base = read_header(handle, size)
            unknown = sorted(set(tensors) - set(CHECKSUM_ORDER))
            if unknown:
                raise ValueError(f"tensor {unknown[0]!r} is not one pced stores")
            checksum = None
            if "checksum" in meta:
                spans = [tensors[name]["data_offsets"] for name in CHECKSUM_ORDER if name in tensors]
                with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
                    checksum = bytes_checksum(view[base + start : base + end] for start, end in spans)
    except NotRegularFile as exc:
        raise CacheError(f"{what} {path} is {exc.strerror}; {fix}") from None
    except OSError as exc:
        if vanished(exc):  # removed (or, on NFS, replaced by another host) while we look: not damage
            raise
        raise CacheError(f"{what} {path} is damaged or not a pced cache: {exc}; {fix}") from None
    except ValueError as exc:  # a cut or foreign file: what its header says is wrong
        raise CacheError(f"{what} {path} is damaged or not a pced cache: {exc}; {fix}") from None
    for key, expected in identity.items():
        if meta.get(key) != str(expected):
            raise CacheError(f"{what} {path} was built for {key}={meta.get(key)!r}, expected {expected!r}")
    if meta.get("content_hash") != digest or not str(meta.get("n_tokens", "")).isdigit():
        raise CacheError(f"{what} {path} does not hold the document it is named after; {fix}")
    if checksum is not None and checksum != meta["checksum"]:
        raise CacheError(f"{what} {path} is damaged: its bytes do not match its checksum; {fix}")
    return meta
