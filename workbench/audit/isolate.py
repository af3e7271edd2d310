"""Audit work in a child process, so that one fault costs one cell, not the rest of the row.

A CUDA fault (illegal memory access, misaligned address, device-side assert) is sticky: every
later call of the process fails for its sake. A segfault or an `abort()` in a kernel library
kills the process outright, and a hang holds it forever. So on CUDA the audit runs its checks,
fuzz batches and shrinks through a `Worker`: one child process that imports the target once
and runs task after task, and is replaced by a fresh one after a task that

- raised a CUDA error (its cell says what it raised, and "(context lost)" where a sticky fault
  or a failed synchronisation after it shows the context is gone),
- killed the process (its cell says so, with the signal or exit code), or
- ran past its time limit (its cell: "not run: timed out after N s").

Reusing one child until it breaks costs one start-up (importing torch, triton and the target:
seconds) per fault rather than per check. On the CPU, children come from a fork server that
has already imported the audit (`forkserver` on Linux), so that a replacement starts in a
fraction of a start-up (scripts/gpu_audit_matrix.py's docstring has the measured figures); on
CUDA (and off Linux) each child is spawned afresh, since a forked child cannot use CUDA once
the server has touched it.
The parent never touches the device: only children do. Any device can be isolated, so the CPU
tests exercise every path with planted faults.
"""

from __future__ import annotations

import importlib
import multiprocessing
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from varlen_workbench.workbench.audit.adapters import ADAPTERS, Adapted, adapt
from varlen_workbench.workbench.audit.campaign import CUDA_ERRORS, CUDA_FAULTS
from varlen_workbench.workbench.audit.checks import CHECKS, CheckResult, Context, Verdict, single_threaded
from varlen_workbench.workbench.audit.spelling import option

PRELOAD = ["varlen_workbench.workbench.audit"]  # what the fork server imports once, before any child forks


@dataclass(frozen=True)
class Crash:
    """A task that did not return: the process died or ran past its time limit."""

    what: str  # "was killed by SIGSEGV", "exited with code 3", "timed out after 120 s"
    timed_out: bool = False

    def __str__(self) -> str:
        return self.what


def cuda_error(text: str) -> bool:
    """Whether `text` (an evidence or finding) reports a CUDA error, sticky or not."""
    return any(marker in text for marker in CUDA_ERRORS)


def sticky(text: str) -> bool:
    """Whether `text` reports a fault CUDA documents as sticky (the context is lost)."""
    return any(marker in text for marker in CUDA_FAULTS)


def context_alive(device: str) -> bool:
    """Whether the CUDA context still runs work (always True off CUDA)."""
    if not device.startswith("cuda"):
        return True
    try:
        torch.cuda.synchronize()
        return float(torch.ones(1, device=device).sum()) == 1.0
    except Exception:
        return False


def _context(method: str) -> Any:
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(PRELOAD)
    return context


@dataclass(frozen=True)
class Spec:
    """What a child needs to build the parent's `Adapted` again: the target, the adapter (its
    registered name, or None where the parent's was inferred from the signature, so the child
    infers it too), the module that defines the adapter (importing it registers a user's
    own), and the device."""

    target: str
    adapter: str | None
    adapter_name: str
    module: str
    device: str

    @classmethod
    def of(cls, impl: Adapted) -> Spec:
        """The spec of `impl`, or ValueError saying why a child process cannot rebuild it."""
        if impl.target is None:
            raise ValueError(
                f"{impl.name} cannot be audited in a child process: it is not importable as 'module:function'; "
                f"define it at the top level of an importable module, or run it in this process ({option('isolate', False)}, "
                f"{option('workers', 1)})."
            )
        registered = ADAPTERS.get(impl.adapter.name) is impl.adapter
        return cls(
            impl.target,
            impl.adapter.name if registered else None,
            impl.adapter.name,
            impl.adapter.wrap.__module__,
            str(impl.device),
        )


def _serve(conn, spec: Spec) -> None:
    """The child's loop: adapt the target once, then run each task sent until None comes."""
    torch.set_num_threads(1)  # the audit's tensors are tiny; see checks.single_threaded
    try:
        importlib.import_module(spec.module)
        impl = adapt(spec.target, spec.adapter, spec.device)
        if impl.adapter.name != spec.adapter_name:
            raise ValueError(f"the child process chose adapter {impl.adapter.name!r}, the audit {spec.adapter_name!r}")
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        task, args = message
        conn.send(("done", task(impl, *args)))


