"""Incremental detokenization and stop handling, shared by every decoding loop and backend."""

from __future__ import annotations

from typing import Sequence


class TextTracker:
    """Turns chosen token ids into streamed text; knows when an answer is finished."""

    def __init__(self, tokenizer: object, eos_ids: set[int], stop: Sequence[str]):
        self.tokenizer, self.eos_ids, self.stop = tokenizer, eos_ids, tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.full = ""
        self.finished = False

    @classmethod
    def for_model(cls, llm, sampling) -> "TextTracker":
        """``llm``: anything with ``tokenizer`` and ``eos_token_ids()``; honours ``sampling.ignore_eos``."""
        return cls(llm.tokenizer, set() if sampling.ignore_eos else llm.eos_token_ids(), sampling.stop)

    def push(self, token: int) -> str:
        """Add a token; returns the text it adds (empty for EOS) and sets ``finished``.

        A character split across tokens decodes to U+FFFD until its last byte arrives, so a
        trailing replacement character is held back instead of streamed (``flush`` releases it).
        """
        if token in self.eos_ids:
            self.finished = True
            return ""
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stop:
            cut = full.find(stop)
            if cut >= 0:
                full, self.finished = full[:cut], True
        self.full = full
        stable = full if self.finished else full.rstrip("\ufffd")
        piece, self.text = stable[len(self.text) :], stable
        return piece

    def truncate(self, keep: int) -> None:
        """Keep the first ``keep`` tokens and finish (the loop guard cut a repeat off). The text is
        what those tokens streamed; ``flush`` releases an incomplete character held at the end."""
        self.ids = self.ids[:keep]
        self.full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.text = self.full.rstrip("\ufffd")
        self.finished = True

    def flush(self) -> str:
        """Whatever was held back (an incomplete character at the very end)."""
        rest = self.full[len(self.text) :]
        self.text += rest
        return rest
