"""`varlen-workbench audit`: check any varlen attention against the padding contract.

    from varlen_workbench.workbench.audit import audit
    report = audit(my_varlen_attention)           # or "module:function"; adapter guessed
    print(report)                                 # fuzzer summary, reproductions, verdict table last

`audit` wraps the function in an adapter (`varlen_workbench.workbench.audit.adapters`: a varlen function's call is
read off its parameter names; FlexAttention, SDPA, flash-dmattn, TE-style and padded-batch
callables have their own; or register yours with `register_adapter`), checks it against the
function's signature, runs every check of `varlen_workbench.workbench.audit.checks` (pass / FAIL with evidence /
n/a with the reason), and
grades input validation apart (`varlen_workbench.workbench.audit.campaign`: validates / partly validates / no
validation; a grade never fails the audit, since an attention that computes every valid layout
right is correct even if it checks nothing), then fuzzes `budget` random layouts
(`varlen_workbench.workbench.audit.fuzz`) and shrinks the first failure of each check to a minimal layout printed
as a runnable snippet. `report.write_notebook(path)` starts a post-mortem notebook from it.

On the command line, `varlen-workbench audit MODULE:FUNCTION` (`varlen_workbench.workbench.cli.audit_command`;
`varlen-workbench audit --help` lists its options). `varlen_workbench.workbench.audit.records` reads a
recorded run back and prints it as the command did.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from varlen_workbench.kernels.contract import describe_head_dims
from varlen_workbench.workbench.adapter_example import REGISTER_EXAMPLE
from varlen_workbench.workbench.audit.adapters import (
    ADAPTERS,
    FEATURES,
    Adapted,
    Adapter,
    AdapterRefused,
    adapt,
    detect,
    load,
    register_adapter,
)
from varlen_workbench.workbench.audit.adapters.varlen import audited_backend
from varlen_workbench.workbench.audit.checks import (
    CHECKS,
    CheckResult,
    Context,
    Finding,
    Verdict,
    layout_findings,
    single_threaded,
)
from varlen_workbench.workbench.audit.fuzz import PROFILES, FuzzResult, case_source, default_profile, fuzz
from varlen_workbench.workbench.audit.isolate import Spec, Worker, run_isolated, sticky
from varlen_workbench.workbench.audit.records import format_campaign, format_verdicts
from varlen_workbench.workbench.audit.spelling import option
from varlen_workbench.workbench.audit_catalog import CASE_DTYPES, DEFAULT_BUDGET, DEFAULT_DTYPE, DEFAULT_HEAD_DIM
from varlen_workbench.workbench.provenance import provenance


@dataclass
class AuditReport:
    target: str
    adapter: str
    device: str
    dtype: str
    results: list[CheckResult]
    fuzz: FuzzResult | None
    seconds: float
    head_dims: str = ""  # the cases' head dim, "192/128" with v's apart
    forward_only: str = ""  # why the backward did not run on this device ("" when it did)
    budget: int = 0  # layouts the fuzzer was asked for (0: checks only)
    partial: str = ""  # a report of a run still under way: what it had not run yet ("" once it ended)
    backend: str = ""  # ours: the backend it ran ("auto: torch" on the CPU); "" for other code

    def result(self, name: str) -> CheckResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no check {name!r} in this report; it ran {[r.name for r in self.results]}.")

    @property
    def failed(self) -> list[str]:
        """Names of failing checks, then of checks the fuzzer found failing layouts for."""
        names = [r.name for r in self.results if r.verdict is Verdict.FAIL]
        return names + [f"fuzz:{f.check}" for f in (self.fuzz.failures if self.fuzz else [])]

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def ran(self) -> bool:
        """False when no check could run at all (e.g. CUDA-only code audited on a CPU)."""
        return any(r.verdict is not Verdict.NA for r in self.results)

    def verdicts(self) -> dict[str, str]:
        return {r.name: r.verdict.value for r in self.results}

    def table(self) -> str:
        """Fixed-width verdict table: check, verdict, evidence."""
        return format_verdicts((r.name, r.verdict.value, r.evidence) for r in self.results)

    def campaign_table(self) -> str:
        """The bad-input campaign, one line per malformed call."""
        return format_campaign(next((r.rows for r in self.results if r.name == "input-validation"), ()))

    @property
    def validation(self) -> str:
        """The input-validation grade (validates / partly validates / no validation), or n/a / not run."""
        return next((r.verdict.value for r in self.results if r.name == "input-validation"), "not run")

    def render(self, campaign: bool = False) -> str:
        """The report as printed: fuzzer findings and their reproductions first, the bad-input
        campaign's calls if `campaign`, then the verdict table and the verdict, last."""
        dims = f", head dim {self.head_dims}" if self.head_dims else ""
        backend = f", backend {self.backend}" if self.backend else ""
        lines = [f"audit of {self.target} (adapter {self.adapter}{backend}, {self.device}, {self.dtype}{dims})"]
        if self.forward_only:
            lines.append(f"forward only: {self.forward_only}")
        if self.fuzz is not None:
            lines += ["", self.fuzz.summary()]
            for failure in self.fuzz.failures:
                lines += [
                    "",
                    f"smallest failing layout for {failure.check} ({failure.shrink_probes} shrink probes):",
                    failure.snippet,
                ]
        rows = next((r.rows for r in self.results if r.name == "input-validation"), ())
        if campaign and rows:
            lines += ["", "input validation (bad-input campaign):", self.campaign_table()]
        lines += ["", self.table()]
        if rows and not campaign:
            lines.append(f"(input-validation graded {len(rows)} malformed calls; --campaign lists each)")
        if not self.ran:
            lines += ["", f"NOTHING RAN: {self.results[0].evidence if self.results else 'no checks selected'}"]
        else:
            lines += ["", "PASSED: every applicable check holds" if self.passed else f"FAILED: {', '.join(self.failed)}"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "adapter": self.adapter,
            **({"backend": self.backend} if self.backend else {}),
            "device": self.device,
            "dtype": self.dtype,
            "head_dims": self.head_dims,
            "passed": self.passed,
            "failed": self.failed,
            "seconds": round(self.seconds, 2),
            "validation": self.validation,
            "forward_only": self.forward_only,
            "budget": self.budget,
            **({"partial": self.partial} if self.partial else {}),
            "checks": [r.to_dict() for r in self.results],
            "fuzz": self.fuzz.to_dict() if self.fuzz else None,
            "versions": package_versions(),
            "provenance": provenance(self.device),  # the audited device's, whatever the default
        }

    def write_notebook(self, path, *, execute: bool = True, root=None):
        """A post-mortem notebook of this audit at `path`, executed (varlen_workbench.workbench.audit.notebook)."""
        from varlen_workbench.workbench.audit.notebook import write_notebook  # nbformat: Jupyter's, which a GPU image lacks

        return write_notebook(self, path, execute=execute, root=root)


