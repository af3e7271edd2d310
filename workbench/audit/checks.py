"""The audit's checks: named probes of the padding contract, each with a verdict.

A check builds a few `varlen_workbench.workbench.layout.Case`s, probes the adapted implementation on them and returns a
`CheckResult`: pass, FAIL with evidence (the case and what went wrong), or n/a with the
adapter's reason when the implementation cannot express what the check needs.

`layout_findings(record)` is the per-layout judgement the checks and the fuzzer share: REAL
rows within FlashAttention's bound of the fp64 oracle (so finite), GAP and TAIL rows of out,
dq, dk, dv exactly 0.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from varlen_workbench.workbench.audit.adapters import Adapted, AdapterRefused, NoOutput
from varlen_workbench.workbench.audit.adapters.context_parallel import CP_SIZE
from varlen_workbench.workbench.audit.campaign import run_campaign, summarize
from varlen_workbench.workbench.audit.results import CONTEXT_PARALLEL, GRADE_VERDICTS, CheckResult, Finding, Verdict
from varlen_workbench.workbench.audit_catalog import CHECKS as CHECK_NAMES
from varlen_workbench.workbench.audit_catalog import registered_as_declared
from varlen_workbench.workbench.bounds import error_check
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.layout import Case, Fill, PackedBatch, Region, pack, real_rows
from varlen_workbench.workbench.probes import TENSORS, ProbeRecord, probe
from varlen_workbench.workbench.reference import reference_attention


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """One intra-op thread: the audit's tensors are tiny and its statistics run on CPU copies
    even natively, so extra threads only spin (measured: the oracle 17x slower with 2 threads
    on a busy 2-core machine), and fuzzing workers would oversubscribe the cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# -- judging one probe record -------------------------------------------------------------


def _region_evidence(record: ProbeRecord, region: str) -> str:
    parts = []
    for name in TENSORS:
        if name not in record.max_abs or record.max_abs[name][region] == 0.0:
            continue
        rows = int((record.regions(name) == Region[region]).sum())
        bad = record.nonfinite[name][region]
        parts.append(
            f"{name}: {bad} non-finite values in {rows} {region} rows"
            if bad
            else f"{name}: max |x| {record.max_abs[name][region]:.3g} in {rows} {region} rows"
        )
    return "; ".join(parts)


def _accuracy_evidence(record: ProbeRecord) -> str:
    parts = []
    for name, check in record.errors.items():
        bad = record.nonfinite.get(name, {}).get("REAL", 0)
        if bad:
            parts.append(f"{name}: {bad} non-finite REAL values")
        elif not check.within:
            parts.append(f"{name}: error {check.error:.3g} > bound {check.bound:.3g} ({check.ratio:.3g}x PyTorch's own error)")
    return "; ".join(parts)


LAYOUT_FINDINGS = ("real-accuracy", "gap-rows", "tail-rows")  # what `layout_findings` can find
ANY_FINDING = "any"  # a check's `finding` where its failing case may show any of them


def layout_findings(record: ProbeRecord) -> list[Finding]:
    """Every contract violation one (poisoned) probe shows, among LAYOUT_FINDINGS."""
    findings = []
    if not record.real_within_bound:
        findings.append(Finding("real-accuracy", _accuracy_evidence(record) or "no oracle comparison"))
    for region, check in (("GAP", "gap-rows"), ("TAIL", "tail-rows")):
        evidence = _region_evidence(record, region)
        if evidence:
            findings.append(Finding(check, evidence))
    return findings


def max_ratio(records: list[ProbeRecord]) -> str:
    """'worst error 0.42x of the bound (dq)': how much room the passing checks left."""
    worst = max(((e.error / e.bound if e.bound else 0.0, n) for r in records for n, e in r.errors.items()), default=None)
    return f"worst REAL error {worst[0]:.2f} of the bound ({worst[1]})" if worst else "no oracle comparison"


# -- the checks ---------------------------------------------------------------------------


