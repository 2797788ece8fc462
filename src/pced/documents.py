"""The document record shared by the store, retrieval, decoding and evaluation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    """One retrievable passage. ``text`` is the body; ``title`` is optional."""

    id: str
    text: str
    title: str = ""

    def render(self) -> str:
        """The text an LLM sees for this document (title on its own line when present)."""
        body = self.text.strip()
        title = self.title.strip()
        return f"{title}\n{body}" if title else body
