"""Post-mortem sdpa-cudnn-masked-rows: SDPA's cuDNN backend and query rows with no visible key.

Our own finding, from the H200 audit matrix (data/gpu/audit-sdpa-cudnn.json, torch 2.11): with a
boolean `attn_mask`, `scaled_dot_product_attention` under the cuDNN backend gives a REAL query row
whose mask row is all False (a key sequence of length 0; causal bottom-right with len_q > len_k)
a finite, non-zero output, and gradients flow from that row into keys it must not see; the math
and memory-efficient backends give 0 there. No GPU was available while this page was written, so:

* the cuDNN behaviour is shown from the committed H200 records, with their provenance;
* the mechanism is studied on the CPU with a replica: the math backend given the *additive* mask
  torch builds for cuDNN from a boolean one (a finite fill, -65504, where the mask is False). A
  fully masked row then has every score shifted by the same constant, so softmax ignores the mask
  and the row attends to every key slot of its batch row. The replica reproduces the recorded
  cuDNN errors of out, dq, dk and dv in both failing cases to three digits;
* `gpu_probes(device)` (torch only) records what the page still lacks: which backend SDPA picks
  by default, the cuDNN output of fully masked rows against unmasked attention, gradients,
  repeat-run determinism, and the workarounds, with
  `workbench repro sdpa-cudnn-masked-rows --device cuda --record data/gpu/sdpa-cudnn-masked-rows-h200.json`.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels import varlen_attention
from workbench import Case, Fill, pack, probe
from workbench.audit import adapt
from workbench.audit.adapters import bshd_mask
from workbench.layout import thd_to_bshd
from workbench.postmortem import (
    OURS,
    REPLICA,
    UPSTREAM_CPU,
    UPSTREAM_GPU,
    Claims,
    Link,
    Meta,
    Results,
    figure,
    latest_gpu_record,
    table,
)
from workbench.probe import ProbeRecord, grad_output
from workbench.provenance import GPU_DATA
from workbench.records import read_record
from workbench.reference import reference_attention, visible_keys
from workbench.timing import time_call

PT = "https://github.com/pytorch/pytorch"

META = Meta(
    id="sdpa-cudnn-masked-rows",
    title="torch SDPA's cuDNN backend gives query rows with no visible key a finite, non-zero output",
    component="PyTorch / scaled_dot_product_attention, cuDNN backend, boolean attn_mask",
    category="training bug",
    impact="a real query row whose boolean mask row is all False (empty key sequence, causal with len_q > len_k) "
    "gets attention over every key slot instead of 0, and its gradient reaches keys it must not see: silent, cuDNN only",
    upstream_status="upstream unaware",
    status_note="no report of this symptom found in the trackers, searched 2026-12-01; the finite mask fill behind it "
    "was discussed in PR #140837 (2024) and PR #177868 (2026-03, for #177842); the H200 record on torch 2.11 still shows it",
    our_verdict="found by our audit on an H200 (torch 2.11.0+cu130); the finite-fill mechanism reproduces the recorded "
    "errors to three digits on the CPU; a GPU probe of the mechanism is written and not yet run",
    detection="none at run time: outputs are finite; rows whose mask row is all False are non-zero, and differ from "
    "the math backend's output there (0)",
    fix_type="workarounds today: zero the rows with no visible key after the call, keep the cuDNN backend off for masked "
    "calls, or avoid such rows; ours: a varlen kernel that writes 0 there by contract",
    tags=("attention mask", "fully masked rows", "silent error", "audit finding"),
    reported="2026-12-01",  # our audit run on the H200 (data/gpu/audit-sdpa-cudnn.json); no upstream report
    published="2026-12-01",
    links=(
        Link(
            "pytorch#103749: SDPA produces NaN with padding mask (fully masked rows)",
            f"{PT}/issues/103749",
            "2023-06-16",
            "issue",
            "closed",
        ),
        Link(
            "pytorch#131060: add a private _safe_softmax (fully masked rows give 0)",
            f"{PT}/pull/131060",
            "2024-07-18",
            "PR",
            "closed",
        ),
        Link(
            "pytorch#133882: update fused kernels and call _safe_softmax from SDPA (take 3 of #131863)",
            f"{PT}/pull/133882",
            "2024-08-19",
            "PR",
            "closed",
        ),
        Link(
            "pytorch#140837: cuDNN bool-mask fill -65504 -> -1024 (diff context shows -65504)",
            f"{PT}/pull/140837",
            "2024-11-15",
            "PR",
            "closed; reviewers uneasy about the 'magic number'",
        ),
        Link(
            "pytorch#177868: fix the cuDNN attn-mask conversion constant, for #177842",
            f"{PT}/pull/177868",
            "2026-03-19",
            "PR",
            "closed; whether it landed, and in which release, not established",
        ),
        Link(
            "transformers#48163: cuDNN is already SDPA's default on Hopper with a new enough cuDNN (comment)",
            "https://github.com/huggingface/transformers/pull/48163",
            "2026-08-31",
            "PR",
            "closed",
        ),
        Link(
            "diffusers#14349: a -inf vs finfo.min fill on a fully masked row gives zeros vs mean(V) (its own cuDNN path)",
            "https://github.com/huggingface/diffusers/pull/14349",
            "2026-07-31",
            "PR",
            "open",
        ),
        Link(
            "pytorch#196678: cuDNN backward NaN dq with attn_mask, 'default backend' since 2.11 (another bug, same path)",
            f"{PT}/issues/196678",
            "2026-09-11",
            "issue",
            "closed",
        ),
        Link(
            "sdp_utils.cpp at the commit read: check_prefer_cudnn_attention, can_use_cudnn_attention",
            f"{PT}/blob/001f694aef6f922b4fdf6d27d59162d27bf3df58/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp",
        ),
    ),
)

# torch's boolean -> additive mask conversion for the cuDNN backend fills False with this finite value
# (`convert_boolean_attn_mask_cudnn`, "workaround -inf issue with cuDNN"; -65504.0 in PR #140837's diff
# context). The replica below feeds exactly that additive mask to the math backend.
CUDNN_FILL = -65504.0

# The two failing cases of the H200 record, exactly (the audit's Context: H=2, D=64, fp16, zero padding).
FULLY = Case((3, 2, 4), seqlens_k=(3, 0, 2), heads=2, head_dim=64, dtype="float16", causal=True, seed=0, fill=Fill.ZEROS)
UNEQUAL = Case((6, 9), seqlens_k=(4, 9), heads=2, head_dim=64, dtype="float16", causal=True, seed=1, fill=Fill.ZEROS)
CASES = (FULLY, UNEQUAL)
CHECK_OF = {FULLY: "fully-masked-rows", UNEQUAL: "causal-unequal"}
POISONED = {FULLY: True, UNEQUAL: False}  # as the audit's checks probed them
TENSORS = ("out", "dq", "dk", "dv")
RECORD_TOLERANCE = 0.02  # relative: the record prints 3 significant digits; cuDNN rounds its output to fp16 itself


# -- the functions under study, all with SDPA's signature ------------------------------------------


def cudnn_mask_replica(query, key, value, attn_mask=None, scale=None, enable_gqa=False):
    """SDPA given the additive mask torch builds for the cuDNN backend from a boolean one: 0 where
    the mask is True, the finite CUDNN_FILL where it is False. Run under the math backend, it is our
    replica of what cuDNN computes (the hypothesis the GPU probe checks)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        fill = torch.tensor(CUDNN_FILL, dtype=query.dtype, device=query.device)
        attn_mask = torch.where(attn_mask, torch.zeros((), dtype=query.dtype, device=query.device), fill)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)


