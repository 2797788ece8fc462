"""``pced serve``: an OpenAI-compatible HTTP server (FastAPI) over a DocumentStore, plus a page at ``/``.

The names below load on first use, so that importing ``pced.server.limits`` (the command line's
defaults) does not load FastAPI."""

__all__ = ["create_app", "Limits", "RequestError"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "Limits":
        from .limits import Limits

        return Limits
    if name == "RequestError":
        from .schemas import RequestError

        return RequestError
    raise AttributeError(f"module 'pced.server' has no attribute {name!r}")