@dataclass
class Context:
    """What a check needs: the implementation, and the dtype and head dims cases are built with
    (`head_dim_v`: v's, None for q and k's)."""

    impl: Adapted
    dtype: str
    head_dim: int = 32
    head_dim_v: int | None = None

    @property
    def native(self) -> bool:
        return self.impl.device.type == "cuda"

    @property
    def tensors(self) -> str:
        """What the probes compare: 'out, dq, dk, dv', or 'out' where the function has no backward here."""
        return ", ".join(TENSORS if self.impl.backward else TENSORS[:1])

    def case(self, seqlens_q, *, padded_q=None, padded_k=None, tail_q=0, tail_k=0, **fields) -> Case:
        """A case with the padding the implementation can express (GAP and TAIL rows are dropped
        where it cannot: checks that are *about* them are n/a instead)."""
        if "padded" in self.impl.lacks:
            padded_q = padded_k = None
        if "tail" in self.impl.lacks:
            tail_q = tail_k = 0
        # Zero padding by default: each check isolates its subject; padding-leak plants the rest.
        fields = {
            "heads": 2,
            "head_dim": self.head_dim,
            "head_dim_v": self.head_dim_v,
            "dtype": self.dtype,
            "fill": Fill.ZEROS,
            **fields,
        }
        return Case(seqlens_q, padded_q=padded_q, padded_k=padded_k, tail_q=tail_q, tail_k=tail_k, **fields)

    def probe(self, case: Case, **kwargs: Any) -> ProbeRecord:
        batch = pack(case, self.impl.device)
        return probe(
            self.impl, batch, name=self.impl.name, backward=self.impl.backward, **{**self.impl.case_kwargs(case), **kwargs}
        )

    def judge(self, cases: list[Case], checks: tuple[str, ...], *, poisoned: bool = True, passed: str = "") -> CheckResult:
        """Probes each case; the first one with a finding among `checks` is the FAIL evidence."""
        records, refused = [], []
        for case in cases:
            try:
                record = self.probe(case, poisoned=poisoned)
            except AdapterRefused as exc:  # this case cannot be expressed; the others still judge
                refused.append(f"{case.label()}: {exc}")
                continue
            records.append(record)
            bad = [f for f in layout_findings(record) if f.check in checks]
            if bad:
                evidence = f"{case.label()} ({case.fill.value} padding): " + "; ".join(f.evidence for f in bad)
                return CheckResult(
                    "", Verdict.FAIL, evidence, (case, *[c for c in cases if c is not case]), records=tuple(records)
                )
        if not records:
            raise AdapterRefused("; ".join(refused))
        note = f" ({len(refused)} of {len(cases)} cases n/a: {refused[0]})" if refused else ""
        return CheckResult("", Verdict.PASS, (passed or max_ratio(records)) + note, tuple(cases), records=tuple(records))


@dataclass(frozen=True)
class Check:
    name: str
    needs: tuple[str, ...]  # features of FEATURES the check cannot do without
    doc: str
    run: Callable[[Context], CheckResult]
    # What a probe of its failing case shows again (`varlen_workbench.workbench.audit.notebook` replays it): one of
    # LAYOUT_FINDINGS, ANY_FINDING (which one depends on the case), or None (its failure is no
    # layout finding: determinism, lse, input-validation...).
    finding: str | None
    # ISO date the check joined the audit ("": from the start): a recorded run older than that
    # could not run it, so its record is not missing it (`varlen_workbench.workbench.audit.matrix.left_out`)
    added: str = ""

    @property
    def distributed(self) -> bool:
        """Whether the check spawns the ranks of a context-parallel attention; every other check
        calls the function in this process."""
        return CONTEXT_PARALLEL in self.needs

    def suits(self, impl: Adapted) -> bool:
        """Whether the check is one an audit of `impl` runs by default: the context-parallel check
        for a context-parallel attention (which lacks "one-process"), every other check otherwise."""
        return self.distributed == ("one-process" in impl.lacks)

    def __call__(self, ctx: Context) -> CheckResult:
        start = time.perf_counter()
        why = ctx.impl.why_not(*self.needs if self.distributed else ("one-process", *self.needs))
        if why:
            result = CheckResult(self.name, Verdict.NA, why)
        else:
            try:
                result = self.run(ctx)
            except AdapterRefused as exc:
                result = CheckResult(self.name, Verdict.NA, str(exc))
            except NoOutput as exc:  # not a wrong result: nothing to compare
                result = CheckResult(self.name, Verdict.FAIL, f"no output: {exc}")
            except Exception as exc:  # a crash on valid input is a finding, never an aborted audit
                where = traceback.extract_tb(exc.__traceback__)[-1]
                result = CheckResult(
                    self.name,
                    Verdict.FAIL,
                    f"raised {type(exc).__name__}: {exc} (at {where.name}, {where.filename.rpartition('/')[2]}:{where.lineno})",
                )
        result.name, result.seconds = self.name, time.perf_counter() - start
        return result


