"""A backend that lives in the tests: the default backend's rows under another name, with a settings
dataclass, a flag and a cache folder of its own (``STORE/renamed-rows/``). Everything pced does with
it goes through the registry (``pced.backend``): registering it is one line, ``register_backend(NAME,
RenamedRows)`` or the entry point ``renamed-rows = helpers.renamed_backend:RenamedRows`` in the
``pced.backends`` group, and nothing outside this file knows it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pced.backend import Capabilities
from pced.backends.transformers import TransformersBackend

NAME = "renamed-rows"


@dataclass(frozen=True)
class RenamedSettings:
    label: str = "plain"  # recorded in an evaluation's run label; changes nothing else


class RenamedRows(TransformersBackend):
    name = NAME
    summary = "the default backend's rows under another name (a test backend)"
    capabilities = Capabilities(methods=("pced",))
    settings_class = RenamedSettings

    def add_options(self, group, command: str = "ask") -> None:
        group.add_argument("--renamed-label", default=RenamedSettings.label, help="renamed-rows: a label")

    def settings_from_args(self, args) -> RenamedSettings:
        return RenamedSettings(getattr(args, "renamed_label", RenamedSettings.label))

    def run_label(self, settings: RenamedSettings) -> str:
        return f"{self.name}:{settings.label}"

    def cache_name(self, settings) -> str:
        return self.name

    def cache_dirs(self, root: Path) -> list[Path]:
        return [Path(root) / self.name] if (Path(root) / self.name).is_dir() else []

    def request_cache_dir(self, cache_dir, model, template, settings, storage_dtype: str = "float16") -> Path:
        return super().request_cache_dir(cache_dir, model, template, settings, storage_dtype) / self.name
