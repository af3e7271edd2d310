"""TransformerEngine itself beyond the report's cases: its audit FAILs taken apart, and the report's
FP8 mechanism on TE's own GEMM (GPU only; scripts/te_probes.py runs them and records the result).

- `ZERO_KEY_VARIANTS`: the fuzzer's smallest failing layout for the audit row `te` (a sequence
  with one key and no query beside one with a query and no key: NaN in dk and dv of a REAL key),
  and the same layout with one thing changed at a time, so that the record says which part of it
  the failure needs. `run_variant` probes one through the `te-thd` adapter as the audit does
  (NaN-poisoned memory, fp64 oracle) and returns its findings.
- `fp8_linear_padding`: the report blames FP8 alignment padding for a perplexity collapse. Its
  mechanism, as our replica shows it, is the FP8 scale: a per-tensor amax taken over padding rows
  that hold large values coarsens the quantization of every REAL row. Here TE's own `Linear`
  runs on the report's packed shapes under each FP8 recipe with padding rows zero, normal (as the
  report's script draws them) or large, and the REAL rows' error against fp64 says whether TE's
  GEMMs show it.
"""

from __future__ import annotations

from typing import Any

import torch

from varlen_workbench.postmortems.te_thd_2892.upstream import RECIPES, REPORT_CASE, Recipe
from varlen_workbench.workbench.layout import Case, Fill, Region, pack

# The audit row te's fuzzer, 2026-12-07 on the H200 (data/gpu/audit-te.json): its smallest failing layout.
FUZZ_SMALLEST = Case(seqlens_q=(0, 1), seqlens_k=(1, 0), kv_heads=1, head_dim=64, dtype="bfloat16", fill=Fill.ZEROS)

ZERO_KEY_VARIANTS: dict[str, Case] = {
    "the fuzzer's smallest": FUZZ_SMALLEST,
    "without GQA": FUZZ_SMALLEST.with_(kv_heads=None),
    "float16": FUZZ_SMALLEST.with_(dtype="float16"),
    "causal": FUZZ_SMALLEST.with_(causal=True),
    "the keyless sequence given a key": FUZZ_SMALLEST.with_(seqlens_k=(1, 1)),
    "the queryless sequence given a query": FUZZ_SMALLEST.with_(seqlens_q=(1, 1)),
    "keyless sequence first": FUZZ_SMALLEST.with_(seqlens_q=(1, 0), seqlens_k=(0, 1)),
    "longer sequences": FUZZ_SMALLEST.with_(seqlens_q=(0, 8), seqlens_k=(8, 0)),
    "a third, whole sequence": FUZZ_SMALLEST.with_(seqlens_q=(0, 1, 4), seqlens_k=(1, 0, 4)),
    "a keyless sequence, every other one whole": FUZZ_SMALLEST.with_(seqlens_q=(3, 1, 4), seqlens_k=(3, 0, 4)),
    "a queryless sequence, every other one whole": FUZZ_SMALLEST.with_(seqlens_q=(3, 0, 4), seqlens_k=(3, 1, 4)),
    # The audit's empty-sequences check, which passed: both kinds of empty sequence, none adjacent.
    "the empty-sequences check's layout": FUZZ_SMALLEST.with_(seqlens_q=(3, 2, 0, 4), seqlens_k=(3, 0, 2, 0), kv_heads=None),
}


def run_variant(case: Case, device: str = "cuda") -> dict[str, Any]:
    """`case` through TE's DotProductAttention as the audit row `te` calls it, under NaN-poisoned
    memory: the audit's findings and the non-finite counts of each tensor by region."""
    from varlen_workbench.workbench.audit import adapt, layout_findings
    from varlen_workbench.workbench.audit.adapters.te import te_dot_product_attention
    from varlen_workbench.workbench.probes import probe

    impl = adapt(te_dot_product_attention, "te-thd", device)
    record = probe(impl, pack(case, impl.device), poisoned=True, backward=impl.backward, **impl.case_kwargs(case))
    return {
        "findings": [{"check": f.check, "evidence": f.evidence} for f in layout_findings(record)],
        "nonfinite": record.nonfinite,
    }


# -- the FP8 scale on TE's GEMM ---------------------------------------------------------------

# What padding rows hold: zero (TE's recipe), normal values (the report's script), large finite
# values (memory a packer never wrote; 2^14 is well inside BF16 and FP8 E4M3 after scaling).
PADDING_FILLS = {"zeros": 0.0, "normal": 1.0, "large": 16384.0}
GEMM_RECIPES = tuple(r for r in RECIPES if r.cls is not None and not dict(r.kwargs).get("fp8_dpa"))
GEMM_STEPS = 3  # DelayedScaling scales a step by the amax history of the steps before it