def zero_rows_without_key(sdpa: Callable) -> Callable:
    """Workaround (a): after any SDPA call, rows whose mask row is all False are set to 0.

    `masked_fill` also zeroes their gradient, so nothing flows from them into q, k or v."""

    def call(query, key, value, attn_mask=None, scale=None, enable_gqa=False):
        out = sdpa(query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)
        return out if attn_mask is None else out.masked_fill(~attn_mask.any(-1, keepdim=True), 0)

    call.__name__ = call.__qualname__ = f"zero_rows_without_key({getattr(sdpa, '__name__', 'sdpa')})"
    return call


def _sdpa(query, key, value, attn_mask=None, scale=None, enable_gqa=False):
    """torch's SDPA itself (the adapter pins the backend)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)


def implementations() -> dict[str, Callable]:
    """The SDPA-style functions studied here; the "sdpa-math" adapter runs each under sdpa_kernel(MATH)
    on a padded batch with a boolean mask, exactly as the audit's "sdpa-cudnn" adapter called cuDNN."""
    return {
        "math backend": _sdpa,
        "cuDNN's mask on math (replica)": cudnn_mask_replica,
        "(a) replica + zero rows without key": zero_rows_without_key(cudnn_mask_replica),
    }


# -- layouts ---------------------------------------------------------------------------------------


def keyless_rows(case: Case) -> list[int]:
    """THD indices of REAL query rows that see no key (causal bottom-right, as the audit's adapter)."""
    rows, start = [], 0
    for lq, lk in zip(case.real_lengths("q"), case.real_lengths("k")):
        window = (-1, 0) if case.causal else (-1, -1)
        has_key = visible_keys(lq, lk, window).any(-1) if lk else torch.zeros(lq, dtype=torch.bool)
        rows += [start + i for i in range(lq) if not has_key[i]]
        start += lq
    return rows


def keyless_rows_beside_keys(case: Case) -> list[int]:
    """The keyless REAL query rows of sequences that do have keys (causal len_q > len_k): with zero
    padding, rows of an empty key sequence attend to zero-valued slots only and come out 0 by accident."""
    rows, start = [], 0
    keyless = set(keyless_rows(case))
    for lq, lk in zip(case.real_lengths("q"), case.real_lengths("k")):
        rows += [start + i for i in range(lq) if lk and start + i in keyless]
        start += lq
    return rows


def keys_of_keyless_sequences(case: Case) -> list[int]:
    """THD indices of the keys of every sequence holding a keyless query row: where cuDNN-style
    attention sends gradient that must not be there."""
    rows, start_q, start_k = [], 0, 0
    keyless = set(keyless_rows(case))
    for lq, lk in zip(case.real_lengths("q"), case.real_lengths("k")):
        if any(start_q + i in keyless for i in range(lq)):
            rows += list(range(start_k, start_k + lk))
        start_q, start_k = start_q + lq, start_k + lk
    return rows


def padded_inputs(case: Case, device=None) -> tuple[torch.Tensor, ...]:
    """The case as a user's padded batch: q, k, v (B, H, S, D) with zero padding and the boolean
    mask (B, 1, S_q, S_k), True where a query may attend (what the audit's adapter passes SDPA)."""
    batch = pack(case, device)
    lq, lk = list(case.real_lengths("q")), list(case.real_lengths("k"))
    sq, sk = max(lq + [1]), max(lk + [1])
    q4 = thd_to_bshd(batch.q.detach(), batch.cu_seqlens_q, None, sq)[0].transpose(1, 2)
    k4 = thd_to_bshd(batch.k.detach(), batch.cu_seqlens_k, None, sk)[0].transpose(1, 2)
    v4 = thd_to_bshd(batch.v.detach(), batch.cu_seqlens_k, None, sk)[0].transpose(1, 2)
    return q4, k4, v4, bshd_mask(lq, lk, sq, sk, case.causal, q4.device)[:, None]