CHECKS: dict[str, Check] = {}


def check(
    name: str, doc: str, *, finding: str | None, needs: tuple[str, ...] = (), added: str = ""
) -> Callable[[Callable[[Context], CheckResult]], Check]:
    """Registers check `name`; `finding` is required (see `Check.finding`), so that no check
    leaves the notebook guessing whether its failing case replays."""
    if finding is not None and finding not in (*LAYOUT_FINDINGS, ANY_FINDING):
        raise ValueError(f"check {name!r}: finding = {finding!r}; pass one of {[*LAYOUT_FINDINGS, ANY_FINDING]} or None.")

    def register(run: Callable[[Context], CheckResult]) -> Check:
        CHECKS[name] = Check(name, needs, doc, run, finding, added)
        return CHECKS[name]

    return register


@check("real-accuracy", "REAL rows of out, dq, dk, dv within FlashAttention's bound of the fp64 oracle", finding="real-accuracy")
def _real_accuracy(ctx: Context) -> CheckResult:
    cases = [
        ctx.case((5, 3, 7), padded_q=(8, 4, 7), padded_k=(6, 3, 9), tail_q=3, tail_k=2),
        ctx.case((17, 40), causal="causal" not in ctx.impl.lacks, seed=1),
    ]
    return ctx.judge(cases, ("real-accuracy",), poisoned=False)


@check("tail-rows", "TAIL rows of out, dq, dk, dv exactly 0 under NaN-poisoned memory", needs=("tail",), finding="tail-rows")
def _tail_rows(ctx: Context) -> CheckResult:
    cases = [ctx.case((5, 3), tail_q=4, tail_k=3, fill=Fill.GARBAGE)]
    return ctx.judge(cases, ("tail-rows",), passed=f"TAIL rows of {ctx.tensors} exactly 0 (poisoned memory, garbage inputs)")


@check("gap-rows", "GAP rows of out, dq, dk, dv exactly 0 under NaN-poisoned memory", needs=("padded",), finding="gap-rows")
def _gap_rows(ctx: Context) -> CheckResult:
    cases = [ctx.case((5, 3, 2), padded_q=(8, 4, 2), padded_k=(6, 7, 3), fill=Fill.GARBAGE)]
    return ctx.judge(cases, ("gap-rows",), passed=f"GAP rows of {ctx.tensors} exactly 0 (poisoned memory, garbage inputs)")


LEAK_FILLS = (Fill.NAN, Fill.POS_INF, Fill.NEG_INF, Fill.HUGE)


@check("padding-leak", "NaN / +-Inf / huge values planted in padding inputs never reach REAL rows", finding="real-accuracy")
def _padding_leak(ctx: Context) -> CheckResult:
    if {"padded", "tail"} <= set(ctx.impl.lacks) and ctx.impl.adapter.case_kwargs is None:
        return CheckResult("", Verdict.NA, "the implementation has neither GAP nor TAIL rows to plant values in")
    cases = [ctx.case((5, 3, 4), padded_q=(7, 4, 6), padded_k=(8, 3, 4), tail_q=2, tail_k=3, fill=fill) for fill in LEAK_FILLS]
    return ctx.judge(
        cases,
        ("real-accuracy",),
        poisoned=False,
        passed=f"REAL rows within the bound with {', '.join(f.value for f in LEAK_FILLS)} in padding",
    )


@check("empty-sequences", "sequences of length 0 (query, key, both; also the last one) are handled", finding=ANY_FINDING)
def _empty_sequences(ctx: Context) -> CheckResult:
    # No TAIL rows here: a TAIL-row bug is tail-rows' finding, and must not pose as this one.
    cases = [ctx.case((3, 0, 4, 0))]
    if "unequal" not in ctx.impl.lacks:
        cases.append(ctx.case((3, 2, 0, 4), seqlens_k=(3, 0, 2, 0), seed=1))
    return ctx.judge(cases, ("real-accuracy", "gap-rows"))