AUDITED_PACKAGES = (
    "torch",
    "triton",
    "flash-dmattn",
    "flash-sparse-attn",
    "flash-attn",
    "flash-attn-4",
    "nvidia-cutlass-dsl",  # FA4's compiler (CuTe DSL): which version built its kernels
    "nvidia-cudnn-frontend",
    "transformer-engine",
)


def package_versions() -> dict[str, str]:
    """Installed versions of the packages the audit matrix covers (absent ones left out)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in AUDITED_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def _device_type(impl: Adapted) -> str:
    """The key of the audit's per-device defaults (`varlen_workbench.workbench.audit_catalog`)."""
    return "cuda" if impl.device.type == "cuda" else "cpu"


def _default_dtype(impl: Adapted) -> str:
    declared = impl.adapter.dtypes or CASE_DTYPES
    preferred = DEFAULT_DTYPE[_device_type(impl)]
    return preferred if preferred in declared else declared[0]


def _default_head_dim(impl: Adapted) -> int:
    preferred = DEFAULT_HEAD_DIM[_device_type(impl)]
    declared = impl.adapter.head_dims
    return preferred if not declared or preferred in declared else min(declared)


def _head_dims_option() -> str:
    """How the user passes the audit's head dims here: a flag on the command line, keywords in Python."""
    if option("head_dim", metavar="D").startswith("--"):
        return "--head-dim D, or D_QK,D_V"
    return "head_dim=D, and head_dim_v=D_V for v's apart"