def without_empty_key_sequences(case: Case) -> Case:
    """Workaround (c): the batch with every sequence that has no key dropped (their rows are 0 anyway)."""
    keep = [i for i, n in enumerate(case.real_lengths("k")) if n > 0]
    lq, lk = case.real_lengths("q"), case.real_lengths("k")
    return Case(
        tuple(lq[i] for i in keep),
        seqlens_k=tuple(lk[i] for i in keep),
        heads=case.heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
        causal=case.causal,
        seed=case.seed,
        fill=case.fill,
    )


# -- the H200 records ------------------------------------------------------------------------------

_ERROR = re.compile(r"(out|dq|dk|dv): error ([0-9.e+-]+) > bound ([0-9.e+-]+) \(([0-9.e+-]+)x PyTorch's own error\)")


def audit_record(row: str) -> dict[str, Any]:
    """data/gpu/audit-<row>.json, the H200 audit of one SDPA backend."""
    path = GPU_DATA / f"audit-{row}.json"
    return {**read_record(path, how="python scripts/gpu_audit_matrix.py"), "file": path.name}


def recorded_check(record: dict[str, Any], name: str) -> dict[str, Any]:
    """One check of an audit record: verdict, evidence, its first case, and the parsed errors."""
    check = next((c for c in record["checks"] if c["name"] == name), None)
    if check is None:
        raise KeyError(f"{record['file']} has no check {name!r}.")
    errors = {m[1]: (float(m[2]), float(m[3]), float(m[4])) for m in _ERROR.finditer(check["evidence"])}
    return {
        "verdict": check["verdict"],
        "evidence": check["evidence"],
        "case": check["cases"][0] if check["cases"] else None,
        "errors": errors,
    }


def sanitizer_summary() -> dict[str, Any]:
    """The compute-sanitizer runs of the cuDNN row: tool -> errors, the watched layout, and where the
    printed initcheck reports point (the first host frame of ours in each report)."""
    data = read_record(GPU_DATA / "audit-sanitizer.json", how="python scripts/audit_sanitize.py sdpa-cudnn")
    rows = data["rows"]["sdpa-cudnn"]
    log = (GPU_DATA / "logs" / "sanitizer-sdpa-cudnn-initcheck.log").read_text().splitlines()
    reports = "\n".join(log).split("Uninitialized __global__ memory read")[1:]
    ours = [
        next((ln.split("Host Frame:")[1].strip() for ln in r.splitlines() if "layout.py" in ln or "paths.py" in ln), "")
        for r in reports
    ]
    return {
        "errors": {tool: rows[tool]["errors"] for tool in rows},
        "program": rows["initcheck"]["program"][0],
        "printed_reports": len(reports),
        "first_frame_of_ours": sorted(set(ours)),
        "provenance": data["provenance"],
    }


# -- results ---------------------------------------------------------------------------------------


@dataclass
class MaskedRowsResults(Results):
    probes: dict[str, dict[str, ProbeRecord]]  # case label -> implementation -> probe
    per_row: dict[str, dict[str, list[float]]]  # case label -> impl -> per REAL query row max |out - oracle|
    keyless: dict[str, list[int]]  # case label -> REAL query rows with no visible key
    damaged: dict[str, dict[str, dict[str, list[int]]]]  # case -> impl -> tensor -> REAL rows beyond the bound
    mechanism: dict[str, dict[str, float]]  # case -> replica vs unmasked attention over all slots, etc.
    recorded: dict[str, dict[str, dict[str, Any]]]  # case -> row (sdpa-cudnn/-math/-efficient) -> recorded check
    provenance: dict[str, str]  # of the cuDNN audit record
    pad_token: dict[str, float]  # the empty key sequence's rows when padding holds a pad token's k/v
    check_run: dict[str, dict[str, float]]  # the check-your-run lines: backend -> rows without key, max |out| there
    dropped: dict[str, int]  # workaround (c): keyless rows before and after dropping empty key sequences
    sanitizer: dict[str, Any]
    gpu: dict[str, Any] | None