@check(
    "no-real-query",
    "a valid batch whose sequences hold no query at all (every q row padding) gives zeros, not an error "
    "(added: the fuzzer found torch varlen_attn raising CUDA invalid argument on one)",
    finding=ANY_FINDING,
)
def _no_real_query(ctx: Context) -> CheckResult:
    unequal = "unequal" not in ctx.impl.lacks
    cases = [ctx.case((0, 0), seqlens_k=(3, 2) if unequal else None, tail_q=2, tail_k=1, fill=Fill.GARBAGE)]
    return ctx.judge(cases, ("real-accuracy", "gap-rows", "tail-rows"), passed=f"every row of {ctx.tensors} exactly 0")


@check(
    "custom-scale",
    "a softmax scale other than 1/sqrt(head_dim) is honoured (added: the bad-input campaign no longer treats a "
    "negative scale as malformed, so nothing else checked that scale reaches the kernel)",
    needs=("scale",),
    finding="real-accuracy",
)
def _custom_scale(ctx: Context) -> CheckResult:
    records = []
    for case, scale in ((ctx.case((5, 9)), 0.3), (ctx.case((7, 4), causal="causal" not in ctx.impl.lacks, seed=1), 1.7)):
        record = ctx.probe(case, scale=scale)
        records.append(record)
        bad = [f for f in layout_findings(record) if f.check == "real-accuracy"]
        if bad:
            return CheckResult(
                "", Verdict.FAIL, f"{case.label()} scale={scale}: {bad[0].evidence}", (case,), records=tuple(records)
            )
    return CheckResult("", Verdict.PASS, f"scales 0.3 and 1.7: {max_ratio(records)}", records=tuple(records))


def _top_left_out(batch: PackedBatch, dtype: torch.dtype) -> torch.Tensor:
    """out of causal attention aligned top-left (query i sees keys 0..i of its sequence: FlashAttention
    before 2.1, SDPA's is_causal), by the oracle in `dtype`, sequence by sequence: top-left is the
    contract's bottom-right over the first len_q keys when len_q <= len_k, and the window
    (-1, len_q - len_k) when len_q > len_k."""
    q, k, v = (t.detach().cpu().to(dtype) for t in (batch.q, batch.k, batch.v))
    rows_q = real_rows(batch.cu_seqlens_q.cpu(), batch.cu_seqlens_q_padded.cpu())
    rows_k = real_rows(batch.cu_seqlens_k.cpu(), batch.cu_seqlens_k_padded.cpu())
    out = q.new_zeros((*q.shape[:2], v.shape[-1]))  # v's head dim: out's
    bounds_q, bounds_k = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        at_q, at_k = rows_q[bounds_q[i] : bounds_q[i + 1]], rows_k[bounds_k[i] : bounds_k[i + 1]]
        len_q = len(at_q)
        at_k = at_k[:len_q]  # keys past len_q: no query sees them top-left
        window = (-1, len_q - len(at_k))
        cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (len_q, len(at_k)))
        out[at_q] = reference_attention(
            q[at_q], k[at_k], v[at_k], cu_q, cu_k, len_q, len(at_k), window_size=window, compute_dtype=dtype, validate=False
        )
    return out


TOP_LEFT = (
    "out matches top-left aligned causal masking (query i sees keys 0..i of its sequence); the contract (FlashAttention "
    ">= 2.1) aligns bottom-right: query i sees key j iff j <= i + len_k - len_q"
)


def _with_alignment_hint(result: CheckResult) -> CheckResult:
    """A causal FAIL whose out matches top-left alignment, within the bound, says so: the likeliest cause."""
    if result.verdict is not Verdict.FAIL or not result.records or result.records[-1].case is not result.cases[0]:
        return result
    record, case = result.records[-1], result.cases[0]
    batch = pack(case, "cpu", requires_grad=False)
    real = batch.regions("out") == Region.REAL
    oracle, baseline = _top_left_out(batch, torch.float64), _top_left_out(batch, batch.q.dtype)
    got = record.tensors["out"]
    if got.shape == oracle.shape and torch.isfinite(got[real]).all():
        match = error_check("out", got[real], oracle[real], baseline[real], batch.q.dtype, **batch.reduction_lengths())
        if match.within:
            result.evidence += f"; {TOP_LEFT}"
    return result


