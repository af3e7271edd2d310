"""Every block a page invites a reader to paste, executed as the page shows it.

The blocks come from the built pages (`published_site`: the committed notebooks rendered as
`varlen-workbench build --no-execute` does), extracted by `varlen_workbench.workbench.site.pasteblocks.paste_blocks`, and each runs
verbatim against the inputs real users have: boolean and float masks, masks that differ across
heads, a non-zero `attn_bias`, grouped K/V, empty sequences. A check must flag exactly the runs
the upstream kernel breaks, judged by running that kernel; a workaround must keep REAL rows
within the page's bound (FlashAttention's: out error at most 2x PyTorch's own error in the same
dtype, `varlen_workbench.workbench.bounds`). Each battery also runs the text its page showed before the fix, and
must fail it: a battery that cannot fail proves nothing.
"""

from __future__ import annotations

import ast
import builtins
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

from varlen_workbench.workbench.bounds import error_check
from varlen_workbench.workbench.provenance import GPU_DATA, REPO
from varlen_workbench.workbench.records import read_record, write_record
from varlen_workbench.workbench.site.pasteblocks import block_digest, paste_blocks


def _is_script(block: str) -> bool:
    """A block that does its work top to bottom, not a block of imports and one function."""
    body = ast.parse(block).body
    functions = [node for node in body if isinstance(node, ast.FunctionDef)]
    return not (len(functions) == 1 and all(isinstance(node, ast.FunctionDef | ast.Import | ast.ImportFrom) for node in body))


def _name(block: str) -> str:
    """The function a block defines (a block of imports and one function); for a block that does its
    work top to bottom, its opening comment (an upstream report's repro names its bug there), or
    'script'."""
    if not _is_script(block):
        return next(node.name for node in ast.parse(block).body if isinstance(node, ast.FunctionDef))
    first = block.lstrip().splitlines()[0] if block.strip() else ""
    return first[2:] if first.startswith("# ") else "script"


def _run(block: str, **names: Any) -> dict[str, Any]:
    """Executes `block` as a reader's fresh session would (plus `names`, for old texts that took
    them from the reader's scope); returns its namespace."""
    filename = f"<paste block {hash(block):x}>"
    linecache.cache[filename] = (len(block), None, block.splitlines(True), filename)  # for inspect: @triton.jit reads source
    namespace: dict[str, Any] = {"__name__": "__snippet__", **names}
    exec(compile(block, filename, "exec"), namespace)
    return namespace


# Torch's global settings a check may flip to poison memory: deterministic algorithms (and warn_only),
# and the filling of uninitialised memory. A user may have any of them set; each is left as it was.
USER_SETTINGS = ((False, False, False), (True, False, False), (True, True, True))


def _torch_settings() -> tuple[bool, bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )


def _set_torch_settings(settings: tuple[bool, bool, bool]) -> None:
    enabled, warn_only, fill = settings
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def _keeps_torch_settings(run: Callable[[], Any], every: bool = True) -> Any:
    """`run()` under each of USER_SETTINGS (torch's defaults, deterministic mode on, and on with
    poisoning; `every=False`: the defaults only, for a battery's later layouts, to save time); each
    time torch's settings must come back as they were. Returns the first run's result."""
    saved = _torch_settings()
    results = []
    try:
        for settings in USER_SETTINGS if every else USER_SETTINGS[:1]:
            _set_torch_settings(settings)
            results.append(run())
            assert _torch_settings() == settings, f"torch's settings {settings} came back as {_torch_settings()}"
    finally:
        _set_torch_settings(saved)
    return results[0]


# -- the padded batches of the mask-taking APIs (varlen_workbench.workbench.affected.MaskedBatch) ---------------------