def _oracle(case: Case, device=None) -> dict[str, torch.Tensor]:
    """fp64 reference (0 on rows with no visible key) with the probe's own dO."""
    batch = pack(case, device).fresh(requires_grad=True)
    d_out = grad_output(batch)
    leaves = [t.detach().double().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    out = reference_attention(*leaves, *batch.args()[3:], **batch.kwargs(), validate=False)
    out.backward(d_out.double())
    return {"out": out.detach().cpu(), "dq": leaves[0].grad.cpu(), "dk": leaves[1].grad.cpu(), "dv": leaves[2].grad.cpu()}


def _row_error(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (x.double() - ref).abs().flatten(1).amax(1)


def unmasked_rows(case: Case, device=None) -> torch.Tensor:
    """(T_q, H, D) fp64: each REAL query row attending to *every* key slot of its padded batch row,
    mask ignored: what a softmax shifted by the same constant everywhere computes."""
    q4, k4, v4, _ = padded_inputs(case, device)
    out4 = F.scaled_dot_product_attention(q4.double(), k4.double(), v4.double())  # (B, H, S_q, D)
    rows = [out4[b, :, i] for b, n in enumerate(case.real_lengths("q")) for i in range(n)]
    return torch.stack(rows).cpu() if rows else torch.zeros(0, case.heads, case.head_dim, dtype=torch.float64)


def study(case: Case, device=None) -> dict[str, Any]:
    """Every implementation on `case` (the probe the audit ran), the oracle, and per-row errors."""
    ref = _oracle(case, device)
    probes, per_row, damaged = {}, {}, {}
    for name, fn in implementations().items():
        record = probe(adapt(fn, "sdpa-math", device=device), pack(case, device), name=name, poisoned=POISONED[case])
        probes[name] = record
        per_row[name] = _row_error(record.tensors["out"], ref["out"]).tolist()
        damaged[name] = {
            t: [int(i) for i in (_row_error(record.tensors[t], ref[t]) > record.errors[t].bound).nonzero().flatten()]
            for t in TENSORS
        }
    ours = probe(varlen_attention, pack(case, device), name="(d) our kernel", poisoned=POISONED[case])
    probes["(d) our kernel"] = ours
    per_row["(d) our kernel"] = _row_error(ours.tensors["out"], ref["out"]).tolist()
    damaged["(d) our kernel"] = {
        t: [int(i) for i in (_row_error(ours.tensors[t], ref[t]) > ours.errors[t].bound).nonzero().flatten()] for t in TENSORS
    }
    rows = keyless_rows(case)
    replica = probes["cuDNN's mask on math (replica)"].tensors
    unmasked = unmasked_rows(case, device)
    mechanism = {
        "replica_vs_unmasked": float((replica["out"][rows].double() - unmasked[rows]).abs().max()) if rows else 0.0,
        "replica_max_abs": float(replica["out"][rows].abs().max()) if rows else 0.0,
        "math_max_abs": float(probes["math backend"].tensors["out"][rows].abs().max()) if rows else 0.0,
        "math_dq_max_abs": float(probes["math backend"].tensors["dq"][rows].abs().max()) if rows else 0.0,
    }
    return {"probes": probes, "per_row": per_row, "damaged": damaged, "keyless": rows, "mechanism": mechanism}


def pad_token_demo(device=None) -> dict[str, float]:
    """FULLY with the padding slots of k and v holding one "pad token" (the same random key and value
    at every padded slot, as a model's pad-token activations would), not zeros: what the rows of the
    empty key sequence return under the replica and under the math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, attn_mask = padded_inputs(FULLY, device)
    gen = torch.Generator().manual_seed(7)
    k_pad, v_pad = (torch.randn(FULLY.heads, 1, FULLY.head_dim, generator=gen).to(q.dtype).to(q.device) for _ in range(2))
    slot = torch.arange(k.shape[2], device=q.device)[None, :] >= torch.tensor(FULLY.real_lengths("k"), device=q.device)[:, None]
    k = torch.where(slot[:, None, :, None], k_pad, k)
    v = torch.where(slot[:, None, :, None], v_pad, v)
    b = FULLY.real_lengths("k").index(0)  # the batch row whose key sequence is empty
    rows = slice(0, FULLY.real_lengths("q")[b])
    replica = cudnn_mask_replica(q, k, v, attn_mask=attn_mask)[b, :, rows]
    math = _pinned(sdpa_kernel, SDPBackend.MATH, q, k, v, attn_mask)[b, :, rows]
    return {
        "replica_max_abs": float(replica.abs().max()),
        "replica_vs_v_pad": float((replica.float() - v_pad.float()).abs().max()),
        "math_max_abs": float(math.abs().max()),
    }


def check_your_run(device=None) -> dict[str, dict[str, float]]:
    """The page's check, on FULLY: SDPA unpinned (CPU: the backend torch picks), the math backend,
    and the replica standing in for cuDNN. Rows without key include padded query rows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, attn_mask = padded_inputs(FULLY, device)
    shown = {}
    for name, run in (
        ("SDPA unpinned", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)),
        ("math backend", lambda: _pinned(sdpa_kernel, SDPBackend.MATH, q, k, v, attn_mask)),
        ("replica of cuDNN", lambda: cudnn_mask_replica(q, k, v, attn_mask=attn_mask)),
    ):
        out = run()
        no_key = ~attn_mask.any(-1).expand(out.shape[:-1])
        shown[name] = {"rows_without_key": int(no_key.sum()), "max_abs_there": float(out[no_key].abs().max())}
    return shown


def _pinned(sdpa_kernel, backend, q, k, v, attn_mask):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def reproduce(device=None) -> MaskedRowsResults:
    cudnn, math_rec, eff = audit_record("sdpa-cudnn"), audit_record("sdpa-math"), audit_record("sdpa-efficient")
    probes, per_row, keyless, damaged, mechanism, recorded = {}, {}, {}, {}, {}, {}
    for case in CASES:
        label = case.label()
        s = study(case, device)
        probes[label], per_row[label], keyless[label] = s["probes"], s["per_row"], s["keyless"]
        damaged[label], mechanism[label] = s["damaged"], s["mechanism"]
        recorded[label] = {r["row"]: recorded_check(r, CHECK_OF[case]) for r in (cudnn, math_rec, eff)}
    gpu = latest_gpu_record(META, "points")
    return MaskedRowsResults(
        probes=probes,
        per_row=per_row,
        keyless=keyless,
        damaged=damaged,
        mechanism=mechanism,
        recorded=recorded,
        provenance=cudnn["provenance"],
        pad_token=pad_token_demo("cpu"),  # the page's demonstrations run on the CPU wherever it runs
        check_run=check_your_run("cpu"),
        dropped={"before": len(keyless_rows(FULLY)), "after": len(keyless_rows(without_empty_key_sequences(FULLY)))},
        sanitizer=sanitizer_summary(),
        gpu=gpu,
    )


# -- tables and figures ----------------------------------------------------------------------------


def error_table(results: MaskedRowsResults, case: Case) -> Any:
    """Per tensor: the recorded cuDNN error on the H200 beside the replica's and the math backend's here."""
    label = case.label()
    rec = results.recorded[label]["sdpa-cudnn"]["errors"]
    rows = []
    for t in TENSORS:
        replica = results.probes[label]["cuDNN's mask on math (replica)"].errors[t]
        math = results.probes[label]["math backend"].errors[t]
        rows.append((t, rec[t][0], rec[t][2], replica.error, replica.ratio, math.error, replica.bound))
    return table(
        (
            "tensor",
            "cuDNN H200 error",
            "cuDNN / torch's own",
            "replica (CPU) error",
            "replica / torch's own",
            "math (CPU) error",
            "bound",
        ),
        rows,
        title=f"{label}: REAL rows against the fp64 oracle",
    )


def workaround_table(results: MaskedRowsResults, only: str = "") -> Any:
    """Each way out, per case: REAL rows within the bound, output of keyless rows, where it ran
    (`only`: the rows whose "how" starts with it, e.g. "(a)", plus the replica as is for contrast)."""
    rows = []
    for case in CASES:
        label = case.label()
        for name in ("cuDNN's mask on math (replica)", "(a) replica + zero rows without key", "math backend", "(d) our kernel"):
            r = results.probes[label][name]
            keyless = results.keyless[label]
            peak = float(r.tensors["out"][keyless].abs().max()) if keyless else 0.0
            where = f"{'our Triton kernel' if name.startswith('(d)') else 'torch math backend'}, {r.device}"
            rows.append((label, name, r.real_within_bound, peak, where))
        for row in ("sdpa-efficient", "sdpa-math"):
            rec = results.recorded[label][row]
            rows.append((label, f"(b) {row.split('-')[1]} backend", rec["verdict"] == "pass", "not recorded", "H200 record"))
    if only:
        rows = [r for r in rows if r[1].startswith(only) or (only != "(b)" and r[1].startswith("cuDNN's mask"))]
    return table(("case", "how", "REAL rows within bound", "max |out| on keyless rows", "evidence from"), rows, fold=16)


def mask_figure(case: Case = FULLY):
    """The boolean mask the audit passed, one panel per batch row (attention-gym style): allowed
    pairs dark, REAL query rows with no visible key outlined in red, padding slots blue."""
    from matplotlib.patches import Rectangle

    *_, mask = padded_inputs(case, "cpu")
    lq, lk = case.real_lengths("q"), case.real_lengths("k")
    fig, axes = figure(1, len(lq), width=2.2 * len(lq) + 0.6, height=2.7)
    for b, ax in enumerate(axes[0]):
        ax.grid(False)
        ax.imshow(mask[b, 0].float(), cmap="Greys", vmin=0, vmax=1.25, aspect="equal")
        ax.set_title(f"batch row {b}: len_q {lq[b]}, len_k {lk[b]}", fontsize=8)
        ax.set_xticks(range(mask.shape[-1]))
        ax.set_yticks(range(mask.shape[-2]))
        ax.set_xlabel("key slot", fontsize=8)
        if b == 0:
            ax.set_ylabel("query slot", fontsize=8)
        ax.tick_params(labelsize=7)
        for i in range(lq[b]):
            if not bool(mask[b, 0, i].any()):
                ax.add_patch(Rectangle((-0.5, i - 0.5), mask.shape[-1], 1, fill=False, edgecolor="#c8453a", linewidth=2))
        for i in range(lq[b], mask.shape[-2]):
            ax.axhspan(i - 0.5, i + 0.5, color="#9ecae1", alpha=0.35, lw=0)
        for j in range(lk[b], mask.shape[-1]):
            ax.axvspan(j - 0.5, j + 0.5, color="#9ecae1", alpha=0.35, lw=0)
    fig.suptitle(case.label(), fontsize=9)
    return fig


def row_error_figure(results: MaskedRowsResults):
    """Per REAL query row, max |out - oracle| of the math backend, the replica and workaround (a);
    keyless rows shaded, the recorded cuDNN error (the max over rows) as a dashed line."""
    fig, axes = figure(1, len(CASES), width=8.0, height=3.2)
    for ax, case in zip(axes[0], CASES):
        label = case.label()
        keyless = results.keyless[label]
        for i in keyless:
            ax.axvspan(i - 0.5, i + 0.5, color="#c8453a", alpha=0.15, lw=0)
        for name, marker in (
            ("math backend", "o"),
            ("cuDNN's mask on math (replica)", "x"),
            ("(a) replica + zero rows without key", "."),
        ):
            values = [max(v, 1e-6) for v in results.per_row[label][name]]
            ax.plot(range(len(values)), values, marker, label=name.replace("cuDNN's mask on math (replica)", "replica"), ms=5)
        ax.axhline(
            results.recorded[label]["sdpa-cudnn"]["errors"]["out"][0], color="#c8453a", ls="--", lw=1, label="cuDNN, H200 (max)"
        )
        ax.set_yscale("log")
        ax.set_ylim(3e-7, 10)
        ax.set_xlabel("REAL query row (packed index)", fontsize=8)
        ax.set_title(label, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("max |out - fp64 oracle|\n(exactly 0 drawn at 1e-6)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7, frameon=False)
    return fig


def gpu_table(record: dict[str, Any]) -> Any:
    """The GPU probe's results, one row per (layout, dtype, backend, mask)."""
    rows = []
    for point in record["probes"]["points"]:
        rows.append(
            (
                point["layout"],
                point["dtype"],
                point["default_choice"],
                point["backend"],
                point["mask"],
                point.get("error", ""),
                point.get("keyless_out_max_abs"),
                point.get("vs_unmasked"),
                point.get("keyless_dq_max_abs"),
                point.get("real_errors", {}).get("dk"),
                point.get("deterministic"),
                point.get("bitwise_equal_to_bool_mask", ""),
            )
        )
    return table(
        (
            "layout",
            "dtype",
            "SDPA picks",
            "backend",
            "mask",
            "refused",
            "keyless |out|",
            "vs unmasked",
            "keyless |dq|",
            "dk error",
            "deterministic",
            "= bool mask",
        ),
        rows,
        fold=24,
    )


# -- the GPU probe: torch only ---------------------------------------------------------------------

# (lengths q, lengths k) of each probed layout: the record's two, and a larger bf16-sized one.
GPU_LAYOUTS = {
    "fully-masked-rows": ((3, 2, 4), (3, 0, 2)),
    "causal-unequal": ((6, 9), (4, 9)),
    "larger": ((300, 64, 128, 17), (0, 40, 128, 5)),
}


def gpu_probes(device) -> dict[str, Any]:
    """What only the GPU shows, with torch alone: per layout, dtype and backend (SDPA unpinned, cuDNN,
    efficient, math), causal bottom-right masks built as a user builds them, and for cuDNN also an
    additive float mask with -inf and with the finite fill. Per point: which backend SDPA picked,
    max |out| and |dq| on REAL rows with no visible key, their distance to unmasked attention over
    every key slot (the replica's mechanism) and to mean(V), REAL-row errors of out/dq/dk/dv
    against fp64 math, and whether two identical runs are bitwise equal."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {"skipped": f"gpu_probes needs a CUDA device, got {device!r}"}
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(dev),
        "points": probe_points(dev),
        "timing_ms": workaround_timing(dev),
    }


def workaround_timing(dev: torch.device, batch: int = 8, seq: int = 2048, heads: int = 16, dim: int = 64) -> dict:
    """Forward+backward milliseconds (`workbench.timing.time_call`'s median of 20 after 5 warm-up runs, bf16, a padding mask with
    lengths seq, seq/2, ...): SDPA unpinned, unpinned + workaround (a), pinned to each backend (b)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, dim, generator=gen).to(dev, torch.bfloat16) for _ in range(3))
    lengths = torch.tensor([max(seq >> (i % 4), 2) for i in range(batch)], device=dev)
    real = torch.arange(seq, device=dev)[None, :] < lengths[:, None]
    mask = (real[:, :, None] & real[:, None, :] & torch.ones(seq, seq, dtype=torch.bool, device=dev).tril())[:, None]

    def step(backend, zero_rows):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        if zero_rows:
            out = out.masked_fill(~mask.any(-1, keepdim=True), 0)
        out.backward(torch.ones_like(out))

    timed = {}
    for name, backend, zero_rows in (
        ("unpinned", None, False),
        ("unpinned + (a) zero rows", None, True),
        ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION, False),
        ("EFFICIENT_ATTENTION", SDPBackend.EFFICIENT_ATTENTION, False),
        ("MATH", SDPBackend.MATH, False),
    ):
        try:
            timed[name] = time_call(functools.partial(step, backend, zero_rows), warmup=5, device=dev).median_ms
        except RuntimeError as exc:
            timed[name] = f"refused: {str(exc).splitlines()[0][:120]}"
    return {"shape": f"B={batch} H={heads} S={seq} D={dim} bf16", **timed}


