"""What a backend is: the ``Backend`` base class with its hooks and their defaults, what it declares
(``Capabilities``, its settings dataclass, ``WorkShape`` for the bench's floors), and the error for a
backend that cannot be used (``PluginError``). Nothing heavy is imported: every command line is
built from these classes without torch."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import UserError

# name -> "module:Class". The default backend answers every method; a request another backend does
# not run (a baseline method, decode-time relevance) goes to it.
DEFAULT_BACKEND = "transformers"
# The hooks without a default: a class that leaves one out is refused as it loads, not mid-question.
REQUIRED_HOOKS = ("load_model", "request_cache_dir", "open_caches", "cache_files", "verify_caches", "expert_rows")


class PluginError(UserError):
    """A backend that cannot be used: one line naming it, where it comes from, and why."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend does itself. What it does not is refused in one line (``Backend.refusal``),
    the same for the CLI, the library, the server and ``pced eval``."""

    methods: tuple[str, ...] | None = None  # the methods it runs (None: every one)
    sampling: bool = True  # temperature > 0 (False: greedy only)
    no_repeat_ngram: bool = True  # the loop's n-gram ban
    decode_time_relevance: bool = True  # --rescore, --max-joins
    request_documents: bool = True  # documents sent with a question (the server, pced generate)
    concurrent_questions: bool = False  # questions decode together in one engine (the server's wide lane)
    own_caches: bool = True  # encodes document caches of its own kind (else it reads another backend's)


@dataclass(frozen=True)
class WorkShape:
    """What one token costs a backend as it runs, for the bench's floors (``pced.bench.floors``,
    which writes the formulas in these symbols)."""

    weight_bytes: int  # W: weights one decode step reads, as held (the input embedding only if it is the output layer)
    matmul_params: int  # P: weights multiplied per token, every linear map and the output layer
    output_params: int  # P_out: the output layer's
    layers: int  # L
    heads: int  # H: query heads (grouped-query attention shares keys and values, not FLOPs)
    key_dim: int  # d_k
    value_dim: int  # d_v
    kv_bytes_per_cell: float  # c: keys and values of one cell across all layers, in the running cache's type
    matrices: tuple[tuple[int, int], ...]  # (inner, outer) of each distinct per-layer weight matrix
    output: tuple[int, int]  # (inner, outer) of the output layer
    gemm_dtype: str = "float32"  # the dtype whose GEMM rate is the floor's arithmetic peak
    described_as: str = ""  # weights and KV as run, for the report

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class NoSettings:
    """The settings of a backend that has none of its own."""


class Backend:
    """One backend. Subclasses set the class attributes and implement the engine hooks; the defaults
    here are those of a backend without settings, flags or a bench of its own."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for --backend's help: what it runs and what it needs
    capabilities: ClassVar[Capabilities] = Capabilities()
    settings_class: ClassVar[type] = NoSettings

    def __repr__(self) -> str:
        return f"<backend {self.name}>"

    def missing_hook(self, hook: str) -> PluginError:
        """The error for a hook its class leaves out (the registry refuses such a class as it loads)."""
        cls = type(self)
        return PluginError(f"the backend {self.name!r} ({cls.__module__}.{cls.__qualname__}) does not implement Backend.{hook}")

    # -- settings -------------------------------------------------------------------------
    def settings(self, value: Any = None) -> Any:
        """``value`` (this backend's settings dataclass) or the defaults; a UserError for another's."""
        if value is None:
            return self.settings_class()
        if not isinstance(value, self.settings_class):
            raise UserError(f"the {self.name} backend takes {self.settings_class.__name__}, got {type(value).__name__}")
        return value

    def add_options(self, group: argparse._ArgumentGroup, command: str = "ask") -> None:
        """Its own command-line flags for ``command`` (index, ask, chat, generate, serve, eval,
        bench), none by default. Every flag's default is None or the settings dataclass's, so that
        a flag left unset means that dataclass's default."""

    def settings_from_args(self, args: argparse.Namespace) -> Any:
        """Its settings from parsed flags (a subcommand without them: the defaults)."""
        return self.settings_class()

    def run_label(self, settings: Any) -> str:
        """How an evaluation run records this backend (runs of different labels never mix)."""
        return self.name

    def refusal(self, options: Any) -> str | None:
        """Why ``options`` (an ``AskOptions``) cannot run on this backend, or None."""
        caps = self.capabilities
        if caps.methods is not None and options.method not in caps.methods:
            return (f"the {self.name} backend runs {', '.join(caps.methods)} only; use --backend "
                    f"{DEFAULT_BACKEND} for {options.method}")
        if not caps.decode_time_relevance and (options.rescore or options.max_joins):
            return f"decode-time relevance (--rescore, --max-joins) does not run on the {self.name} backend"
        if not caps.sampling and options.sampling.temperature > 0:
            return f"the {self.name} backend decodes greedily: --temperature is not supported with --backend {self.name}"
        if not caps.no_repeat_ngram and options.sampling.no_repeat_ngram:
            return f"--no-repeat-ngram is not supported with --backend {self.name} (it decodes inside its engine's sampler)"
        return None

    def runs(self, options: Any) -> bool:
        """Whether the method and its decode-time features run here (sampling aside): the server
        sends what does not to the default backend's lane."""
        caps = self.capabilities
        return ((caps.methods is None or options.method in caps.methods)
                and (caps.decode_time_relevance or not (options.rescore or options.max_joins))
                and (caps.no_repeat_ngram or not options.sampling.no_repeat_ngram))

    # -- the model ------------------------------------------------------------------------
    def load_model(self, model: str | None, settings: Any, device: str | None = None, dtype: str = "auto") -> Any:
        """The model it answers with (``model``: a --model setting, None for the embedded one)."""
        raise self.missing_hook("load_model")

    def model_key(self, settings: Any) -> tuple:
        """Backends whose models load alike (same key) share one loaded model in a store."""
        return (self.name, settings)

    def prepare(self, model: Any, settings: Any) -> None:
        """Called before retrieval loads its libraries on a question's way (an engine that must
        start first starts here). Nothing by default."""

    # -- document caches ------------------------------------------------------------------
    def cache_name(self, settings: Any) -> str:
        """The folder of its caches in a store (and under a request-cache directory)."""
        return self.name

    def cache_dir(self, root: Path, settings: Any) -> Path:
        return Path(root) / self.cache_name(settings)

    def cache_dirs(self, root: Path) -> list[Path]:
        """Every cache directory of its kind under a store ``root`` (any settings): what
        ``pced store stats``, ``verify`` and ``remove`` cover. None for a backend that reads another's."""
        if not self.capabilities.own_caches:
            return []
        return sorted(p for p in Path(root).glob(f"{self.cache_name(self.settings_class())}*") if p.is_dir())

    def request_cache_dir(self, cache_dir: str | Path | None, model: Any, template: Any, settings: Any) -> Path:
        """Where documents sent with a question keep their caches: its folder under ``cache_dir``,
        or, without one, a folder per model, template and settings under the cache root."""
        raise self.missing_hook("request_cache_dir")

    def open_caches(self, model: Any, builder: Any, directory: Path, settings: Any, **policy: Any) -> Any:
        """The cache store of ``directory`` (``add``, ``load``, ``prefix``, ``stats``, ...); ``policy``:
        storage_dtype, tiers, budget_bytes, on_demand, recorded_model_path."""
        raise self.missing_hook("open_caches")

    def cache_files(self, directory: Path) -> Path:
        """The folder under a cache directory that holds one file per document (``<h[:2]>/<h>.safetensors``)."""
        raise self.missing_hook("cache_files")

    def verify_caches(self, directory: Path, remove: bool = False, referenced: set[str] | None = None) -> dict:
        """Check every file of a cache directory without a model: ``{"checked", "damaged": [lines],
        "removed", "without_checksum", "orphans", "orphans_removed"}``; a file whose content hash is
        not in ``referenced`` (None: all count) is an orphan, counted apart and deleted by ``remove``."""
        raise self.missing_hook("verify_caches")

    def check_cache(self, directory: Path, path: Path, digest: str) -> dict:
        """One document's cache file checked from its bytes, without torch or a model (header, sizes,
        identity, content hash, checksum; ``verify_caches`` runs the same check first): its metadata,
        or a one-line DataError. Optional: ``pced store show`` counts a file it cannot check as it is."""
        raise NotImplementedError

    def cache_estimate(self, model: Any, storage_dtype: str, token_counts: list[int]) -> dict | None:
        """Disk its caches of documents with ``token_counts`` tokens take, when known before encoding."""
        return None

    # -- a question -----------------------------------------------------------------------
    def expert_rows(self, generator: Any, candidates: list, question: str, sampling: Any, rule: Any,
                    max_joins: int = 0) -> Any:
        """PCED's rows (``decoding.Rows``): the amateur, then one row per candidate's document, from
        ``generator``'s model, prompt builder and caches; room for ``max_joins`` documents joining
        mid-answer (decode-time relevance)."""
        raise self.missing_hook("expert_rows")

    def pced_scoring(self, rows: Any, rule: Any, candidates: list) -> Any:
        """The loop's ``Scoring`` for PCED over ``rows``: the contrastive rule on their logits."""
        from ..decoding.loop import ContrastiveScoring

        return ContrastiveScoring(rule, [c.document.id for c in candidates], [c.relevance for c in candidates])

    # -- serving --------------------------------------------------------------------------
    def warm_up(self, store: Any, settings: Any) -> dict:
        """What ``pced serve`` does before the first request (beyond loading the model and the
        retrievers), and a report of it. Nothing by default."""
        return {}

    def health(self, generator: Any) -> dict:
        """The backend's counters for /health."""
        return {}

    def failure(self, generator: Any) -> str | None:
        """Why this process can answer with the backend no more (its engine died), or None. The
        server then refuses every request and exits for its supervisor to start a fresh process."""
        return None

    def shutdown(self) -> None:
        """Release what serving started (an engine's processes) as the server stops. Nothing by default."""

    # -- bench hooks ----------------------------------------------------------------------
    def bench_prepare(self, generator: Any, documents: list[str]) -> dict:
        """Before a bench times ``generator`` over ``documents`` (rendered texts): what the backend
        does with them first, and a report (e.g. an engine's start and warm-up seconds). Nothing
        by default: the documents' caches are encoded by the bench itself."""
        return {}

    def bench_forget(self, generator: Any) -> None:
        """Before a bench's question: forget what the backend kept from earlier questions (an
        engine's prefix cache), so the question reads its documents as a new process would. Nothing
        by default: the caches are read from their files every question."""
        return None

    def bench_threads(self, settings: Any) -> int | None:
        """The CPU threads its engine computes with when that is not this process's torch threads
        (an engine in processes of its own): the bench measures the machine's limits, so the floors,
        with as many. None: this process's."""
        return None

    def work_shape(self, generator: Any) -> WorkShape | None:
        """What one token costs ``generator``'s model on this backend, as it runs (None: the bench
        prints no floor for it)."""
        return None

    def bench_cache_bytes(self, generator: Any, files: list[Path]) -> int:
        """Bytes of the documents' cache ``files`` its first token reads (the floor's page-cache term):
        all of them by default."""
        return sum(Path(f).stat().st_size for f in files)

    def bench_kernel_step(self, generator: Any, rows: int) -> tuple[float, int] | None:
        """Its own kernels' speed, reported beside the floor: the best seconds of one decode step of
        ``rows`` rows, each attending the returned number of cells (None: it has no kernels of its
        own to time; torch's are the floor's)."""
        return None
