"""A store's ``manifest.json``, read one way by every command (``read_manifest``): a regular file,
UTF-8, JSON, and the schema checked, so that a manifest that is cut, empty, not an object, lacks a
section, names an impossible generation or holds a setting this version does not know is one line
that names the file and says how to repair the store, never an error from deep inside a reader."""

from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import MISSING, fields
from pathlib import Path

from ..fs import NotRegularFile, read_regular
from ..options import STORAGE_DTYPES
from ..text.prompts import TEMPLATES
from .layout import FORMAT, MANIFEST, IndexSettings, StoreError

MODEL_FIELDS = ("name", "fingerprint", "tokenizer_hash")  # what opening a store compares with the model
CHOICES = {"template": tuple(TEMPLATES), "storage_dtype": STORAGE_DTYPES}
MIN_DOC_TOKENS = 16
MAX_GENERATION = 2**31 - 1  # one per index run: never reached, and a folder name any file system takes


def rebuild_advice(root: Path) -> str:
    """What repairs a store whose manifest or document list is damaged (``pced index --rebuild``
    replaces both, keeping the caches that still match)."""
    return f"rebuild it from its corpus: pced index CORPUS --out {shlex.quote(str(root))} --rebuild"


def described(value: object) -> str:
    """A JSON value as a message shows it: its kind for a container, else itself (cut short)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def read_manifest(root: Path) -> dict:
    """The manifest of the store at ``root``, checked (``check_manifest``); else a one-line
    ``StoreError`` naming the file."""
    path = Path(root) / MANIFEST
    if not os.path.lexists(path):
        raise StoreError(f"{root} is not a pced store (no {MANIFEST}); build it with pced index")
    try:
        raw = read_regular(path)
    except NotRegularFile as exc:
        raise damaged(path, exc.strerror) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise damaged(path, f"not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    try:
        manifest = json.loads(text)
    except ValueError as exc:  # cut short, empty, or a number too long to read
        raise damaged(path, f"not readable JSON ({exc})") from None
    return check_manifest(path, manifest)


def recorded_settings(root: Path) -> dict:
    """The settings the store at ``root`` was built with (``IndexSettings``' fields), or nothing where
    there is no store there or its manifest is damaged (the index run then reports that itself)."""
    if not os.path.lexists(Path(root) / MANIFEST):
        return {}
    try:
        return dict(read_manifest(root)["settings"])
    except StoreError:
        return {}


def damaged(path: Path, what: str) -> StoreError:
    return StoreError(f"{path}: {what}; {rebuild_advice(path.parent)}")


def check_manifest(path: Path, manifest: object) -> dict:
    """``manifest`` (the parsed ``path``) if it fits the schema; else a ``StoreError`` naming the file."""
    if not isinstance(manifest, dict):
        raise damaged(path, f"expected a JSON object, found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{path}: store format {manifest.get('format')!r} is not supported (expected {FORMAT})")
    number = manifest.get("generation", 0)
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= MAX_GENERATION:
        raise damaged(path, f"'generation' must be a whole number from 0 to {MAX_GENERATION}, got {described(number)}")
    chunked = manifest.get("chunked", [])
    if not isinstance(chunked, list) or not all(isinstance(owner, str) for owner in chunked):
        raise damaged(path, "'chunked' must be a list of document ids")
    settings = manifest.get("settings")
    if not isinstance(settings, dict):
        raise damaged(path, "no 'settings' object")
    known = {f.name: f for f in fields(IndexSettings)}
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise damaged(path, f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}")
    for name, value in settings.items():
        default = known[name].default
        if value is None and (default is None or default is MISSING):
            continue
        if isinstance(default, bool):
            ok, what = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif "float" in str(known[name].type):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            what = "a positive number"
        else:
            ok, what = isinstance(value, str), "a string"
        if not ok:
            raise damaged(path, f"settings.{name} must be {what}, got {value!r}")
        if name in CHOICES and value not in CHOICES[name]:
            raise damaged(path, f"settings.{name} must be one of {', '.join(CHOICES[name])}, got {value!r}")
    if settings.get("max_doc_tokens", MIN_DOC_TOKENS) < MIN_DOC_TOKENS:
        raise damaged(path, f"settings.max_doc_tokens must be at least {MIN_DOC_TOKENS}")
    model = manifest.get("model")
    if not isinstance(model, dict) or any(not isinstance(model.get(key), str) for key in MODEL_FIELDS) \
            or any(not isinstance(model.get(key), (str, type(None))) for key in ("path", "backend")):
        raise damaged(path, f"'model' must be an object with the strings {', '.join(MODEL_FIELDS)}")
    return manifest