def probe_points(dev: torch.device, layouts: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = GPU_LAYOUTS) -> list:
    """The points of `gpu_probes` on `dev` (on a CPU the cuDNN and efficient points read "refused")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {int(b.value): name for name, b in SDPBackend.__members__.items()}
    points = []
    for layout, (lens_q, lens_k) in layouts.items():
        for dtype in (torch.float16, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            bsz, heads, dim = len(lens_q), 2, 64
            sq, sk = max(lens_q), max(max(lens_k), 2)  # cuDNN refuses a key length of 1
            rq = torch.arange(sq)[None, :] < torch.tensor(lens_q)[:, None]
            rk = torch.arange(sk)[None, :] < torch.tensor(lens_k)[:, None]

            def draw(*shape, gen=gen, dtype=dtype):  # rounded to `dtype`: the fp64 reference sees what the GPU sees
                return torch.randn(*shape, generator=gen).to(dtype).float()

            # Padded slots hold one "pad token" (as a model's pad-token activations would), not zeros.
            q = torch.where(rq[:, None, :, None], draw(bsz, heads, sq, dim), draw(1, heads, 1, dim))
            k = torch.where(rk[:, None, :, None], draw(bsz, heads, sk, dim), draw(1, heads, 1, dim))
            v = torch.where(rk[:, None, :, None], draw(bsz, heads, sk, dim), draw(1, heads, 1, dim))
            rows = torch.arange(sq)[None, :, None]
            cols = torch.arange(sk)[None, None, :]
            shift = (torch.tensor(lens_k) - torch.tensor(lens_q))[:, None, None]
            mask = (rq[:, :, None] & rk[:, None, :] & (cols <= rows + shift))[:, None]  # (B, 1, S_q, S_k)
            keyless = (rq[:, None, :] & ~mask.any(-1)).expand(bsz, heads, sq)  # REAL rows without a key
            d_out = draw(bsz, heads, sq, dim) * rq[:, None, :, None]  # a loss that ignores padded queries
            ref = _fp64_math(q, k, v, mask, d_out)
            unmasked = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
            mean_v = v.double().mean(2, keepdim=True).expand_as(unmasked)
            inputs = [t.to(dev, dtype) for t in (q, k, v)]
            mask_d, d_out_d = mask.to(dev), d_out.to(dev, dtype)
            choice = int(torch._fused_sdp_choice(*inputs, attn_mask=mask_d))
            variants = [
                ("default", None, "bool"),
                ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION, "bool"),
                ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION, "float -inf"),
                ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION, "float -65504"),
                ("EFFICIENT_ATTENTION", SDPBackend.EFFICIENT_ATTENTION, "bool"),
                ("MATH", SDPBackend.MATH, "bool"),
            ]
            first_runs: dict[str, dict[str, torch.Tensor]] = {}  # backend -> its boolean-mask run
            for backend_name, backend, mask_kind in variants:
                point: dict[str, Any] = {
                    "layout": layout,
                    "dtype": str(dtype).replace("torch.", ""),
                    "backend": backend_name,
                    "mask": mask_kind,
                    "default_choice": names.get(choice, str(choice)),
                }
                if mask_kind == "bool":
                    attn = mask_d
                else:
                    fill = float("-inf") if mask_kind == "float -inf" else CUDNN_FILL
                    attn = torch.zeros(mask_d.shape, dtype=dtype, device=dev).masked_fill(~mask_d, fill)
                try:
                    runs = [_gpu_run(inputs, attn, d_out_d, sdpa_kernel, backend) for _ in range(2)]
                except RuntimeError as exc:
                    point["error"] = str(exc).splitlines()[0][:200]
                    points.append(point)
                    continue
                got = {n: t.double().cpu() for n, t in runs[0].items()}
                point["deterministic"] = all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
                if mask_kind == "bool":
                    first_runs[backend_name] = runs[0]
                elif backend_name in first_runs:  # the hypothesis: a boolean mask is this float mask for cuDNN
                    point["bitwise_equal_to_bool_mask"] = all(
                        torch.equal(runs[0][n], first_runs[backend_name][n]) for n in runs[0]
                    )
                point["nonfinite"] = {n: int((~torch.isfinite(t)).sum()) for n, t in got.items()}
                point["keyless_rows"] = int(keyless[:, 0].sum())
                if keyless.any():
                    point["keyless_out_max_abs"] = float(got["out"][keyless].abs().max())
                    point["keyless_dq_max_abs"] = float(got["dq"][keyless].abs().max())
                    point["vs_unmasked"] = float((got["out"][keyless] - unmasked[keyless]).abs().max())
                    point["vs_mean_v"] = float((got["out"][keyless] - mean_v[keyless]).abs().max())
                real_q = (rq[:, None, :] & ~keyless[:, :1]).expand(bsz, heads, sq)
                real_k = rk[:, None, :].expand(bsz, heads, sk)
                point["real_errors"] = {
                    "out": float((got["out"] - ref["out"])[real_q].abs().max()),
                    "dq": float((got["dq"] - ref["dq"])[real_q].abs().max()),
                    "dk": float((got["dk"] - ref["dk"])[real_k].abs().max()),
                    "dv": float((got["dv"] - ref["dv"])[real_k].abs().max()),
                }
                points.append(point)
    return points


def _fp64_math(q, k, v, mask, d_out) -> dict[str, torch.Tensor]:
    """fp64 SDPA under the math backend on the CPU (rows with no visible key: 0), with gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask)
    out.backward(d_out.double())
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def _gpu_run(inputs, attn, d_out, sdpa_kernel, backend) -> dict[str, torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    if backend is None:
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=attn)
    else:
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=attn)
    out.backward(d_out)
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