def _crash(process) -> Crash:
    process.join(5)
    code = process.exitcode
    if code is not None and code < 0:
        return Crash(f"was killed by {signal.Signals(-code).name}")
    return Crash(f"exited with code {code}" if code is not None else "stopped answering")


class Worker:
    """One child process running audit tasks for `spec`'s target, replaced when it breaks.

    `call(task, *args)` runs `task(impl, *args)` in the child (a module-level function, its
    arguments and result picklable) and returns its result, or a `Crash`; after a crash the next
    call starts a fresh child. `retire()` ends the child now (after a CUDA error, say).
    """

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        # On CUDA, spawn: on the H200 a forkserver child's first CUDA call raised "Cannot
        # re-initialize CUDA in forked subprocess" (the preloaded imports had brought CUDA up in
        # the server), inside a check rather than at start, where the fallback below looks.
        cuda = spec.device.startswith("cuda")
        self.method = "forkserver" if sys.platform == "linux" and not cuda else "spawn"
        self.process: Any = None
        self.conn: Any = None
        self.starts = 0  # children started: the first, then one per replacement
        self.start_seconds: list[float] = []

    def _start(self) -> None:
        context = _context(self.method)
        parent, child = context.Pipe()
        began = time.perf_counter()
        # Not a daemon: a daemon may not start processes, and torch.compile's may (FlexAttention).
        process = context.Process(target=_serve, args=(child, self.spec))
        process.start()
        child.close()
        self.process, self.conn = process, parent
        try:
            status, detail = parent.recv()
        except EOFError:
            crash = _crash(self.process)
            self.retire()
            raise RuntimeError(f"the audit's child process for {self.spec.target} {crash} before it was ready") from None
        if status == "error":
            self.retire()
            if "forked subprocess" in detail and self.method == "forkserver":  # CUDA came up in the server
                self.method = "spawn"
                return self._start()
            raise ValueError(detail)
        self.starts += 1
        self.start_seconds.append(time.perf_counter() - began)

    def call(self, task: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        if self.process is None:
            self._start()
        self.conn.send((task, args))
        if not self.conn.poll(timeout):
            self.process.kill()
            self.retire()
            return Crash(f"timed out after {timeout:g} s", timed_out=True)
        try:
            _, value = self.conn.recv()
        except (EOFError, ConnectionResetError):
            crash = _crash(self.process)
            self.retire()
            return crash
        return value

    def retire(self) -> None:
        """Ends the child (politely if it still listens); the next call starts a fresh one."""
        if self.process is None:
            return
        try:
            if self.process.is_alive():
                self.conn.send(None)
                self.process.join(10)
        except (BrokenPipeError, OSError):
            pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
        self.process = self.conn = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.retire()


# -- a check in a child process --------------------------------------------------------------


def _check_in_child(impl: Adapted, name: str, dtype: str, head_dim: int, head_dim_v: int | None) -> tuple[CheckResult, bool]:
    """Runs check `name` in the child; (its result without the probe records, whether a CUDA
    error it reported left the context unusable)."""
    with single_threaded():
        result = CHECKS[name](Context(impl, dtype, head_dim, head_dim_v))
    result.records = ()  # tensors, possibly on the device: the parent needs the verdict
    return result, cuda_error(result.evidence) and not context_alive(str(impl.device))


TIMED_OUT = "(the check's time limit)"  # ends the evidence of a check that ran past it


def run_isolated(
    worker: Worker, name: str, dtype: str, head_dim: int, head_dim_v: int | None = None, timeout: float | None = None
) -> CheckResult:
    """Check `name` in `worker`'s child. The child is replaced after a check that raised a CUDA
    error (the cell adds "(context lost)" where the fault is sticky or the context no longer
    runs work), that killed it, or that ran past `timeout` seconds (the cell: not run)."""
    start = time.perf_counter()
    value = worker.call(_check_in_child, name, dtype, head_dim, head_dim_v, timeout=timeout)
    if isinstance(value, Crash):
        if value.timed_out:
            return CheckResult(name, Verdict.NA, f"not run: {value} {TIMED_OUT}", seconds=time.perf_counter() - start)
        return CheckResult(name, Verdict.FAIL, f"its process {value}", seconds=time.perf_counter() - start)
    result, lost = value
    if lost or sticky(result.evidence):
        result.evidence += " (context lost)"
    if cuda_error(result.evidence):
        worker.retire()
    return result


__all__ = ["PRELOAD", "TIMED_OUT", "Crash", "Spec", "Worker", "context_alive", "cuda_error", "run_isolated", "sticky"]