def _dense(x: dict[str, Any], dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """(B, H, S_q, D) in `dtype`: attention over the keys each row may see (`visible` of a built
    MaskedBatch) plus its bias; a row with no visible key: 0."""
    q, k, v = (x[n].to(dtype).transpose(1, 2) for n in ("q", "k", "v"))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    keep = x["visible"]
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if x["bias"] is not None:
        scores = scores + x["bias"].to(dtype)
    has = keep.any(-1, keepdim=True)
    scores = torch.where(has, scores.masked_fill(~keep, float("-inf")), torch.zeros_like(scores))
    return torch.softmax(scores.float(), -1).to(dtype) * has @ v


def _rows_within_bound(out: torch.Tensor, x: dict[str, Any], scale: float | None = None) -> Any:
    """The error check of `out` ((B, H, S_q, D)) on real query rows against the fp64 answer, bound
    2x PyTorch's own error in the same dtype; rows that see no key must be exactly 0 as well."""
    pick = x["real_q"][:, None, :].expand(-1, out.shape[1], -1)  # (B, H, S_q)
    oracle, baseline = _dense(x, torch.float64, scale)[pick], _dense(x, out.dtype, scale)[pick]
    check = error_check("out", out[pick], oracle, baseline, out.dtype, keys=x["k"].shape[1])
    keyless = ~x["visible"].any(-1) & pick
    return check if not out[keyless].any() else dataclasses.replace(check, error=float("inf"))


# -- flash-dmattn 1.2.2's Triton backend: the NaN check of flash-dmattn-121 -------------------------


@functools.cache
def _kernel_nan_121(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What 1.2.2's Triton kernel does on the declared layout `name`: ((B,) items with a non-finite
    dK or dV, (B, H, Q) rows with a non-finite output)."""
    from varlen_workbench.postmortems import flash_dmattn_121 as pm

    x = pm.WHO.layout(name).inputs.build()
    q, k, v = (x[n].requires_grad_() for n in ("q", "k", "v"))
    shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    bias = torch.zeros(shape, dtype=q.dtype) if x["attn_bias"] is None else x["attn_bias"]
    mask = None if x["attn_mask"] is None else x["attn_mask"].expand(shape).contiguous()
    out = pm.upstream_triton_func()(q, k, v, mask, bias, x["is_causal"], None)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.dtype))
    bad_grad = [(~torch.isfinite(t.grad)).flatten(1).any(-1) for t in (k, v)]
    return bad_grad[0] | bad_grad[1], (~torch.isfinite(out)).any(-1).transpose(1, 2)


def battery_nan_check_121(check: Callable) -> None:
    """On every layout the page declares, `check(q_len, attn_mask, is_causal) -> (items, rows)` names
    exactly the items whose dK/dV 1.2.2's kernel makes NaN, and the rows whose output it makes NaN
    (per head, or any head); the kernel hits exactly the layouts declared affected."""
    from varlen_workbench.postmortems import flash_dmattn_121 as pm

    for layout in pm.WHO.layouts:
        items, rows = _kernel_nan_121(layout.name)
        assert bool(items.any() or rows.any()) == layout.affected, f"{layout.name}: declared affected={layout.affected}"
        x = layout.inputs.build()
        said_items, said_rows = check(x["q"].shape[1], x["attn_mask"], x["is_causal"])
        assert torch.equal(said_items.expand_as(items), items), (
            f"{layout.name}: items {said_items.tolist()}, kernel {items.tolist()}"
        )
        expected = rows if said_rows.dim() == 3 else rows.any(1)
        assert torch.equal(said_rows.expand_as(expected), expected), f"{layout.name}: NaN rows differ from the kernel's"


# -- flash-dmattn's Flex backend: flash-dmattn-flex-mask ---------------------------------------------
# The blocks import flash_dmattn.flash_dmattn_flex, 1.2.2's file as installed (with transformers, which it
# imports). Nothing here makes the calls eager: on a CPU the blocks must do it themselves, since the compiled
# CPU call crashes the process (the old texts, which did not, run under `_eager_flex` only).


@contextlib.contextmanager
def _no_compiling_on_cpu():
    """Inductor raises instead of compiling: on a CPU, FlexAttention compiled by inductor (the path
    flex_dmattn_func takes) crashes the process, so a block must run it eagerly there. (Eager
    FlexAttention compiles with the "eager" backend, which stays allowed.)"""
    from unittest import mock

    def refuse(*args, **kwargs):
        raise RuntimeError("a block compiled FlexAttention with inductor on a CPU, where the compiled call crashes the process")

    with mock.patch("torch._inductor.compile_fx.compile_fx", refuse):
        yield True


@contextlib.contextmanager
def _eager_flex():
    """torch.compile eager, for the texts before issue 36, which compiled FlexAttention on a CPU."""
    with torch.compiler.set_stance("force_eager"):
        yield


def _flex_call(x: dict[str, Any]) -> dict[str, Any]:
    return {"attn_mask": x["attn_mask"], "attn_bias": x["attn_bias"], "is_causal": x["is_causal"]}


def _flex_upstream_within(x: dict[str, Any]) -> bool:
    """1.2.2's flex_dmattn_func on a built layout, eagerly: its real rows within the bound."""
    from flash_dmattn.flash_dmattn_flex import flex_dmattn_func

    with torch.compiler.set_stance("force_eager"):
        out = flex_dmattn_func(x["q"], x["k"], x["v"], **_flex_call(x))
    return _rows_within_bound(out.transpose(1, 2), x).within


def _flex_layouts(expect_refusal: bool = True):
    """(layout, built inputs) for every layout of the page; with `expect_refusal`, a refused layout's
    error (the library's own) checked on 1.2.2 itself first."""
    from flash_dmattn.flash_dmattn_flex import flex_dmattn_func

    from varlen_workbench.postmortems.flash_dmattn_flex_mask import WHO

    for layout in WHO.layouts:
        x = layout.inputs.build()
        if layout.refused and expect_refusal:
            with pytest.raises(getattr(builtins, layout.refused)), torch.compiler.set_stance("force_eager"):
                flex_dmattn_func(x["q"], x["k"], x["v"], **_flex_call(x))
        yield layout, x


def battery_mask_dropped(check: Callable) -> None:
    """On every declared layout, `check(q, k, v, attn_mask, attn_bias, is_causal)` is True exactly on
    those declared affected, and 1.2.2's function gets exactly those wrong; a refused layout raises
    the library's error or says False."""
    for i, (layout, x) in enumerate(_flex_layouts()):
        if layout.refused:
            with contextlib.suppress(ValueError):
                assert check(x["q"], x["k"], x["v"], **_flex_call(x)) is False, layout.name
            continue
        assert (not _flex_upstream_within(x)) == layout.affected, f"{layout.name}: declared affected={layout.affected}"
        said = _keeps_torch_settings(lambda x=x: check(x["q"], x["k"], x["v"], **_flex_call(x)), i == 0)
        assert said is layout.affected, f"{layout.name}: the check says {said}"


def battery_flex_dmattn_masked(flex_dmattn_masked: Callable) -> None:
    """Workaround (a), flex_dmattn_func with the mask folded into its bias: REAL rows within the bound on
    every declared layout the library takes (every mask shape, with a bias of your own, causal, a custom
    scale), and the library's own error on a layout it refuses."""
    for layout, x in _flex_layouts():
        if layout.refused:
            with pytest.raises(ValueError):
                flex_dmattn_masked(x["q"], x["k"], x["v"], **_flex_call(x))
            continue
        out = flex_dmattn_masked(x["q"], x["k"], x["v"], **_flex_call(x), softmax_scale=0.3)
        check = _rows_within_bound(out.transpose(1, 2), x, scale=0.3)
        assert check.within, f"{layout.name}: {check}"


def battery_flex_with_mask(flex_with_mask: Callable) -> None:
    """Workaround (b), torch's flex_attention with a mask_mod that reads the mask: REAL rows within the
    bound on every declared layout, grouped K/V included, with a custom scale."""
    for layout, x in _flex_layouts(expect_refusal=False):
        out = flex_with_mask(x["q"], x["k"], x["v"], **_flex_call(x), softmax_scale=0.3)
        check = _rows_within_bound(out.transpose(1, 2), x, scale=0.3)
        assert check.within, f"{layout.name}: {check}"


# -- torch SDPA's cuDNN backend: sdpa-cudnn-masked-rows ---------------------------------------------
# Without a GPU, the page's replica of cuDNN's boolean-mask path stands in for cuDNN (a boolean mask
# becomes the finite fill; a float mask passes as it is: what the H200 record confirms bit for bit).


def _sdpa_inputs(x: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """q, k, v as SDPA takes them, (B, H, S, D), and the mask as built."""
    return (*(x[n].transpose(1, 2) for n in ("q", "k", "v")), x["attn_mask"])


@contextlib.contextmanager
def _cudnn_replica():
    """Where no GPU runs cuDNN: SDPA with only the cuDNN backend enabled (`sdpa_kernel(CUDNN_ATTENTION)`)
    runs the page's replica of its boolean-mask path, the math backend given the finite fill. Yields
    whether cuDNN itself runs."""
    import torch.nn.functional as F

    from varlen_workbench.postmortems.sdpa_cudnn_masked_rows import CUDNN_FILL

    if _native_cuda():
        yield True
        return
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, **kwargs):
        cudnn_only = torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.math_sdp_enabled()
        if cudnn_only and attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, 0.0, CUDNN_FILL).to(query.dtype)
        with contextlib.ExitStack() as stack:
            if cudnn_only:
                stack.enter_context(torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH))
            return original(query, key, value, attn_mask=attn_mask, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield False
    finally:
        F.scaled_dot_product_attention = original


def _cudnn_like(x: dict[str, Any]) -> torch.Tensor:
    from varlen_workbench.postmortems.sdpa_cudnn_masked_rows import cudnn_mask_replica

    q, k, v, mask = _sdpa_inputs(x)
    return cudnn_mask_replica(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def _sdpa_layouts():
    from varlen_workbench.postmortems.sdpa_cudnn_masked_rows import WHO

    for layout in WHO.layouts:
        x = layout.inputs.build()
        replica_within = _rows_within_bound(_cudnn_like(x), x).within
        assert (not replica_within) == layout.affected, f"{layout.name}: declared affected={layout.affected}"
        yield layout, x


def battery_rows_without_key(check: Callable) -> None:
    """On every declared layout, `check(out, attn_mask) -> (rows, max |out|)` counts every row (per head)
    that sees no key, and flags (max > 0) exactly the layouts declared affected on the replica of
    cuDNN's output; the math backend's output is never flagged."""
    for layout, x in _sdpa_layouts():
        q, k, v, mask = _sdpa_inputs(x)
        rows, worst = check(_cudnn_like(x), mask)
        expected_rows = int((~x["visible"].any(-1)).sum())
        assert rows == expected_rows and (worst > 0) == layout.affected, f"{layout.name}: {rows} rows, max {worst}"
        math = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        assert check(math, mask)[1] == 0, f"{layout.name}: the math backend's clean output flagged"


def battery_zero_rows_without_key(zero_rows_without_key: Callable) -> None:
    """Workaround (a) on the replica's output: every real row within the bound on every declared layout,
    rows without keys exactly 0."""
    for layout, x in _sdpa_layouts():
        check = _rows_within_bound(zero_rows_without_key(_cudnn_like(x), x["attn_mask"]), x)
        assert check.within, f"{layout.name}: {check}"


def battery_sdpa_without_cudnn(sdpa_without_cudnn: Callable) -> None:
    """Workaround (b): the memory-efficient or math backend (math on this CPU) within the bound on every
    declared layout, GQA included."""
    for layout, x in _sdpa_layouts():
        check = _rows_within_bound(sdpa_without_cudnn(*_sdpa_inputs(x)), x)
        assert check.within, f"{layout.name}: {check}"


# -- torch's varlen_attn: torch-varlen-176793 -------------------------------------------------------
# varlen_attn runs on CUDA only; without a GPU the page's replica of its mechanism
# (varlen_workbench.kernels.replicas.torch_varlen: TAIL rows of out, dq, dk, dv never written) stands in for it, as
# on the page; on a GPU the same tests run the page's texts against torch's own varlen_attn.


def _native_cuda() -> bool:
    from varlen_workbench.kernels._compat import default_device
    from varlen_workbench.kernels.runtime import interpreted

    return default_device().type == "cuda" and not interpreted("cuda")


@contextlib.contextmanager
def _varlen_attn_replica():
    """`from torch.nn.attention.varlen import varlen_attn` giving the replica where torch's own
    cannot run (no native CUDA); on a GPU, torch's varlen_attn itself. Yields whether it is
    torch's own."""
    import torch.nn.attention.varlen as varlen

    if _native_cuda():
        yield True
        return

    from varlen_workbench.kernels.replicas.torch_varlen import replica_varlen_attn

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
    from varlen_workbench.postmortems import torch_varlen_176793 as pm

    if not _native_cuda():
        return pm.TinyLM(pm.TRAIN_CONFIG, pm.token_budget_attention), batch
    from torch.nn.attention.varlen import varlen_attn

    from varlen_workbench.workbench.audit import adapt

    varlen = adapt(varlen_attn, "torch-varlen", device="cuda")

    def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, **padded_layout):
        return varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal)

    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    on_cuda = dataclasses.replace(batch, **{n: t.cuda() for n, t in fields.items() if isinstance(t, torch.Tensor)})
    return pm.TinyLM(pm.TRAIN_CONFIG, attention).to("cuda", torch.bfloat16), on_cuda