@check(
    "fully-masked-rows",
    "query rows with no visible key give 0 and gradient 0, never NaN",
    needs=("unequal", "causal"),
    finding="real-accuracy",
)
def _fully_masked(ctx: Context) -> CheckResult:
    cases = [ctx.case((3, 2, 4), seqlens_k=(3, 0, 2), causal=True)]
    return _with_alignment_hint(ctx.judge(cases, ("real-accuracy",)))


@check(
    "causal-unequal",
    "causal masking is bottom-right aligned when len_q != len_k",
    needs=("unequal", "causal"),
    finding="real-accuracy",
)
def _causal_unequal(ctx: Context) -> CheckResult:
    cases = [ctx.case((5, 3), seqlens_k=(9, 7), causal=True), ctx.case((6, 9), seqlens_k=(4, 9), causal=True, seed=1)]
    return _with_alignment_hint(ctx.judge(cases, ("real-accuracy",), poisoned=False))


@check(
    "gqa",
    "grouped-query (H_kv < H) and multi-query (H_kv = 1) attention match the oracle",
    needs=("gqa",),
    finding="real-accuracy",
)
def _gqa(ctx: Context) -> CheckResult:
    cases = [ctx.case((5, 3), heads=4, kv_heads=2), ctx.case((4, 6), heads=4, kv_heads=1, causal=True, seed=1)]
    return ctx.judge(cases, ("real-accuracy",), poisoned=False)


@check(
    "sliding-window",
    "window_size=(left, right) (asymmetric, zero-width, one-sided, with causal, len_q != len_k): REAL rows match the "
    "fp64 oracle with the same window (0 where it holds no key), GAP and TAIL rows exactly 0 (added: windows are the "
    "mask torch varlen_attn 2.11+ and FlashAttention take beside causal, and no other check passes one)",
    needs=("window",),
    finding=ANY_FINDING,
)
def _sliding_window(ctx: Context) -> CheckResult:
    """Every row class under FlashAttention windows, bottom-right aligned, in poisoned memory.

    Why it was added (issue 17): `varlen_workbench.kernels.varlen.varlen_attention` gained `window_size`, and torch's
    varlen_attn (2.11+) and FlashAttention take one too, but every other check calls without a
    window, so an implementation that dropped a window's left bound, aligned it top-left or let
    a row whose window holds no key come back NaN passed the whole audit. The windows cover
    one side bounded, both (asymmetric), zero width (a query sees only its diagonal key), and
    a left bound under causal=True (which bounds the right at 0); the lengths put query rows
    whose window holds no key of their sequence (len_q > len_k), and natively cross several
    key blocks, so that skipping the blocks outside a window is exercised too.
    """
    unequal, causal = "unequal" not in ctx.impl.lacks, "causal" not in ctx.impl.lacks
    q: tuple[int, ...]
    k: tuple[int, ...]
    padded_q: tuple[int, ...]
    padded_k: tuple[int, ...]
    if ctx.native:
        q, k, shapes = (300, 129, 64, 1), (257, 200, 64, 3), ((37, 5), (0, 0), (-1, 64), (100, -1))
        padded_q, padded_k = (320, 130, 64, 8), (260, 200, 80, 3)
    else:  # the interpreter: one 64-row block per sequence, a handful of probes
        q, k, shapes = (9, 5, 7), (6, 5, 11), ((2, 1), (0, 0), (-1, 1), (3, -1))
        padded_q, padded_k = (11, 5, 8), (6, 8, 11)
    cases = []
    for i, window in enumerate(shapes):
        cases.append(
            ctx.case(
                q,
                seqlens_k=k if unequal else None,
                padded_q=padded_q,
                padded_k=padded_k if unequal else padded_q,
                tail_q=2,
                tail_k=3,
                causal=causal and window[1] < 0 and window[0] >= 0,  # (left, -1) under causal: (left, 0)
                window=window,
                fill=Fill.GARBAGE if i == 0 else Fill.ZEROS,
                seed=i,
            )
        )
    result = ctx.judge(cases, ("real-accuracy", "gap-rows", "tail-rows"))
    if result.verdict is Verdict.PASS:
        shapes_run = ", ".join(f"{c.window}{' causal' if c.causal else ''}" for c in cases)
        result.evidence = f"windows {shapes_run}: {result.evidence}"
    return result


