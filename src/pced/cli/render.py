"""Human-readable answers: every token coloured by the document that won it, plus a legend.

User text (questions, ids, titles, and the tokens, which may copy a document) is printed
literally: never read as rich markup, and with control characters (terminal escape sequences,
bidirectional overrides) shown as escapes rather than sent to the terminal."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.text import Text

from ..text.answers import Answer
from ..text.citations import Citation, cite_answer, sources
from .terminal import count, printable

PALETTE = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta", "bright_green"]
AMATEUR_STYLE = "dim"


def doc_styles(doc_ids: Sequence[str]) -> dict[str, str]:
    return {doc_id: PALETTE[i % len(PALETTE)] for i, doc_id in enumerate(doc_ids)}


def legend(answer: Answer, candidates: Sequence, titles: bool = True) -> Text:
    """One line per expert: colour, id, relevance, how many tokens it won."""
    ids = [c.document.id for c in candidates]
    styles = doc_styles(ids)
    wins: dict[str | None, int] = {}
    for step in answer.trace:
        wins[step.doc_id] = wins.get(step.doc_id, 0) + 1
    text = Text()
    for c in candidates:
        label = printable(c.document.title or c.document.text[:50], newlines=False)
        text.append("  ■ ", style=styles[c.document.id])
        text.append(f"{printable(c.document.id, newlines=False)}  r={c.relevance:.3f}  tokens won: {wins.get(c.document.id, 0):>3}")
        text.append(f"  {label}\n" if titles else "\n", style="dim")
    if wins.get(None):
        text.append("  ■ ", style=AMATEUR_STYLE)
        text.append(f"amateur (no document)  tokens won: {wins[None]}\n")
    return text


def cited_answer(answer: Answer, citations: Sequence[Citation], candidates: Sequence) -> Text:
    """The answer with a numbered marker after each sentence ([1], [2]: its sources), then the
    sources list; user and document text is appended literally, never read as markup."""
    numbers = {doc_id: n for n, doc_id in enumerate(sources(citations), start=1)}
    titles = {c.document.id: c.document.title for c in candidates}
    styles = doc_styles([c.document.id for c in candidates])
    text, position = Text(), 0
    for citation in citations:
        text.append(printable(answer.text[position:citation.end]))
        for doc_id in citation.doc_ids:
            text.append(f"[{numbers[doc_id]}]", style=styles.get(doc_id, "bold"))
        position = citation.end
    text.append(printable(answer.text[position:]) + "\nSources:\n")
    for doc_id, number in numbers.items():
        text.append(f"  [{number}] ", style=styles.get(doc_id, "bold"))
        title = f"  {printable(titles[doc_id], newlines=False)}" if titles.get(doc_id) else ""
        text.append(printable(doc_id, newlines=False) + title + "\n")
    return text


def stream_answer(generation, candidates: Sequence, question: str, console: Console | None = None) -> Answer:
    """Print the question, then each token as it is chosen, coloured by its document; then the legend."""
    console = console or Console(highlight=False)
    styles = doc_styles([c.document.id for c in candidates])
    console.print(Text.assemble(("Q: ", "bold"), printable(question)))
    console.print(Text("A: ", style="bold"), end="")
    for step in generation:
        console.print(Text(printable(step.text), style=styles.get(step.doc_id, AMATEUR_STYLE) + " bold"), end="")
    console.print()
    answer = generation.answer()
    if answer.amateur_only:
        console.print("[dim](no documents: answered from the model alone)[/dim]")
    citations = cite_answer(answer)
    if any(c.doc_ids for c in citations):
        console.print(Text("Cited: ", style="bold") + cited_answer(answer, citations, candidates), end="")
    if answer.method == "pced":
        console.print(legend(answer, candidates), end="")
    else:
        console.print(f"[dim]method {answer.method}: no per-token attribution[/dim]")
    t = answer.timings
    console.print(
        f"[dim]time to first token {t.get('ttft_s', 0):.2f} s, total {t.get('total_s', 0):.2f} s, "
        f"{count(len(answer.trace), 'token')}" + (f", beta {' '.join(f'{b:.3f}' for b in answer.betas)}" if answer.betas else "") + "[/dim]"
    )
    return answer
