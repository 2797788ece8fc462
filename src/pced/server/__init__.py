"""``pced serve``: an OpenAI-compatible HTTP server (FastAPI) over a DocumentStore, plus a page at ``/``."""

from .app import create_app
from .schemas import Limits, RequestError

__all__ = ["create_app", "Limits", "RequestError"]