# Layouts of an lse the check recognises: the contract's (flash-attn's varlen functions') and its transpose.
LSE_LAYOUTS = ("(H, T_q)", "(T_q, H)")


def _lse_findings(batch: PackedBatch, lse: Any) -> tuple[list[str], str, float]:
    """What is wrong with `lse` against the fp64 oracle's (REAL rows that see a key within the bound,
    an infinity on rows that see no key and on GAP and TAIL rows: the contract says -inf,
    FlashAttention +inf, so that exp(-lse) is 0 there; the sign is a convention, NaN or a finite
    value is not); with the layout it came in and the error's fraction of the bound."""
    heads, rows = batch.q.shape[1], batch.q.shape[0]
    shapes = {"(H, T_q)": (heads, rows), "(T_q, H)": (rows, heads)}
    layout = next((name for name in LSE_LAYOUTS if isinstance(lse, torch.Tensor) and tuple(lse.shape) == shapes[name]), None)
    if layout is None:
        got = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        return [f"lse is {got}; expected a tensor (H, T_q) = {shapes['(H, T_q)']} (or its transpose)"], "", 0.0
    lse = (lse if layout == "(H, T_q)" else lse.transpose(0, 1)).detach().cpu().double()
    inputs, metadata = batch.args()[:3], batch.args()[3:]
    _, oracle = reference_attention(
        *(t.detach().double() for t in inputs), *metadata, **batch.kwargs(), return_lse=True, validate=False
    )
    _, baseline = reference_attention(
        *(t.detach() for t in inputs), *metadata, **batch.kwargs(), return_lse=True, compute_dtype=batch.q.dtype, validate=False
    )
    oracle, baseline = oracle.cpu(), baseline.cpu().double()
    real = (batch.regions("lse") == Region.REAL)[None, :].expand_as(lse)
    sees = real & torch.isfinite(oracle)
    findings = []
    check = error_check(
        "lse", lse[sees], oracle[sees], baseline[sees], batch.q.dtype, head_dim=batch.q.shape[-1], **batch.reduction_lengths()
    )
    if not check.within:
        findings.append(f"REAL rows: error {check.error:.3g} > bound {check.bound:.3g} ({check.ratio:.3g}x PyTorch's own error)")
    for where, rows in (("REAL rows that see no key", real & ~sees), ("GAP and TAIL rows", ~real)):
        wrong = lse[rows][~torch.isinf(lse[rows])]
        if wrong.numel():
            values = ", ".join(sorted({f"{x:.3g}" for x in wrong.tolist()})[:3])
            findings.append(
                f"{wrong.numel()} of {int(rows.sum())} values ({int(rows[0].sum())} rows x {heads} heads) on {where} are not "
                f"an infinity (e.g. {values})"
            )
    return findings, layout, check.error / check.bound if check.bound else 0.0


