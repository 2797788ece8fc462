"""What docs/deploy.md claims for a fleet: a roll-out by ``pced store sync`` to servers that each
read their own copy of the store loses no request and leaves every server on the new generation,
and a server reading the store through a second mount of its directory picks up a generation
``pced index`` wrote through the first one, whole. ``pced serve`` runs the tiny random model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pced.cli import main

from helpers.cli import write_jsonl
from helpers.server import CORPUS, QUESTION, free_port, wait_healthy

pytestmark = pytest.mark.slow
httpx = pytest.importorskip("httpx")

ASK = {"top_k": 3, "top_n": 10, "rerank": False, "max_tokens": 2}
MIN_REQUESTS = 20


@pytest.fixture(scope="module")
def build(tmp_path_factory, tiny_model_dir) -> Path:
    """The build host's store."""
    root = tmp_path_factory.mktemp("deploy")
    corpus = write_jsonl(root / "corpus.jsonl", [{"id": i, "title": t, "text": x} for i, t, x in CORPUS])
    assert index(corpus, root / "build", tiny_model_dir) == 0
    return root / "build"


def index(corpus: Path, store: Path, model: Path) -> int:
    return main(["index", str(corpus), "--out", str(store), "--model", str(model), "--storage-dtype", "float32"])


def serve(store: Path, log: Path, wrapper: list[str] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [*wrapper, sys.executable, "-m", "pced.cli", "serve", str(store), "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PCED_API_KEY": ""})
    return process, f"http://127.0.0.1:{port}"


def stop(servers) -> None:
    for process, _ in servers:
        process.terminate()
    for process, _ in servers:
        process.wait(timeout=60)


def ask(url: str, question: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/pced/answer", json={"question": question, **ASK}, timeout=120)


class Client(threading.Thread):
    """Sends questions to ``urls`` in turn until told to stop (at least ``MIN_REQUESTS``)."""

    def __init__(self, urls: list[str]):
        super().__init__()
        self.urls, self.replies, self.done = urls, [], threading.Event()

    def run(self) -> None:
        for turn in range(400):
            if turn >= MIN_REQUESTS and self.done.is_set():
                return
            url = self.urls[turn % len(self.urls)]
            try:
                response = ask(url, QUESTION)
                self.replies.append((url, response.status_code, response.text[:200]))
            except httpx.HTTPError as exc:
                self.replies.append((url, None, repr(exc)))

    def wait_for(self, count: int, deadline: float) -> None:
        """Until ``count`` replies have come (the roll-out waits so that requests meet each state)."""
        while len(self.replies) < count:
            assert self.is_alive() and time.monotonic() < deadline, "the client stopped sending"
            time.sleep(0.05)

    def finish(self) -> list:
        self.done.set()
        self.join(timeout=600)
        return self.replies


def test_a_rollout_by_sync_loses_no_request_and_leaves_both_servers_on_the_new_generation(build, tmp_path,
                                                                                          tiny_model_dir):
    copies = [tmp_path / "server-a", tmp_path / "server-b"]
    for copy in copies:
        assert main(["store", "sync", str(build), str(copy)]) == 0
    servers = [serve(copy, tmp_path / f"{copy.name}.log") for copy in copies]
    try:
        deadline = time.monotonic() + 300
        for (process, url), copy in zip(servers, copies):
            wait_healthy(process, url, tmp_path / f"{copy.name}.log", deadline)
        generation = httpx.get(f"{servers[0][1]}/health").json()["store"]["generation"]
        client = Client([url for _, url in servers])
        client.start()
        client.wait_for(4, deadline)
        new = write_jsonl(tmp_path / "new.jsonl", [{"id": "ilden", "title": "Port Ilden",
                                                   "text": "Mira Quell moved to Port Ilden in her sixtieth year."}])
        assert index(new, build, tiny_model_dir) == 0  # on the build host
        for copy in copies:  # one server at a time: requests meet one on the new generation, one on the old
            assert main(["store", "sync", str(build), str(copy)]) == 0
            client.wait_for(len(client.replies) + 4, deadline)
        replies = client.finish()
        assert len(replies) >= MIN_REQUESTS and {url for url, _, _ in replies} == {url for _, url in servers}
        assert all(status == 200 for _, status, _ in replies), [r for r in replies if r[1] != 200][:3]
        for _, url in servers:
            experts = [e["doc_id"] for e in ask(url, "Where did Mira Quell move in her sixtieth year?").json()["experts"]]
            store = httpx.get(f"{url}/health").json()["store"]
            assert "ilden" in experts and store["generation"] == generation + 1, (experts, store)
            assert store["newer_generation_unread"] is None and store["documents"] == len(CORPUS) + 1
    finally:
        stop(servers)


def bind_mount_wrapper(source: Path, target: Path) -> list[str]:
    """A command prefix that runs its command in a mount namespace of its own with ``source``
    bind-mounted at ``target`` (gone with the process); skips where that is not permitted."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(source), str(target)]
    probe = subprocess.run([*wrapper, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"mount --bind is not permitted here (needs CAP_SYS_ADMIN): {probe.stderr.strip()[:200]}")
    return wrapper


def test_a_server_on_a_second_mount_picks_up_the_generation_index_wrote_through_the_first_whole(
        build, tmp_path, tiny_model_dir):
    store, mount = tmp_path / "store", tmp_path / "mount"
    mount.mkdir()
    assert main(["store", "sync", str(build), str(store)]) == 0
    wrapper = bind_mount_wrapper(store, mount)
    server = serve(mount, tmp_path / "server.log", wrapper)
    try:
        wait_healthy(*server, tmp_path / "server.log", time.monotonic() + 300)
        url = server[1]
        before = httpx.get(f"{url}/health").json()["store"]
        client = Client([url])
        client.start()
        more = write_jsonl(tmp_path / "more.jsonl", [{"id": "tarn", "title": "Tarn light",
                                                    "text": "The Tarn light on Lake Tarnow burns green on feast days."}])
        assert index(more, store, tiny_model_dir) == 0  # through the first path
        replies = client.finish()
        assert all(status == 200 for _, status, _ in replies), [r for r in replies if r[1] != 200][:3]
        experts = [e["doc_id"] for e in ask(url, "What colour does the Tarn light burn on feast days?").json()["experts"]]
        after = httpx.get(f"{url}/health").json()["store"]
        assert "tarn" in experts, experts
        assert (after["generation"], after["documents"], after["reloads"]) == \
            (before["generation"] + 1, before["documents"] + 1, 1)
        assert after["newer_generation_unread"] is None
    finally:
        stop([server])
