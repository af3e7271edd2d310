"""Every block a page invites a reader to paste, executed as the page shows it.

The blocks come from the built pages (`published_site`: the committed notebooks rendered as
`workbench build --no-execute` does), extracted by `workbench.pasteblocks.paste_blocks`, and each runs
verbatim against the inputs real users have: boolean and float masks, masks that differ across
heads, a non-zero `attn_bias`, grouped K/V, empty sequences. A check must flag exactly the runs
the upstream kernel breaks, judged by running that kernel; a workaround must keep REAL rows
within the page's bound (FlashAttention's: out error at most 2x PyTorch's own error in the same
dtype, `workbench.bounds`). Each battery also runs the text its page showed before the fix, and
must fail it: a battery that cannot fail proves nothing.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import io
import linecache
import os
import re
import shlex
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch

from workbench.bounds import error_check
from workbench.pasteblocks import block_digest, paste_blocks
from workbench.provenance import GPU_DATA, REPO
from workbench.records import read_record, write_record


def _name(block: str) -> str:
    """The function a block defines (a block of imports and one function), or 'script' for a
    block that does its work top to bottom."""
    body = ast.parse(block).body
    functions = [node.name for node in body if isinstance(node, ast.FunctionDef)]
    if len(functions) == 1 and all(isinstance(node, ast.FunctionDef | ast.Import | ast.ImportFrom) for node in body):
        return functions[0]
    return "script"


def _run(block: str, **names: Any) -> dict[str, Any]:
    """Executes `block` as a reader's fresh session would (plus `names`, for old texts that took
    them from the reader's scope); returns its namespace."""
    filename = f"<paste block {hash(block):x}>"
    linecache.cache[filename] = (len(block), None, block.splitlines(True), filename)  # for inspect: @triton.jit reads source
    namespace: dict[str, Any] = {"__name__": "__snippet__", **names}
    exec(compile(block, filename, "exec"), namespace)
    return namespace


# -- flash-dmattn 1.2.2's Triton backend: the NaN check of flash-dmattn-121 -------------------------

Q_LEN, HEADS, DIM = 64, 2, 16


def _masks_121() -> dict[str, tuple[int, torch.Tensor | None, bool, bool]]:
    """name -> (q_len, attn_mask or None, is_causal, non-zero bias): batch 2, 2 heads."""
    ones = torch.ones(2, HEADS, Q_LEN, Q_LEN, dtype=torch.bool)
    right = ones.clone()
    right[1, :, :, 40:] = False  # item 1: 24 padding keys on the right
    left = ones.clone()
    left[1, :, :, :20] = False  # item 1: 20 padding tokens on the left (with causal: rows 0-19 see nothing)
    per_head = ones.clone()
    per_head[0, 1, :10] = False  # item 0, head 1 only: rows 0-9 see no key
    empty = ones.clone()
    empty[1] = False  # item 1: an empty key sequence
    return {
        "no mask": (Q_LEN, None, False, False),
        "no mask, length 100": (100, None, False, False),
        "right padding (bool)": (Q_LEN, right, False, False),
        "left padding, causal (bool)": (Q_LEN, left, True, False),
        "per-head mask (bool)": (Q_LEN, per_head, False, False),
        "per-head mask (float 0/1)": (Q_LEN, per_head.half(), False, False),
        "per-head mask, non-zero attn_bias": (Q_LEN, per_head, False, True),
        "empty sequence": (Q_LEN, empty, False, False),
    }


@functools.cache
def _kernel_nan_121(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What 1.2.2's Triton kernel does on battery input `name`: ((B,) items with a non-finite
    dK or dV, (B, H, Q) rows with a non-finite output)."""
    from postmortems import flash_dmattn_121 as pm

    q_len, mask, causal, with_bias = _masks_121()[name]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, q_len, HEADS, DIM, generator=generator).half().requires_grad_() for _ in range(3))
    shape = (2, HEADS, q_len, q_len)
    bias = torch.randn(shape, generator=generator).half() if with_bias else torch.zeros(shape, dtype=torch.half)
    out = pm.upstream_triton_func()(q, k, v, None if mask is None else mask.expand(shape).contiguous(), bias, causal, None)
    out.backward(torch.randn(out.shape, generator=generator).half())
    bad_grad = [(~torch.isfinite(t.grad)).flatten(1).any(-1) for t in (k, v)]
    return bad_grad[0] | bad_grad[1], (~torch.isfinite(out)).any(-1).transpose(1, 2)


def battery_nan_check_121(check: Callable) -> None:
    """`check(q_len, attn_mask, is_causal) -> (items, rows)` names exactly the items whose dK/dV
    the kernel makes NaN, and the rows whose output it makes NaN (per head, or any head)."""
    for name, (q_len, mask, causal, _) in _masks_121().items():
        items, rows = _kernel_nan_121(name)
        said_items, said_rows = check(q_len, mask, causal)
        assert torch.equal(said_items.expand_as(items), items), f"{name}: items {said_items.tolist()}, kernel {items.tolist()}"
        expected = rows if said_rows.dim() == 3 else rows.any(1)
        assert torch.equal(said_rows.expand_as(expected), expected), f"{name}: NaN rows differ from the kernel's"


# -- flash-dmattn's Flex backend: flash-dmattn-flex-mask ---------------------------------------------

LENGTHS = {"padded": (5, 3, 8), "empty sequence": (5, 0, 8)}


def _flex_cases() -> dict[str, dict[str, Any]]:
    """name -> the call's arguments: q (B, S, H, D) in fp16, attn_mask (B, H, S, S), attn_bias, is_causal."""
    generator = torch.Generator().manual_seed(1)
    seq, heads = 8, 2

    def batch(lengths, kv_heads=heads, **extra):
        q = torch.randn(len(lengths), seq, heads, DIM, generator=generator).half()
        k, v = (torch.randn(len(lengths), seq, kv_heads, DIM, generator=generator).half() for _ in range(2))
        keys = torch.arange(seq) < torch.tensor(lengths)[:, None]  # (B, S_k): real keys
        mask = keys[:, None, None, :].expand(-1, heads, seq, -1).contiguous()
        return {"q": q, "k": k, "v": v, "attn_mask": mask, "attn_bias": None, "is_causal": False, "lengths": lengths} | extra

    per_head = batch(LENGTHS["padded"])
    per_head["attn_mask"] = per_head["attn_mask"] & (torch.rand(3, heads, seq, seq, generator=generator) < 0.6)
    float_mask = batch(LENGTHS["padded"])
    float_mask["attn_mask"] = float_mask["attn_mask"].half()
    return {
        "all-True mask": batch((seq, seq, seq)),
        "padding mask (bool)": batch(LENGTHS["padded"]),
        "padding mask (float 0/1)": float_mask,
        "per-head masks": per_head,
        "non-zero attn_bias": batch(LENGTHS["padded"], attn_bias=torch.randn(3, heads, seq, seq, generator=generator).half()),
        "causal": batch(LENGTHS["padded"], is_causal=True),
        "empty sequence": batch(LENGTHS["empty sequence"]),
        "GQA (2 query heads, 1 key/value head)": batch(LENGTHS["padded"], kv_heads=1),
    }


