"""The one file-system helper: atomic writes with a plain file mode, directory swaps, temp names."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pced.fs import (atomic_path, atomic_save_tensors, atomic_write_json, atomic_write_text, recover_directory,
                     staging_dir, sweep_temporaries, swap_directory, temp_path)

SRC = Path(__file__).resolve().parents[1] / "src" / "pced"


def plain_mode(tmp_path: Path) -> int:
    (tmp_path / "plain").write_bytes(b"")
    return stat.S_IMODE((tmp_path / "plain").stat().st_mode)


def test_atomic_files_get_a_plain_open_s_mode(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "x")
    atomic_write_json(tmp_path / "b.json", {"x": 1})
    atomic_save_tensors(tmp_path / "c.safetensors", {"t": torch.zeros(2)}, {"k": "v"})
    for name in ("a.txt", "b.json", "c.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == plain_mode(tmp_path), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.json", "c.safetensors", "plain"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "old")
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "a.txt") as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert (tmp_path / "a.txt").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_directory_swap_and_its_recovery(tmp_path):
    target = tmp_path / "index"
    for version in ("one", "two"):
        with staging_dir(target) as staging:
            (staging / "v").write_text(version)
            swap_directory(staging, target)
    assert (target / "v").read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["index"]
    # a swap killed between its two renames: the old directory lies aside under a temporary name
    aside = temp_path(tmp_path / "index.old")
    os.replace(target, aside)
    recover_directory(target)
    assert (target / "v").read_text() == "two" and not aside.exists()
    # a staging folder of a killed writer is swept by the next writer
    temp_path(target).mkdir()
    assert sweep_temporaries(tmp_path) == 1 and [p.name for p in tmp_path.iterdir()] == ["index"]


@pytest.mark.slow
def test_importing_any_pced_module_leaves_the_umask_unchanged():
    code = (
        "import os, pkgutil, importlib, pced\n"
        "os.umask(0o027)\n"
        "for m in pkgutil.walk_packages(pced.__path__, 'pced.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print(oct(os.umask(0o022)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0o27"


def test_fs_is_the_only_maker_of_temporary_names():
    pattern = re.compile(r"mkstemp|mkdtemp|NamedTemporaryFile|TemporaryDirectory|token_hex|os\.umask|\.tmp-")
    users = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if pattern.search(p.read_text()))
    assert users == ["fs.py"]


def test_sweeping_with_keep_live_leaves_the_files_of_running_processes(tmp_path):
    import subprocess as sp

    finished = sp.Popen(["true"])
    finished.wait()
    mine = tmp_path / f".tmp-a.json.{os.getpid()}.abcd"
    dead = tmp_path / f".tmp-b.json.{finished.pid}.abcd"
    for path in (mine, dead):
        path.write_text("x")
    assert sweep_temporaries(tmp_path, keep_live=True) == 1
    assert mine.exists() and not dead.exists()


def test_a_file_another_host_replaced_while_it_was_read_is_read_again_by_its_name(tmp_path, monkeypatch):
    """NFS: a reader's open manifest.json renamed over by a writer on another host reads ESTALE."""
    import errno

    import pced.fs

    path = tmp_path / "manifest.json"
    path.write_text("the new one")
    real_open, opened = pced.fs.open_regular, []

    class Stale:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))

    def open_regular(name):
        opened.append(name)
        return Stale() if len(opened) == 1 else real_open(name)

    monkeypatch.setattr(pced.fs, "open_regular", open_regular)
    assert pced.fs.read_regular(path) == b"the new one" and len(opened) == 2
    opened.clear()
    monkeypatch.setattr(Stale, "read", lambda self: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError):  # another error is not a replaced file: it is reported
        pced.fs.read_regular(path)
