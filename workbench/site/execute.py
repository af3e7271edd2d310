"""Executing notebooks: in a fresh kernel each, top to bottom, for publication or to commit them.

`execute` runs one notebook with nbclient in its own directory (explorers static, so that a
page and a committed notebook carry every frame); `execute_all` runs many in parallel, one kernel
per notebook; `execute_in_place` saves one with its outputs (`varlen-workbench new`, `workbench
execute`, the audit's notebook). A failure raises `varlen_workbench.workbench.errors.BuildError` naming the
notebook, the cell and the error. Rendering the executed notebooks is `varlen_workbench.workbench.site.build`'s job.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import nbformat

from varlen_workbench.workbench.errors import BuildError
from varlen_workbench.workbench.records import READ_LOG

CELL_TIMEOUT_S = 900


def first_error(nb) -> tuple[int, Any, Any] | None:
    """The first unexpected error output: cells tagged `raises-exception` (the tag nbclient and
    nbval share) show an error on purpose."""
    for index, cell in enumerate(nb.cells):
        if "raises-exception" in cell.metadata.get("tags", []):
            continue
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                return index, cell, output
    return None


def describe_error(path: Path, index: int, cell, output) -> str:
    line = next((s for s in cell.source.splitlines() if s.strip() and not s.startswith("#")), "")
    return f"{path}: cell {index} (`{line.strip()[:60]}`) raised {output.ename}: {output.evalue}"


# The IPython profile of the kernels that execute our notebooks (kernel_env points IPYTHONDIR
# at it). nbclient starts each kernel on 127.0.0.1 over TCP, every message signed with the
# connection file's key; ipykernel >= 7 logs on each start that the transport is not encrypted,
# a warning about traffic crossing a network that this local, signed channel never does.
# The profile drops that one record, and keeps the user's own ~/.ipython (startup scripts,
# history) out of published runs.
KERNEL_PROFILE = """\
# Written by varlen_workbench.workbench.site.execute.kernel_env for the kernels that execute notebooks; edit it there.
import logging


class LocalTcpWarning(logging.Filter):
    def filter(self, record):
        return "running over TCP without encryption" not in record.getMessage()


logging.getLogger("IPKernelApp").addFilter(LocalTcpWarning())
c.HistoryManager.enabled = False
"""


def _kernel_ipython_dir() -> Path:
    """A per-user IPYTHONDIR holding KERNEL_PROFILE (rewritten when it differs)."""
    directory = Path(tempfile.gettempdir()) / f"workbench-ipython-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    config = directory / "profile_default" / "ipython_kernel_config.py"
    if not config.exists() or config.read_text() != KERNEL_PROFILE:
        config.parent.mkdir(parents=True, exist_ok=True)
        partial = config.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(KERNEL_PROFILE)
        partial.replace(config)  # atomic: parallel builds never read half a file
    return directory


def kernel_env(root: Path, *, static: bool = False) -> dict[str, str]:
    """A kernel's environment: ours, with the project root first on the import path, and with
    `static`, explorers in their static form (precomputed frames, see varlen_workbench.workbench.instruments.explorer)."""
    # Absolute: the kernel runs in the notebook's directory, where a relative root means nothing.
    paths = [str(Path(root).resolve()), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "IPYTHONDIR": str(_kernel_ipython_dir())}
    if static:
        env["WORKBENCH_STATIC"] = "1"
    return env


def execute(path: Path, root: Path) -> Any:
    """Runs `path` top to bottom in a fresh kernel in its own directory, for publication
    (explorers static: a page and a committed notebook carry every frame); returns the notebook.

    Raises `BuildError` naming the notebook, the cell and the error (for a claim that no
    longer holds, `ClaimFailed` names the claim).
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,  # timestamps would make every build differ
        store_widget_state=False,  # live widget state is for JupyterLab; the site uses static frames
    )
    # The GPU records the notebook reads (`records.READ_LOG`), kept in its metadata for the page's freshness stamps.
    with tempfile.TemporaryDirectory(prefix="workbench-records-read-") as scratch:
        read_log = Path(scratch) / "read.txt"
        try:
            client.execute(env={**kernel_env(root, static=True), READ_LOG: str(read_log)})
        except CellTimeoutError as exc:
            raise BuildError(f"{path}: a cell ran longer than {CELL_TIMEOUT_S} s: {exc}") from None
        except CellExecutionError as exc:
            failed = first_error(nb)
            if failed is None:
                raise BuildError(f"{path}: {exc}") from None
            raise BuildError(describe_error(path, *failed)) from None
        read = sorted(set(read_log.read_text().split())) if read_log.exists() else []
    nb.metadata["gpu_records"] = read
    return nb


def execute_in_place(path: Path, root: Path) -> None:
    """Executes a notebook and saves it with its outputs (how `varlen-workbench new` commits one)."""
    nbformat.write(execute(path, root), path)


def _execute_job(path: str, root: str) -> tuple[str, str, float]:
    start = time.perf_counter()
    nb = execute(Path(path), Path(root))
    return path, nbformat.writes(nb), time.perf_counter() - start


def execute_all(paths: list[Path], root: Path, jobs: int, log: Callable[[str], None]) -> dict[Path, Any]:
    """Executes notebooks in `jobs` processes; collects every failure before raising."""
    executed, failures = {}, []
    # spawn: the parent has torch loaded, and forking a process that holds its threads is unsafe.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_execute_job, str(p), str(root)) for p in paths]
        for done, future in enumerate(as_completed(futures), 1):
            try:
                path, text, seconds = future.result()
            except BuildError as exc:
                failures.append(str(exc))
                log(f"  [{done}/{len(paths)}] FAILED {exc}")
                continue
            executed[Path(path)] = nbformat.reads(text, as_version=4)
            log(f"  [{done}/{len(paths)}] {Path(path).name} executed in {seconds:.1f} s")
    if failures:
        raise BuildError("site not built; " + "; ".join(failures))
    return executed
