"""``pced serve``: an OpenAI-compatible HTTP server (FastAPI) over a DocumentStore, plus a page at ``/``."""

from .schemas import Limits, RequestError


def __getattr__(name: str):
    # FastAPI takes seconds to import; building the command line's parser needs only Limits
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module 'pced.server' has no attribute {name!r}")


__all__ = ["create_app", "Limits", "RequestError"]
