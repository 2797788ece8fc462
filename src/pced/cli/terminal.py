"""Text for a terminal: user text (questions, ids, titles, answer tokens that copy a document)
is shown literally, its control characters as visible escapes rather than sent to the terminal."""

from __future__ import annotations

import sys
import unicodedata

BIDI_CONTROLS = set(range(0x202A, 0x202F)) | set(range(0x2066, 0x206A))


def printable(text: str, newlines: bool = True) -> str:
    """``text`` safe for a terminal: control characters (ESC, CSI, BEL, ...) and bidirectional
    overrides become visible escapes (``\\x1b``); tabs stay, and newlines unless ``newlines`` is False."""
    keep = "\t\n" if newlines else "\t"
    out = []
    for char in text:
        code = ord(char)
        if (unicodedata.category(char) == "Cc" and char not in keep) or code in BIDI_CONTROLS:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)


def report(kind: str, message: str) -> None:
    """One ``pced: <kind>: ...`` line on stderr ("error", "warning"), whatever ``message`` holds:
    its user text (a path, a typed command, a question) shown literally."""
    print(f"pced: {kind}: {printable(message, newlines=False)}", file=sys.stderr)


def count(n: int, thing: str, plural: str | None = None) -> str:
    """``n`` and the noun in the number it takes: "1 document", "3 documents", "0 entries"."""
    return f"{n:,} {thing if n == 1 else plural or thing + 's'}"
