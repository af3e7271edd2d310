"""Records: results written as JSON with their provenance, and read back on any machine.

One format for every record the workbench writes (`varlen-workbench repro --record`, `varlen-workbench audit
--record`, `varlen-workbench bench --record`): a JSON object whose `provenance` block says where and
with what it was produced (`varlen_workbench.workbench.provenance.provenance()` plus the command that ran). GPU
records live under `data/gpu/` (`GPU_DATA`) so that CPU-only CI and the site render them
honestly, stamped with the machine that made them.

The API, the only code that reads or writes a record file:

* `write_record(path, payload, command=None)` writes `payload` (made JSON-ready by `jsonable`)
  with its `provenance` block (`provenance_block`: `provenance()` plus the command line);
* `write_json(path, data)` writes a record that already holds its provenance (one being
  updated, or merged from runs), whole or not at all: a reader, or a kill mid-write, sees the
  old file or the new one (`write_record` writes through it too); `with_fingerprint(path, data)`
  adds the fingerprint of the measured code to such a record's provenance;
* `read_record(path, how=None)` reads one back, checking that it is a JSON object with a
  provenance block; a missing file is a `FileNotFoundError` naming `how` (the command that
  records it) when given;
* `load_records(pattern, directory=GPU_DATA, how=None)` reads every `directory/pattern` in
  file-name order, each with its `file` name added (none: `[]`, or the error naming `how`).

A record written to `GPU_DATA` carries the fingerprint of the code it measured
(`varlen_workbench.workbench.gpu_records.fingerprint`). Where the environment names a file in
READ_LOG, every GPU record read is listed there, one name a line: the site names one for each
notebook it executes, and stamps the page with the records read and their freshness.

A post-mortem's GPU records are `load_records(f"{META.id}-*.json")`
(`varlen_workbench.workbench.postmortem.gpu_records`); a claim about them compares with what they hold, read
through this API, never with a number typed from them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from varlen_workbench.workbench.gpu_records.kinds import kind_of
from varlen_workbench.workbench.provenance import GPU_DATA, provenance


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, shell-quoted, as a record names it (`varlen-workbench ...`)."""
    argv = list(sys.argv if argv is None else argv)
    program = Path(argv[0]).name if argv else "python"
    if program in ("__main__.py", "cli.py"):
        program = "varlen-workbench"
    return shlex.join([program, *argv[1:]])


# Paths of the machine that made a record, which no reader's machine has: pip's temporary build
# folder in an upstream error message (what follows it is the file's path in that source tree),
# the folder a command wrote to (`--out`), and the checkout's root before a repository path.
_PIP_BUILD = re.compile(r"/tmp/pip-req-build-[^/\s]+/")
_OUT_FOLDER = re.compile(r"--out[ =](/\S+)")
_CHECKOUT = re.compile(r"(?<![\w.$])/(?:[\w.+-]+/)+?(?=(?:\.whl|data|scripts|notebooks)/)")


def portable(text: str) -> str:
    """A recorded command or message as a reader's machine can follow it: pip's temporary build
    folder dropped, `$OUT` for the output folder, repository paths relative to the checkout.
    The record keeps what ran; pages show this."""
    text = _PIP_BUILD.sub("", text)
    if out := _OUT_FOLDER.search(text):
        text = text.replace(out.group(1), "$OUT")
    return _CHECKOUT.sub("", text)


# The environment variable naming the file that lists the GPU records read (set by the site for
# a notebook's kernel): the file, not this process's memory, so every cell and subprocess adds to it.
READ_LOG = "WORKBENCH_RECORDS_READ"


def provenance_block(command: str | None = None, *, record: str | None = None) -> dict[str, str]:
    """`provenance()` with the command that produced the record and, for a GPU record (its file
    name `record`), the fingerprint of the code it measured, so that a page can tell later
    whether that code has changed."""
    block = {**provenance(), "command": command if command is not None else command_line()}
    return {**block, "fingerprint": _code_fingerprint(record)} if record is not None else block


def _code_fingerprint(name: str) -> str:
    """The fingerprint of the code a GPU record named `name` measures, as installed here."""
    from varlen_workbench.workbench.gpu_records.fingerprint import current_fingerprint, installed_versions

    kind = kind_of(name)
    return current_fingerprint(kind, versions=installed_versions(kind))


def with_fingerprint(path: str | Path, record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` (which holds its provenance) with the fingerprint of the code it measured, where
    `path` names a GPU record: for records written through `write_json`, such as an audit's."""
    name = _gpu_name(Path(path))
    if name is None:
        return dict(record)
    return {**record, "provenance": {**record["provenance"], "fingerprint": _code_fingerprint(name)}}


def jsonable(value: Any) -> Any:
    """A value as JSON: objects with `summary()` give their summary, Cases their fields, small
    tensors their values, anything else its repr (so that writing a record never fails)."""
    import torch

    from varlen_workbench.workbench.layout import Case

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Case):
        return value.to_dict()
    if hasattr(value, "summary") and callable(value.summary):
        return jsonable(value.summary())
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: jsonable(v) for k, v in value.items()}
        return [{"key": jsonable(k), "value": jsonable(v)} for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 1024 else {"shape": list(value.shape), "dtype": str(value.dtype)}
    return repr(value)


def write_record(path: str | Path, payload: Mapping[str, Any], *, command: str | None = None) -> dict[str, Any]:
    """Writes `payload` with a provenance block as JSON to `path` (folders made); returns it."""
    path = Path(path)
    record = {**jsonable(dict(payload)), "provenance": provenance_block(command, record=_gpu_name(path))}
    write_json(path, record)
    return record


def _gpu_name(path: Path) -> str | None:
    """The file name of a GPU record: a .json file under GPU_DATA (its kind must be declared), or
    one written elsewhere (a GPU machine's $OUT) under a declared kind's name; else None (a
    run's partial `.json.new` too)."""
    try:
        kind_of(path.name)
    except LookupError:
        if path.suffix == ".json" and path.resolve().parent == GPU_DATA.resolve():
            raise
        return None
    return path.name


def write_json(path: str | Path, data: Mapping[str, Any]) -> None:
    """Writes `data` as JSON to `path` (folders made), whole or not at all: the text goes to a
    file of this process beside it, which then replaces `path` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(data, indent=1) + "\n")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def load_records(pattern: str, directory: str | Path = GPU_DATA, *, how: str | None = None) -> list[dict[str, Any]]:
    """Every record `directory/pattern` in file-name order, each with its `file` name added.

    With `how` (the command that records one), finding none raises `FileNotFoundError` saying
    so; without it, none is an empty list (a page that shows GPU records when there are some).
    """
    paths = sorted(Path(directory).glob(pattern))
    if not paths and how:
        raise FileNotFoundError(f"no {pattern} under {directory}; record one on a GPU machine with `{how}`")
    return [{**read_record(path), "file": path.name} for path in paths]


def read_record(path: str | Path, *, how: str | None = None) -> dict[str, Any]:
    """The record at `path`, checked: a JSON object with a `provenance` block."""
    path = Path(path)
    if not path.exists():
        hint = f"; record it on a GPU machine with `{how}`" if how else ""
        raise FileNotFoundError(f"no {path.name} under {path.parent}{hint}")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); re-record it or remove it.") from None
    if not isinstance(record, dict) or "provenance" not in record:
        raise ValueError(
            f"{path} has no provenance block; records are written by varlen_workbench.workbench.records.write_record."
        )
    log = os.environ.get(READ_LOG)
    if log and path.resolve().parent == GPU_DATA.resolve():
        with open(log, "a") as listed:
            listed.write(path.name + "\n")
    return record
