"""The backend seam: what a backend is, what it declares, and the registry of backends by name.

A backend runs a question's rows: it loads a model, encodes a document into a cache of its own
kind (kept in a directory of a store or of the request cache), and opens rows for a question
that the one decoding loop (``pced.decoding.loop``) drives with the one rule. Each backend is a package
under ``pced.backends`` with one ``Backend`` subclass, and one line in ``REGISTRY``; a backend that
lives in another distribution registers the same line as an entry point in the ``pced.backends``
group (``name = "package.module:Class"``), or calls ``register_backend`` at import.

Everything above the engines (the CLI, the server, ``pced eval``, ``pced bench``, the store and
``AskOptions``) asks the backend object, never compares its name: its capabilities and refusals,
its settings dataclass and command-line flags, its cache directories, its bench hooks are written
once, in the backend. The shape follows vLLM's platforms (one class a platform, resolved from a
qualified name when first needed) and LangChain's chat models (one base class, capabilities as
data the callers read).

A backend's module is imported when it is first asked for and must import nothing heavy at module
level (torch, its engine): ``pced --version`` and the store's metadata commands build the
command line of every registered backend. A plug-in that does not load is left out with one
``PluginWarning`` and refused by name (``PluginError``), so that it takes nothing else down.
"""

from .protocol import DEFAULT_BACKEND, REQUIRED_HOOKS, Backend, Capabilities, NoSettings, PluginError, WorkShape
from .registry import (ENTRY_POINT_GROUP, REGISTRY, PluginWarning, all_backends, backend_names, get_backend,
                       register_backend, set_aside, unregister_backend)

__all__ = ["Backend", "Capabilities", "DEFAULT_BACKEND", "ENTRY_POINT_GROUP", "NoSettings", "PluginError",
           "PluginWarning", "REGISTRY", "REQUIRED_HOOKS", "WorkShape", "all_backends", "backend_names", "get_backend",
           "register_backend", "set_aside", "unregister_backend"]