def battery_nonfinite_grads_with_nan_memory(check: Callable) -> None:
    """`check(model, step)` names parameters exactly when the run is hit: every one of a tiny packed
    LM whose buffer has TAIL rows, none without TAIL rows (the same model and attention)."""
    from varlen_workbench.postmortems import torch_varlen_176793 as pm

    for pad, hit in ((3, True), (0, False)):
        model, batch = _token_budget_lm(pm.budget_batches(pad=pad, steps=1)[0][0])
        named = check(model, lambda model=model, batch=batch: model.loss(batch).backward())
        assert bool(named) == hit, f"{pad} TAIL rows: {named}"
    assert not torch.are_deterministic_algorithms_enabled(), "the check leaves deterministic mode off"


DIM = 16  # the head dim of the varlen workaround batteries' batches
VARLEN_LAYOUTS = {"TAIL rows": ((5, 9), 3), "an empty sequence and TAIL rows": ((5, 0, 9), 4)}


def _battery_varlen_workaround(workaround: Callable, fill: str, out_padding: str, head_dim: int = DIM) -> None:
    """Under NaN-poisoned memory, padding rows of q, k, v holding `fill`, a loss that ignores the
    padding: REAL rows within the bound of the fp64 answer, padding rows of dq, dk, dv exactly 0, and
    of out `out_padding` ("zero", or "finite" where the page says the rows hold an attention of their own)."""
    from varlen_workbench.workbench.instruments.poison import poisoned_memory
    from varlen_workbench.workbench.layout import Case, pack
    from varlen_workbench.workbench.reference import reference_attention

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

    from varlen_workbench.workbench.upstream import _standing_in

    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        pass
    else:
        yield True
        return
    from varlen_workbench.postmortems.fa4_unwritten_padding import replica_flash_attn_varlen_func

    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = replica_flash_attn_varlen_func
    package.cute = cute
    with _standing_in({"flash_attn": package, "flash_attn.cute": cute}):
        yield False