def _dense(case: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """Attention as the arguments mean it, computed in `dtype` ((B, H, S, D)); a row with no visible key: 0."""
    q, k, v = (case[n].to(dtype).transpose(1, 2) for n in ("q", "k", "v"))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    keep = case["attn_mask"] > 0
    if case["is_causal"]:
        keep = keep & torch.ones(keep.shape[-2:], dtype=torch.bool).tril()
    scores = q @ k.transpose(-1, -2) * DIM**-0.5
    if case["attn_bias"] is not None:
        scores = scores + case["attn_bias"].to(dtype)
    has = keep.any(-1, keepdim=True)
    scores = torch.where(has, scores.masked_fill(~keep, float("-inf")), torch.zeros_like(scores))
    return torch.softmax(scores.float(), -1).to(dtype) * has @ v


def _assert_within_bound(name: str, out: torch.Tensor, case: dict[str, Any]) -> None:
    """REAL query rows of `out` ((B, S, H, D)) within 2x PyTorch's own fp16 error of the fp64 answer."""
    real = torch.arange(out.shape[1]) < torch.tensor(case["lengths"])[:, None]  # (B, S)
    pick = real[:, None, :].expand(-1, out.shape[2], -1)  # (B, H, S)
    oracle, baseline = _dense(case, torch.float64)[pick], _dense(case, torch.half)[pick]
    check = error_check("out", out.transpose(1, 2)[pick], oracle, baseline, torch.half, keys=case["k"].shape[1])
    assert check.within, f"{name}: {check}"


@contextlib.contextmanager
def _upstream_flex():
    """`from flash_dmattn.flash_dmattn_flex import flex_dmattn_func` resolving to the installed
    1.2.2 file as the post-mortem runs it (transformers stood in for where it is not installed),
    and torch.compile eager: inductor's C++ build takes minutes on a CPU."""
    import sys
    import types

    from postmortems import flash_dmattn_flex_mask as pm

    module = types.ModuleType("flash_dmattn.flash_dmattn_flex")
    module.flex_dmattn_func = pm.upstream_function(torch.device("cpu"))
    saved = sys.modules.get(module.__name__)
    sys.modules[module.__name__] = module
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        if saved is None:
            sys.modules.pop(module.__name__)
        else:
            sys.modules[module.__name__] = saved


def _arguments(case: dict[str, Any]) -> dict[str, Any]:
    return {n: case[n] for n in ("attn_mask", "attn_bias", "is_causal")}


def battery_mask_dropped(check: Callable) -> None:
    """`check(q, k, v, attn_mask, attn_bias, is_causal)` is True exactly when the mask hides a
    key (1.2.2 drops every mask), on every input the Flex backend accepts (not grouped K/V)."""
    for name, case in _flex_cases().items():
        if case["k"].shape[2] != case["q"].shape[2]:
            continue  # flex_dmattn_func refuses grouped K/V with a ValueError: loud, nothing to check
        affected = not bool((case["attn_mask"] > 0).all())
        assert check(case["q"], case["k"], case["v"], **_arguments(case)) is affected, name


def battery_mask_as_bias(mask_as_bias: Callable) -> None:
    """Workaround (a): 1.2.2's flex_dmattn_func given `mask_as_bias(attn_mask, attn_bias, dtype)`
    as its bias keeps REAL rows within the bound, with every mask kind and a bias of your own."""
    from flash_dmattn.flash_dmattn_flex import flex_dmattn_func  # under _upstream_flex: 1.2.2's file

    for name, case in _flex_cases().items():
        if case["k"].shape[2] != case["q"].shape[2]:
            continue  # refused loudly by flex_dmattn_func (the page's GQA note)
        bias = mask_as_bias(case["attn_mask"], case["attn_bias"], case["q"].dtype)
        out = flex_dmattn_func(
            case["q"], case["k"], case["v"], attn_mask=case["attn_mask"], attn_bias=bias, is_causal=case["is_causal"]
        )
        _assert_within_bound(name, out, case)


def battery_flex_with_mask(flex_with_mask: Callable) -> None:
    """Workaround (b): torch's flex_attention through `flex_with_mask(q, k, v, attn_mask,
    attn_bias, is_causal)` keeps REAL rows within the bound on every input, grouped K/V included."""
    for name, case in _flex_cases().items():
        _assert_within_bound(name, flex_with_mask(case["q"], case["k"], case["v"], **_arguments(case)), case)


# -- torch SDPA's cuDNN backend: sdpa-cudnn-masked-rows ---------------------------------------------


def _sdpa_cases() -> dict[str, dict[str, Any]]:
    """name -> q (B, H, S_q, D) in fp16, k and v, attn_mask as the user passes it, and `visible`
    (B, H, S_q, S_k) bool: the keys each row may see, worked out here independently."""
    generator = torch.Generator().manual_seed(2)
    heads, seq = 2, 6

    def case(lengths, kv_heads=heads, causal_shift=None, per_head=False, form="bool", bias=False):
        q = torch.randn(len(lengths), heads, seq, DIM, generator=generator).half()
        k, v = (torch.randn(len(lengths), kv_heads, seq, DIM, generator=generator).half() for _ in range(2))
        keys = torch.arange(seq) < torch.tensor(lengths)[:, None]
        visible = keys[:, None, None, :].expand(-1, heads, seq, -1).clone()
        if causal_shift is not None:  # bottom-right causal with len_q > len_k: the first rows see nothing
            visible &= torch.ones(seq, seq, dtype=torch.bool).tril(causal_shift)
        if per_head:
            visible[0, 1, 2] = False  # one row of one head only
        mask: torch.Tensor = visible
        if form == "float":
            mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).half()
            if bias:
                mask = torch.where(visible, torch.randn(visible.shape, generator=generator).half(), mask)
        return {"q": q, "k": k, "v": v, "attn_mask": mask, "visible": visible}

    return {
        "no row without keys (bool)": case((6, 4, 5)),
        "no row without keys (float)": case((6, 4, 5), form="float"),
        "empty key sequence (bool)": case((6, 0, 5)),
        "empty key sequence (float -inf)": case((6, 0, 5), form="float"),
        "per-head mask (bool)": case((6, 4, 5), per_head=True),
        "per-head mask (float), non-zero bias": case((6, 4, 5), per_head=True, form="float", bias=True),
        "causal, len_q > len_k": case((6, 6, 6), causal_shift=-2),
        "GQA, empty key sequence": case((6, 0, 5), kv_heads=1),
    }


