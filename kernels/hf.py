"""`varlen_workbench.kernels.varlen.varlen_attention` as a transformers attention implementation: the one-line swap.

    import varlen_workbench.kernels.hf

    varlen_workbench.kernels.hf.register()  # once per process; returns NAME
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

GQA goes through as it is (the kernel takes H % H_kv == 0), and value heads may be narrower than
query/key heads (multi-latent attention). What it cannot express gets an error naming the fix:
dropout, left padding, soft-capping.

The batch's `VarlenMetadata` is built once per forward (`step_metadata`): the first layer builds
it, with at most one host read, and the others find it, keyed on the tensors transformers hands
every layer: no host sync per layer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from varlen_workbench.kernels import caches
from varlen_workbench.kernels.varlen.metadata import VarlenMetadata

NAME = "varlen_contract"  # the attn_implementation string: our varlen attention, keeping the padding contract


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "varlen_workbench.kernels.hf registers an attention implementation with transformers, which is not installed; "
            "install it with `pip install transformers` (one with AttentionInterface: 4.51 has it)."
        ) from exc
    if not hasattr(transformers, "AttentionInterface"):
        raise ImportError(
            f"transformers {transformers.__version__} has no AttentionInterface (4.51 has it); "
            "upgrade with `pip install -U transformers`."
        )
    return transformers


def _read(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The values of `tensors` on the host, as int64 arrays, in one device->host copy: the one
    host read (one sync on a GPU) the swap makes per forward, where it makes any."""
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]).cpu().numpy()
    return np.split(flat, np.cumsum([t.numel() for t in tensors])[:-1])


def _cumulative(lengths: Sequence[int] | np.ndarray) -> torch.Tensor:
    """Boundaries in host memory, int32, from lengths."""
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def _max_length(value: Any, name: str) -> int | None:
    """max_length_q/k as transformers passes it: an int, or None / a tensor (then read with the boundaries)."""
    if value is None or isinstance(value, torch.Tensor):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be an int (the longest sequence), got {type(value).__name__}.")