def battery_fa4_unwritten_tail_rows(check: Callable) -> None:
    """`check(q, k, v, cu_q, cu_k, max_q, max_k)` counts non-finite values in every TAIL row of
    out, dq, dk, dv when the buffer has TAIL rows, and none without; deterministic mode left off."""
    from varlen_workbench.workbench.layout import Case, Fill, pack

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
    from varlen_workbench.postmortems.fsa_varlen_descriptors import load

    load("cpu")
    yield True


@functools.cache
def _fsa_bare_call(case) -> Any:
    """The library as is on `case`, under the interpreter in NaN-poisoned memory: what it builds and leaves."""
    from varlen_workbench.postmortems.fsa_varlen_descriptors import BARE, FUNCTIONS, run

    return run(FUNCTIONS[0], BARE, case, poisoned=True)


def battery_fsa_varlen_faults(check: Callable) -> None:
    """On every layout the page declares, `check(q, cu_seqlens_q)` counts the lse bases the library's
    backward builds misaligned, the sequences whose forward builds descriptors of extent 0, and the rows
    past cu_seqlens_q[-1] it leaves unwritten in out and dq, as the interpreter records them; the
    library hits exactly the layouts declared affected."""
    from varlen_workbench.postmortems.fsa_varlen_descriptors import WHO
    from varlen_workbench.workbench.layout import pack

    for layout in WHO.layouts:
        case, batch = layout.inputs, pack(layout.inputs)
        call = _fsa_bare_call(case)  # each sequence shorter than one 64-row tile: one program per (sequence, head)
        unwritten = call.probe.nonfinite["out"]["TAIL"] // (case.heads * case.head_dim)
        assert call.probe.nonfinite["dq"]["TAIL"] == call.probe.nonfinite["out"]["TAIL"], layout.name
        hit = bool(call.misaligned or call.zero_extent or unwritten)
        assert hit == layout.affected, (
            f"{layout.name}: declared affected={layout.affected}, library {call.misaligned}, {call.zero_extent}, {unwritten}"
        )
        expected = {
            "misaligned_lse_bases": call.misaligned,
            "empty_sequences": case.seqlens_q.count(0),
            "unwritten_rows": unwritten,
        }
        counts = check(batch.q, batch.cu_seqlens_q.int())
        assert (counts.get("empty_sequences", 0) > 0) == (call.zero_extent > 0), f"{layout.name}: {counts}, {call.zero_extent}"
        assert counts == expected, f"{layout.name}: the check says {counts}, the library {expected}"


