"""Functions that take a padded (batch, seq) batch and a mask: what a user builds from THD metadata.

One helper builds the batch the way a user does (`padded_batch`: each sequence's real rows, padded
to the longest real sequence with the case's fill) and one mask rule (`bshd_mask`); the adapters:

    bshd            any fn(q, k, v, mask) on (B, S, H, D) tensors, mask (B, S_q, S_k) bool (never guessed)
    sdpa-math       torch.nn.functional:scaled_dot_product_attention, one adapter per backend
    sdpa-efficient  (sdpa_kernel(...)): a padded (B, H, S, D) batch with a boolean padding
    sdpa-flash      mask (and bottom-right causality) in attn_mask; the flash backend takes no
    sdpa-cudnn      mask, so it cannot express a padded batch: not applicable
    dmattn          flash_dmattn.flash_dmattn_triton:triton_dmattn_func and
    dmattn-nobias   flash_dmattn.flash_dmattn_flex:flex_dmattn_func (B, S, H, D) with attn_mask
                    (and an explicit zero attn_bias, or None)

    varlen-workbench audit torch.nn.functional:scaled_dot_product_attention --adapter sdpa-efficient --device cuda
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from varlen_workbench.workbench.audit.adapters.base import (
    AdapterRefused,
    ContractCall,
    contract_shaped,
    cuda_only,
    first,
    params,
    register_adapter,
)
from varlen_workbench.workbench.layout import Fill, bshd_to_thd, pad_thd, thd_to_bshd

GATHERED = (
    "the adapter builds a padded (batch, seq) batch from the real rows and scatters the output back, "
    "so THD GAP/TAIL rows never reach the function"
)
MASKED = "the function never receives cu_seqlens/max_seqlen: the adapter turns them into a mask"


def fill_kwargs(case) -> dict[str, Any]:
    """The wrapped call's padding fill: the case's, so padded positions hold NaN, Inf or garbage too."""
    return {"padding_fill": case.fill}


# The keywords of a padded-batch wrapper besides the contract's: the case's fill and the window (inside the mask).
TAKES = ("window_size", "padding_fill")


def padded_batch(c: ContractCall):
    """THD -> (B, S, H, D) q, k, v padded to the longest real sequence (at least 1) with the call's
    `padding_fill`, the (B, S_q) real-query mask, and the (B, S_q, S_k) attention mask
    (`padded_mask`); keeps autograd.

    The longest real sequence, not max_seqlen: the function never sees max_seqlen, so a batch a
    user builds from the real lengths is the one to audit (a larger max_seqlen would only add
    fully padded columns)."""
    generator = torch.Generator().manual_seed(0)

    def padded(x, cu, cu_padded):
        x4, real = thd_to_bshd(x, cu, cu_padded, max(cu.diff().tolist() + [1]))
        filler = Fill(c.padding_fill).values(x4.shape, x4.dtype, generator).to(x4.device)
        return torch.where(real[:, :, None, None], x4, filler), real

    q4, real_q = padded(c.q, c.cu_seqlens_q, c.cu_seqlens_q_padded)
    k4, _ = padded(c.k, c.cu_seqlens_k, c.cu_seqlens_k_padded)
    v4, _ = padded(c.v, c.cu_seqlens_k, c.cu_seqlens_k_padded)
    return q4, k4, v4, real_q, padded_mask(c.cu_seqlens_q, c.cu_seqlens_k, q4, k4, c.causal, c.window_size)


def padded_mask(cu_q, cu_k, q4, k4, causal, window_size):
    """(B, S_q, S_k) bool, True where query i of sequence b may attend key j of the padded batch
    (causality and the window bottom-right aligned, padded positions never)."""
    return bshd_mask(cu_q.diff().tolist(), cu_k.diff().tolist(), q4.shape[1], k4.shape[1], causal, q4.device, window_size)


def back_to_thd(out4, real_q, c: ContractCall):
    """The padded batch's output, real rows scattered back to the call's THD layout (padding rows 0)."""
    flat, _, _ = bshd_to_thd(out4, real_q)
    padded_q = c.cu_seqlens_q if c.cu_seqlens_q_padded is None else c.cu_seqlens_q_padded
    return pad_thd(flat, c.cu_seqlens_q, padded_q, total_rows=c.q.shape[0])


def bshd_mask(
    lengths_q: list[int],
    lengths_k: list[int],
    seq_q: int,
    seq_k: int,
    causal: bool,
    device,
    window: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """(B, S_q, S_k) bool, True where query i of sequence b may attend key j.

    Padded positions are masked on both sides, so a padded query row is fully masked, like a
    real row with no visible key: the function can tell both from the mask alone. Causal and
    the window (FlashAttention's (left, right), -1 unbounded; causal bounds the right at 0)
    are bottom-right aligned.
    """
    lq = torch.tensor(lengths_q, device=device)[:, None, None]
    lk = torch.tensor(lengths_k, device=device)[:, None, None]
    rows = torch.arange(seq_q, device=device)[None, :, None]
    cols = torch.arange(seq_k, device=device)[None, None, :]
    mask = (rows < lq) & (cols < lk)
    left, right = window[0], 0 if causal else window[1]
    if right >= 0:
        mask = mask & (cols <= rows + lk - lq + right)
    if left >= 0:
        mask = mask & (cols >= rows + lk - lq - left)
    return mask


def _bshd_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    return {
        "padded": GATHERED,
        "tail": GATHERED,
        "metadata": MASKED,
        **({} if "scale" in params(fn) else {"scale": "the function takes no scale keyword"}),
    }


@register_adapter("bshd", lacks=_bshd_lacks, case_kwargs=fill_kwargs, calls=(4, ()))
def _bshd(fn: Callable) -> Callable:
    """fn(q, k, v, mask) on padded (B, S, H, D) tensors; mask (B, S_q, S_k) bool, True = may attend
    (a window is part of the mask).

    The batch is padded to the longest real sequence (`padded_batch`), its padded positions hold
    the case's fill (`padding_fill`), so a function that lets masked positions reach real outputs
    (0 * NaN) is caught.
    """
    takes_scale = "scale" in params(fn)

    def body(c: ContractCall):
        q4, k4, v4, real_q, mask = padded_batch(c)
        kwargs = {}
        if c.scale is not None:
            if not takes_scale:
                raise AdapterRefused("this BSHD function takes no scale keyword.")
            kwargs["scale"] = c.scale
        return back_to_thd(first(fn(q4, k4, v4, mask, **kwargs)), real_q, c)

    return contract_shaped(body, TAKES)


# -- SDPA on padded batches, one adapter per backend ------------------------------------------

SDPA_BACKENDS = {
    "sdpa-math": "MATH",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}


def _sdpa_lacks(backend: str) -> Callable[[Callable, torch.device], dict[str, str]]:
    def lacks(fn: Callable, device: torch.device) -> dict[str, str]:
        out = {"padded": GATHERED, "tail": GATHERED, "metadata": MASKED}
        if backend == "FLASH_ATTENTION":
            out["run"] = (
                "SDPA's flash backend takes no attn_mask, and a padded batch of unequal lengths needs one "
                "(sequences of equal length need no padding): not applicable"
            )
        elif backend == "CUDNN_ATTENTION" and device.type != "cuda":
            out["run"] = "SDPA's cuDNN backend runs on CUDA only"
        elif backend == "EFFICIENT_ATTENTION" and device.type != "cuda":
            out["run"] = "SDPA's memory-efficient backend has no CPU kernel"
        return out

    return lacks


def _make_sdpa(name: str, backend: str) -> None:
    @register_adapter(name, lacks=_sdpa_lacks(backend), case_kwargs=fill_kwargs, calls=(3, ("attn_mask", "scale")))
    def wrap(fn: Callable) -> Callable:
        def body(c: ContractCall):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q4, k4, v4, real_q, mask = padded_batch(c)
            kwargs = {"enable_gqa": True} if c.q.shape[1] != c.k.shape[1] else {}
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    out4 = fn(
                        q4.transpose(1, 2),
                        k4.transpose(1, 2),
                        v4.transpose(1, 2),
                        attn_mask=mask[:, None],
                        scale=c.scale,
                        **kwargs,
                    ).transpose(1, 2)
            except RuntimeError as exc:
                if "No available kernel" in str(exc):  # the backend cannot take this call: not its bug
                    raise AdapterRefused(f"SDPA backend {backend} refused this call: {str(exc).splitlines()[0]}") from exc
                raise
            return back_to_thd(out4, real_q, c)

        return contract_shaped(body, TAKES)

    wrap.__doc__ = (
        f"scaled_dot_product_attention under sdpa_kernel({backend}) on a padded batch. Decisions: q, k, v padded "
        "to (B, S, H, D) with the case's padding fill, attn_mask (B, 1, S_q, S_k) bool True where a query may attend "
        "(real keys of its own sequence; causal and the window bottom-right), padded query rows fully masked; the output's real rows "
        "are scattered back to THD (padding rows 0); enable_gqa when H_kv < H; a 'No available kernel' refusal is "
        "'not applicable', not a failure."
    )


for _name, _backend in SDPA_BACKENDS.items():
    _make_sdpa(_name, _backend)


# -- flash-dmattn (Triton and Flex backends): (B, S, H, D) with attn_mask ---------------------


def _dmattn_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    return {
        **cuda_only("flash-dmattn's Triton and Flex backends", device),
        "padded": GATHERED,
        "tail": GATHERED,
        "metadata": MASKED,
        "gqa": (
            "flash-dmattn's Flex backend calls flex_attention without enable_gqa: grouped K/V raise ValueError"
            if "flex" in getattr(fn, "__module__", "")
            else "flash-dmattn's Triton backend asserts k.shape == (batch, seqlen_k, nheads, d): no GQA"
        ),
    }


def _make_dmattn(name: str, zero_bias: bool) -> None:
    @register_adapter(
        name,
        lacks=_dmattn_lacks,
        detect=(lambda fn, names: {"attn_mask", "attn_bias", "is_causal", "softmax_scale"} <= names) if zero_bias else None,
        case_kwargs=fill_kwargs,
        calls=(3, ("attn_mask", "attn_bias", "is_causal", "softmax_scale")),
        dtypes=("float16", "bfloat16"),
        head_dims=(16, 32, 64, 128),
    )
    def wrap(fn: Callable) -> Callable:
        def body(c: ContractCall):
            q4, k4, v4, real_q, mask = padded_batch(c)
            mask = mask[:, None].expand(-1, c.q.shape[1], -1, -1).to(c.q.dtype).contiguous()
            bias = torch.zeros_like(mask) if zero_bias else None
            out4 = first(fn(q4, k4, v4, attn_mask=mask, attn_bias=bias, is_causal=False, softmax_scale=c.scale))
            return back_to_thd(out4, real_q, c)

        return contract_shaped(body, TAKES)

    wrap.__doc__ = (
        "flash-dmattn's triton_dmattn_func / flex_dmattn_func(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale). "
        "Decisions: q, k, v padded to (B, S, H, D) with the case's padding fill; attn_mask (B, H, S_q, S_k) in q's dtype, "
        "1 where a query may attend (real keys of its sequence; causality and the window bottom-right, inside the mask), so is_causal=False "
        "(the Triton kernel's own causal is top-left in padded coordinates, and the Flex backend turns is_causal=None into "
        "True); "
        + (
            "attn_bias explicit zeros (B, H, S_q, S_k): with attn_bias=None, 1.2.2's Triton backward returns a bias gradient "
            "for a None input and autograd raises (adapter dmattn-nobias shows it)"
            if zero_bias
            else "attn_bias=None, the signature's default"
        )
        + "; the output's real rows scattered back to THD."
    )


_make_dmattn("dmattn", zero_bias=True)
_make_dmattn("dmattn-nobias", zero_bias=False)
