"""A backend plug-in that cannot be used takes nothing else down: installed plug-ins that fail to
import, name a missing class, name a class that is not a ``Backend``, declare another name, leave
out a hook, take a built-in's name or bring a flag that clashes with a command's are each one
warning line naming the distribution and entry point, every other backend and command works, and
naming one with --backend is its one-line error (exit 2)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import pytest

import pced.backend.registry as registry
from helpers.cli import run_pced, write_jsonl
from helpers.server import CORPUS, QUESTION
from pced.backend import REGISTRY, Backend, all_backends, get_backend, register_backend, unregister_backend
from pced.cli import main
from pced.errors import UserError

# entry point name -> (distribution, "module:attribute", what its warning says)
BROKEN = {
    "boom": ("boom-backend", "pced_plugin_boom:Boom", "RuntimeError: the engine is not installed"),
    "gone": ("gone-backend", "pced_plugins_bad:Nowhere", "AttributeError: module 'pced_plugins_bad' has no attribute 'Nowhere'"),
    "plain": ("plain-backend", "pced_plugins_bad:Plain",
              "TypeError: <class 'pced_plugins_bad.Plain'> is not a subclass of pced.backend.Backend"),
    "liar": ("liar-backend", "pced_plugins_bad:Liar", "TypeError: Liar declares the name 'someone-else'"),
    "hollow": ("hollow-backend", "pced_plugins_bad:Hollow", "TypeError: Hollow does not implement Backend.load_model, "
               "Backend.request_cache_dir, Backend.open_caches, Backend.cache_files, Backend.verify_caches, Backend.expert_rows"),
    "flaggy": ("flaggy-backend", "pced_plugins_bad:Flaggy", "its flags for pced ask: ArgumentError: argument --top-k: "
               "conflicting option string: --top-k"),
    "transformers": ("clash-backend", "pced_plugins_bad:Liar", "is ignored: 'transformers' is a built-in backend"),
}
MODULES = {
    "pced_plugin_boom": 'raise RuntimeError("the engine is not installed")\n',
    "pced_plugins_bad": '''from pced.backend import Backend
from pced.backends.transformers import TransformersBackend


class Plain:
    name = "plain"


class Liar(TransformersBackend):
    name = "someone-else"


class Hollow(Backend):
    name = "hollow"


class Flaggy(TransformersBackend):
    name = "flaggy"
    summary = "the default rows with a flag that pced ask already has"

    def add_options(self, group, command="ask"):
        group.add_argument("--top-k")
''',
}


def warning_line(name: str) -> str:
    distribution, value, why = BROKEN[name]
    return f"backend plug-in {name!r} (entry point {name} = {value}, distribution {distribution} 0.1) " + (
        why if why.startswith("is ignored") else f"cannot be used: {why}")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder of installed distributions, one broken backend plug-in each, as pip would leave them."""
    site = tmp_path_factory.mktemp("site")
    for name, (distribution, value, _) in BROKEN.items():
        info = site / f"{distribution.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[pced.backends]\n{name} = {value}\n")
    for module, source in MODULES.items():
        (site / f"{module}.py").write_text(source)
    return site


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as a fresh process finds it (nothing loaded, refused or warned about yet)."""
    for state, empty in (("_LOADED", {}), ("_BROKEN", {}), ("_WARNED", set())):
        monkeypatch.setattr(registry, state, empty, raising=False)


@pytest.fixture
def installed(site, monkeypatch, fresh_registry):
    """The broken plug-ins installed in this process."""
    monkeypatch.syspath_prepend(str(site))
    yield site
    for module in MODULES:
        sys.modules.pop(module, None)


def test_each_broken_plugin_is_one_warning_and_the_built_ins_work(installed, capsys, tmp_path):
    assert main(["ask", str(tmp_path / "missing"), QUESTION, "--backend", "boom"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert sorted(err[:-1]) == sorted(f"pced: warning: {warning_line(name)}" for name in BROKEN)
    assert err[-1] == f"pced: error: {warning_line('boom')}"
    for name in set(BROKEN) - {"transformers"}:
        with pytest.raises(UserError) as refused:  # pced.backend.PluginError
            get_backend(name)
        assert str(refused.value) == warning_line(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [b.name for b in all_backends()] == list(REGISTRY)  # warned once a process: no second warning
    assert not [w for w in caught if "plug-in" in str(w.message)]
    assert type(get_backend("transformers")).__name__ == "TransformersBackend"  # the built-in, not the clash


class Unfinished(Backend):
    name = "unfinished"
    summary = "a backend that implements none of its hooks"


@pytest.fixture
def unfinished(fresh_registry):
    register_backend(Unfinished.name, Unfinished)
    yield
    unregister_backend(Unfinished.name)


def test_a_backend_without_a_hook_pced_calls_is_refused_naming_it(unfinished, capsys, tmp_path):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "Mira Quell was born in Oskvale.", "score": 0.9}])
    assert main(["generate", "--docs", str(docs), "--question", QUESTION, "--backend", "unfinished"]) == 2
    why = (f"backend 'unfinished' (registered as {Unfinished!r}) cannot be used: TypeError: Unfinished does not implement "
           f"Backend.load_model, Backend.request_cache_dir, Backend.open_caches, Backend.cache_files, "
           f"Backend.verify_caches, Backend.expert_rows")
    assert capsys.readouterr().err.splitlines() == [f"pced: warning: {why}", f"pced: error: {why}"]
    with pytest.raises(UserError, match=r"^the backend 'unfinished' \(test_backend_plugins.Unfinished\) does not "
                                          r"implement Backend.load_model$"):
        Unfinished().load_model(None, None)  # an instance handed over directly, not through the registry


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """A store for each built-in backend that runs here: transformers on the tiny model, llama.cpp on
    the embedded GGUF (vLLM takes minutes to start; tests/test_vllm_*.py run it)."""
    root = tmp_path_factory.mktemp("plugins")
    corpus = write_jsonl(root / "corpus.jsonl", [{"id": i, "title": t, "text": x} for i, t, x in CORPUS])
    assert main(["index", str(corpus), "--out", str(root / "transformers"), "--model", str(tiny_model_dir),
                 "--storage-dtype", "float32"]) == 0
    stores = {"transformers": root / "transformers"}
    if importlib.util.find_spec("llama_cpp") is not None:  # pced[llamacpp] installed
        assert main(["index", str(corpus), "--out", str(root / "llamacpp"), "--backend", "llamacpp"]) == 0
        stores["llamacpp"] = root / "llamacpp"
    return stores


@pytest.mark.slow
def test_pced_runs_with_broken_plugins_installed(site, stores, tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    expected = sorted(f"pced: warning: {warning_line(name)}" for name in BROKEN)
    ask = [QUESTION, "--json", "--top-k", "3", "--max-new-tokens", "4", "--threads", "1", "--retriever", "sparse"]
    runs = [(["--version"], "pced "), (["--help"], "usage: pced"),
            (["ask", str(stores["transformers"]), *ask, "--model", str(tiny_model_dir)], '{"answer"')]
    if "llamacpp" in stores:
        runs.append((["ask", str(stores["llamacpp"]), *ask, "--backend", "llamacpp"], '{"answer"'))
    for argv, out in runs:
        result = run_pced(*argv, env=env)
        assert result.returncode == 0 and result.stdout.startswith(out), (argv, result.stderr)
        assert sorted(result.stderr.splitlines()) == expected, argv
        if argv[0] == "ask":
            assert json.loads(result.stdout)["trace"]
