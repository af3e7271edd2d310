"""`kernels.varlen_attention` as a transformers attention implementation: the one-line swap.

    import kernels.hf

    kernels.hf.register()  # once per process; returns NAME
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="varlen_contract")

transformers is optional: it is imported only when `register()` runs, and a missing install is
an ImportError saying how to get it. The attention takes batches the ways transformers passes them:

- packed by `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`: the `cu_seq_lens_q/k` and
  `max_length_q/k` keywords, flattened over the batch as FlashAttention's path reads them. Rows
  after `cu_seq_lens_q[-1]` are TAIL padding: the kernel's contract leaves them exactly 0, with 0
  gradients, whatever memory holds there;
- packed with `position_ids` alone (restarting at 0 for every document), as that collator's default;
- a right-padded batch with a padding `attention_mask`: each row's padding becomes GAP rows of the
  contract's padded layout (`cu_seqlens_q_padded`): no unpadding pass, the rows stay where they are;
- a plain batch: each row one sequence, causal bottom-right aligned (so decoding with a KV cache,
  len_q < len_k, attends to the whole cache).

GQA goes through as it is (the kernel takes H % H_kv == 0). What it cannot express gets an error
naming the fix: dropout, left padding, soft-capping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

NAME = "varlen_contract"  # the attn_implementation string: our varlen attention, keeping the padding contract


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "kernels.hf registers an attention implementation with transformers, which is not installed; "
            "install it with `pip install transformers` (one with AttentionInterface: 4.51 has it)."
        ) from exc
    if not hasattr(transformers, "AttentionInterface"):
        raise ImportError(
            f"transformers {transformers.__version__} has no AttentionInterface (4.51 has it); "
            "upgrade with `pip install -U transformers`."
        )
    return transformers


@dataclass(frozen=True)
class Layout:
    """Where the sequences of a (B, S) batch lie once flattened to B*S rows (the contract's arguments)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_k_padded: torch.Tensor | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"cu_seqlens_q_padded": self.cu_seqlens_q_padded, "cu_seqlens_k_padded": self.cu_seqlens_k_padded}


def _boundaries(values: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, device=device).to(torch.int32)


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.max())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be an int (the longest sequence), got {type(value).__name__}.")


def _key_padding(attention_mask: torch.Tensor, batch: int, kv_length: int) -> torch.Tensor | None:
    """The (B, S_k) bool mask of real keys a padding mask says, or None when every key is real.

    transformers passes a 2-D padding mask, or a 4-D causal one (bool, or additive float with the
    dtype's minimum where masked); a 4-D mask's last query row sees every real key."""
    mask = attention_mask
    if mask.dim() == 4:
        mask = mask[:, 0, -1, :]
        if mask.dtype != torch.bool:
            mask = mask == 0
    if mask.dim() != 2 or mask.shape[0] != batch:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} is not a padding mask of this batch "
            f"({batch}, {kv_length}); pass a (batch, seq) mask of 1 on real tokens, or pack the batch."
        )
    mask = mask[:, -kv_length:].to(torch.bool)
    return None if bool(mask.all()) else mask


def _restarts(position_ids: torch.Tensor) -> bool:
    """Whether position_ids restart within a row: a packed batch of several documents."""
    return position_ids.dim() == 2 and bool((position_ids[:, 1:] == 0).any())