def _cudnn_like(case: dict[str, Any]) -> torch.Tensor:
    """SDPA as our replica of cuDNN computes it (sdpa-cudnn-masked-rows, Mechanism): the mask's
    masked positions filled with a finite constant instead of -inf, so a row without keys is not 0."""
    from postmortems import sdpa_cudnn_masked_rows as pm

    mask = case["attn_mask"]
    fill = torch.tensor(pm.CUDNN_FILL, dtype=torch.half)
    additive = torch.where(mask, torch.zeros((), dtype=torch.half), fill) if mask.dtype == torch.bool else mask.clamp(min=fill)
    return torch.nn.functional.scaled_dot_product_attention(
        case["q"], case["k"], case["v"], attn_mask=additive, enable_gqa=case["k"].shape[1] != case["q"].shape[1]
    )


def _sdpa_oracle(case: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """(B, H, S_q, D) in `dtype`: the contract's answer, 0 on rows without keys."""
    bias = case["attn_mask"].to(dtype).masked_fill(~case["visible"], 0) if case["attn_mask"].dtype != torch.bool else None
    as_flex = {"q": case["q"].transpose(1, 2), "k": case["k"].transpose(1, 2), "v": case["v"].transpose(1, 2)}
    return _dense(as_flex | {"attn_mask": case["visible"], "attn_bias": bias, "is_causal": False}, dtype)


def _assert_sdpa_within_bound(name: str, out: torch.Tensor, case: dict[str, Any]) -> None:
    """Every row within 2x PyTorch's own fp16 error of the fp64 answer (rows without keys: exactly 0)."""
    no_key = ~case["visible"].any(-1)
    assert not out[no_key].any(), f"{name}: rows without keys are not 0"
    oracle, baseline = _sdpa_oracle(case, torch.float64), _sdpa_oracle(case, torch.half)
    check = error_check("out", out, oracle, baseline, torch.half, keys=case["k"].shape[-2])
    assert check.within, f"{name}: {check}"


def battery_rows_without_key(check: Callable) -> None:
    """`check(out, attn_mask) -> (rows, max |out|)` counts every row (per head) that sees no key,
    and flags (max > 0) exactly the outputs that are not 0 there: cuDNN's, not the math backend's."""
    for name, case in _sdpa_cases().items():
        expected_rows = int((~case["visible"].any(-1)).sum())
        rows, worst = check(_cudnn_like(case), case["attn_mask"])
        assert rows == expected_rows and (worst > 0) == (expected_rows > 0), (
            f"{name}: {rows} rows, max {worst} (expected {expected_rows} rows)"
        )
        math = torch.nn.functional.scaled_dot_product_attention(
            case["q"], case["k"], case["v"], attn_mask=case["attn_mask"], enable_gqa=case["k"].shape[1] != case["q"].shape[1]
        )
        assert check(math, case["attn_mask"])[1] == 0, f"{name}: the math backend's clean output flagged"


def battery_zero_rows_without_key(zero_rows_without_key: Callable) -> None:
    """Workaround (a) on the replica's output keeps every row within the bound, rows without keys 0."""
    for name, case in _sdpa_cases().items():
        _assert_sdpa_within_bound(name, zero_rows_without_key(_cudnn_like(case), case["attn_mask"]), case)


def battery_sdpa_without_cudnn(sdpa_without_cudnn: Callable) -> None:
    """Workaround (b): the memory-efficient or math backend (math on this CPU) within the bound, GQA included."""
    for name, case in _sdpa_cases().items():
        _assert_sdpa_within_bound(name, sdpa_without_cudnn(case["q"], case["k"], case["v"], case["attn_mask"]), case)


# -- torch's varlen_attn: torch-varlen-176793 -------------------------------------------------------
# varlen_attn runs on CUDA only; without a GPU the page's replica of its mechanism
# (kernels.replicas.torch_varlen: TAIL rows of out, dq, dk, dv never written) stands in for it, as
# on the page; on a GPU the same tests run the page's texts against torch's own varlen_attn.


def _native_cuda() -> bool:
    import kernels

    return kernels.default_device().type == "cuda" and not kernels.interpreted("cuda")


@contextlib.contextmanager
def _varlen_attn_replica():
    """`from torch.nn.attention.varlen import varlen_attn` giving the replica where torch's own
    cannot run (no native CUDA); on a GPU, torch's varlen_attn itself. Yields whether it is
    torch's own."""
    import torch.nn.attention.varlen as varlen

    if _native_cuda():
        yield True
        return

    from kernels.replicas.torch_varlen import replica_varlen_attn

    saved = varlen.varlen_attn
    varlen.varlen_attn = replica_varlen_attn  # type: ignore[assignment]
    try:
        yield False
    finally:
        varlen.varlen_attn = saved  # type: ignore[assignment]


def _token_budget_lm(batch: Any) -> tuple[Any, Any]:
    """The page's tiny packed LM as a varlen_attn user with a padded token budget runs it (real
    boundaries only), and `batch` where the model is: on a GPU torch's own varlen_attn in bf16 on
    CUDA, elsewhere the replica in fp32 on the CPU."""
    from postmortems import torch_varlen_176793 as pm

    if not _native_cuda():
        return pm.TinyLM(pm.TRAIN_CONFIG, pm.token_budget_attention), batch
    from torch.nn.attention.varlen import varlen_attn

    from workbench.audit import adapt

    varlen = adapt(varlen_attn, "torch-varlen", device="cuda")

    def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, **padded_layout):
        return varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal)

    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    on_cuda = dataclasses.replace(batch, **{n: t.cuda() for n, t in fields.items() if isinstance(t, torch.Tensor)})
    return pm.TinyLM(pm.TRAIN_CONFIG, attention).to("cuda", torch.bfloat16), on_cuda