# -- claims ----------------------------------------------------------------------------------------

claims = Claims()


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RECORD_TOLERANCE * abs(b)


@claims(
    "On the H200 (torch 2.11.0+cu130, fp16), the cuDNN backend fails fully-masked-rows and causal-unequal with REAL-row "
    "errors hundreds of times torch's own, while the math and memory-efficient backends pass both on the same calls",
    evidence=UPSTREAM_GPU,
)
def _recorded(r: MaskedRowsResults):
    parts, ok = [], True
    for case in CASES:
        rec = r.recorded[case.label()]
        cud = rec["sdpa-cudnn"]
        worst = min(e[2] for e in cud["errors"].values()) if cud["errors"] else 0.0
        ok &= cud["verdict"] == "FAIL" and set(cud["errors"]) == set(TENSORS) and worst > 100
        ok &= rec["sdpa-math"]["verdict"] == "pass" and rec["sdpa-efficient"]["verdict"] == "pass"
        ok &= cud["case"]["seqlens_q"] == list(case.seqlens_q) and cud["case"]["seqlens_k"] == list(case.seqlens_k)
        parts.append(
            f"{CHECK_OF[case]}: cuDNN {cud['verdict']} (all four tensors >= {worst:.0f}x), math "
            f"{rec['sdpa-math']['verdict']}, efficient {rec['sdpa-efficient']['verdict']}"
        )
    return ok and "H200" in r.provenance[
        "device"
    ], f"{'; '.join(parts)} ({r.provenance['date']}, commit {r.provenance['commit']})"


