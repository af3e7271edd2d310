"""How the audit's messages name its options: `--adapter NAME` on the command line, `adapter=` in Python.

An error or n/a reason that tells the user what to pass is written once, with `option(...)`;
`varlen-workbench audit` spells it for the command line while it runs (`command_line()`), every other
caller (`varlen_workbench.workbench.audit.audit(fn, ...)`, `adapt`, `fuzz`) gets Python's keywords. A keyword's
flag is the keyword with '-' for '_' (`time_limit`: `--time-limit`), as `varlen_workbench.workbench.cli.main` declares them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_COMMAND_LINE = contextvars.ContextVar("workbench_audit_command_line", default=False)


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Messages made inside name command-line flags."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def option(keyword: str, value: object = None, *, metavar: str = "") -> str:
    """`keyword` as the user writes it here: with a `value` (`--device cuda` / `device='cuda'`; a
    bool is a switch: `--no-isolate` / `isolate=False`), a `metavar` placeholder (`--adapter NAME`
    / `adapter=NAME`), or bare (`--checks` / `checks=`)."""
    if not _COMMAND_LINE.get():
        return f"{keyword}={metavar}" if value is None else f"{keyword}={value!r}"
    flag = "--" + keyword.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    shown = metavar if value is None else str(value)
    return f"{flag} {shown}" if shown else flag