def battery_nonfinite_grads_with_nan_memory(check: Callable) -> None:
    """`check(model, step)` names parameters exactly when the run is hit: every one of a tiny packed
    LM whose buffer has TAIL rows, none without TAIL rows (the same model and attention)."""
    from postmortems import torch_varlen_176793 as pm

    for pad, hit in ((3, True), (0, False)):
        model, batch = _token_budget_lm(pm.budget_batches(pad=pad, steps=1)[0][0])
        named = check(model, lambda model=model, batch=batch: model.loss(batch).backward())
        assert bool(named) == hit, f"{pad} TAIL rows: {named}"
    assert not torch.are_deterministic_algorithms_enabled(), "the check leaves deterministic mode off"


VARLEN_LAYOUTS = {"TAIL rows": ((5, 9), 3), "an empty sequence and TAIL rows": ((5, 0, 9), 4)}


def _battery_varlen_workaround(workaround: Callable, fill: str, out_padding: str, head_dim: int = DIM) -> None:
    """Under NaN-poisoned memory, padding rows of q, k, v holding `fill`, a loss that ignores the
    padding: REAL rows within the bound of the fp64 answer, padding rows of dq, dk, dv exactly 0, and
    of out `out_padding` ("zero", or "finite" where the page says the rows hold an attention of their own)."""
    from workbench import Case, pack, poisoned_memory, reference_attention

    for name, (lengths, tail) in VARLEN_LAYOUTS.items():
        case = Case(seqlens_q=lengths, tail_q=tail, tail_k=tail, heads=2, head_dim=head_dim, dtype="float16", fill=fill)
        batch = pack(case)
        leaves = [t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
        args = (batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k)
        n_q, n_k = int(batch.cu_seqlens_q[-1]), int(batch.cu_seqlens_k[-1])
        with poisoned_memory():
            out = workaround(*leaves, *args)
            d_out = torch.ones_like(out)
            d_out[n_q:] = 0  # the loss ignores the padding rows
            out.backward(d_out)
        fp64 = reference_attention(batch.q.double(), batch.k.double(), batch.v.double(), *args)
        own = reference_attention(batch.q, batch.k, batch.v, *args, compute_dtype=batch.q.dtype)
        check = error_check("out", out[:n_q], fp64[:n_q], own[:n_q], torch.half, keys=batch.max_seqlen_k)
        assert check.within, f"{name}: {check}"
        padding = out[n_q:]
        assert (padding == 0).all() if out_padding == "zero" else padding.isfinite().all(), f"{name}: padding rows of out"
        for label, grad, real in (("dq", leaves[0].grad, n_q), ("dk", leaves[1].grad, n_k), ("dv", leaves[2].grad, n_k)):
            assert (grad[real:] == 0).all(), f"{name}: padding rows of {label} are not 0"


def battery_varlen_tail_as_sequence(workaround: Callable) -> None:
    """Workaround (a), with the finite padding it requires (stale activations)."""
    _battery_varlen_workaround(workaround, "garbage", out_padding="finite")


def battery_varlen_sliced(workaround: Callable) -> None:
    """Workaround (b), with NaN in the padding."""
    _battery_varlen_workaround(workaround, "nan", out_padding="zero")


# -- FlashAttention-4's unwritten padding rows: fa4-unwritten-padding ---------------------------------
# FA4 runs on sm90/sm100 GPUs only; elsewhere the page's stand-in (the replica of the same
# mechanism, called as FA4 is) answers `from flash_attn.cute import flash_attn_varlen_func`.
# Head dim 64, so that the same batteries run FA4 itself: its interface lists head dims 64, 96 and 128
# (flash_attn/cute/interface.py), and its H200 audit (data/gpu/audit-fa4.json) ran at 64.
FA4_DIM = 64


@contextlib.contextmanager
def _fa4_or_replica():
    """`flash_attn.cute.flash_attn_varlen_func`: FA4 itself where it imports, else the page's
    replica. Yields whether it is FA4 itself."""
    import types

    from workbench.upstream import _standing_in

    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        pass
    else:
        yield True
        return
    from postmortems.fa4_unwritten_padding import replica_flash_attn_varlen_func

    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = replica_flash_attn_varlen_func
    package.cute = cute
    with _standing_in({"flash_attn": package, "flash_attn.cute": cute}):
        yield False


def battery_fa4_unwritten_tail_rows(check: Callable) -> None:
    """`check(q, k, v, cu_q, cu_k, max_q, max_k)` counts non-finite values in every TAIL row of
    out, dq, dk, dv when the buffer has TAIL rows, and none without; deterministic mode left off."""
    from workbench import Case, Fill, pack

    for tail, hit in ((3, True), (0, False)):
        case = Case((5, 0, 9), tail_q=tail, tail_k=tail, heads=2, head_dim=FA4_DIM, dtype="float16", fill=Fill.GARBAGE)
        b = pack(case)
        counts = check(b.q, b.k, b.v, b.cu_seqlens_q, b.cu_seqlens_k, b.max_seqlen_q, b.max_seqlen_k)
        values = dict.fromkeys(("out", "dq", "dk", "dv"), tail * 2 * FA4_DIM)
        assert counts == (values if hit else dict.fromkeys(values, 0)), f"{tail} TAIL rows: {counts}"
    assert not torch.are_deterministic_algorithms_enabled(), "the check leaves deterministic mode off"


def battery_fa4_padding_zeroed(workaround: Callable) -> None:
    """The workaround with NaN and with garbage in the padding rows: padding rows of out, dq, dk, dv
    exactly 0, REAL rows within the bound."""
    _battery_varlen_workaround(workaround, "nan", out_padding="zero", head_dim=FA4_DIM)
    _battery_varlen_workaround(workaround, "garbage", out_padding="zero", head_dim=FA4_DIM)


@pytest.mark.slow
def test_the_fa4_batteries_fail_a_bare_call_and_a_blind_check():
    """No old text on this page: the batteries must fail FA4 called as is, and a check that sees nothing."""
    with _fa4_or_replica():
        from flash_attn.cute import flash_attn_varlen_func

        def bare(q, k, v, cu_q, cu_k, max_q, max_k):
            kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
            return flash_attn_varlen_func(q, k, v, **kwargs)[0]

        with pytest.raises(AssertionError):
            battery_fa4_padding_zeroed(bare)
        with pytest.raises(AssertionError):
            battery_fa4_unwritten_tail_rows(lambda *args: dict.fromkeys(("out", "dq", "dk", "dv"), 0))


# -- flash-sparse-attn's tensor descriptors: fsa-varlen-descriptors ---------------------------------
# The library itself runs here, on the CPU under the Triton interpreter, every descriptor its kernels
# build recorded and checked against Triton's rule (postmortems/fsa_varlen_descriptors/upstream.py):
# the page's check must count what the kernels build, and its workaround must leave nothing that
# faults on the GPU. Head dim 64 and float16, as the H200 audit called the library.


@contextlib.contextmanager
def _fsa_interpreted():
    """`flash_sparse_attn` importable and runnable here: the library itself, under the interpreter."""
    from postmortems.fsa_varlen_descriptors import load

    load("cpu")
    yield True


def _fsa_layouts() -> list[Any]:
    from workbench import Case, Fill

    base = Case((5, 3, 7), tail_q=3, tail_k=2, heads=2, head_dim=64, dtype="float16", fill=Fill.ZEROS)
    return [
        base,  # the audit's first call: 4 of 6 lse bases misaligned
        base.with_(seqlens_q=(8, 4, 12), tail_q=0, tail_k=0),  # every start and the row count multiples of 4
        base.with_(seqlens_q=(3, 0, 4, 0), tail_q=0, tail_k=0),  # empty sequences, misaligned bases
        base.with_(seqlens_q=(4, 0, 4), seqlens_k=(4, 3, 4), tail_q=0, tail_k=0),  # a query-less sequence, aligned
        base.with_(seqlens_q=(5, 3), seqlens_k=(9, 7), tail_q=0, tail_k=0, causal=True),  # bottom-right causal
    ]


def _fsa_bare_call(case) -> Any:
    from postmortems.fsa_varlen_descriptors import BARE, FUNCTIONS, run

    return run(FUNCTIONS[0], BARE, case)


def battery_fsa_varlen_faults(check: Callable) -> None:
    """`check(q, cu_seqlens_q)` counts the lse bases the library's backward builds misaligned and the
    sequences whose forward builds descriptors of extent 0, as the interpreter records them."""
    from workbench import pack

    for case in _fsa_layouts():
        batch = pack(case)
        counts = check(batch.q, batch.cu_seqlens_q.int())
        call = _fsa_bare_call(case)  # each sequence shorter than one 64-row tile: one program per (sequence, head)
        assert counts["misaligned_lse_bases"] == call.misaligned, f"{case.label()}: {counts}, recorded {call.misaligned}"
        assert (counts["empty_sequences"] > 0) == (call.zero_extent > 0), f"{case.label()}: {counts}, {call.zero_extent}"
        assert counts["empty_sequences"] == case.seqlens_q.count(0), f"{case.label()}: {counts}"


def battery_fsa_varlen_aligned(workaround: Callable) -> None:
    """The workaround around the library: no descriptor breaks Triton's rule, none has extent 0, REAL
    rows within the bound, padding rows of out, dq, dk, dv exactly 0 in NaN-poisoned memory (the
    library leaves TAIL rows of out and dq unwritten); through both functions."""
    import flash_sparse_attn

    from postmortems.fsa_varlen_descriptors import FUNCTIONS, measure
    from postmortems.fsa_varlen_descriptors.study import Call

    for function in FUNCTIONS:
        attn = getattr(flash_sparse_attn, function)

        def called(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, softmax_scale=None, attn=attn):
            return workaround(q, k, v, cu_q, cu_k, is_causal=is_causal, attn=attn, softmax_scale=softmax_scale)

        for case in _fsa_layouts() if function == FUNCTIONS[0] else _fsa_layouts()[:1]:
            call = Call(function, "pasted", case, *measure(called, case, "the page's workaround", poisoned=True))
            label = f"{function}, {case.label()}"
            assert call.misaligned == 0 and not call.violations(), f"{label}: {call.violations()}"
            assert call.zero_extent == 0, f"{label}: {call.zero_extent} descriptors of extent 0"
            assert call.probe.real_within_bound, f"{label}: {[str(e) for e in call.probe.errors.values()]}"
            assert call.probe.padding_exactly_zero, f"{label}: padding rows not 0"


@pytest.mark.slow
def test_the_fsa_batteries_fail_a_bare_call_and_a_blind_check():
    """No old text on this page: the batteries must fail the library called as is, and a check that sees nothing."""
    with _fsa_interpreted():

        def bare(q, k, v, cu_q, cu_k, is_causal=False, attn=None, **kwargs):
            lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
            return attn(q, k, v, cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()), is_causal=is_causal, **kwargs)

        with pytest.raises(AssertionError):
            battery_fsa_varlen_aligned(bare)
        with pytest.raises(AssertionError):
            battery_fsa_varlen_faults(lambda q, cu: {"misaligned_lse_bases": 0, "empty_sequences": 0})


