"""Draws the mask pictures of docs/contract.md from the fp64 oracle: which keys each query of one
sequence sees, under `causal` and `window_size`.

Each picture follows a marker naming what it draws, e.g.

    <!-- mask len_q=3 len_k=5 causal -->
    <!-- mask len_q=5 len_k=5 window=(2, 0) -->

    python docs/contract_pictures.py          # rewrites every picture of the doc in place

`tests/test_contract_doc.py` fails when a picture differs from what this draws.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.plots import attention_mask

DOC = ROOT / "docs" / "contract.md"
MARKER = re.compile(r"<!-- mask len_q=(\d+) len_k=(\d+)((?: causal)?)((?: window=\(-?\d+, -?\d+\))?) -->")


def mask(len_q: int, len_k: int, causal: bool = False, window: tuple[int, int] = (-1, -1)):
    """(len_q, len_k) bool: the keys each query of one sequence sees, as the oracle computes it."""
    case = Case((len_q,), seqlens_k=(len_k,), causal=causal, window=window, heads=1, head_dim=16)
    return attention_mask(pack(case, "cpu", requires_grad=False))


def picture(len_q: int, len_k: int, causal: bool = False, window: tuple[int, int] = (-1, -1)) -> str:
    """The fenced block's text: `x` a visible key, `.` a masked one (lengths up to 10)."""
    if max(len_q, len_k) > 10:
        raise ValueError(f"len_q = {len_q}, len_k = {len_k}: a picture holds at most 10 keys and queries a side.")
    visible = mask(len_q, len_k, causal, window)
    what = [*(["causal"] if causal else []), *([f"window_size = {window}"] if window != (-1, -1) else [])]
    lines = [", ".join([*what, f"len_q = {len_q}, len_k = {len_k}"]), "           key " + " ".join(map(str, range(len_k)))]
    lines += [f"      query {i}  " + " ".join("x" if seen else "." for seen in row) for i, row in enumerate(visible.tolist())]
    return "\n".join(lines)


def parse(marker: re.Match) -> tuple[int, int, bool, tuple[int, int]]:
    """(len_q, len_k, causal, window) of a marker."""
    window = (-1, -1)
    if marker.group(4):
        left, right = re.findall(r"-?\d+", marker.group(4))
        window = (int(left), int(right))
    return int(marker.group(1)), int(marker.group(2)), bool(marker.group(3)), window


def update(text: str) -> str:
    """`text` with the fenced block after every marker replaced by its picture."""
    out, position = [], 0
    for marker in MARKER.finditer(text):
        start = text.index("```\n", marker.end()) + 4
        end = text.index("```", start)  # the closing fence (the block may be empty)
        out += [text[position:start], picture(*parse(marker)), "\n"]
        position = end
    return "".join(out) + text[position:]


if __name__ == "__main__":
    DOC.write_text(update(DOC.read_text()))
