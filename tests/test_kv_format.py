"""The cache file checks that cost time to first token: a file's checksum is matched when it is
written and then at most once per process on load; ``pced verify`` and ``verify=True`` still read
every byte every time."""

import pytest

import pced.kv.file_check as file_check
import pced.kv.format as kv_format
from pced.kv.format import CacheError, verify_cache_dir
from pced.kv.store import KVStore
from pced.text.prompts import PromptBuilder

DOCS = ["Mira Quell founded Zorblax. " * 6, "Oskvale lies on Lake Tarnow and has a long pier. " * 9]


@pytest.fixture
def checksums(monkeypatch):
    """Counts the checksums computed (the real functions, counted): over a cache's tensors on load,
    over a file's bytes in ``pced verify``."""
    calls = []
    for module, name in ((kv_format, "tensor_checksum"), (file_check, "bytes_checksum")):
        real = getattr(module, name)

        def counted(data, real=real):
            calls.append(1)
            return real(data)

        monkeypatch.setattr(module, name, counted)
    return calls


def test_a_cache_is_checksummed_when_written_and_at_most_once_per_process_on_load(tiny_llm, tmp_path, checksums):
    builder = PromptBuilder(tiny_llm.tokenizer)
    store = KVStore(tmp_path, tiny_llm, builder, "float16")
    digests = store.add(DOCS, progress=False)
    written = len(checksums)
    assert written >= 2  # each file read back against its checksum once written (and the prefix)
    for _ in range(3):
        for digest in digests:
            store.load(digest)
    again = KVStore(tmp_path, tiny_llm, builder, "float16")  # another store of the same process
    for digest in digests:
        again.load(digest)
    assert len(checksums) == written  # no load re-read the bytes
    every_time = KVStore(tmp_path, tiny_llm, builder, "float16", verify=True)
    every_time.load(digests[0])
    every_time.load(digests[0])
    assert len(checksums) == written + 2
    assert verify_cache_dir(tmp_path)["checked"] == 3 and len(checksums) == written + 2 + 3  # pced verify: every file


def test_a_file_changed_after_its_check_is_checked_again(tiny_llm, tmp_path):
    builder = PromptBuilder(tiny_llm.tokenizer)
    store = KVStore(tmp_path, tiny_llm, builder, "float16")
    digest = store.add(DOCS[:1], progress=False)[0]
    store.load(digest)
    path = store.path_for(digest)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one byte of the values, same size: only the checksum can tell
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="checksum"):
        store.load(digest)