# -- the registry: every paste block of every page ------------------------------------------------


def battery_load_with_varlen_contract(load_with_varlen_contract: Callable) -> None:
    """real-client's one-line swap: a tiny Llama saved to a folder and loaded through the block runs our
    kernel as its attention, and one step on a packed batch with TAIL rows gives finite gradients."""
    transformers = pytest.importorskip("transformers")
    from workbench import realclient as rc

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    with tempfile.TemporaryDirectory() as path:
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        model = load_with_varlen_contract(path)
    assert model.config._attn_implementation == "varlen_contract"
    assert rc.SIZES["cpu"].tail > 0
    loss = model(**rc.pack(rc.SIZES["cpu"])).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _prints(expected: Callable[[str], bool]) -> Callable[[dict[str, Any]], None]:
    """A battery for a self-contained script: what it printed (namespace['printed']) passes `expected`."""

    def battery(namespace: dict[str, Any]) -> None:
        assert expected(namespace["printed"]), namespace["printed"]

    return battery


def _bf16_dot_flagged(printed: str) -> bool:
    """The interpreter here (triton 3.6) multiplies bf16 bit patterns: the check must say affected."""
    return float(re.search(r"max \|error\| = (\S+)", printed).group(1)) >= 1e9  # type: ignore[union-attr]