def battery_fsa_varlen_aligned(workaround: Callable) -> None:
    """The workaround around the library, on every declared layout (the first through both functions):
    no descriptor breaks Triton's rule, none has extent 0, REAL rows within the bound, padding rows of
    out, dq, dk, dv exactly 0 in NaN-poisoned memory (the library leaves TAIL rows of out and dq
    unwritten); with return_lse, lse back on the caller's rows, -inf on those the call does not see."""
    import flash_sparse_attn

    from varlen_workbench.postmortems.fsa_varlen_descriptors import FUNCTIONS, WHO, measure
    from varlen_workbench.postmortems.fsa_varlen_descriptors.study import Call
    from varlen_workbench.workbench.layout import Region, pack

    for function in FUNCTIONS:
        attn = getattr(flash_sparse_attn, function)

        def called(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, softmax_scale=None, attn=attn):
            return workaround(q, k, v, cu_q, cu_k, is_causal=is_causal, attn=attn, softmax_scale=softmax_scale)

        for layout in WHO.layouts if function == FUNCTIONS[0] else WHO.layouts[:1]:
            case = layout.inputs
            call = Call(function, "pasted", case, *measure(called, case, "the page's workaround", poisoned=True))
            label = f"{function}, {layout.name}"
            assert call.misaligned == 0 and not call.violations(), f"{label}: {call.violations()}"
            assert call.zero_extent == 0, f"{label}: {call.zero_extent} descriptors of extent 0"
            assert call.probe.real_within_bound, f"{label}: {[str(e) for e in call.probe.errors.values()]}"
            assert call.probe.padding_exactly_zero, f"{label}: padding rows not 0"
    batch = pack(next(layout.inputs for layout in WHO.layouts if layout.inputs.tail_q))
    out, lse = workaround(*batch.args()[:5], return_lse=True)
    unseen = batch.regions_q != Region.REAL
    assert out.shape == batch.q.shape and lse.shape == (batch.q.shape[1], batch.q.shape[0]), "lse on the caller's rows"
    assert torch.isneginf(lse[:, unseen]).all() and lse[:, ~unseen].isfinite().all(), "lse -inf exactly where unseen"


