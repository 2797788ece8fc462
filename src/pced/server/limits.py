"""The server's request limits (plain data: the command line reads their defaults without loading
the web framework)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError
from ..options import MAX_QUESTION_CHARS, MAX_TOP_K, MAX_TOP_N, GivenDocuments
from ..decoding.sampling import SamplingConfig

SAMPLING = SamplingConfig()


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (every violation is a 4xx), and how long the server drains as it stops."""

    max_body_bytes: int = 1_000_000
    max_question_chars: int = MAX_QUESTION_CHARS
    max_documents: int = GivenDocuments.max_documents
    max_document_chars: int = GivenDocuments.max_document_chars
    request_cache_gb: float = GivenDocuments.cache_gb  # request documents' KV caches (never the store's)
    max_top_k: int = MAX_TOP_K
    max_top_n: int = MAX_TOP_N
    max_tokens: int = 1024
    default_max_tokens: int = SAMPLING.max_new_tokens
    max_stop: int = 4
    max_stop_chars: int = 64
    max_queue: int = 64
    max_concurrent: int = 32  # questions decoding at once on a backend whose engine batches them (others: one)
    request_timeout_s: float = 120.0  # one request's retrieval and generation, from when it starts running
    # after SIGTERM, how long accepted requests may still run (so that with the engine's shutdown the
    # server is gone within Kubernetes' default 30 s grace period); then they end with a 503
    drain_timeout_s: float = 20.0
    store_poll_s: float = 2.0  # how often the server looks for a new store generation between requests (0: only before one)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise UserError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.request_timeout_s <= 0:
            raise UserError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")