@claims(
    "The failing layouts are exactly the ones with a REAL query row that sees no key: an empty key sequence, and causal "
    "bottom-right rows with len_q > len_k",
    evidence=UPSTREAM_GPU,
)
def _layouts(r: MaskedRowsResults):
    counts = {CHECK_OF[c]: len(r.keyless[c.label()]) for c in CASES}
    # causal-unequal's first case (q=[5,3], k=[9,7]) has no keyless row and is not the FAIL evidence.
    first = Case((5, 3), seqlens_k=(9, 7), causal=True)
    named = all(r.recorded[c.label()]["sdpa-cudnn"]["evidence"].startswith(c.label()) for c in CASES)
    return all(counts.values()) and not keyless_rows(first) and named, (
        f"keyless REAL rows: {counts}; causal-unequal's passing first case q=[5,3] k=[9,7]: {len(keyless_rows(first))}"
    )


@claims(
    "torch's math backend gives every REAL row with no visible key exactly 0, and 0 gradient to its query",
    evidence=UPSTREAM_CPU,
)
def _math_zero(r: MaskedRowsResults):
    m = {c: r.mechanism[c.label()] for c in CASES}
    within = all(r.probes[c.label()]["math backend"].real_within_bound for c in CASES)
    ok = within and all(v["math_max_abs"] == 0.0 and v["math_dq_max_abs"] == 0.0 for v in m.values())
    return ok, f"torch {torch.__version__}: max |out|, |dq| on keyless rows " + ", ".join(
        f"{CHECK_OF[c]} {v['math_max_abs']:.3g}, {v['math_dq_max_abs']:.3g}" for c, v in m.items()
    ) + f"; REAL rows within the bound: {within}"


