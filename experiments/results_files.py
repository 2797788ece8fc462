"""How the experiments save what they measure: JSON for programs, Markdown for people."""

from __future__ import annotations

import json
from pathlib import Path


def save(out: str | Path, stem: str, results: dict, text: str) -> None:
    """``results`` as OUT/STEM.json and ``text`` as OUT/STEM.md (OUT created), and ``text`` printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (out / f"{stem}.md").write_text(text)
    print(text)