@pytest.mark.slow
def test_the_fsa_batteries_fail_a_bare_call_and_a_blind_check():
    """The batteries must fail the library called as is, and a check that sees nothing."""
    with _fsa_interpreted():

        def bare(q, k, v, cu_q, cu_k, is_causal=False, attn=None, **kwargs):
            lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
            return attn(q, k, v, cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()), is_causal=is_causal, **kwargs)

        with pytest.raises(AssertionError):
            battery_fsa_varlen_aligned(bare)
        with pytest.raises(AssertionError):
            battery_fsa_varlen_faults(
                lambda q, cu: dict.fromkeys(("misaligned_lse_bases", "empty_sequences", "unwritten_rows"), 0)
            )


# -- the upstream reports: each repro exactly as its page shows it ------------------------------------
# A repro prints what it shows; its battery checks the printout against the report's `prints`, and,
# where the library needs a GPU (the printout then comes from the page's stand-in), that the GPU record
# the report names shows the library doing the same.


def _record_check(name: str, check: str) -> dict[str, Any]:
    record = read_record(GPU_DATA / name)
    return next(c for c in record["checks"] if c["name"] == check)


def _fsa_lse_report_shown() -> None:
    """fsa-misaligned.json: the repro's batch (15 rows, 2 heads, cu_seqlens_q [0, 5, 8, 15]) faulted on the H200
    with 'misaligned address' at the backward preprocess kernel's launch."""
    runs = read_record(GPU_DATA / "fsa-misaligned.json")["results"]
    run = next(r for r in runs if r["function"] == "flash_dense_attn_varlen_func" and r["case"] == "no-tail")
    assert run["q_shape"] == [15, 2, 64] and run["cu_seqlens_q"] == [0, 5, 8, 15], run
    assert "misaligned address" in run["error"] and run["stage"] == "backward", run["error"]
    assert any("flash_bwd_preprocess.py" in frame for frame in run["library_frames"]), run["library_frames"]


def _cudnn_report_shown() -> None:
    """audit-sdpa-cudnn.json: the sliding-window check FAILed on cuDNN (the page's claims tie its rows to the window)."""
    recorded = _record_check("audit-sdpa-cudnn.json", "sliding-window")
    assert recorded["verdict"] == "FAIL" and "window=" in recorded["evidence"], recorded["evidence"]


def _repro_battery(report: Any, shown: Callable[[], None] | None = None) -> Callable[[dict[str, Any]], None]:
    """A battery for an upstream report's repro: it printed exactly the report's lines; and `shown`, where
    the report's actual behaviour comes from a GPU record."""

    def battery(namespace: dict[str, Any]) -> None:
        printed = tuple(namespace["printed"].strip().splitlines())
        assert printed == report.prints, f"{report.name}: printed {printed}, the report says {report.prints}"
        if shown is not None:
            shown()

    return battery


def _report_batteries() -> dict[tuple[str, str], Callable[[Any], None]]:
    from varlen_workbench.postmortems import flash_dmattn_flex_mask, fsa_varlen_descriptors, sdpa_cudnn_masked_rows
    from varlen_workbench.workbench.audit.reports import NESTED_NO_REAL_QUERY

    tail_rows, misaligned_lse = fsa_varlen_descriptors.REPORTS
    pages = {
        "fsa-varlen-descriptors.html": ((tail_rows, None), (misaligned_lse, _fsa_lse_report_shown)),
        "flash-dmattn-flex-mask.html": ((flash_dmattn_flex_mask.REPORT, None),),
        "audit-matrix.html": ((NESTED_NO_REAL_QUERY, None),),
        "sdpa-cudnn-masked-rows.html": ((sdpa_cudnn_masked_rows.REPORT, _cudnn_report_shown),),
    }
    return {(page, report.name): _repro_battery(report, shown) for page, reports in pages.items() for report, shown in reports}


# -- the registry: every paste block of every page ------------------------------------------------


def battery_load_with_varlen_contract(load_with_varlen_contract: Callable) -> None:
    """real-client's one-line swap: a tiny Llama saved to a folder and loaded through the block runs our
    kernel as its attention, and one step on a packed batch with TAIL rows gives finite gradients."""
    transformers = pytest.importorskip("transformers")
    from varlen_workbench.workbench.instruments import realclient as rc

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
    ("flash-dmattn-flex-mask.html", "flex_dmattn_masked"): battery_flex_dmattn_masked,
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
    **_report_batteries(),
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
PAGE_CONTEXT = {
    "flash-dmattn-flex-mask.html": _no_compiling_on_cpu,
    "fsa-varlen-descriptors.html": _fsa_interpreted,
    "sdpa-cudnn-masked-rows.html": _cudnn_replica,
    **GPU_PAGES,
}


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
    settings = _torch_settings()  # a script (a repro) may set torch's flags, as a standalone program does
    with PAGE_CONTEXT.get(page, contextlib.nullcontext)() as itself:
        run["stand_in"] = itself is False
        try:
            if _is_script(block):
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
            _set_torch_settings(settings)
    run["verdict"] = "passed"