def packed_activations(case: Case, fill: str, features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, real): `case`'s packed rows (its padded lengths) of `features` normal values in BF16,
    padding rows replaced as `fill` says; `real` marks REAL rows."""
    if fill not in PADDING_FILLS:
        raise ValueError(f"fill = {fill!r} must be one of {tuple(PADDING_FILLS)}.")
    batch = pack(case.with_(heads=1, head_dim=8), "cpu", requires_grad=False)
    real = batch.regions_q == Region.REAL
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(len(real), features, generator=generator)
    padding = torch.randn(len(real), features, generator=generator) * PADDING_FILLS[fill]
    return torch.where(real[:, None], x, padding).to(torch.bfloat16), real


def relative_error(value: torch.Tensor, oracle: torch.Tensor) -> float:
    return float((value.double() - oracle).norm() / oracle.norm())


def fp8_linear_padding(recipe: Recipe, fill: str, device: str = "cuda", case: Case = REPORT_CASE) -> dict[str, Any]:
    """TE's `Linear` (hidden = heads x head_dim of `case`, no bias, BF16 weights) on `case`'s packed
    rows under `recipe`, padding rows as `fill` says; dY is zero on padding rows, as a loss over
    REAL tokens sends it. Returns the REAL rows' relative error of y and of dW against fp64, after
    `GEMM_STEPS` steps on the same batch (the last one measured)."""
    from varlen_workbench.workbench.audit.adapters.te import _recipes, _te

    te = _te()
    hidden = case.heads * case.head_dim
    x, real = packed_activations(case, fill, hidden)
    x, real = x.to(device), real.to(device)
    torch.manual_seed(0)
    layer = te.Linear(hidden, hidden, bias=False, params_dtype=torch.bfloat16, device=device)
    dy = torch.where(real[:, None], torch.randn(x.shape, device=device), 0.0).to(torch.bfloat16)
    built = recipe.build(_recipes())
    for _ in range(GEMM_STEPS):
        layer.weight.grad = None
        with te.autocast(enabled=built is not None, recipe=built):
            y = layer(x.detach().requires_grad_())
        y.backward(dy)
    weight = layer.weight.detach().double()
    y_oracle = x.double() @ weight.T
    dw_oracle = dy.double().T @ x.double().where(real[:, None], 0.0)
    return {
        "recipe": recipe.describe(),
        "fill": fill,
        "padding_abs_max": float(x[~real].float().abs().max()) if (~real).any() else 0.0,
        "y_real_error": relative_error(y.detach()[real], y_oracle[real]),
        "dw_error": relative_error(layer.weight.grad, dw_oracle),
        "y_padding_finite": bool(torch.isfinite(y.detach()[~real]).all()),
    }


def fp8_linear_table(device: str = "cuda", case: Case = REPORT_CASE) -> list[dict[str, Any]]:
    """`fp8_linear_padding` for every FP8 GEMM recipe and fill, with BF16's own error beside them
    (no recipe: the floor the FP8 errors are read against). A recipe that raises is recorded so."""
    rows = []
    for recipe in (Recipe("bf16"), *GEMM_RECIPES):
        for fill in PADDING_FILLS:
            try:
                rows.append({"name": recipe.name, **fp8_linear_padding(recipe, fill, device, case)})
            except Exception as exc:  # a recipe this GPU or TE build refuses: a finding, not a lost run
                rows.append(
                    {"name": recipe.name, "recipe": recipe.describe(), "fill": fill, "error": f"{type(exc).__name__}: {exc}"}
                )
    return rows


def scale_damage(rows: list[dict[str, Any]]) -> dict[str, float]:
    """For each recipe, how much its REAL-row y error grows from zero padding to large padding
    (1.0: padding does not reach REAL rows); recipes that raised are left out."""
    by = {(r["name"], r["fill"]): r for r in rows if "error" not in r}
    return {
        name: by[name, "large"]["y_real_error"] / by[name, "zeros"]["y_real_error"]
        for name in dict.fromkeys(r["name"] for r in rows)
        if (name, "large") in by and (name, "zeros") in by and by[name, "zeros"]["y_real_error"] > 0
    }


# -- compute-sanitizer's initcheck, with and without padding -----------------------------------

# The layout the audit's sanitizer run watched for the row te (scripts/audit_sanitize.py: GAP and
# TAIL rows, a sequence with keys and no query, unequal lengths, GQA, causal), then the same
# lengths with each kind of padding alone and with none, and without padding, the queryless
# sequence or GQA: which of them the uninitialised reads follow.
_WATCHED = Case(
    seqlens_q=(37, 0, 100, 64),
    seqlens_k=(40, 5, 100, 64),
    padded_q=(48, 3, 128, 64),
    padded_k=(48, 8, 112, 70),
    tail_q=5,
    tail_k=3,
    heads=4,
    kv_heads=2,
    head_dim=64,
    dtype="bfloat16",
    causal=True,
    fill=Fill.ZEROS,
)
INITCHECK_LAYOUTS: dict[str, Case] = {
    "the audit's (GAP and TAIL)": _WATCHED,
    "GAP only": _WATCHED.with_(tail_q=0, tail_k=0),
    "TAIL only": _WATCHED.with_(padded_q=None, padded_k=None),
    "no padding": _WATCHED.with_(padded_q=None, padded_k=None, tail_q=0, tail_k=0),
    "no padding, no queryless sequence": _WATCHED.with_(
        seqlens_q=(37, 100, 64), seqlens_k=(40, 100, 64), padded_q=None, padded_k=None, tail_q=0, tail_k=0
    ),
    "no padding, no GQA": _WATCHED.with_(padded_q=None, padded_k=None, tail_q=0, tail_k=0, kv_heads=None),
}


def forward_backward(case: Case, device: str = "cuda") -> str:
    """`case` forward and backward through the `te` row, no oracle (the program compute-sanitizer
    watches); its last line is the one `varlen_workbench.workbench.audit.sanitizer.parse` reads as completed."""
    import time

    from varlen_workbench.workbench.audit import adapt
    from varlen_workbench.workbench.audit.adapters.te import te_dot_product_attention
    from varlen_workbench.workbench.probes import probe

    impl = adapt(te_dot_product_attention, "te-thd", device)
    start = time.perf_counter()
    probe(impl, pack(case, impl.device), reference=False, backward=True, **impl.case_kwargs(case))
    if impl.device.type == "cuda":
        torch.cuda.synchronize()
    return f"te: {case.label()} forward+backward in {time.perf_counter() - start:.1f} s"