def _te_boundaries(printed: str) -> bool:
    """The page's example boundaries, [0, 3, 5, 9] real and [0, 4, 8, 13] padded, described as
    counted independently here."""
    cu, padded = [0, 3, 5, 9], [0, 4, 8, 13]
    padding = sum((padded[i + 1] - padded[i]) - (cu[i + 1] - cu[i]) for i in range(3))
    return printed.strip() == (
        "identical vectors (VERL workaround): False; padding between sequences: True; "
        f"rows after cu_seqlens[-1]: {padded[-1] - cu[-1]}; padding rows: {padding}"
    )


# (page, the function a block defines or 'script') -> the battery that runs it: a function's
# battery takes the function, a script's takes its namespace (with what it printed).
BATTERIES: dict[tuple[str, str], Callable[[Any], None]] = {
    ("flash-dmattn-121.html", "flash_dmattn_122_nan"): battery_nan_check_121,
    ("flash-dmattn-flex-mask.html", "mask_dropped"): battery_mask_dropped,
    ("flash-dmattn-flex-mask.html", "mask_as_bias"): battery_mask_as_bias,
    ("flash-dmattn-flex-mask.html", "flex_with_mask"): battery_flex_with_mask,
    ("triton-interpreter-bf16-dot.html", "script"): _prints(_bf16_dot_flagged),
    ("te-thd-2892.html", "script"): _prints(_te_boundaries),
    ("sdpa-cudnn-masked-rows.html", "rows_without_key"): battery_rows_without_key,
    ("sdpa-cudnn-masked-rows.html", "zero_rows_without_key"): battery_zero_rows_without_key,
    ("sdpa-cudnn-masked-rows.html", "sdpa_without_cudnn"): battery_sdpa_without_cudnn,
    ("torch-varlen-176793.html", "nonfinite_grads_with_nan_memory"): battery_nonfinite_grads_with_nan_memory,
    ("torch-varlen-176793.html", "varlen_attn_tail_as_sequence"): battery_varlen_tail_as_sequence,
    ("torch-varlen-176793.html", "varlen_attn_sliced"): battery_varlen_sliced,
    ("real-client.html", "load_with_varlen_contract"): battery_load_with_varlen_contract,
    ("fa4-unwritten-padding.html", "fa4_unwritten_tail_rows"): battery_fa4_unwritten_tail_rows,
    ("fa4-unwritten-padding.html", "fa4_padding_zeroed"): battery_fa4_padding_zeroed,
    ("fsa-varlen-descriptors.html", "fsa_varlen_faults"): battery_fsa_varlen_faults,
    ("fsa-varlen-descriptors.html", "fsa_varlen_aligned"): battery_fsa_varlen_aligned,
}
# Not a reader's block: the patch the page proposes for upstream's function body (it reads that
# function's own `attn_mask` and `is_causal`); workaround (b) runs the same mask_mod.
UPSTREAM_PATCHES = {("flash-dmattn-flex-mask.html", "mask_mod")}
# Pages whose blocks are not all self-contained yet, with their number of blocks, listed so that
# no new block escapes the batteries unnoticed (none today).
NOT_YET_SELF_CONTAINED: dict[str, int] = {}
# Pages whose blocks call a CUDA-only library, each with what resolves it (the library itself on a
# GPU, else the page's replica). On an H200, GPU_BLOCKS_COMMAND runs their blocks as shown against
# the library and records each block's sha256 and verdict in GPU_BLOCKS_RECORD.
GPU_PAGES = {"torch-varlen-176793.html": _varlen_attn_replica, "fa4-unwritten-padding.html": _fa4_or_replica}
GPU_BLOCKS_RECORD = GPU_DATA / "paste-blocks-h200.json"
GPU_BLOCKS_COMMAND = (
    "WORKBENCH_PUBLISHED_SITE=site/_build python -m pytest tests/test_snippets.py -k 'torch-varlen or fa4' "
    f"-p no:cacheprovider --snippet-record {GPU_BLOCKS_RECORD.relative_to(REPO)}"
)
# What a page's blocks import, resolved where this machine lacks it: flash-dmattn's Flex file as the
# post-mortem runs it, and the CUDA-only libraries above.
PAGE_CONTEXT = {"flash-dmattn-flex-mask.html": _upstream_flex, "fsa-varlen-descriptors.html": _fsa_interpreted, **GPU_PAGES}