def _checked_head_dims(impl: Adapted, head_dim: int | None, head_dim_v: int | None) -> tuple[int, int | None]:
    """(q/k's head dim, v's or None): the audit's, given or the default, each one the adapter declares."""
    if head_dim is None and head_dim_v is not None:
        raise ValueError(f"head_dim_v = {head_dim_v} needs head_dim, q and k's, too: pass {_head_dims_option()}.")
    declared = impl.adapter.head_dims
    for name, value in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r} must be a positive int (the features per head).")
        if declared and value not in declared:
            raise ValueError(
                f"{name} = {value}: adapter {impl.adapter.name!r} declares head dims {describe_head_dims(declared)}; "
                f"pass one of them ({_head_dims_option()})."
            )
    return (_default_head_dim(impl) if head_dim is None else head_dim), head_dim_v


def audit(
    fn: Callable | str | Adapted,
    adapter: str | Adapter | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    head_dim: int | None = None,
    head_dim_v: int | None = None,
    budget: int | None = None,
    checks: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    seed: int = 0,
    time_limit: float | None = None,
    workers: int = 1,
    isolate: bool | None = None,
    check_timeout: float | None = None,
    log: Callable[[str], None] | None = None,
    checkpoint: Callable[[AuditReport], None] | None = None,
) -> AuditReport:
    """Runs the checks (those that suit the function, or `checks` by name) and the fuzzer (`budget`
    layouts; 0: none). `head_dim` (with v's apart, `head_dim_v`) is the head dim of every case
    the checks build and of every layout the fuzzer draws; by default 32 on the CPU, 64 natively
    for the checks and the fuzzer's profile's own (16 and 32, or 64 and 128). A context-parallel attention gets the context-parallel check, any other
    function every other check (`Check.suits`); one asked for by name that does not suit is n/a.

    `budget=None` takes DEFAULT_BUDGET for the device; `time_limit` (seconds) caps the fuzzer's
    search, `workers` runs it in that many processes (see `varlen_workbench.workbench.audit.fuzz.fuzz`).
    `isolate` (default: on CUDA) runs every check and fuzz batch in a child process that a CUDA
    error, a crash or `check_timeout` seconds replace with a fresh one, so that one fault costs
    one cell (`varlen_workbench.workbench.audit.isolate`); the target must then be importable. `checkpoint` hears
    of the report so far (`partial` says what is still to run) after each check and as the fuzzer
    goes, so that a run killed before its end leaves what it finished (`--record` writes each).
    """
    start = time.perf_counter()
    impl = fn if isinstance(fn, Adapted) else adapt(fn, adapter, device)
    names = [n for n, c in CHECKS.items() if c.suits(impl)] if checks is None else list(checks)
    unknown = [n for n in [*names, *skip] if n not in CHECKS]
    if unknown:
        raise ValueError(
            f"{option('checks')} / {option('skip')} name unknown checks {unknown}; the audit's checks are {list(CHECKS)}."
        )
    names = [n for n in names if n not in skip]
    asked = head_dim is not None
    head_dim, head_dim_v = _checked_head_dims(impl, head_dim, head_dim_v)
    # A head dim asked for is the fuzzer's too; by default it draws its profile's own.
    profile = default_profile(impl).at_head_dim(head_dim, head_dim_v) if asked else None
    ctx = Context(impl, dtype or _default_dtype(impl), head_dim, head_dim_v)
    if budget is None:
        budget = DEFAULT_BUDGET[_device_type(impl)]
    if isolate is None:
        isolate = impl.device.type == "cuda" and impl.target is not None and not impl.why_not()
    # The malformed calls of the input-validation campaign run last, after the fuzzer: they are
    # the likeliest to fault the device. In one process a CUDA fault (sticky: every later call
    # fails for its sake) stops everything after it, said so in each verdict, instead of failing it.
    late = [n for n in names if n == "input-validation"]
    results: list[CheckResult] = []
    lost: str | None = None

    def report(fuzz_so_far: FuzzResult | None, partial: str = "") -> AuditReport:
        return AuditReport(
            impl.target or impl.name,
            impl.adapter.name,
            str(impl.device),
            ctx.dtype,
            sorted(results, key=lambda r: names.index(r.name)),
            fuzz_so_far,
            time.perf_counter() - start,
            head_dims=f"{head_dim}" + ("" if head_dim_v is None else f"/{head_dim_v}"),
            forward_only=impl.lacks.get("backward", ""),
            budget=budget,
            partial=partial,
            backend=backend,
        )

    fuzzed: FuzzResult | None = None
    backend = audited_backend(impl.adapter.name, impl.device, ctx.dtype, head_dim)

    def save(so_far: FuzzResult | None = None) -> None:
        """Hands the report so far to `checkpoint`: the checks done, the fuzzer so far or done."""
        if not checkpoint:
            return
        so_far = so_far or fuzzed
        left = [n for n in names if n not in {r.name for r in results}]
        parts = [f"checks not run yet: {', '.join(left)}"] * bool(left)
        if so_far is None and budget:
            parts.append("fuzzer not run yet")
        elif so_far is not None and so_far.partial:
            parts.append(f"fuzzer: {so_far.partial}")
        checkpoint(report(so_far, "; ".join(parts) or "every part ran; the run had not ended"))

    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(Worker(Spec.of(impl))) if isolate else None

        def run(name: str) -> None:
            nonlocal lost
            if lost:
                results.append(CheckResult(name, Verdict.NA, f"not run: the CUDA context was lost at {lost}"))
                return
            if worker is not None:
                results.append(run_isolated(worker, name, ctx.dtype, ctx.head_dim, ctx.head_dim_v, check_timeout))
            else:
                with single_threaded():
                    results.append(CHECKS[name](ctx))
            result = results[-1]
            if worker is None and impl.device.type == "cuda" and result.verdict is Verdict.FAIL and sticky(result.evidence):
                lost = f"check {name}"
            if log:
                log(f"{name}: {result.verdict.value} ({result.seconds:.1f} s)")
            save()

        def fuzzing(so_far: FuzzResult) -> None:
            if log:
                log(so_far.summary())
            save(so_far)

        for name in names:
            if name not in late:
                run(name)
        if budget and not impl.why_not("one-process") and not lost:
            fuzzed = fuzz(
                impl,
                budget,
                seed=seed,
                profile=profile,
                time_limit=time_limit,
                workers=workers,
                isolate=isolate,
                progress=fuzzing,
            )
            if "CUDA context lost" in fuzzed.stopped_early:
                lost = "the fuzzer"
            if log:
                log(fuzzed.summary())
            if late:
                save()
        for name in late:
            run(name)
    return report(fuzzed)


__all__ = [
    "ADAPTERS",
    "CHECKS",
    "DEFAULT_BUDGET",
    "FEATURES",
    "PROFILES",
    "REGISTER_EXAMPLE",
    "Adapted",
    "Adapter",
    "AdapterRefused",
    "AuditReport",
    "CheckResult",
    "Finding",
    "FuzzResult",
    "Verdict",
    "adapt",
    "audit",
    "case_source",
    "detect",
    "fuzz",
    "layout_findings",
    "load",
    "register_adapter",
]
