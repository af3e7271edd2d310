"""The study: the upstream function and the workarounds on the audited cases, the rule that predicts the wrong rows,
the H200 audit record read back, and reproduce()."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.flash_dmattn_flex_mask.cases import _RATIO, AUDIT_RECORD, AUDITED, IMPLS, META, STUDY
from varlen_workbench.postmortems.flash_dmattn_flex_mask.upstream import (
    SUCCESSOR_PACKAGE,
    UPSTREAM_PACKAGE,
    compile_room,
    installed_version,
    source_facts,
    transformers_version,
    upstream_function,
    upstream_module,
)
from varlen_workbench.workbench.audit.adapters import ADAPTERS, bshd_mask
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.postmortem import Results as PostmortemResults
from varlen_workbench.workbench.postmortem import latest_gpu_record
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import read_record
from varlen_workbench.workbench.reference import reference_attention


def _bshd(case: Case, device) -> dict[str, torch.Tensor]:
    """The padded (B, S, H, D) batch the audit's adapter builds from `case`, and its mask (B, H, S_q, S_k) in q's dtype."""
    batch = pack(case, device, requires_grad=False)
    lens_q, lens_k = case.real_lengths("q"), case.real_lengths("k")
    seq_q, seq_k = max([*lens_q, 1]), max([*lens_k, 1])

    def padded(x, lengths, seq):
        out = x.new_zeros(len(lengths), seq, *x.shape[1:])
        start = 0
        for b, n in enumerate(lengths):
            out[b, :n] = x[start : start + n]
            start += n
        return out

    q, k, v = padded(batch.q, lens_q, seq_q), padded(batch.k, lens_k, seq_k), padded(batch.v, lens_k, seq_k)
    mask = bshd_mask(list(lens_q), list(lens_k), seq_q, seq_k, case.causal, q.device)
    return {"q": q, "k": k, "v": v, "mask": mask[:, None].expand(-1, case.heads, -1, -1).to(q.dtype).contiguous()}


def mask_as_bias(fn: Callable) -> Callable:
    """Workaround (a): the same upstream function, the mask folded into `attn_bias` as -inf and both
    expanded to (B, H, S_q, S_k), the shape upstream indexes (the page's flex_dmattn_masked)."""

    def call(query, key, value, attn_mask=None, attn_bias=None, is_causal=None, softmax_scale=None):
        batch, seq_q, heads, _ = query.shape
        if attn_mask is not None:  # a bool mask gives an additive bias in q's dtype, never a bool one
            bias = torch.zeros((), dtype=query.dtype, device=query.device) if attn_bias is None else attn_bias.to(query.dtype)
            attn_bias = torch.where(attn_mask > 0, bias, float("-inf"))
        if attn_bias is not None:
            attn_bias = attn_bias.expand(batch, heads, seq_q, key.shape[1])
        return fn(query, key, value, attn_mask=attn_mask, attn_bias=attn_bias, is_causal=is_causal, softmax_scale=softmax_scale)

    call.__name__ = "mask as -inf attn_bias"
    return call


def flex_with_mask(device=None) -> Callable:
    """Workaround (b): torch's own flex_attention with a mask_mod that reads the mask (compiled on a GPU, eager on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = default_device() if device is None else torch.device(device)
    flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

    def call(query, key, value, attn_mask=None, attn_bias=None, is_causal=None, softmax_scale=None):
        batch, seq_q, heads, _ = query.shape
        seq_k = key.shape[1]

        def full(x):  # (B, H, S_q, S_k) from any shape flash-dmattn accepts, as on the page
            return x.repeat_interleave(heads // x.shape[1], 1).expand(batch, heads, seq_q, seq_k)

        keep = full(torch.ones(1, 1, 1, 1, dtype=torch.bool, device=query.device) if attn_mask is None else attn_mask > 0)
        bias = None if attn_bias is None else full(attn_bias)
        causal = is_causal is None or is_causal  # None means True, as in flash-dmattn

        def mask_mod(b, h, q_idx, kv_idx):
            return keep[b, h, q_idx, kv_idx] & (q_idx >= kv_idx) if causal else keep[b, h, q_idx, kv_idx]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score if bias is None else score + bias[b, h, q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, batch, heads, seq_q, seq_k, device=query.device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*flex_attention called without torch\.compile")
            out = flex(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                score_mod=score_mod,
                block_mask=block_mask,
                scale=softmax_scale,
                enable_gqa=heads != key.shape[2],
            )
        return out.transpose(1, 2)

    call.__name__ = "torch flex_attention + BlockMask"
    return call


def as_thd(fn: Callable) -> Callable:
    """`fn(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale)` behind the audit's own
    `dmattn` adapter: the same padded batch, mask, zero bias and is_causal=False as on the H200."""
    return ADAPTERS["dmattn"].wrap(fn)


def _dense(q, k, v, keep, bias, scale=None) -> torch.Tensor:
    """fp64 attention on (B, S, H, D) with a (B, H, S_q, S_k) boolean mask; rows with no key: 0."""
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        scores = scores + bias.double()
    has = keep.any(-1, keepdim=True)
    scores = torch.where(has, scores.masked_fill(~keep, float("-inf")), torch.zeros_like(scores))
    return (torch.softmax(scores, -1) * has @ vh).transpose(1, 2)


def mask_effect(fn: Callable, device) -> dict[str, Any]:
    """The study batch called with four masks: padding (the right one), all ones, all zeros, and
    upstream's own top-k dynamic mask (`flash_dmattn.utils.mask.create_mask`, window 3). Which
    outputs are bit-identical to the all-ones one, and the error of each against the fp64 answer
    with that mask."""
    x = _bshd(STUDY.with_(dtype="float32"), device)
    q, k, v, padding = x["q"], x["k"], x["v"], x["mask"]
    generator = torch.Generator().manual_seed(3)
    bias = torch.randn(padding.shape, generator=generator).to(device)
    masks = {"padding": padding, "all ones": torch.ones_like(padding), "all zeros": torch.zeros_like(padding)}
    try:
        from flash_dmattn.utils.mask import create_mask

        topk = create_mask(
            attention_bias=bias,
            attention_mask=padding.bool(),
            batch_size=q.shape[0],
            query_len=q.shape[1],
            key_len=k.shape[1],
            window_size=3,
            min_dtype=torch.finfo(q.dtype).min,
        )
        masks["top-k (create_mask, window 3)"] = topk.expand_as(padding).to(q.dtype)
    except ImportError as exc:  # flash_dmattn's package import needs triton; recorded, not hidden
        masks_error = f"{type(exc).__name__}: {exc}"
    else:
        masks_error = ""
    outs = {name: fn(q, k, v, attn_mask=m, attn_bias=None, is_causal=False) for name, m in masks.items()}
    rows = []
    for name, m in masks.items():
        want = _dense(q, k, v, m > 0, None)
        real = m[:, 0].bool().any(-1)  # rows with a visible key
        err = (outs[name].double() - want).abs().amax(dim=(-1, -2))[real]
        rows.append(
            {
                "mask": name,
                "kept keys": int(m[:, 0].bool().sum()),
                "identical to all-ones": bool(torch.equal(outs[name], outs["all ones"])),
                "max error vs that mask": float(err.max()) if err.numel() else 0.0,
            }
        )
    return {"rows": rows, "error": masks_error}


def gqa_error(fn: Callable, device) -> str:
    """What a grouped-query call (2 query heads, 1 key/value head) gives: the exception, or 'ran'."""
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 8, h, 16, generator=generator).to(device) for h in (2, 1, 1))
    try:
        fn(q, k, v, is_causal=False)
    except Exception as exc:  # the finding is the exception itself
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def causal_default(fn: Callable, device) -> dict[str, bool]:
    """is_causal=None against True and False on the study batch (all-ones mask: no padding effect)."""
    x = _bshd(STUDY.with_(dtype="float32"), device)
    ones = torch.ones_like(x["mask"])
    got = {c: fn(x["q"], x["k"], x["v"], attn_mask=ones, is_causal=c) for c in (None, True, False)}
    top_left = _dense(x["q"], x["k"], x["v"], torch.ones(x["mask"].shape, dtype=torch.bool, device=device).tril(), None)
    return {
        "None == True (bitwise)": bool(torch.equal(got[None], got[True])),
        "None == False (bitwise)": bool(torch.equal(got[None], got[False])),
        "True is top-left causal (fp32 vs fp64 < 1e-5)": bool((got[True].double() - top_left).abs().max() < 1e-5),
    }


def applied_weights(fn: Callable, device) -> dict[str, torch.Tensor]:
    """The attention weights the function applies, measured through its output: with value =
    identity (key j's value is the unit vector e_j), output row i is row i of softmax(QK^T + bias).
    Returns the mask passed and the weights measured, (B, S_q, S_k) for head 0, on the study batch."""
    x = _bshd(STUDY.with_(dtype="float32"), device)
    batch, seq_k, heads, dim = x["k"].shape
    eye = torch.eye(seq_k, dim, device=device)[None, :, None, :].expand(batch, -1, heads, -1).contiguous()
    weights = fn(x["q"], x["k"], eye, attn_mask=x["mask"], attn_bias=None, is_causal=False)[..., 0, :seq_k]
    fixed = mask_as_bias(fn)(x["q"], x["k"], eye, attn_mask=x["mask"], attn_bias=None, is_causal=False)[..., 0, :seq_k]
    return {"mask": x["mask"][:, 0].bool().cpu(), "weights": weights.cpu(), "weights with the bias workaround": fixed.cpu()}


@dataclass
class CaseRun:
    """One implementation on one audited case: forward (and backward on a GPU) against the fp64 oracle."""

    check: str
    impl: str
    case: Case
    ratios: dict[str, float]  # tensor -> error / PyTorch's own error in that dtype
    within: bool
    finite: bool
    row_errors: list[float]  # per real query row: max |out - oracle| / the out bound
    rows_right: list[bool]  # per real query row: within the out bound
    rows_predicted: list[bool]  # per real query row: its mask row is all True (nothing to drop)
    seconds: float
    backward: bool = False

    def summary(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "impl": self.impl,
            "case": self.case.label(),
            "ratios": self.ratios,
            "within": self.within,
            "finite": self.finite,
            "rows_right": sum(self.rows_right),
            "rows": len(self.rows_right),
            "prediction_exact": self.rows_right == self.rows_predicted,
            "seconds": round(self.seconds, 2),
        }


def _predicted_rows(case: Case) -> list[bool]:
    """Real query rows whose output the ignored mask leaves right: those whose mask row over the
    padded keys is all True (nothing to drop), and, with zero-filled padding, those whose mask row
    is all False (every key of theirs is padding: all their weight lands on zero values, so they
    get 0, the oracle's answer for a row with no visible key, by accident)."""
    lens_q, lens_k = case.real_lengths("q"), case.real_lengths("k")
    seq_q, seq_k = max([*lens_q, 1]), max([*lens_k, 1])
    mask = bshd_mask(list(lens_q), list(lens_k), seq_q, seq_k, case.causal, "cpu")
    zeros = case.fill.value == "zeros"
    return [bool(mask[b, i].all()) or (zeros and lens_k[b] == 0) for b, n in enumerate(lens_q) for i in range(n)]


def run_case(check: str, impl: Callable, name: str, device, backward: bool, *, through_adapter: bool = True) -> CaseRun:
    """`impl` on the audited case of `check`; `through_adapter`: it is `as_thd(...)` and takes the padding fill."""
    case, kwargs = AUDITED[check]
    start = time.perf_counter()
    fill = {"padding_fill": case.fill} if through_adapter else {}
    record = probe(impl, pack(case, device), name=name, backward=backward, **fill, **kwargs)
    seconds = time.perf_counter() - start
    out_error = record.errors["out"]
    real = record.regions_q == 0  # Region.REAL
    fresh = pack(case, device, requires_grad=False)
    leaves = (t.double() for t in (fresh.q, fresh.k, fresh.v))
    call = {**fresh.kwargs(), **kwargs}
    oracle = reference_attention(*leaves, *fresh.args()[3:], **call, compute_dtype=torch.float64, validate=False).cpu()
    per_row = (record.tensors["out"].double() - oracle.double()).abs().flatten(1).amax(1)[real]
    bound = out_error.bound
    return CaseRun(
        check=check,
        impl=name,
        case=case,
        ratios={n: e.ratio for n, e in record.errors.items()},
        within=record.real_within_bound,
        finite=record.real_finite,
        row_errors=[float(e / bound) for e in per_row],
        rows_right=[bool(e <= bound) for e in per_row],
        rows_predicted=_predicted_rows(case),
        seconds=seconds,
        backward=backward,
    )


def audit_record() -> dict[str, Any]:
    """data/gpu/audit-dmattn-flex.json: `varlen-workbench audit ... --device cuda` on the H200 (scripts/gpu_audit_matrix.py)."""
    path = GPU_DATA / AUDIT_RECORD
    return {**read_record(path, how="python scripts/gpu_audit_matrix.py --rows dmattn-flex"), "file": path.name}


def recorded_ratios(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """check (and fuzz:<check>) -> {case: the first failing case, ratios: {tensor: x PyTorch's own error}, nonfinite: bool}."""
    found = {}
    for check in record["checks"]:
        if check["verdict"] == "FAIL":
            found[check["name"]] = {
                "case": Case(**check["cases"][0]),
                "ratios": {t: float(r) for t, r in _RATIO.findall(check["evidence"])},
                "nonfinite": "non-finite" in check["evidence"],
                "evidence": check["evidence"],
            }
    for failure in (record.get("fuzz") or {}).get("failures", []):
        found[f"fuzz:{failure['check']}"] = {
            "case": Case(**failure["case"]),
            "ratios": {t: float(r) for t, r in _RATIO.findall(failure["evidence"])},
            "nonfinite": "non-finite" in failure["evidence"],
            "evidence": failure["evidence"],
        }
    return found


# Failing checks whose error is set by what the padding holds (NaN; huge garbage values the
# ignored mask lets in), not by the dropped mask alone: reported on their own.
PADDING_SET = ("padding-leak", "sliding-window")


def gpu_error_range(recorded: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """The smallest and largest error, in multiples of PyTorch's own (out, dq, dk, dv), of the H200
    audit's failing checks (`recorded_ratios`), PADDING_SET apart."""
    ratios = [r for check, found in recorded.items() if check not in PADDING_SET for r in found["ratios"].values()]
    return min(ratios), max(ratios)


def impact_figures() -> dict[str, str]:
    """The index's figure, from the committed H200 audit: its range of error ratios."""
    low, high = gpu_error_range(recorded_ratios(audit_record()))
    return {"h200_error_ratios": f"{_three_digits(low)} to {_three_digits(high)}"}


def _three_digits(x: float) -> str:
    """22.7, 1,170: three significant digits, thousands separated."""
    return f"{float(f'{x:.3g}'):,g}"


@dataclass
class Results(PostmortemResults):
    device: str
    versions: dict[str, str | None]
    transformers_used: str
    source: dict[str, Any]
    successor_source: dict[str, Any]
    successor_identical_output: bool
    mask_effect: dict[str, Any]
    causal: dict[str, bool]
    gqa: str
    weights: dict[str, torch.Tensor] = field(repr=False)
    runs: dict[str, dict[str, CaseRun]]  # impl -> check -> run
    audit: dict[str, Any] = field(repr=False)
    recorded: dict[str, dict[str, Any]]
    gpu: dict[str, Any] | None = field(repr=False, default=None)

    def run(self, impl: str, check: str) -> CaseRun:
        return self.runs[impl][check]


def _reproduce(device: torch.device) -> Results:
    fn = upstream_function(device)
    # Forward only for the FlexAttention paths, on every device: FlexAttention has no CPU backward,
    # and on a GPU the gradients are gpu_probes' (which records a probe that raises instead of dying).
    backward = False
    impls = {
        IMPLS[0]: as_thd(fn),
        IMPLS[1]: as_thd(mask_as_bias(fn)),
        IMPLS[2]: as_thd(flex_with_mask(device)),
    }
    runs: dict[str, dict[str, CaseRun]] = {name: {} for name in IMPLS}
    for name, impl in impls.items():
        for check in AUDITED:
            runs[name][check] = run_case(check, impl, name, device, backward)
    runs[IMPLS[3]]["real-accuracy"] = run_case(
        "real-accuracy", varlen_attention_triton, IMPLS[3], device, backward=True, through_adapter=False
    )

    successor = upstream_function(device, SUCCESSOR_PACKAGE)
    x = _bshd(STUDY.with_(dtype="float32"), device)
    same = torch.equal(
        fn(x["q"], x["k"], x["v"], attn_mask=x["mask"], is_causal=False),
        successor(x["q"], x["k"], x["v"], attn_mask=x["mask"], is_causal=False),
    )
    record = audit_record()
    return Results(
        device=str(device),
        versions={
            UPSTREAM_PACKAGE: installed_version(UPSTREAM_PACKAGE),
            SUCCESSOR_PACKAGE: installed_version(SUCCESSOR_PACKAGE),
            "transformers": transformers_version(),
            "torch": torch.__version__,
        },
        transformers_used=upstream_module().transformers_used,
        source=source_facts(),
        successor_source=source_facts(SUCCESSOR_PACKAGE),
        successor_identical_output=same,
        mask_effect=mask_effect(fn, device),
        causal=causal_default(fn, device),
        gqa=gqa_error(fn, device),
        weights=applied_weights(fn, device),
        runs=runs,
        audit=record,
        recorded=recorded_ratios(record),
        gpu=latest_gpu_record(META),
    )


def reproduce(device=None) -> Results:
    """Runs the upstream function (and the workarounds) on every audited case; reads the H200 record."""
    device = default_device() if device is None else torch.device(device)
    with compile_room(device):
        return _reproduce(device)


def study_batch(device=None) -> tuple[torch.Tensor, ...]:
    """q, k, v (B, S, H, D) and attn_mask (B, H, S, S) of the study case (fp32): three sequences
    of 5, 3 and 7 tokens padded to 7, as the audit's adapter builds them."""
    x = _bshd(STUDY.with_(dtype="float32"), default_device() if device is None else torch.device(device))
    return x["q"], x["k"], x["v"], x["mask"]


def _short(text: str, width: int = 60) -> str:
    """`text` cut at a word boundary before `width` characters, with '...' when cut."""
    return text if len(text) <= width else text[: text.rfind(" ", 0, width)] + " ..."
