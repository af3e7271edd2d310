"""The mechanism on the replica of TransformerEngine's THD path: the layout contract, the recipe, the workaround
and its sweep, pad_between_seqs detection read from the source, FP8 padding, casts, sequence parallelism and RoPE."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.te_thd_2892.cases import (
    ALIGN,
    CAST_VALUES,
    FP8_CASE,
    FP8_FILLS,
    PADDING_FRACTIONS,
    ROPE_CASE,
    SEQPAR_SEQLENS,
    TE_DOCSTRING,
    TE_TOLERANCE,
    padding_case,
    te_case,
)
from varlen_workbench.postmortems.te_thd_2892.fp8 import (
    FP8,
    FP8_MAX,
    plain_cast_e4m3,
    quantize_fp8_blockwise,
    quantize_reference,
    varlen_attention_fp8,
)
from varlen_workbench.workbench.bounds import ErrorCheck, error_check
from varlen_workbench.workbench.instruments.seqpar import SeqParStudy, run_sequence_parallel
from varlen_workbench.workbench.instruments.tinylm import (
    LMConfig,
    SyntheticTask,
    TinyLM,
    apply_rope,
    dense_attention,
    rope_positions,
)
from varlen_workbench.workbench.layout import Case, Region, cumulative, pack, unpad_thd
from varlen_workbench.workbench.probes import ProbeRecord, grad_output, probe
from varlen_workbench.workbench.reference import reference_attention


def layout_contract(case: Case = TE_DOCSTRING, impl=varlen_attention_triton, device=None) -> ProbeRecord:
    """The fixed kernel on a padded layout, forward and backward, NaN in every padding row and
    NaN-poisoned memory: the probe records shape, padding rows and REAL-row error vs the oracle."""
    return probe(impl, pack(case, device), name=getattr(impl, "__name__", "impl"), poisoned=True)


@dataclass(frozen=True)
class RecipeResult:
    """TE's THD-padding test recipe applied to one implementation."""

    case: Case
    pads: tuple[int, ...]  # padding rows appended to each sequence
    te_tolerance: float
    te_error: dict[str, float]  # tensor -> max(|x - ref| - rtol |ref|): <= atol passes TE's allclose
    checks: dict[str, ErrorCheck]  # tensor -> our relative bound (FlashAttention style)
    padding_max_abs: float  # largest |x| on padding rows of out, dq, dk, dv

    @property
    def te_passes(self) -> bool:
        return all(e <= self.te_tolerance for e in self.te_error.values())

    @property
    def within_bound(self) -> bool:
        return all(c.within for c in self.checks.values())


