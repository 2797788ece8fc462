"""Checking a directory of llama.cpp sequence states without loading a model (``pced verify``).

Each file must be what ``states.StateStore`` wrote: a safetensors file with one uint8 ``state``
tensor, the directory's identity (``states.json``) in its metadata, the content hash it is named
after and a CRC-32 of its bytes. The bytes themselves are llama.cpp's serialization: only
llama.cpp can read further into them, which ``StateStore`` does on every restore.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...kv.format import CacheError, mmap_safetensors, tensor_checksum, verify_files

MANIFEST = "states.json"


def check_state_file(path: Path, identity: dict, digest: str) -> dict:
    """The file's metadata if it is a whole state of ``digest`` built for ``identity``; else a CacheError."""
    fix = "remove it and re-index (pced index --backend llamacpp), or pced verify --remove"
    try:
        meta, tensors = mmap_safetensors(path)
        state = tensors["state"]
    except Exception as exc:  # a truncated or foreign file: whatever safetensors raised
        raise CacheError(f"state file {path} is damaged or not a pced llama.cpp state: {exc}; {fix}") from exc
    for key, expected in identity.items():
        if meta.get(key) != str(expected):
            raise CacheError(f"state file {path} was built for {key}={meta.get(key)!r}, its directory for {expected!r}")
    if meta.get("content_hash") != digest or state.dim() != 1 or not meta.get("n_tokens", "").isdigit():
        raise CacheError(f"state file {path} does not hold the document it is named after; {fix}")
    if "checksum" in meta and tensor_checksum([state]) != meta["checksum"]:
        raise CacheError(f"state file {path} is damaged: its bytes do not match its checksum; {fix}")
    return meta


def verify_state_dir(root: Path, remove: bool = False) -> dict:
    """Counts and one line per damaged file; ``remove`` deletes damaged files so that the next index
    run (or an on-demand store's next answer) encodes them again."""
    try:
        identity = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CacheError(f"{root} has no readable {MANIFEST} ({exc}); not a llama.cpp state directory") from None
    return verify_files(root, "seq", lambda path, digest: check_state_file(path, identity, digest), remove)
