"""What a metadata command loads: ``pced --version``, every command's ``--help`` and the store verbs
that read files (list, show, stats, sync, remove) import no torch and no model, each in a fresh process.
Their speed is measured by ``experiments/startup_times.py``, not here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.cli import write_jsonl
from helpers.server import CORPUS
from pced.cli import main

PROBE = ("import sys\nfrom pced.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as exc:\n"
         "    code = exc.code or 0\nloaded = [m for m in ('torch', 'transformers', 'sentence_transformers') if m in sys.modules]\n"
         "print('LOADED=' + ','.join(loaded), file=sys.stderr)\nsys.exit(code)")


def loaded(*args: str) -> tuple[int, list[str]]:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=300)
    line = [x for x in done.stderr.splitlines() if x.startswith("LOADED=")][-1]
    return done.returncode, [m for m in line.removeprefix("LOADED=").split(",") if m]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("startup")
    corpus = write_jsonl(root / "corpus.jsonl", [{"id": i, "title": t, "text": x} for i, t, x in CORPUS])
    assert main(["index", str(corpus), "--out", str(root / "store"), "--model", str(tiny_model_dir)]) == 0
    return root / "store"


@pytest.mark.slow
def test_version_and_every_help_load_no_torch():
    commands = [["--version"], ["--help"]] + [[c, "--help"] for c in ("index", "ask", "chat", "demo", "generate", "serve",
                                                                       "eval", "bench", "verify")]
    commands += [["store", verb, "--help"] for verb in ("list", "show", "remove", "stats", "sync", "verify")]
    for command in commands:
        code, heavy = loaded(*command)
        assert code == 0 and heavy == [], (command, heavy)


@pytest.mark.slow
def test_store_verbs_that_read_files_load_no_torch_and_no_model(store):
    for command in (["store", "list", str(store)], ["store", "show", str(store), "quell"], ["store", "stats", str(store)],
                    ["store", "sync", str(store), str(store.parent / "copy")], ["store", "remove", str(store), "vantor"]):
        code, heavy = loaded(*command)
        assert code == 0 and heavy == [], (command, heavy)
    code, _ = loaded("store", "show", str(store), "vantor")
    assert code == 2  # removed, without a model