def test_gpu_page_blocks_ran_as_shown_on_a_gpu(published_site):
    """Every block the CUDA-only pages show today ran, exactly as shown, against the library itself
    (not a replica) natively on a GPU, and passed its battery: GPU_BLOCKS_RECORD names each run
    block by the sha256 of its text, so a block edited since (or a new one) fails here until
    GPU_BLOCKS_COMMAND runs again, and a missing record fails too (never a skip)."""
    record = read_record(
        GPU_BLOCKS_RECORD, how=f"{GPU_BLOCKS_COMMAND} (the site built with `varlen-workbench build --no-execute`)"
    )
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


# The texts the pages showed before issue 36 (checks and workarounds run on every declared layout,
# drop-in, CPU-safe), verbatim.
BEFORE_36_MASK_DROPPED = '''import torch
from flash_dmattn.flash_dmattn_flex import flex_dmattn_func


def mask_dropped(q, k, v, attn_mask, attn_bias=None, is_causal=None):
    """True when attn_mask hides some key and flex_dmattn_func gives the bits of an all-True mask."""
    out = flex_dmattn_func(q, k, v, attn_mask=attn_mask, attn_bias=attn_bias, is_causal=is_causal)
    out_all = flex_dmattn_func(q, k, v, attn_mask=torch.ones_like(attn_mask), attn_bias=attn_bias, is_causal=is_causal)
    return bool(not (attn_mask > 0).all() and torch.equal(out, out_all))
'''
BEFORE_36_MASK_AS_BIAS = '''import torch


def mask_as_bias(attn_mask, attn_bias, dtype):
    """attn_mask (bool, or float where > 0 attends) folded into attn_bias (or zeros) as -inf, in dtype."""
    bias = torch.zeros((), dtype=dtype, device=attn_mask.device) if attn_bias is None else attn_bias.to(dtype)
    return torch.where(attn_mask > 0, bias, float("-inf"))


# out = flex_dmattn_func(q, k, v, attn_mask=attn_mask, attn_bias=mask_as_bias(attn_mask, attn_bias, q.dtype), is_causal=is_causal)
'''
BEFORE_36_FLEX_WITH_MASK = '''import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def flex_with_mask(q, k, v, attn_mask, attn_bias=None, is_causal=False, scale=None):
    """q (B, S_q, H, D), k and v (B, S_k, H_kv, D); attn_mask (B, H, S_q, S_k) bool or float (> 0 attends); attn_bias additive or None."""
    keep = attn_mask > 0

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[b, h, q_idx, kv_idx] & (q_idx >= kv_idx) if is_causal else keep[b, h, q_idx, kv_idx]

    def score_mod(score, b, h, q_idx, kv_idx):
        return score if attn_bias is None else score + attn_bias[b, h, q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, q.shape[0], q.shape[2], q.shape[1], k.shape[1], device=q.device)
    flex = torch.compile(flex_attention) if q.is_cuda else flex_attention  # eager on CPU
    out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod, block_mask=block_mask,
               scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
'''
BEFORE_36_FSA_FAULTS = '''import torch


def fsa_varlen_faults(q, cu_seqlens_q):
    """What flash-sparse-attn 2.0.6's varlen call builds from your batch that faults on an H200: the
    (sequence, head) lse bases its backward reads that are not 16-byte aligned, and the sequences with
    no query, for which its forward builds descriptors of extent 0. Both 0: the call is safe."""
    rows, heads = q.shape[0], q.shape[1]  # lse is float32 (heads, rows), rows counting any rows past the end
    starts = cu_seqlens_q[:-1].tolist()
    misaligned = sum((h * rows + start) % 4 != 0 for h in range(heads) for start in starts)
    return {"misaligned_lse_bases": misaligned, "empty_sequences": int((cu_seqlens_q.diff() == 0).sum())}
'''
BEFORE_36_FSA_ALIGNED = '''import torch
from flash_sparse_attn import flash_dense_attn_varlen_func


def fsa_varlen_aligned(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=False, attn=flash_dense_attn_varlen_func, **kwargs):
    """flash-sparse-attn's varlen attention (`attn`: flash_dense_attn_varlen_func or
    flash_sparse_attn_varlen_func) on a repacked batch: sequences with no query or no key dropped (their
    rows come back 0), each sequence's queries padded to a multiple of 4 with zero rows at its START, so
    that every lse base is 16-byte aligned. fsa aligns a causal mask to the bottom right: a real query
    keeps exactly its keys, the dummy rows see none. Dropped and dummy rows get no gradient."""
    starts_q, starts_k, rows = cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), q.shape[0]
    index_q, index_k, cu_q, cu_k, back = [], [], [0], [0], [None] * rows
    for b in range(len(starts_q) - 1):
        (q0, q1), (k0, k1) = starts_q[b : b + 2], starts_k[b : b + 2]
        if q1 == q0 or k1 == k0:
            continue
        index_q += [rows] * (-(q1 - q0) % 4)  # dummy rows first: index `rows` is an appended zero row
        for r in range(q0, q1):
            back[r] = len(index_q)
            index_q.append(r)
        index_k += range(k0, k1)
        cu_q.append(len(index_q))
        cu_k.append(len(index_k))
    if not index_q:  # no sequence has both: every row is 0 (torch.where keeps the graph, gradient 0)
        return torch.where(torch.zeros_like(q, dtype=torch.bool), q, 0)

    def on_device(rows, dtype=torch.long):
        return torch.tensor(rows, dtype=dtype, device=q.device)

    zero = q.new_zeros(1, *q.shape[1:])
    out = attn(
        torch.cat([q, zero])[on_device(index_q)], k[on_device(index_k)], v[on_device(index_k)],
        on_device(cu_q, torch.int32), on_device(cu_k, torch.int32),
        max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_k, cu_k[1:])),
        is_causal=is_causal, **kwargs,
    )
    back = [len(index_q) if r is None else r for r in back]  # rows the call did not see: the zero row
    return torch.cat([out, zero])[on_device(back)]
'''