def _unpadded_attention(batch, dtype: torch.dtype, d_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference of TE's recipe: the same attention on unpadded copies (no padding exists)."""
    cu_q, cu_k = batch.cu_seqlens_q, batch.cu_seqlens_k
    leaves = [
        unpad_thd(t.detach(), cu, pad).to(dtype).requires_grad_()
        for t, cu, pad in (
            (batch.q, cu_q, batch.cu_seqlens_q_padded),
            (batch.k, cu_k, batch.cu_seqlens_k_padded),
            (batch.v, cu_k, batch.cu_seqlens_k_padded),
        )
    ]
    out = reference_attention(
        *leaves, cu_q, cu_k, batch.max_seqlen_q, batch.max_seqlen_k, causal=batch.case.causal, compute_dtype=dtype
    )
    out.backward(unpad_thd(d_out, cu_q, batch.cu_seqlens_q_padded).to(dtype))
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def te_recipe(
    impl,
    seqlens: tuple[int, ...],
    *,
    dtype: str = "float16",
    causal: bool = True,
    heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
    device=None,
) -> RecipeResult:
    """TE's own test of THD with padding between sequences, run on `impl`.

    Append 0-3 padding rows per sequence, zero padding rows of q, k, v and of the output
    gradient, run `impl` on the padded layout, run the reference on unpadded copies, and
    compare valid rows only: TE's allclose (atol = rtol = `TE_TOLERANCE[dtype]`) and our
    relative bound (error <= FlashAttention factor x PyTorch's own error in `dtype`).
    """
    case, pads = te_case(seqlens, dtype=dtype, causal=causal, heads=heads, head_dim=head_dim, seed=seed)
    batch = pack(case, device)
    torch_dtype = case.torch_dtype
    if torch_dtype not in TE_TOLERANCE:
        raise ValueError(f"dtype = {dtype!r}: TE's recipe states tolerances for {sorted(str(d) for d in TE_TOLERANCE)} only.")
    d_out = grad_output(batch).masked_fill((batch.regions_q != Region.REAL).to(batch.device)[:, None, None], 0.0)
    out = batch.call(impl)
    out.backward(d_out)
    got = {"out": out.detach(), "dq": batch.q.grad, "dk": batch.k.grad, "dv": batch.v.grad}
    oracle = _unpadded_attention(batch, torch.float64, d_out)
    baseline = _unpadded_attention(batch, torch_dtype, d_out)
    tol = TE_TOLERANCE[torch_dtype]
    te_error, checks, padding = {}, {}, 0.0
    for name, value in got.items():
        side = "q" if name in ("out", "dq") else "k"
        cu, cu_padded = getattr(batch, f"cu_seqlens_{side}"), getattr(batch, f"cu_seqlens_{side}_padded")
        valid = unpad_thd(value, cu, cu_padded).double().cpu()
        ref = oracle[name].cpu()
        te_error[name] = float(((valid - ref).abs() - tol * ref.abs()).max())
        checks[name] = error_check(name, valid, ref, baseline[name].cpu(), torch_dtype, **batch.reduction_lengths())
        rows = batch.regions(name) != Region.REAL
        if rows.any():
            padding = max(padding, float(value.detach().cpu()[rows].abs().max()))
    return RecipeResult(case, pads, tol, te_error, checks, padding)


def identical_boundaries(impl, separate: bool = False):
    """`impl` called the way VERL's workaround calls it: the padded boundaries passed as the real ones
    (and the longest padded sequence as max_seqlen), so that padding rows count as tokens.

    By default the same tensor goes in twice. `separate=True` passes a copy as the real boundaries:
    equal values in another tensor, which TE 2.18+ tells apart (its pad_between_seqs auto-detect
    compares the objects, TE#3487)."""

    def workaround(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, cu_seqlens_q_padded, cu_seqlens_k_padded, **kwargs
    ):
        real_q, real_k = (t.clone() if separate else t for t in (cu_seqlens_q_padded, cu_seqlens_k_padded))
        return impl(
            q,
            k,
            v,
            real_q,
            real_k,
            int(cu_seqlens_q_padded.diff().max()),
            int(cu_seqlens_k_padded.diff().max()),
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_k_padded=cu_seqlens_k_padded,
            **kwargs,
        )

    return workaround


def workaround_error(case: Case, impl=varlen_attention_triton, device=None) -> ErrorCheck:
    """REAL-row output error of the workaround against the fp64 oracle of the correct contract."""
    batch = pack(case, device, requires_grad=False)
    real = batch.regions_q == Region.REAL
    oracle = batch.call(reference_attention).cpu()[real]
    baseline = batch.call(reference_attention, compute_dtype=case.torch_dtype).cpu()[real]
    return error_check(
        "out", batch.call(identical_boundaries(impl)).cpu()[real], oracle, baseline, case.torch_dtype, **batch.reduction_lengths()
    )


def contract_error(case: Case, impl=dense_attention, device=None) -> ErrorCheck:
    """REAL-row output error of the correct call (real `cu_seqlens`, padded `cu_seqlens_padded`)."""
    batch = pack(case, device, requires_grad=False)
    real = batch.regions_q == Region.REAL
    oracle = batch.call(reference_attention).cpu()[real]
    baseline = batch.call(reference_attention, compute_dtype=case.torch_dtype).cpu()[real]
    return error_check("out", batch.call(impl).cpu()[real], oracle, baseline, case.torch_dtype, **batch.reduction_lengths())


def workaround_sweep(impl, fractions=PADDING_FRACTIONS, **case_fields) -> dict[bool, list[tuple[float, ErrorCheck]]]:
    """Workaround error on REAL rows vs padding fraction, non-causal and causal."""
    return {
        causal: [(f, workaround_error(padding_case(f, causal=causal, **case_fields), impl)) for f in fractions]
        for causal in (False, True)
    }


def pad_between_seqs_v2_12(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> bool:
    """TE 2.12 to 2.17.1 (`DotProductAttention.forward`, qkv_format "thd", argument None): padding
    between sequences iff the boundaries differ anywhere but in their last entry."""
    return not torch.equal(cu_seqlens_padded[:-1], cu_seqlens[:-1])


def pad_between_seqs_main(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> bool:
    """TE main after PR #2898 (v2.18): padding between sequences iff a padded tensor was passed
    that is not the same object as the real one (sync-free, so values are not compared)."""
    return cu_seqlens_padded is not cu_seqlens


def auto_detect_layouts() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(cu_seqlens, cu_seqlens_padded) of four layouts of the sequences 3, 2, 4."""
    cu = cumulative([3, 2, 4])
    return {
        "padding between sequences (TE's docstring)": (cu, cumulative([4, 4, 5])),
        "padding at the end only": (cu, cumulative([3, 2, 11])),
        "VERL: equal values, two tensors": (cumulative([4, 4, 5]), cumulative([4, 4, 5])),
        "no padding, one tensor passed twice": (cu, cu),
    }


def auto_detect() -> dict[str, tuple[bool, bool]]:
    """Layout -> (TE 2.12 detects padding between sequences, TE main detects it)."""
    return {name: (pad_between_seqs_v2_12(*pair), pad_between_seqs_main(*pair)) for name, pair in auto_detect_layouts().items()}


def _quantized(batch, scales_from: str, quantize=quantize_fp8_blockwise):
    return [
        quantize(x, cu, cu_padded, scales_from=scales_from)
        for x, cu, cu_padded in (
            (batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded),
            (batch.k, batch.cu_seqlens_k, batch.cu_seqlens_k_padded),
            (batch.v, batch.cu_seqlens_k, batch.cu_seqlens_k_padded),
        )
    ]


def fp8_error(case: Case, scales_from: str, device=None) -> ErrorCheck:
    """REAL-row error of the FP8 forward against the fp64 oracle on the unquantized inputs.

    The bound follows FlashAttention's rule with FP8 as the precision: at most 2x the error of
    PyTorch doing the same FP8 computation (torch's own e4m3 cast with per-(block, head) scales
    from real rows, then exact attention), floored like every bound here (`varlen_workbench.workbench.bounds`: at
    least one ulp of the output dtype). e4m3 keeps 3 mantissa bits (2^-4 relative rounding),
    so that baseline is large: the bound is about what FP8 costs, not about the kernel.
    """
    batch = pack(case, device, requires_grad=False)
    real = batch.regions_q == Region.REAL
    oracle = batch.call(reference_attention).cpu()[real]
    emulated = [x.dequantize() for x in _quantized(batch, "real", quantize_reference)]
    baseline = reference_attention(*emulated, *batch.args()[3:], **batch.kwargs()).cpu()[real]
    out = varlen_attention_fp8(*_quantized(batch, scales_from), *batch.args()[3:], **batch.kwargs(), out_dtype=case.torch_dtype)
    return error_check("out", out.cpu()[real], oracle, baseline, case.torch_dtype, **batch.reduction_lengths())


def fp8_study(case: Case = FP8_CASE, fills=FP8_FILLS, device=None) -> dict[tuple[str, str], ErrorCheck]:
    """(padding fill, scales_from) -> REAL-row error check of the FP8 forward."""
    return {(fill.value, mode): fp8_error(case.with_(fill=fill), mode, device) for fill in fills for mode in ("real", "all")}


def cast_study(device=None) -> dict:
    """Triton's own fp32 -> e4m3 cast vs torch's, and our quantizer vs torch's cast of the same scaled values.

    `values` are hand-picked: a carry (124.3 rounds up into the next binade), ties (17, 200,
    1.0625: torch rounds to even) and plain values, with 448 so that their block's scale is 1;
    `sample` is 4096 N(0, 3^2) values.
    """
    generator = torch.Generator().manual_seed(0)
    values = torch.tensor(CAST_VALUES + (FP8_MAX,) + (0.0,) * (15 - len(CAST_VALUES)))
    found = {}
    for name, x in (("values", values), ("sample", torch.randn(4096, generator=generator) * 3)):
        x = x.to(device or default_device())
        torch_cast, triton_cast = x.to(FP8).float().cpu(), plain_cast_e4m3(x).float().cpu()
        rows = x.view(-1, 1, 16)  # one head of dim 16; a scale per 16 rows
        cu = cumulative([rows.shape[0]], x.device)
        ours, torchs = quantize_fp8_blockwise(rows, cu), quantize_reference(rows, cu)
        found[name] = {
            "x": x.cpu(),
            "interpreted": interpreted(x),  # Triton's cast ran through the interpreter
            "torch": torch_cast,
            "triton": triton_cast,
            "quantizer": ours.data.float().cpu().flatten(),
            "triton_differs": float((triton_cast != torch_cast).float().mean()),
            "quantizer_matches": bool(
                torch.equal(ours.data.float(), torchs.data.float()) and torch.equal(ours.scale, torchs.scale)
            ),
        }
    return found


def seqpar_study(device=None, world_size: int = 2) -> SeqParStudy:
    """One layer of the tiny LM run sequence-parallel on `world_size` processes with our own
    all-gather (`varlen_workbench.workbench.instruments.seqpar`), sized from padded boundaries, from real ones (our check),
    and from real ones unchecked (what torch.distributed itself says)."""
    model = TinyLM(LMConfig(seed=1))
    batch = SyntheticTask(seed=2).batch(SEQPAR_SEQLENS, align=ALIGN)
    with torch.no_grad():
        x = model.embed(batch.tokens)
    return run_sequence_parallel(
        model.blocks[0], x, batch.cu_seqlens, batch.cu_seqlens_padded, world_size=world_size, device=device
    )


@dataclass(frozen=True)
class RopeSequence:
    index: int
    length: int
    offset: int  # real boundaries: position of the sequence's first real token (0 is right)
    kind: str  # "exact", "shifted" (a constant offset) or "restarted" (a jump inside the sequence)
    check: ErrorCheck  # REAL-row error of attention with real-boundary positions


@dataclass(frozen=True)
class RopeStudy:
    case: Case
    from_padded: torch.Tensor  # positions of every row, Megatron-Core MLA style
    from_real: torch.Tensor  # positions with the real boundaries taken as the layout
    consistent: bool  # from_padded gives every sequence's real tokens 0..len-1
    sequences: tuple[RopeSequence, ...]
    check: ErrorCheck  # all REAL rows


def rope_study(case: Case = ROPE_CASE, device=None) -> RopeStudy:
    """Attention after RoPE with positions from the padded layout (the oracle's choice) vs from
    real boundaries applied to the same padded layout, per sequence against the fp64 oracle.

    The oracle and PyTorch's baseline rotate with padded-layout positions (in float64 and in
    the case's dtype); the candidate is the same computation in the case's dtype with the
    real-boundary positions. RoPE scores depend on relative positions only, so a constant
    offset within a sequence costs nothing beyond rounding; a restart inside one does.
    """
    batch = pack(case, device, requires_grad=False)
    rows = batch.q.shape[0]
    from_padded = rope_positions(batch.cu_seqlens_q.cpu(), batch.cu_seqlens_q_padded.cpu(), rows)
    from_real = rope_positions(batch.cu_seqlens_q.cpu(), None, rows)

    def attention(positions, dtype):
        q, k = (apply_rope(x.to(dtype), positions) for x in (batch.q, batch.k))
        return reference_attention(q, k, batch.v.to(dtype), *batch.args()[3:], **batch.kwargs(), compute_dtype=dtype).cpu()

    oracle, baseline = attention(from_padded, torch.float64), attention(from_padded, case.torch_dtype)
    candidate = attention(from_real, case.torch_dtype)
    starts, bounds = batch.cu_seqlens_q_padded.tolist(), batch.cu_seqlens_q.tolist()
    sequences, consistent = [], True
    for i, (start, begin, end) in enumerate(zip(starts, bounds, bounds[1:])):
        real = slice(start, start + end - begin)
        consistent &= torch.equal(from_padded[real], torch.arange(end - begin))
        got = from_real[real]
        kind = (
            "exact"
            if torch.equal(got, from_padded[real])
            else "shifted"
            if torch.equal(got - got[0], torch.arange(end - begin))
            else "restarted"
        )
        check = error_check("out", candidate[real], oracle[real], baseline[real], case.torch_dtype, **batch.reduction_lengths())
        sequences.append(RopeSequence(i, end - begin, int(got[0]), kind, check))
    real = batch.regions_q == Region.REAL
    return RopeStudy(
        case,
        from_padded,
        from_real,
        consistent,
        tuple(sequences),
        error_check("out", candidate[real], oracle[real], baseline[real], case.torch_dtype, **batch.reduction_lengths()),
    )
