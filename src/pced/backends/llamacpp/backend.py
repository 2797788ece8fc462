"""``LlamaCppBackend``: PCED on llama.cpp, declared for the registry (``pced.backend``).

A GGUF model as it ships (``model.LlamaModel``), sequences as rows (``rows.LlamaExpertRows``),
document caches as stored sequence states in ``STORE/llamacpp-<cache type>/``
(``states.StateStore``). It runs PCED only: the baselines go to the default backend. Nothing heavy
is imported at module level (llama-cpp-python loads with the first model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...backend import Backend, Capabilities
from ...errors import UserError
from .settings import LLAMA_CACHE_TYPES, LlamaSettings

CACHE_PREFIX = "llamacpp-"  # STORE/llamacpp-<cache type>/: one directory per KV cache type
DEFAULTS = LlamaSettings()


class LlamaCppBackend(Backend):
    name = "llamacpp"
    summary = "a GGUF model on llama.cpp (--model file.gguf); pced only; pip install 'pced[llamacpp]'"
    capabilities = Capabilities(methods=("pced",))
    settings_class = LlamaSettings

    # -- settings -------------------------------------------------------------------------
    def add_options(self, group, command: str = "ask") -> None:
        group.add_argument("--cache-type", choices=LLAMA_CACHE_TYPES, default=DEFAULTS.cache_type,
                           help=f"llamacpp: the KV cache type, also of stored sequence states (default {DEFAULTS.cache_type})")
        group.add_argument("--gpu-layers", type=int, default=DEFAULTS.gpu_layers, metavar="N",
                           help="llamacpp: layers on the GPU when llama-cpp-python was built with one (Metal, CUDA); "
                                "default: all there, none on a CPU build; 0 keeps the CPU")

    def settings_from_args(self, args) -> LlamaSettings:
        """--cache-type and --gpu-layers (threads: --threads, through torch's setting)."""
        gpu_layers = getattr(args, "gpu_layers", DEFAULTS.gpu_layers)
        if gpu_layers is not None and gpu_layers < 0:
            raise UserError(f"--gpu-layers must be 0 or more (got {gpu_layers})")
        return LlamaSettings(cache_type=getattr(args, "cache_type", DEFAULTS.cache_type), gpu_layers=gpu_layers)

    def run_label(self, settings: LlamaSettings) -> str:
        return f"{self.name}:{settings.cache_type}"

    # -- the model ------------------------------------------------------------------------
    def load_model(self, model: str | None, settings: LlamaSettings, device: str | None = None, dtype: str = "auto") -> Any:
        from .model import LlamaModel

        return LlamaModel(model, settings)

    # -- document caches ------------------------------------------------------------------
    def cache_name(self, settings: LlamaSettings) -> str:
        return f"{CACHE_PREFIX}{settings.cache_type}"

    def cache_dirs(self, root: Path) -> list[Path]:
        return sorted(p for p in Path(root).glob(f"{CACHE_PREFIX}*") if p.is_dir())

    def request_cache_dir(self, cache_dir, model: Any, template: Any, settings: LlamaSettings,
                          storage_dtype: str = "float16") -> Path:
        """``llamacpp-<cache type>/`` under a request cache directory (beside the transformers caches,
        as in a store), or a folder per GGUF, template and cache type under the cache root: one
        layout for the server and ``pced generate``, each cache type its own."""
        if cache_dir is not None:
            return self.cache_dir(Path(cache_dir), settings)
        from ...llm import cache_root

        return cache_root() / "kv" / f"{model.name}-{model.fingerprint[:8]}-{template.name}-{self.cache_name(settings)}"

    def open_caches(self, model: Any, builder: Any, directory: Path, settings: LlamaSettings, **policy: Any) -> Any:
        from .states import StateStore

        return StateStore(directory, model, builder, budget_bytes=policy.get("budget_bytes"),
                          on_demand=policy.get("on_demand", False))

    def cache_files(self, directory: Path) -> Path:
        return Path(directory) / "seq"

    def verify_caches(self, directory: Path, remove: bool = False, referenced: set[str] | None = None) -> dict:
        from .verify import verify_state_dir

        return verify_state_dir(Path(directory), remove=remove, referenced=referenced)

    def check_cache(self, directory: Path, path: Path, digest: str) -> dict:
        from .verify import check_state_bytes

        return check_state_bytes(Path(directory), path, digest)

    # -- a question -----------------------------------------------------------------------
    def expert_rows(self, generator: Any, candidates: list, question: str, sampling: Any, rule: Any,
                    max_joins: int = 0) -> Any:
        from .rows import LlamaExpertRows

        caches, builder, llm = generator.caches, generator.builder, generator.llm
        digests = caches.add([c.document.render() for c in candidates])
        rows = LlamaExpertRows(llm, caches.prefix(), [lambda d=d: caches.load(d) for d in digests],
                               builder.suffix_ids(question, with_context=True),
                               builder.suffix_ids(question, with_context=False), sampling.max_new_tokens)
        if max_joins:  # room for joining documents: a quarter of the window per join, at most (a join is refused past it)
            rows.reserve(max_joins * (llm.max_context or 2048) // 4)
        return rows

    # -- bench hooks ----------------------------------------------------------------------
    def work_shape(self, generator: Any) -> Any:
        """The GGUF's tensors as shipped and the KV cache in the context's cache type."""
        from .bench import gguf_work_shape

        return gguf_work_shape(generator.llm.path, generator.settings.cache_type)

    def bench_kernel_step(self, generator: Any, rows: int) -> tuple[float, int]:
        from .bench import kernel_step

        return kernel_step(generator.llm, rows)