@claims(
    "SDPA given the additive mask torch builds for cuDNN (-65504 where the boolean mask is False) reproduces the "
    "recorded cuDNN errors of out, dq, dk and dv in both cases within 2%",
    evidence=REPLICA,
)
def _replica_matches(r: MaskedRowsResults):
    pairs = []
    for case in CASES:
        rec = r.recorded[case.label()]["sdpa-cudnn"]["errors"]
        rep = r.probes[case.label()]["cuDNN's mask on math (replica)"].errors
        pairs += [(f"{CHECK_OF[case]} {t}", rep[t].error, rec[t][0]) for t in TENSORS]
    worst = max(abs(a - b) / b for _, a, b in pairs)
    return all(_close(a, b) for _, a, b in pairs), f"8 errors, worst relative difference {worst:.2%}: " + ", ".join(
        f"{n} {a:.3g} vs {b:.3g}" for n, a, b in pairs[:2]
    ) + ", ..."


@claims(
    "In the replica a keyless row is unmasked attention over every key slot of its batch row, padding slots included "
    "(the softmax of scores all shifted by the same constant)",
    evidence=REPLICA,
)
def _mechanism(r: MaskedRowsResults):
    m = {CHECK_OF[c]: r.mechanism[c.label()] for c in CASES}
    ok = all(v["replica_vs_unmasked"] < 2e-3 and v["replica_max_abs"] > 0.1 for v in m.values())
    return ok, "; ".join(
        f"{n}: max |out| {v['replica_max_abs']:.3g}, max |out - unmasked| {v['replica_vs_unmasked']:.2g}" for n, v in m.items()
    )


@claims(
    "With zero padding the damage is confined and predictable: out and dq go wrong exactly on the keyless rows of "
    "sequences that have keys, dk and dv exactly on those keys; every other row stays within the bound",
    evidence=REPLICA,
)
def _damage(r: MaskedRowsResults):
    parts, ok = [], True
    for case in CASES:
        d = r.damaged[case.label()]["cuDNN's mask on math (replica)"]
        want_q, want_k = keyless_rows_beside_keys(case), keys_of_keyless_sequences(case)
        ok &= d["out"] == want_q and d["dq"] == want_q and d["dk"] == want_k and d["dv"] == want_k
        parts.append(f"{CHECK_OF[case]}: out/dq rows {d['out']}/{d['dq']}, dk/dv rows {d['dk']}/{d['dv']}")
    return ok, "; ".join(parts)


@claims(
    "With padding slots that hold a pad token's key and value instead of zeros, the replica returns exactly that pad "
    "token's value on every row of the empty key sequence; the math backend returns 0",
    evidence=REPLICA,
)
def _pad_token(r: MaskedRowsResults):
    p = r.pad_token
    ok = p["replica_max_abs"] > 0.1 and p["replica_vs_v_pad"] < 2e-3 and p["math_max_abs"] == 0.0
    return (
        ok,
        f"replica max |out| {p['replica_max_abs']:.3g}, max |out - v_pad| {p['replica_vs_v_pad']:.2g}; math max |out| {p['math_max_abs']:.3g}",
    )


@claims(
    "Workaround (a), zeroing rows with no visible key after the call, puts the replica within the bound on every REAL "
    "row of out, dq, dk and dv",
    evidence=REPLICA,
)
def _workaround_a(r: MaskedRowsResults):
    recs = {CHECK_OF[c]: r.probes[c.label()]["(a) replica + zero rows without key"] for c in CASES}
    return all(x.real_within_bound for x in recs.values()), "; ".join(
        f"{n}: worst {max(e.ratio for e in x.errors.values()):.2f}x torch's own error" for n, x in recs.items()
    )


@claims(
    "Workaround (c), dropping sequences with no key, removes only the empty-key rows: causal rows with len_q > len_k "
    "still see no key",
    evidence=UPSTREAM_CPU,
)
def _workaround_c(r: MaskedRowsResults):
    return r.dropped["after"] > 0 and r.dropped["after"] < r.dropped["before"], (
        f"{FULLY.label()}: {r.dropped['before']} keyless REAL rows, {r.dropped['after']} after dropping the empty key sequence"
    )


@claims(
    "The check-your-run lines flag the replica (non-zero output on rows without key) and pass torch's own CPU backends",
    evidence=UPSTREAM_CPU,
)
def _check_run(r: MaskedRowsResults):
    c = r.check_run
    ok = c["replica of cuDNN"]["max_abs_there"] > 0.1 and c["SDPA unpinned"]["max_abs_there"] == 0.0
    ok &= c["math backend"]["max_abs_there"] == 0.0
    return ok, "; ".join(f"{k}: {v['rows_without_key']} rows, max |out| {v['max_abs_there']:.3g}" for k, v in c.items())


@claims(
    "Our kernel gives every keyless row 0 and passes both layouts",
    evidence=OURS,
)
def _ours(r: MaskedRowsResults):
    recs = {c: r.probes[c.label()]["(d) our kernel"] for c in CASES}
    peaks = {CHECK_OF[c]: float(x.tensors["out"][r.keyless[c.label()]].abs().max()) for c, x in recs.items()}
    return all(x.real_within_bound for x in recs.values()) and not any(peaks.values()), f"max |out| on keyless rows {peaks}"


@claims(
    "The initcheck reports of the cuDNN row are reads by our adapter's gather of cuDNN's output, in a layout with "
    "no keyless REAL row (so not this bug); memcheck reports 0 errors",
    evidence=UPSTREAM_GPU,
)
def _sanitizer(r: MaskedRowsResults):
    s = r.sanitizer
    watched = Case((37, 0, 100, 64), seqlens_k=(40, 5, 100, 64), causal=True)
    ok = s["errors"].get("initcheck", 0) > 0 and s["errors"].get("memcheck") == 0
    ok &= s["printed_reports"] > 0 and all("bshd_to_thd" in f or "_back_to_thd" in f for f in s["first_frame_of_ours"])
    ok &= not keyless_rows(watched) and "q=[37, 0, 100, 64]" in s["program"]
    return ok, f"{s['errors']}; {s['printed_reports']} printed reports, our first frame: {s['first_frame_of_ours']}"