@check(
    "lse",
    "a returned lse matches the fp64 oracle's: REAL rows within the bound, an infinity on rows that see no key and on GAP "
    "and TAIL rows (-inf in the contract, +inf in FlashAttention's convention), laid out (H, T_q) (added: the audit "
    "compared out alone, so a wrong lse beside a right out passed)",
    needs=("lse",),
    added="2026-12-05",
    finding=None,
)
def _lse(ctx: Context) -> CheckResult:
    unequal, causal = "unequal" not in ctx.impl.lacks, "causal" not in ctx.impl.lacks
    cases = [
        ctx.case((5, 3, 7), padded_q=(8, 4, 7), padded_k=(6, 3, 9), tail_q=3, tail_k=2),
        # causal with len_q > len_k: the first rows of a sequence see no key
        ctx.case((6, 4), seqlens_k=(3, 4) if unequal else None, causal=causal, tail_q=1, tail_k=1, seed=1),
    ]
    layouts, worst, signs = set(), 0.0, set()
    for i, case in enumerate(cases):
        batch = pack(case, ctx.impl.device, requires_grad=False)
        with torch.no_grad(), poisoned_memory():
            _, lse = batch.call(ctx.impl, return_lse=True, **ctx.impl.case_kwargs(case))
        findings, layout, ratio = _lse_findings(batch, lse)
        if findings:
            laid_out = f" (lse laid out {layout})" if layout not in ("", LSE_LAYOUTS[0]) else ""
            evidence = f"{case.label()}{laid_out}: " + "; ".join(findings)
            return CheckResult("", Verdict.FAIL, evidence, (case, *cases[:i], *cases[i + 1 :]))
        layouts.add(layout)
        worst = max(worst, ratio)
        signs |= {"+inf" if x > 0 else "-inf" for x in lse.detach().cpu()[torch.isinf(lse.detach().cpu())].unique().tolist()}
    return CheckResult(
        "",
        Verdict.PASS,
        f"lse laid out {', '.join(sorted(layouts))}: worst REAL error {worst:.2f} of the bound; {' and '.join(sorted(signs))} "
        "on every row that sees no key and on every GAP and TAIL row (poisoned memory)",
        tuple(cases),
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN matching NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@check("determinism", "two runs of the same call give bitwise identical REAL rows of out, dq, dk, dv", finding=None)
def _determinism(ctx: Context) -> CheckResult:
    # Natively, long sequences and many heads make split-key backward passes (atomic dq
    # accumulation) actually race; under the interpreter programs run one at a time.
    if ctx.native:
        case = ctx.case((300, 1000, 77, 512), heads=8, causal=True)
    else:
        case = ctx.case((37, 64, 20), heads=2)
    first, second = (ctx.probe(case, reference=False) for _ in range(2))
    differ = []
    for name in first.tensors:  # out, and dq, dk, dv where the function has a backward here
        real = first.regions(name) == Region.REAL
        a, b = first.tensors[name][real], second.tensors[name][real]
        if not _same(a, b):
            differ.append(
                f"{name}: {int((a != b).sum())} values differ, max |diff| {float((a.double() - b.double()).abs().nan_to_num(0).max()):.3g}"
            )
    if differ:
        return CheckResult("", Verdict.FAIL, f"{case.label()}: " + "; ".join(differ), (case,), records=(first, second))
    return CheckResult("", Verdict.PASS, f"{case.label()}: identical", (case,), records=(first, second))


@check(
    CONTEXT_PARALLEL,
    "each rank's shard of out, dq, dk, dv under zig-zag context parallelism equals the single-device oracle's: "
    "REAL rows within the bound, GAP and TAIL rows (the 2 x cp_size padding included) exactly 0",
    needs=(CONTEXT_PARALLEL,),
    finding=None,
)
def _context_parallel(ctx: Context) -> CheckResult:
    """The target itself (importable: its ranks are spawned) on CP_SIZE ranks, in the audit's
    dtype and head dim, against the single-device oracle; on the audit's device (gloo ranks on the
    CPU, NCCL on GPUs)."""
    # Imported here: it builds on this module, and it runs as a script (python -m), which an
    # import when the audit package loads would run a second time.
    from varlen_workbench.workbench.audit.context_parallel import context_parallel_check

    return context_parallel_check(ctx.impl.fn, cp_size=CP_SIZE, dtype=ctx.dtype, head_dim=ctx.head_dim, on_cpu=not ctx.native)


@check(
    "input-validation",
    "graded, not pass/FAIL: each malformed call of varlen_workbench.workbench.malformed gets a clear error naming the argument, "
    "or (a list for a tensor, a negative scale) the fp64 oracle's answer",
    needs=("metadata",),
    finding=None,
)
def _input_validation(ctx: Context) -> CheckResult:
    rows = run_campaign(ctx.impl, ctx.dtype)
    grade, evidence = summarize(rows)
    return CheckResult("", Verdict.NA if grade is None else GRADE_VERDICTS[grade], evidence, rows=tuple(rows))


registered_as_declared("checks", list(CHECKS), CHECK_NAMES)
