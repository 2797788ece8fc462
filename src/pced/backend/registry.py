"""The registry of backends by name: the built-ins (``REGISTRY``), plug-ins of other distributions
(entry points of the ``pced.backends`` group) and run-time registrations (``register_backend``).
A backend's class is imported when it is first asked for; a plug-in that does not load is left out
with one ``PluginWarning`` naming it and refused by name (``PluginError``), so that it takes nothing
else down."""

from __future__ import annotations

import threading
import warnings
from importlib import import_module
from typing import Any

from ..errors import UserError
from .protocol import REQUIRED_HOOKS, Backend, PluginError

REGISTRY: dict[str, str] = {
    "transformers": "pced.backends.transformers:TransformersBackend",
    "llamacpp": "pced.backends.llamacpp:LlamaCppBackend",
    "vllm": "pced.backends.vllm:VLLMBackend",
}
ENTRY_POINT_GROUP = "pced.backends"
class PluginWarning(UserWarning):
    """A backend plug-in left out (it cannot be used, or takes a built-in's name); the others work."""


_LOCK = threading.Lock()
_LOADED: dict[str, Backend] = {}
_EXTRA: dict[str, str | type] = {}  # registered at run time (register_backend)
_BROKEN: dict[str, str] = {}  # name -> why it cannot be used (a PluginError's line)
_WARNED: set[str] = set()


def register_backend(name: str, target: str | type) -> None:
    """Add a backend: ``target`` a ``Backend`` subclass or its "module:Class" name."""
    with _LOCK:
        _EXTRA[name] = target
        _LOADED.pop(name, None), _BROKEN.pop(name, None)


def unregister_backend(name: str) -> None:
    """Remove a backend added by ``register_backend`` (the registry's own lines stay)."""
    with _LOCK:
        _EXTRA.pop(name, None), _LOADED.pop(name, None), _BROKEN.pop(name, None)


def _warn_once(message: str) -> None:
    with _LOCK:
        first = message not in _WARNED
        _WARNED.add(message)
    if first:
        warnings.warn(message, PluginWarning, stacklevel=3)


def _origin(ep: Any) -> str:
    dist = f"distribution {ep.dist.name} {ep.dist.version}" if getattr(ep, "dist", None) else "unknown distribution"
    return f"backend plug-in {ep.name!r} (entry point {ep.name} = {ep.value}, {dist})"


def _entry_points() -> dict[str, Any]:
    """The group's entry points by name, from the installed metadata (nothing imported). One that
    takes a built-in's name, or a name another distribution took first, is left out with a warning."""
    from importlib.metadata import entry_points

    found: dict[str, Any] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        taken = f"{ep.name!r} is a built-in backend" if ep.name in REGISTRY else (
            f"{_origin(found[ep.name])} has that name" if ep.name in found else None)
        if taken:
            _warn_once(f"{_origin(ep)} is ignored: {taken}")
        else:
            found[ep.name] = ep
    return found


def backend_names() -> tuple[str, ...]:
    """Every registered name (nothing imported): the registry's, then entry points and run-time
    registrations, with any that will not load (``all_backends`` leaves those out)."""
    with _LOCK:
        extra = dict(_EXTRA)
    return tuple(dict.fromkeys([*REGISTRY, *_entry_points(), *extra]))


def _resolve(target: str | type) -> Any:
    module, _, attribute = target.partition(":") if isinstance(target, str) else ("", "", "")
    return getattr(import_module(module), attribute) if module else target


def _load_plugin(name: str, target: str | type) -> Backend:
    cls = _resolve(target)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{cls!r} is not a subclass of pced.backend.Backend")
    missing = [hook for hook in REQUIRED_HOOKS if getattr(cls, hook) is getattr(Backend, hook)]
    if missing:
        raise TypeError(f"{cls.__qualname__} does not implement {', '.join('Backend.' + m for m in missing)}")
    backend = cls()
    if backend.name != name:
        raise TypeError(f"{cls.__qualname__} declares the name {backend.name!r}")
    return backend


def _origin_of(name: str, target: Any) -> tuple[str, Any]:
    """Where a registered name comes from, for its messages, and what to load for it."""
    if target is not None:
        return f"backend {name!r} (registered as {target!r})", target
    ep = _entry_points().get(name)
    if ep is None:
        raise UserError(f"unknown backend {name!r}; choose one of {', '.join(backend_names())}")
    return _origin(ep), ep.value


def get_backend(name: str | Backend) -> Backend:
    """The backend of that name (its class imported on first use); a UserError for an unknown name,
    a PluginError (which plug-in, from where, why) for one that cannot be used."""
    if isinstance(name, Backend):
        return name
    with _LOCK:
        if name in _LOADED:
            return _LOADED[name]
        if name in _BROKEN:
            raise PluginError(_BROKEN[name])
        target = _EXTRA.get(name) or REGISTRY.get(name)
    if target is not None and target == REGISTRY.get(name):
        backend = _resolve(target)()  # a built-in that fails to load is pced's bug: its traceback
    else:
        origin, target = _origin_of(name, target)
        try:
            backend = _load_plugin(name, target)
        except Exception as exc:  # the plug-in's own code: whatever it raises is its fault alone
            raise PluginError(set_aside(name, f"{type(exc).__name__}: {exc}", origin, warn=False)) from exc
    with _LOCK:
        return _LOADED.setdefault(name, backend)


def set_aside(name: str, why: str, origin: str | None = None, warn: bool = True) -> str:
    """Take a plug-in out of use (also where a front end finds it broken: a flag of its clashes with a
    command's): asking for it raises the returned line, which is warned about once."""
    origin = origin or _origin_of(name, _EXTRA.get(name))[0]
    message = f"{origin} cannot be used: {' '.join(why.split())}"
    with _LOCK:
        _LOADED.pop(name, None)
        _BROKEN[name] = message
    if warn:
        _warn_once(message)
    return message


def all_backends() -> list[Backend]:
    """Every backend that loads; one that does not is left out with a ``PluginWarning`` (once a
    process), so that a broken plug-in takes no other backend or command down."""
    backends = []
    for name in backend_names():
        try:
            backends.append(get_backend(name))
        except PluginError as exc:
            _warn_once(str(exc))
    return backends
