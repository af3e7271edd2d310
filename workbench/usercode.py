"""Importing the user's own modules: an audited function's, an adapter's, a post-mortem's.

An exception raised while such a module runs is the user's bug, and is reported as itself: its
type, its message and the file and line of the user's code that raised it (`import_user_module`),
never as "cannot import module", which reads as "not installed".
"""

from __future__ import annotations

import importlib
import os
import traceback
from types import ModuleType


class UserModuleError(ImportError):
    """Importing a user's module failed; the message says how, the cause is chained."""


def _shown(path: str) -> str:
    """`path` relative to the working directory when it lies under it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def _importing_machinery(frame: traceback.FrameSummary) -> bool:
    return frame.filename.startswith("<frozen") or frame.filename in (__file__, importlib.__file__)


def where_raised(exc: BaseException) -> str:
    """'path, line N' of the code that raised `exc` while a module was imported, and the line of
    the imported module that led there when that is another one; '' when no frame says."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{_shown(exc.filename)}, line {exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _importing_machinery(f)]
    if not frames:
        return ""
    first, last = frames[0], frames[-1]
    here = f"{_shown(last.filename)}, line {last.lineno}"
    return here if first is last else f"{here}, reached from {_shown(first.filename)}, line {first.lineno}"


def not_found(name: str, exc: BaseException | None) -> bool:
    """Whether `exc` says module `name` (or a package above it) does not exist, rather than that
    its code failed (a missing dependency imported inside it counts as its code failing)."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    return bool(missing) and (name == missing or name.startswith(f"{missing}."))


def describe(name: str, exc: BaseException) -> str:
    """One sentence: module `name` was not found, or its code raised `exc` (type, message, where)."""
    if not_found(name, exc):
        return f"no module named {getattr(exc, 'name', name)!r}; is it installed, or on PYTHONPATH (the working directory is)?"
    where = where_raised(exc)
    text = exc.msg if isinstance(exc, SyntaxError) else str(exc)  # a SyntaxError's str() repeats where
    message = text.strip() or "(no message)"
    return f"importing {name!r} raised {type(exc).__name__}: {message}" + (f" (at {where})" if where else "")


def import_user_module(name: str) -> ModuleType:
    """`importlib.import_module(name)`; any failure a `UserModuleError` saying what it was (`describe`)."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # the user's code may raise anything while it runs
        raise UserModuleError(describe(name, exc), name=name) from exc
