"""The page at / in headless Chromium (Playwright driving the system chromium, never a downloaded
browser): ask a question, watch the answer stream in, every token coloured by its document."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
import httpx  # noqa: E402

from pced.options import METHODS, AskOptions  # noqa: E402
from pced.decoding.sampling import SamplingConfig  # noqa: E402
from pced.server import create_app  # noqa: E402
from helpers.server import QUESTION, live_server, tiny_store  # noqa: E402

CHROMIUM = os.environ.get("PCED_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT_COPY = Path(__file__).resolve().parents[1] / "runs" / "server" / "page.png"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason="no system chromium (apt-get install chromium)")]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llm):
    return tiny_store(tmp_path_factory, tiny_llm)


def test_page_streams_an_answer_coloured_by_document(tmp_path, store):
    with live_server(create_app(store)) as url, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 760})
            problems = []
            page.on("pageerror", lambda exc: problems.append(str(exc)))
            page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
            page.goto(f"{url}/")
            page.wait_for_function("document.getElementById('model').textContent.includes('documents')")
            page.wait_for_function("document.getElementById('top-k').value !== ''")
            # the form starts from what pced ask asks (AskOptions, SamplingConfig), not numbers of its own
            assert page.input_value("#top-k") == str(AskOptions.top_k) and page.input_value("#method") == AskOptions.method
            assert page.input_value("#max-tokens") == str(SamplingConfig().max_new_tokens)
            assert page.eval_on_selector_all("#method option", "els => els.map(e => e.value)") == list(METHODS)
            page.fill("#question", QUESTION)
            page.fill("#top-k", "3")
            page.fill("#max-tokens", "24")
            page.click("#ask")
            page.wait_for_selector("body[data-state]", timeout=60_000)
            assert page.get_attribute("body", "data-state") == "done", page.inner_text("#status")

            experts = page.eval_on_selector_all("#experts li", "els => els.map(e => e.dataset.doc)")
            tokens = page.eval_on_selector_all(
                "#answer span.tok",
                "els => els.map(e => ({doc: e.dataset.doc, color: e.style.color, cls: e.className,"
                " title: e.title, text: e.textContent}))",
            )
            assert len(experts) == 3 and tokens
            for token in tokens:  # max aggregation: every token is won by a document, never the amateur
                assert token["doc"] in experts and token["color"].startswith("rgb") and "amateur" not in token["cls"]
                assert "relevance" in token["title"]
            colours = {}
            for token in tokens:
                assert colours.setdefault(token["doc"], token["color"]) == token["color"]  # one colour per document
            assert len(set(colours.values())) == len(colours)

            answer = httpx.post(f"{url}/v1/pced/answer", json={"question": QUESTION, "top_k": 3, "max_tokens": 24}).json()
            assert "".join(t["text"] for t in tokens) == answer["answer"]
            assert [t["doc"] for t in tokens] == [t["doc_id"] for t in answer["trace"] if t["token"]]
            assert experts == [e["doc_id"] for e in answer["experts"]]

            page.hover("#answer span.tok >> nth=0")
            assert "relevance" in page.get_attribute("#answer span.tok >> nth=0", "title")
            assert "tokens" in page.inner_text("#experts") and "total" in page.inner_text("#status")
            shot = tmp_path / "page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, SCREENSHOT_COPY)
            assert not problems, problems
        finally:
            browser.close()


def test_hovering_a_sentence_shows_its_sources(store):
    with live_server(create_app(store)) as url, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 760})
            problems = []
            page.on("pageerror", lambda exc: problems.append(str(exc)))
            page.goto(f"{url}/")
            page.wait_for_function("document.getElementById('model').textContent.includes('documents')")
            # the page starts from the server's defaults, which are the library's (one default per setting)
            assert page.input_value("#max-tokens") == str(SamplingConfig().max_new_tokens)
            assert page.input_value("#top-k") == str(AskOptions.top_k)
            page.fill("#question", QUESTION)
            page.fill("#top-k", "3")
            page.fill("#max-tokens", "24")
            page.click("#ask")
            page.wait_for_selector("body[data-state]", timeout=60_000)
            assert page.get_attribute("body", "data-state") == "done", page.inner_text("#status")
            answer = httpx.post(f"{url}/v1/pced/answer", json={"question": QUESTION, "top_k": 3, "max_tokens": 24}).json()
            titles = {e["doc_id"]: e["title"] for e in answer["experts"]}
            sentences = page.eval_on_selector_all(
                "#answer span.sentence",
                "els => els.map(e => ({index: Number(e.dataset.index), sources: e.dataset.sources,"
                " text: Array.from(e.querySelectorAll('.tok')).map(t => t.textContent).join('')}))")
            cited = [c for c in answer["citations"] if c["text"].strip()]
            assert [s["index"] for s in sentences] == list(range(len(cited)))
            for sentence, citation in zip(sentences, cited):
                assert sentence["text"].strip() == citation["text"]
                assert sentence["sources"] == " ".join(citation["doc_ids"])
            # the tokens are all still there, in order, with the sentence markers outside them
            assert page.eval_on_selector_all("#answer span.tok", "els => els.map(e => e.textContent).join('')") == answer["answer"]
            for i, citation in enumerate(cited):
                page.hover(f"#answer span.sentence >> nth={i}")
                shown = page.inner_text("#sources")
                assert shown.startswith("Sources:")
                for doc_id in citation["doc_ids"]:
                    assert doc_id in shown and titles[doc_id] in shown
                if not citation["doc_ids"]:
                    assert "none" in shown
            marks = page.eval_on_selector_all("#answer sup.cite", "els => els.length")
            assert marks == sum(len(c["doc_ids"]) for c in cited) > 0
            assert not problems, problems
        finally:
            browser.close()
