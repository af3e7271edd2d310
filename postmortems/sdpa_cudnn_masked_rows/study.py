"""The study: SDPA's backends and our replica of cuDNN's masking on the cases, the workarounds, the H200 audit and
sanitizer records read back, and reproduce()."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.cases import (
    _ERROR,
    CASES,
    CHECK_OF,
    CUDNN_FILL,
    FULLY,
    META,
    POISONED,
    TENSORS,
)
from varlen_workbench.workbench.audit import adapt
from varlen_workbench.workbench.audit.adapters import bshd_mask
from varlen_workbench.workbench.layout import Case, pack, thd_to_bshd
from varlen_workbench.workbench.postmortem import (
    Results,
    latest_gpu_record,
)
from varlen_workbench.workbench.probes import ProbeRecord, grad_output, probe
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import load_records, read_record
from varlen_workbench.workbench.reference import reference_attention, visible_keys


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
        if attn_mask is None:
            return out
        visible = attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")  # as on the page
        return out.masked_fill(~visible.any(-1, keepdim=True), 0)

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


def keyless_rows(case: Case) -> list[int]:
    """THD indices of REAL query rows that see no key (causal and the window bottom-right, as the audit's adapter)."""
    rows, start = [], 0
    window = (case.window[0], 0 if case.causal else case.window[1])
    for lq, lk in zip(case.real_lengths("q"), case.real_lengths("k")):
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


def sliding_window_rows(device=None) -> dict[str, Any]:
    """The H200 audit's sliding-window failure on cuDNN, replayed forward with the replica on the recorded
    case through the audit's own adapter and padding: the replica's out error beside the recorded one,
    and the REAL rows beyond the bound beside the rows the window leaves without a key."""
    check = recorded_check(audit_record("sdpa-cudnn"), "sliding-window")
    case = Case(**check["case"])
    impl = adapt(cudnn_mask_replica, "sdpa-math", device=device)
    record = probe(impl, pack(case, device), backward=False, padding_fill=case.fill)
    real = record.regions_q == 0
    batch = pack(case, device)
    oracle = reference_attention(*(t.detach().double() for t in (batch.q, batch.k, batch.v)), *batch.args()[3:], **batch.kwargs())
    row_error = (record.tensors["out"].double() - oracle.cpu()).abs().flatten(1).amax(1)
    wrong = (real & (row_error > record.errors["out"].bound)).nonzero().flatten().tolist()
    return {
        "case": case.label(),
        "error": record.errors["out"].error,
        "recorded": check["errors"]["out"][0],
        "wrong_rows": wrong,
        "keyless_rows": keyless_rows(case),
    }


def default_backend_records() -> list[dict[str, Any]]:
    """data/gpu/sdpa-default-backend-*.json: which backend SDPA ran, by the profiler's aten ops, for
    ordinary masked calls made with no `sdpa_kernel` context (`varlen_workbench.workbench.instruments.sdpa_dispatch`)."""
    how = "python -m varlen_workbench.workbench.instruments.sdpa_dispatch --record data/gpu/sdpa-default-backend-<gpu>.json"
    return load_records("sdpa-default-backend-*.json", how=how)


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
    default_backend: list[dict[str, Any]]  # the records of SDPA's unpinned dispatch, one per GPU
    sliding_window: dict[str, Any]  # the audit's sliding-window failure replayed on the replica


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
    ours = probe(varlen_attention_triton, pack(case, device), name="(d) our kernel", poisoned=POISONED[case])
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


def _pinned(sdpa_kernel, backend, q, k, v, attn_mask):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


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
        default_backend=default_backend_records(),
        sliding_window=sliding_window_rows("cpu"),
    )


def _fp64_math(q, k, v, mask, d_out) -> dict[str, torch.Tensor]:
    """fp64 SDPA under the math backend on the CPU (rows with no visible key: 0), with gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask)
    out.backward(d_out.double())
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
