"""What a built page invites a reader to paste, as the reader's clipboard gets it.

Kept apart from `varlen_workbench.workbench.site.build` (nbformat, nbconvert): a GPU machine without Jupyter runs the
blocks of a site built elsewhere, and hashes them into its record.
"""

from __future__ import annotations

import hashlib
import html
import re

TAG = re.compile(r"<[^>]+>")

# A code cell tagged `wb-show-code` (shown unfolded, see the template) and a fenced ```python
# block of the prose (nbconvert renders it as a bare `highlight` div; executed cells are
# `highlight hl-ipython3`).
_PASTE = re.compile(r'<details class="wb-code" open[^>]*>.*?<pre>(.*?)</pre>|<div class="highlight"><pre>(.*?)</pre>', re.DOTALL)


def paste_blocks(page: str) -> list[str]:
    """The code blocks a built page offers for copying, as a reader's clipboard gets them."""
    return [html.unescape(TAG.sub("", a or b)) for a, b in _PASTE.findall(page)]


def block_digest(block: str) -> str:
    """sha256 of a block's exact text: what a record of a run names it by, so that an edited
    block no longer matches the run of its old text."""
    return hashlib.sha256(block.encode()).hexdigest()