def _bias_into_flex(mask_as_bias: Callable) -> Callable:
    """A bias function, called the way the page said before (its `# out = flex_dmattn_func(...)` line),
    as workaround (a)'s wrapper."""

    def call(query, key, value, attn_mask=None, attn_bias=None, is_causal=None, softmax_scale=None):
        from flash_dmattn.flash_dmattn_flex import flex_dmattn_func

        bias = mask_as_bias(attn_mask, attn_bias, query.dtype)
        return flex_dmattn_func(
            query, key, value, attn_mask=attn_mask, attn_bias=bias, is_causal=is_causal, softmax_scale=softmax_scale
        )

    return call


def _scale_named_scale(flex_with_mask: Callable) -> Callable:
    """An old (b), which named flex_dmattn_func's softmax_scale `scale`, called with flex_dmattn_func's arguments."""

    def call(query, key, value, attn_mask=None, attn_bias=None, is_causal=False, softmax_scale=None):
        return flex_with_mask(query, key, value, attn_mask, attn_bias=attn_bias, is_causal=is_causal, scale=softmax_scale)

    return call


def _defined(text: str, name: str) -> Callable[[], Callable]:
    return lambda: _run(text)[name]


@pytest.mark.slow
@pytest.mark.parametrize(
    "battery, old, context, error",
    [
        (battery_nan_check_121, _defined(OLD_NAN_CHECK, "flash_dmattn_122_nan"), contextlib.nullcontext, AssertionError),
        (battery_flex_dmattn_masked, lambda: _bias_into_flex(_old_mask_as_bias), _eager_flex, (AssertionError, RuntimeError)),
        (battery_flex_with_mask, lambda: _scale_named_scale(_old_flex_with_mask), _eager_flex, (AssertionError, RuntimeError)),
        (battery_mask_dropped, _defined(BEFORE_36_MASK_DROPPED, "mask_dropped"), _no_compiling_on_cpu, RuntimeError),
        (
            battery_flex_dmattn_masked,
            lambda: _bias_into_flex(_run(BEFORE_36_MASK_AS_BIAS)["mask_as_bias"]),
            _eager_flex,
            IndexError,
        ),
        (
            battery_flex_with_mask,
            lambda: _scale_named_scale(_run(BEFORE_36_FLEX_WITH_MASK)["flex_with_mask"]),
            _eager_flex,
            IndexError,
        ),
        (battery_fsa_varlen_faults, _defined(BEFORE_36_FSA_FAULTS, "fsa_varlen_faults"), _fsa_interpreted, AssertionError),
        (battery_fsa_varlen_aligned, _defined(BEFORE_36_FSA_ALIGNED, "fsa_varlen_aligned"), _fsa_interpreted, TypeError),
    ],
    ids=[
        "flash-dmattn-121 check, issue 21",
        "flex-mask (a), issue 21",
        "flex-mask (b), issue 21",
        "flex-mask check, issue 36",
        "flex-mask (a), issue 36",
        "flex-mask (b), issue 36",
        "fsa check, issue 36",
        "fsa workaround, issue 36",
    ],
)
def test_battery_fails_the_old_text(battery, old, context, error):
    """Issue 21: the per-head check missed per-head masks; (a) turned a bool mask into a bool bias; (b)
    read head 0's mask only and dropped attn_bias (and grouped K/V). Issue 36: the flex check compiled
    FlexAttention on a CPU, where the call crashes the process; (a) and (b) indexed a broadcast mask
    per head (IndexError); the fsa check said "safe" of a batch with unwritten TAIL rows; the fsa
    workaround passed return_lse on and broke on the tuple it got back."""
    with context(), pytest.raises(error):
        battery(old())