def _blocks(site) -> list[tuple[str, str, str]]:
    return [(page.name, _name(b), b) for page in sorted(site.glob("*.html")) for b in paste_blocks(page.read_text())]


def test_every_paste_block_has_a_battery(published_site):
    """A block a page offers is run by a battery below, or is a listed upstream patch, or sits
    on a page listed as not yet self-contained with exactly its known number of blocks."""
    blocks = _blocks(published_site)
    counts: dict[str, int] = {}
    for page, name, _ in blocks:
        if page in NOT_YET_SELF_CONTAINED:
            counts[page] = counts.get(page, 0) + 1
        else:
            assert (page, name) in BATTERIES or (page, name) in UPSTREAM_PATCHES, f"{page}: block {name!r} has no battery"
    assert counts == NOT_YET_SELF_CONTAINED
    assert {(p, n) for p, n, _ in blocks} >= set(BATTERIES), "a battery whose block is no longer on its page"


def _library_versions() -> dict[str, str | None]:
    """The versions of the CUDA-only libraries the GPU pages' blocks call (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {"torch": torch.__version__}
    try:
        versions["flash-attn-4"] = version("flash-attn-4")
    except PackageNotFoundError:
        versions["flash-attn-4"] = None
    return versions


@pytest.fixture(scope="session")
def block_runs(request):
    """Each block run by this session: page, block, sha256 of its text, verdict, and whether a replica
    stood in for the library; with `--snippet-record FILE`, written there (with provenance) at the end."""
    runs: list[dict[str, Any]] = []
    yield runs
    path = request.config.getoption("snippet_record")
    if path:
        site = os.environ.get("WORKBENCH_PUBLISHED_SITE")
        command = shlex.join(["python", "-m", "pytest", *request.config.invocation_params.args])
        command = f"WORKBENCH_PUBLISHED_SITE={shlex.quote(site)} {command}" if site else command
        write_record(path, {"libraries": _library_versions(), "blocks": runs}, command=command)


@pytest.mark.slow
@pytest.mark.parametrize("page, name", sorted(BATTERIES))
def test_paste_block_passes_its_battery(published_site, block_runs, page, name):
    """The block exactly as the page shows it, run in a fresh namespace, then its battery."""
    block = next(b for p, n, b in _blocks(published_site) if (p, n) == (page, name))
    run: dict[str, Any] = {"page": page, "block": name, "sha256": block_digest(block), "verdict": "failed"}
    block_runs.append(run)
    environ = dict(os.environ)  # a block may set variables (TRITON_INTERPRET=1): this session keeps its own
    with PAGE_CONTEXT.get(page, contextlib.nullcontext)() as itself:
        run["stand_in"] = itself is False
        try:
            if name == "script":
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    namespace = _run(block)
                BATTERIES[page, name](namespace | {"printed": printed.getvalue()})
            else:
                BATTERIES[page, name](_run(block)[name])
        except Exception as exc:
            run["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            raise
        finally:
            os.environ.clear()
            os.environ.update(environ)
    run["verdict"] = "passed"


def test_gpu_page_blocks_ran_as_shown_on_a_gpu(published_site):
    """Every block the CUDA-only pages show today ran, exactly as shown, against the library itself
    (not a replica) natively on a GPU, and passed its battery: GPU_BLOCKS_RECORD names each run
    block by the sha256 of its text, so a block edited since (or a new one) fails here until
    GPU_BLOCKS_COMMAND runs again, and a missing record fails too (never a skip)."""
    record = read_record(GPU_BLOCKS_RECORD, how=f"{GPU_BLOCKS_COMMAND} (the site built with `workbench build --no-execute`)")
    assert record["provenance"]["mode"] == "native", f"{GPU_BLOCKS_RECORD.name}: not a native GPU run"
    runs = {(run["page"], run["block"], run["sha256"]): run for run in record["blocks"]}
    shown = [(page, name, block) for page, name, block in _blocks(published_site) if page in GPU_PAGES]
    assert {page for page, _, _ in shown} == set(GPU_PAGES), "a GPU page shows no block any more"
    for page, name, block in shown:
        run = runs.get((page, name, block_digest(block)))
        assert run is not None, f"{page}: block {name!r} as shown today never ran on a GPU: run `{GPU_BLOCKS_COMMAND}`"
        assert not run["stand_in"], f"{page}: block {name!r} ran against a replica, not the library"
        assert run["verdict"] == "passed", f"{page}: block {name!r} failed its battery on the GPU: {run.get('error')}"


# The texts the pages showed before issue 21, each run the way a reader would have used it.
OLD_NAN_CHECK = """import torch

