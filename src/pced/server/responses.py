"""Response bodies: the OpenAI chat shapes (with PCED's trace in an extra ``pced`` field), SSE
framing and the OpenAI-style error body."""

from __future__ import annotations

import json
import math
import time
import uuid

from ..text.answers import answer_json, experts_json
from .worker import Finished, Started


def clean(value):
    """JSON-safe: NaN and infinities (invalid JSON for browsers) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return clean(value.item())
    return value


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(payload: object) -> str:
    return f"data: {json.dumps(clean(payload), ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def experts_of(started: Started) -> list[dict]:
    return experts_json(started.candidates)


def pced_contract(started: Started, finished: Finished) -> dict:
    """The ``pced ask --json`` object (DESIGN.md); timings also carry the server's queue_s."""
    return answer_json(finished.answer, started.candidates, started.retrieval_s)


def trace_fields(started: Started, finished: Finished) -> dict:
    """What the chat endpoints add under ``pced``: the contract without the (duplicated) answer text."""
    fields = pced_contract(started, finished)
    fields.pop("answer")
    return fields


def usage(finished: Finished) -> dict:
    completion = len(finished.answer.trace)
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": completion,
            "total_tokens": finished.prompt_tokens + completion}


def chat_completion(completion_id: str, model: str, started: Started, finished: Finished) -> dict:
    message = {"role": "assistant", "content": finished.answer.text, "pced": trace_fields(started, finished)}
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finished.finish_reason, "logprobs": None}],
        "usage": usage(finished),
    }


def chunk(completion_id: str, model: str, delta: dict, finish_reason: str | None = None, **extra) -> dict:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        **extra,
    }


def first_chunk(completion_id: str, model: str, method: str, started: Started) -> dict:
    """The role, plus the experts up front so that a client can colour tokens as they arrive."""
    return chunk(completion_id, model, {"role": "assistant", "content": ""},
                 pced={"method": method, "experts": experts_of(started),
                       "timings": {"retrieval_s": started.retrieval_s, "queue_s": started.queue_s}})


def token_chunk(completion_id: str, model: str, step) -> dict:
    return chunk(completion_id, model, {"content": step.text}, pced={"index": step.index, "doc_id": step.doc_id})


def final_chunk(completion_id: str, model: str, started: Started, finished: Finished) -> dict:
    return chunk(completion_id, model, {}, finished.finish_reason, pced=trace_fields(started, finished),
                 usage=usage(finished))
