"""The schema of a store's ``manifest.json``: checked on every open, so that a manifest that is
not an object, lacks a section, or holds a setting this version does not know is one line that
names the file, never a KeyError, AttributeError or TypeError from deep inside a reader."""

from __future__ import annotations

import math
from dataclasses import MISSING, fields
from pathlib import Path

from ..options import STORAGE_DTYPES
from ..text.prompts import TEMPLATES
from .layout import FORMAT, IndexSettings, StoreError

MODEL_FIELDS = ("name", "fingerprint", "tokenizer_hash")  # what opening a store compares with the model
CHOICES = {"template": tuple(TEMPLATES), "storage_dtype": STORAGE_DTYPES}
MIN_DOC_TOKENS = 16


def check_manifest(path: Path, manifest: object) -> dict:
    """``manifest`` (the parsed ``path``) if it fits the schema; else a ``StoreError`` naming the file."""

    def damaged(what: str) -> StoreError:
        return StoreError(f"{path}: {what}; this is not a manifest pced wrote (re-run pced index into a new store)")

    if not isinstance(manifest, dict):
        raise damaged(f"expected a JSON object, found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{path}: store format {manifest.get('format')!r} is not supported (expected {FORMAT})")
    settings = manifest.get("settings")
    if not isinstance(settings, dict):
        raise damaged("no 'settings' object")
    known = {f.name: f for f in fields(IndexSettings)}
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise damaged(f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}")
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
            raise damaged(f"settings.{name} must be {what}, got {value!r}")
        if name in CHOICES and value not in CHOICES[name]:
            raise damaged(f"settings.{name} must be one of {', '.join(CHOICES[name])}, got {value!r}")
    if settings.get("max_doc_tokens", MIN_DOC_TOKENS) < MIN_DOC_TOKENS:
        raise damaged(f"settings.max_doc_tokens must be at least {MIN_DOC_TOKENS}")
    model = manifest.get("model")
    if not isinstance(model, dict) or any(not isinstance(model.get(key), str) for key in MODEL_FIELDS):
        raise damaged(f"'model' must be an object with the strings {', '.join(MODEL_FIELDS)}")
    return manifest