def packed_layout(
    batch: int,
    q_length: int,
    kv_length: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: Any = None,
    max_length_k: Any = None,
) -> Layout:
    """The sequences of a batch transformers hands an attention function, as varlen arguments.

    The keywords are transformers' own; the most explicit that describes the batch wins:
    `cu_seq_lens_*`, then a padding mask, then position_ids restarting per document; else each
    row is one sequence."""
    if cu_seq_lens_q is not None:
        cu_q = _boundaries(cu_seq_lens_q, device)
        cu_k = cu_q if cu_seq_lens_k is None else _boundaries(cu_seq_lens_k, device)
        lengths = lambda cu: int((cu[1:] - cu[:-1]).max())
        max_q = lengths(cu_q) if max_length_q is None else _as_int(max_length_q, "max_length_q")
        max_k = lengths(cu_k) if max_length_k is None else _as_int(max_length_k, "max_length_k")
        return Layout(cu_q, cu_k, max_q, max_k)
    rows = lambda n: torch.arange(batch + 1, device=device, dtype=torch.int32) * n
    keys = None if attention_mask is None else _key_padding(attention_mask, batch, kv_length)
    if keys is not None:
        lengths = keys.sum(-1)
        if not torch.equal(keys, torch.arange(kv_length, device=keys.device) < lengths[:, None]):
            raise ValueError(
                f"{NAME} takes right-padded batches (each row's real tokens first); this attention_mask pads on the left. "
                "Set tokenizer.padding_side = 'right' for training, or pack the batch with DataCollatorWithFlattening."
            )
        if q_length != kv_length:
            raise ValueError(
                f"{NAME} got a padding mask with {q_length} queries and {kv_length} keys per row; a right-padded batch "
                "has as many queries as keys. Decode with left padding through another implementation, or without padding."
            )
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)
        longest = int(lengths.max())
        return Layout(cu, cu, longest, longest, rows(q_length), rows(kv_length))
    if position_ids is not None and q_length == kv_length and _restarts(position_ids):
        flat = position_ids.reshape(-1)
        if int(flat[0]) != 0:
            raise ValueError(
                f"position_ids of a packed batch must start every document at 0, but the first is {int(flat[0])}; "
                "pass DataCollatorWithFlattening's position_ids (position_ids_start=0), or cu_seq_lens_q/k."
            )
        starts = (flat == 0).nonzero().reshape(-1)
        cu = _boundaries(torch.cat([starts, starts.new_tensor([flat.numel()])]), device)
        longest = int((cu[1:] - cu[:-1]).max())
        return Layout(cu, cu, longest, longest)
    return Layout(rows(q_length), rows(kv_length), q_length, kv_length)


def attention_forward(varlen: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, None]]:
    """A transformers attention function (module, query, key, value, attention_mask, **kwargs) that
    runs `varlen`, any callable with `kernels.varlen_attention`'s signature, on the batch's layout."""

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if dropout:
            raise ValueError(f"{NAME} has no attention dropout, got dropout={dropout}; set config.attention_dropout = 0.0.")
        if kwargs.get("softcap") is not None:
            raise ValueError(f"{NAME} has no logit soft-capping, got softcap={kwargs['softcap']}; use another implementation.")
        batch, heads, q_length, dim = query.shape
        kv_heads, kv_length = key.shape[1], key.shape[2]
        layout = packed_layout(
            batch,
            q_length,
            kv_length,
            query.device,
            attention_mask,
            kwargs.get("position_ids"),
            *(kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")),
        )
        window = kwargs.get("sliding_window")
        extra = {"window_size": (window - 1, 0)} if window else {}  # transformers' window counts the query itself
        out = varlen(
            query.transpose(1, 2).reshape(batch * q_length, heads, dim),
            key.transpose(1, 2).reshape(batch * kv_length, kv_heads, dim),
            value.transpose(1, 2).reshape(batch * kv_length, kv_heads, dim),
            layout.cu_seqlens_q,
            layout.cu_seqlens_k,
            layout.max_seqlen_q,
            layout.max_seqlen_k,
            **layout.kwargs(),
            causal=bool(kwargs.get("is_causal", getattr(module, "is_causal", True))),
            scale=scaling,
            **extra,
        )
        return out.reshape(batch, q_length, heads, dim), None

    return forward


def register(name: str = NAME, varlen: Callable[..., torch.Tensor] | None = None) -> str:
    """Registers `varlen` (default: `kernels.varlen_attention`) with transformers' AttentionInterface
    as `name`, so that `attn_implementation=name` selects it; returns `name`.

    Where transformers builds masks per implementation (AttentionMaskInterface), the name gets FlashAttention's:
    None for a causal batch, the (batch, seq) padding mask otherwise, never a dense 4-D mask."""
    transformers = _transformers()
    from kernels.varlen import varlen_attention

    transformers.AttentionInterface.register(name, attention_forward(varlen_attention if varlen is None else varlen))
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # no AttentionMaskInterface: the model builds a 4-D mask, read by _key_padding
        return name
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name