def _key_padding(attention_mask: torch.Tensor, batch: int, kv_length: int) -> torch.Tensor:
    """The (B, S_k) bool mask of real keys a padding mask says (on its device, nothing read).

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
    return mask[:, -kv_length:].to(torch.bool)


def step_metadata(
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
) -> VarlenMetadata:
    """The `VarlenMetadata` of the batch transformers hands an attention function, built once per
    forward: transformers passes every layer the same tensors (mask, position_ids, cu_seq_lens),
    so the layers after the first find it in `varlen_workbench.kernels.caches.LAST`, keyed on those very
    tensors, unmodified: no host read, no check, no allocation.

    The keywords are transformers' own; the most explicit that describes the batch wins:
    `cu_seq_lens_*`, then a padding mask, then position_ids restarting per document; else each
    row is one sequence. At most one host read per forward (`_read`): none for `cu_seq_lens_*`
    with int max lengths (their check runs on the device, read in the backward) or a batch without
    mask and position_ids; one of the mask's row lengths, of position_ids, or of cu_seq_lens
    without max lengths, whose values the host check then reads for free."""
    given = (attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)
    tensors = tuple(t if isinstance(t, torch.Tensor) else None for t in given)
    extra = ("hf", batch, q_length, kv_length, device, *(None if isinstance(t, torch.Tensor) else t for t in given))

    def build() -> VarlenMetadata:
        return _build(batch, q_length, kv_length, device, *given)

    return caches.LAST.get(tensors, extra, build)


def _build(batch, q_length, kv_length, device, attention_mask, position_ids, cu_q, cu_k, max_q, max_k) -> VarlenMetadata:
    totals: dict[str, Any] = {"total_q": batch * q_length, "total_k": batch * kv_length, "device": device}
    plain = {"cu_seqlens_q": _cumulative([q_length] * batch), "cu_seqlens_k": _cumulative([kv_length] * batch)}
    if cu_q is not None:
        cu_k = cu_q if cu_k is None else cu_k
        known_q, known_k = _max_length(max_q, "max_length_q"), _max_length(max_k, "max_length_k")
        if known_q is not None and known_k is not None:  # checked on the device where they live: no read here
            return VarlenMetadata(cu_q.to(device, torch.int32), cu_k.to(device, torch.int32), known_q, known_k, **totals)
        host_q, host_k = _read(cu_q, cu_k)
        longest_q = int(np.diff(host_q).max(initial=0)) if known_q is None else known_q
        longest_k = int(np.diff(host_k).max(initial=0)) if known_k is None else known_k
        return VarlenMetadata(_as_int32(host_q), _as_int32(host_k), longest_q, longest_k, **totals)
    if attention_mask is not None:
        keys = _key_padding(attention_mask, batch, kv_length)
        lengths = keys.sum(-1)
        right_padded = (keys == (torch.arange(kv_length, device=keys.device) < lengths[:, None])).all(-1)
        lengths, right = _read(lengths, right_padded)
        if (lengths == kv_length).all():  # no padding: a plain batch
            return VarlenMetadata(plain["cu_seqlens_q"], plain["cu_seqlens_k"], q_length, kv_length, **totals)
        if not right.all():
            raise ValueError(
                f"{NAME} takes right-padded batches (each row's real tokens first); this attention_mask pads on the left. "
                "Set tokenizer.padding_side = 'right' for training, or pack the batch with DataCollatorWithFlattening."
            )
        if q_length != kv_length:
            raise ValueError(
                f"{NAME} got a padding mask with {q_length} queries and {kv_length} keys per row; a right-padded batch "
                "has as many queries as keys. Decode with left padding through another implementation, or without padding."
            )
        cu, most = _cumulative(lengths), int(lengths.max())
        padded = {"cu_seqlens_q_padded": plain["cu_seqlens_q"], "cu_seqlens_k_padded": plain["cu_seqlens_k"]}
        return VarlenMetadata(cu, cu, most, most, **padded, **totals)
    if position_ids is not None and q_length == kv_length and position_ids.dim() == 2:
        (flat,) = _read(position_ids)
        if (flat.reshape(position_ids.shape)[:, 1:] == 0).any():  # restarts within a row: packed documents
            if flat[0] != 0:
                raise ValueError(
                    f"position_ids of a packed batch must start every document at 0, but the first is {int(flat[0])}; "
                    "pass DataCollatorWithFlattening's position_ids (position_ids_start=0), or cu_seq_lens_q/k."
                )
            starts = np.flatnonzero(flat == 0)
            documents = np.diff(np.append(starts, flat.size))
            cu, most = _cumulative(documents), int(documents.max())
            return VarlenMetadata(cu, cu, most, most, **totals)
    return VarlenMetadata(plain["cu_seqlens_q"], plain["cu_seqlens_k"], q_length, kv_length, **totals)


def _as_int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values).to(torch.int32)


def _takes_metadata(varlen: Callable[..., Any]) -> bool:
    """Whether `varlen` takes a `metadata=` keyword (ours does); other callables get the boundaries."""
    try:
        return "metadata" in inspect.signature(varlen).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def attention_forward(varlen: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, None]]:
    """A transformers attention function (module, query, key, value, attention_mask, **kwargs) that
    runs `varlen`, any callable with `varlen_workbench.kernels.varlen.varlen_attention`'s signature, on the batch's layout:
    the step's `VarlenMetadata` as `metadata=` where `varlen` takes it, else its boundaries."""
    with_metadata = _takes_metadata(varlen)

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
        metadata = step_metadata(
            batch,
            q_length,
            kv_length,
            query.device,
            attention_mask,
            kwargs.get("position_ids"),
            *(kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")),
        )
        window = kwargs.get("sliding_window")
        extra: dict[str, Any] = {"window_size": (window - 1, 0)} if window else {}  # the window counts the query itself
        if with_metadata:
            extra["metadata"] = metadata
            boundaries: tuple = ()
        else:
            padded = [None if given is None else b for given, b in zip(metadata.given[2:], metadata.boundaries[2:])]
            extra.update(cu_seqlens_q_padded=padded[0], cu_seqlens_k_padded=padded[1])
            boundaries = (*metadata.boundaries[:2], metadata.max_seqlen_q, metadata.max_seqlen_k)
        out = varlen(
            query.transpose(1, 2).reshape(batch * q_length, heads, dim),
            key.transpose(1, 2).reshape(batch * kv_length, kv_heads, key.shape[-1]),
            value.transpose(1, 2).reshape(batch * kv_length, kv_heads, value.shape[-1]),
            *boundaries,
            causal=bool(kwargs.get("is_causal", getattr(module, "is_causal", True))),
            scale=scaling,
            **extra,
        )
        return out.reshape(batch, q_length, heads, value.shape[-1]), None

    return forward


def register(name: str = NAME, varlen: Callable[..., torch.Tensor] | None = None) -> str:
    """Registers `varlen` (default: `varlen_workbench.kernels.varlen.varlen_attention`) with transformers' AttentionInterface
    as `name`, so that `attn_implementation=name` selects it; returns `name`.

    Where transformers builds masks per implementation (AttentionMaskInterface), the name gets FlashAttention's:
    None for a causal batch, the (batch, seq) padding mask otherwise, never a dense 4-D mask."""
    transformers = _transformers()
    from varlen_workbench.kernels.varlen import varlen_attention

    transformers.AttentionInterface.register(name, attention_forward(varlen_attention if varlen is None else varlen))
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # no AttentionMaskInterface: the model builds a 4-D mask, read by _key_padding
        return name
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name