def flash_dmattn_122_nan(q_len, attn_mask=None, is_causal=False):  # (items whose dK/dV are NaN, rows whose output is NaN)
    visible = attn_mask if attn_mask is not None else torch.ones(1, 1, q_len, q_len, dtype=torch.bool)
    visible = visible & (torch.ones(visible.shape[-2:], dtype=torch.bool, device=visible.device).tril() if is_causal else True)
    nan_rows = ~visible[..., :64].any(-1).any(1)  # (B, Q)
    return nan_rows.any(-1) | (q_len % 64 != 0), nan_rows
"""
OLD_MASK_AS_BIAS = (
    'attn_bias = (attn_bias if attn_bias is not None else torch.zeros_like(attn_mask)).masked_fill(attn_mask == 0, float("-inf"))'
)
OLD_FLEX_WITH_MASK = """keep = attn_mask[:, 0] > 0                                                   # (B, S_q, S_k) bool
block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: keep[b, q_idx, kv_idx], B, None, S_q, S_k, device=q.device)
out = torch.compile(flex_attention)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask, scale=scale).transpose(1, 2)
"""


def _old_mask_as_bias(attn_mask, attn_bias, dtype):
    return _run(OLD_MASK_AS_BIAS, torch=torch, attn_mask=attn_mask, attn_bias=attn_bias)["attn_bias"]


def _old_flex_with_mask(q, k, v, attn_mask, attn_bias=None, is_causal=False, scale=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    names = dict(q=q, k=k, v=v, attn_mask=attn_mask, B=q.shape[0], S_q=q.shape[1], S_k=k.shape[1], scale=scale)
    return _run(OLD_FLEX_WITH_MASK, torch=torch, create_block_mask=create_block_mask, flex_attention=flex_attention, **names)[
        "out"
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "battery, old",
    [
        (battery_nan_check_121, lambda: _run(OLD_NAN_CHECK)["flash_dmattn_122_nan"]),
        (battery_mask_as_bias, lambda: _old_mask_as_bias),
        (battery_flex_with_mask, lambda: _old_flex_with_mask),
    ],
    ids=["flash-dmattn-121 check", "flex-mask (a)", "flex-mask (b)"],
)
def test_battery_fails_the_old_text(battery, old):
    """The per-head check missed per-head masks; (a) turned a bool mask into a bool bias; (b)
    read head 0's mask only and dropped attn_bias (and grouped K/V)."""
    with _upstream_flex(), pytest.raises((AssertionError, RuntimeError, ValueError)):
        battery(old())
