"""No note meant for the team reaches a page: every page of the built site, prose, code and
outputs alike, is free of test-harness markers, local or temporary paths, words about our
sessions and device time, seed files, and conditionals that went stale once a record came."""

from __future__ import annotations

import html
import re

import pytest

INTERNAL = {
    "a test-harness marker": re.compile(r"\bnbval\b|NBVAL_", re.IGNORECASE),
    "a local or temporary path": re.compile(r"/tmp/|ipykernel_|/work/|/home/\w|/root/"),
    "a note about our sessions or device time": re.compile(
        r"\b(?:this|next|the|a) (?:GPU |device )?session\b|session-start|device budget|time budget|device(?:'s)? copy",
        re.IGNORECASE,
    ),
    "a seed file": re.compile(r"shared/seeds|\bseeds/\d+_"),
    "an instruction to the page's authors": re.compile(r"\bMeta\.links\b|\bfill (?:this|it) in\b", re.IGNORECASE),
    "a stale conditional": re.compile(r"once a GPU record exists|when a GPU record exists|next GPU (?:run|call)", re.IGNORECASE),
}
_INVISIBLE = re.compile(r"<(script|style)\b.*?</\1>", re.DOTALL | re.IGNORECASE)
_TAG = re.compile(r"<[^>]+>")


def visible_text(page: str) -> str:
    """What a reader can see of a page (folded code included), tags and scripts removed."""
    return html.unescape(_TAG.sub(" ", _INVISIBLE.sub(" ", page)))


def internal_notes(text: str) -> list[str]:
    """Each internal note in `text`, as 'what: …context…'."""
    found = []
    for what, pattern in INTERNAL.items():
        for match in pattern.finditer(text):
            context = " ".join(text[max(0, match.start() - 50) : match.end() + 50].split())
            found.append(f"{what}: …{context}…")
    return found


@pytest.mark.parametrize(
    "text",
    [
        "# NBVAL_CHECK_OUTPUT",
        "at /tmp/ipykernel_16376/2449625859.py:12",
        "the device budget of the session was spent",
        "Next GPU session: workbench repro x",
        "the device copy's stale .git",
        "Seed: shared/seeds/001_90a18acb6ed00fca.txt",
        "and, once a GPU record exists, around torch's own",
    ],
)
def test_each_kind_of_note_is_found(text):
    assert internal_notes(text)


def test_reader_wording_passes():
    assert not internal_notes("Not yet measured on a GPU. CPU debugging sessions, a padded token budget, budget=20.")


@pytest.mark.slow  # renders every page (seconds); the rules themselves are checked above, in the fast loop
def test_no_page_carries_internal_notes(published_site):
    found = [
        f"{page.name}: {note}"
        for page in sorted(published_site.glob("*.html"))
        for note in internal_notes(visible_text(page.read_text()))
    ]
    assert not found, "\n".join(found)
