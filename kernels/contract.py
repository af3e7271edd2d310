"""Validation of varlen attention arguments: the padding contract's checks (docs/contract.md).

Every malformed input raises `TypeError` (wrong kind of thing) or `ValueError` (right kind,
wrong value) whose message names the argument, the offending index and value, and the fix.

Metadata checks here read `cu_seqlens*` on the host: one device->host copy of all of them (one
sync), then numpy on the host (a numpy op costs about a microsecond, a torch op on a small CPU
tensor several). Natively `varlen_attention` checks the values with a kernel instead
(`varlen_workbench.kernels.varlen.device_check`) and comes here only to raise the error of a call that failed.
Callers that cannot afford any wait (CUDA graphs, `torch.compile`) pass `validate=False` to
the kernel and keep only the tensor-shape checks in `check_varlen_tensors`, which need no sync.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class VarlenShape:
    """What the tensor checks learned: sizes the launcher needs."""

    total_q: int
    total_k: int
    heads: int
    kv_heads: int
    head_dim: int  # q's and k's
    head_dim_v: int  # v's, and the output's


def describe_head_dims(head_dims: Collection[int]) -> str:
    """'16, 32, 64' for a short list; '8, 16, 24, ..., 256' for a long evenly spaced one."""
    dims = sorted(head_dims)
    if len(dims) > 4 and len({b - a for a, b in zip(dims, dims[1:])}) == 1:
        return f"{dims[0]}, {dims[1]}, {dims[2]}, ..., {dims[-1]}"
    return ", ".join(map(str, dims))


def _unsupported_head_dim(name: str, head_dim: int, head_dims: Collection[int], pad: str) -> str:
    """The error of a head dim the implementation does not take: `name` says whose (e.g.
    "head_dim 20 (q.shape[-1])"), `pad` how to pad it to `{up}`, the next supported one."""
    up = min((d for d in head_dims if d >= head_dim), default=None)
    fix = pad.format(up=up, dim=head_dim) if up is not None else f"Use at most {max(head_dims)} features per head"
    return f"{name} is not supported; supported head dims are {describe_head_dims(head_dims)}. {fix}."


def check_varlen_tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    head_dims: Collection[int] | None = None,
    separate_v_head_dim: bool = True,
) -> VarlenShape:
    """Shape, dtype and device checks of q, k, v. No host sync.

    `head_dims`: the head dims the implementation takes, for q and k and for v (each of its
    own); None: any. `separate_v_head_dim=False`: v must have q and k's head dim (an
    implementation with one head dim for all three)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor, got {type(t).__name__}; pass a (tokens, heads, head_dim) tensor, "
                f"e.g. torch.as_tensor({name})."
            )
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D (tokens, heads, head_dim) in packed THD layout, got shape "
                f"{tuple(t.shape)}; for a padded (batch, seq, heads, dim) tensor use "
                "varlen_workbench.workbench.layout.bshd_to_thd first."
            )
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor, got {t.dtype}; cast it, e.g. "
                f"{name}.to({_suggested_dtype(t.device, dtypes or (torch.float32, torch.bfloat16))})."
            )
        if dtypes is not None and t.dtype not in dtypes:
            raise TypeError(
                f"{name} has dtype {t.dtype}; this implementation supports "
                f"{', '.join(str(d) for d in dtypes)}. Cast with {name}.to({_suggested_dtype(t.device, dtypes)}) "
                "(or another supported dtype)."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}; cast them to the same dtype.")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}; move them with .to(q.device)."
        )
    if k.shape[0] != v.shape[0]:
        raise ValueError(
            f"v has {v.shape[0]} rows but k has {k.shape[0]} (k {tuple(k.shape)}, v {tuple(v.shape)}); pass one value "
            "row per key row: k and v share the layout cu_seqlens_k describes."
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(
            f"v has {v.shape[1]} heads but k has {k.shape[1]} (k {tuple(k.shape)}, v {tuple(v.shape)}); pass v with "
            "k's heads (H_kv), one value head per key head."
        )
    total_q, heads, head_dim = q.shape
    total_k, kv_heads, head_dim_k = k.shape
    head_dim_v = v.shape[2]
    if head_dim_k != head_dim:
        raise ValueError(
            f"q and k must have the same head_dim (last dimension), got q {head_dim} and k {head_dim_k}; "
            f"project q and k to one head dim (v's may differ).{_transposed_hint(q, k, head_dims)}"
        )
    if heads == 0 or kv_heads == 0:
        raise ValueError(
            f"q and k need at least one head, got q {heads} and k {kv_heads}; pass (tokens, heads, head_dim) "
            "tensors with heads >= 1."
        )
    if heads % kv_heads != 0:
        raise ValueError(
            f"q has {heads} heads, not a multiple of k's {kv_heads} heads (H % H_kv must be "
            "0 for GQA/MQA); repeat k/v heads or choose H_kv among the divisors of H."
        )
    if head_dims is not None and head_dim not in head_dims:
        message = _unsupported_head_dim(
            f"head_dim {head_dim} (q.shape[-1])",
            head_dim,
            head_dims,
            "Pad q and k with zeros to {up} features and pass scale={dim}**-0.5 (the default scale follows the head dim)",
        )
        raise ValueError(message + _transposed_hint(q, k, head_dims))
    if not separate_v_head_dim and head_dim_v != head_dim:
        raise ValueError(
            f"v has head_dim {head_dim_v} but q and k have {head_dim}; this implementation takes one head dim for "
            "q, k and v: pad v with zeros to q's head dim and drop the extra output features (varlen_workbench.kernels.varlen.varlen_attention "
            "takes v's head dim apart)."
        )
    if head_dims is not None and head_dim_v not in head_dims:
        raise ValueError(
            _unsupported_head_dim(
                f"v's head_dim {head_dim_v} (v.shape[-1])",
                head_dim_v,
                head_dims,
                "Pad v with zeros to {up} features and keep out[..., :{dim}] (the extra features of out are 0)",
            )
        )
    return VarlenShape(total_q, total_k, heads, kv_heads, head_dim, head_dim_v)


def _suggested_dtype(device: torch.device, dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The cast to advise: float32 on the CPU (the interpreter emulates half precision slowly),
    bfloat16 on a GPU, whichever of them the implementation supports."""
    preferred = (torch.float32, torch.bfloat16) if device.type == "cpu" else (torch.bfloat16, torch.float32)
    return next((d for d in preferred if d in dtypes), dtypes[0])


def _transposed_hint(q: torch.Tensor, k: torch.Tensor, head_dims: Collection[int] | None) -> str:
    """Names q or k as likely transposed, (tokens, head_dim, heads), when its middle dimension is
    a supported head dim and its last is not: the usual cause of a head-dim error."""
    for name, t in (("q", q), ("k", k)):
        if head_dims is not None and t.shape[1] in head_dims and t.shape[-1] not in head_dims:
            return (
                f" {name} has shape {tuple(t.shape)}: is it (tokens, head_dim, heads), transposed? Pass "
                f"{name}.transpose(1, 2) for (tokens, heads, head_dim)."
            )
    return ""


def _check_index_tensor(name: str, cu: object, device: torch.device | None) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}; build it with "
            f"torch.tensor(..., dtype=torch.int32, device=q.device)."
        )
    if cu.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (torch.int32), got {cu.dtype}; pass {name}.to(torch.int32).")
    if cu.dim() != 1:
        raise ValueError(
            f"{name} must be 1-D of length batch+1, got shape {tuple(cu.shape)}; "
            f"flatten it or pass one boundary vector for the whole packed batch."
        )
    if cu.numel() < 2:
        raise ValueError(
            f"{name} must hold at least 2 boundaries (batch+1 with batch >= 1), got "
            f"{cu.tolist()}; for one sequence of n tokens pass [0, n]."
        )
    if device is not None and cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}; move it with {name}.to(q.device).")


def check_cu_seqlens_tensors(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> int:
    """Kind, shape and device of the metadata tensors; returns the batch size. No host sync.

    What `validate=False` still checks: a batch-size mismatch here would make a kernel read
    boundaries past the end of the shorter tensor.
    """
    sides = (("q", cu_seqlens_q, cu_seqlens_q_padded), ("k", cu_seqlens_k, cu_seqlens_k_padded))
    for side, cu, cu_padded in sides:
        name, name_padded = f"cu_seqlens_{side}", f"cu_seqlens_{side}_padded"
        _check_index_tensor(name, cu, device)
        if cu_padded is None:
            continue
        _check_index_tensor(name_padded, cu_padded, device)
        if cu_padded.numel() != cu.numel():
            raise ValueError(
                f"{name_padded} has {cu_padded.numel() - 1} sequences but {name} has "
                f"{cu.numel() - 1}; both describe the same batch and need the same length."
            )
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q describes {cu_seqlens_q.numel() - 1} sequences but cu_seqlens_k "
            f"describes {cu_seqlens_k.numel() - 1}; q and k must come from the same batch "
            "(batch+1 boundaries each)."
        )
    return cu_seqlens_q.numel() - 1


def _to_host(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The metadata tensors' values as int64 numpy arrays, in one device->host copy (one sync):
    the vectors are concatenated where they live, the one copy moves them, numpy splits them."""
    if len({t.device for t in tensors}) > 1:  # only where no device was imposed: one copy each
        return [t.to("cpu", torch.int64).numpy() for t in tensors]
    dtype = tensors[0].dtype if all(t.dtype == tensors[0].dtype for t in tensors) else torch.int64
    host = torch.cat([t.to(dtype) for t in tensors]).cpu().numpy().astype(np.int64)
    starts = [0]
    for t in tensors:
        starts.append(starts[-1] + t.numel())
    return [host[a:b] for a, b in zip(starts, starts[1:])]


def _steps(name: str, values: np.ndarray) -> np.ndarray:
    """Checks one boundary vector (int64 numpy, on the host, >= 2 entries) in vectorised form;
    returns its steps (the sequences' lengths)."""
    if values[0] != 0:
        raise ValueError(
            f"{name}[0] = {int(values[0])}: cumulative boundaries must start at 0; "
            f"prepend 0 (torch.nn.functional.pad(lengths.cumsum(0), (1, 0)))."
        )
    steps = values[1:] - values[:-1]
    if steps.min() < 0:
        i = int(np.argmax(steps < 0)) + 1  # the first decrease
        raise ValueError(
            f"{name} decreases at index {i}: {name}[{i - 1}] = {int(values[i - 1])} > "
            f"{name}[{i}] = {int(values[i])}; boundaries must be non-decreasing cumulative "
            "sums of sequence lengths: build them as torch.nn.functional.pad(lengths.cumsum(0), (1, 0))."
        )
    return steps


def _check_side(
    side: str,
    real: np.ndarray,
    padded_values: np.ndarray | None,
    total: int | None,
    max_seqlen: object,
) -> list[int]:
    """Checks the values of one side (q or k), given as host arrays; returns the real lengths."""
    name, name_padded = f"cu_seqlens_{side}", f"cu_seqlens_{side}_padded"
    lengths = _steps(name, real)
    if padded_values is None:
        padded, layout = real, name
    else:
        padded, layout = padded_values, name_padded
        rooms = _steps(name_padded, padded)
        too_long = lengths > rooms
        if too_long.any():
            i = int(np.argmax(too_long))  # the first sequence too long for its slot
            length, room = int(lengths[i]), int(rooms[i])
            raise ValueError(
                f"sequence {i} has {length} real tokens ({name}[{i + 1}] - {name}[{i}]) "
                f"but only {room} rows in the padded layout ({name_padded}[{i + 1}] - "
                f"{name_padded}[{i}]); a real length must not exceed its padded length. "
                f"Did you swap {name} and {name_padded}?"
            )
    end = int(padded[-1])
    if total is not None and end > total:
        tensor = "q" if side == "q" else "k and v"
        raise ValueError(
            f"{layout}[-1] = {end} exceeds {tensor}.shape[0] = {total}: the layout "
            f"addresses rows past the end of {tensor}. Pass tensors with at least "
            f"{end} rows or fix {layout}. (Rows beyond {layout}[-1] are legal TAIL "
            "padding; fewer rows are not.)"
        )
    max_name = f"max_seqlen_{side}"
    max_seqlen = check_max_seqlen(max_name, max_seqlen, name)
    longest = int(lengths.max())
    if max_seqlen < longest:
        i = int(np.argmax(lengths == longest))  # the first sequence of that length
        raise ValueError(
            f"{max_name} = {max_seqlen} is smaller than sequence {i}'s real length {longest}; "
            f"tokens past {max_name} would be silently dropped. Pass {max_name} >= {longest}."
        )
    return lengths.tolist()


def check_max_seqlen(name: str, value: object, cu_name: str) -> int:
    """`max_seqlen_q`/`_k` as an int: a Python or numpy integer (not a bool, not a tensor, whose
    value would need a host read). No host sync."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        kind = type(value).__name__
        if type(value).__module__ == "numpy":  # np.float64 is not torch.float64's kind of mistake: say whose
            kind = f"numpy.{kind}"
        raise TypeError(f"{name} must be a Python int, got {kind}; pass int({cu_name}.diff().max()).")
    return int(value)


def check_cu_seqlens(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    total_q: int | None = None,
    total_k: int | None = None,
    device: torch.device | None = None,
) -> tuple[list[int], list[int]]:
    """Validates varlen metadata; returns the real lengths of q and k sequences.

    `total_q`/`total_k` are the row counts of q and k (the memory the layout addresses);
    rows beyond the padded end are TAIL padding and legal. `device`, when given, is where
    the metadata must live (q's device).
    """
    check_cu_seqlens_tensors(
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_k_padded=cu_seqlens_k_padded,
        device=device,
    )
    given = [t for t in (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded) if t is not None]
    host = dict(zip(map(id, given), _to_host(given)))
    q_padded, k_padded = (None if t is None else host[id(t)] for t in (cu_seqlens_q_padded, cu_seqlens_k_padded))
    lengths_q = _check_side("q", host[id(cu_seqlens_q)], q_padded, total_q, max_seqlen_q)
    lengths_k = _check_side("k", host[id(cu_seqlens_k)], k_padded, total_k, max_seqlen_k)
    return lengths_q, lengths_k


def check_scale(scale: object, head_dim: int) -> float:
    """Returns the softmax scale, defaulting to 1/sqrt(head_dim)."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(
            f"scale must be a Python float or None, got {type(scale).__name__}; pass float(scale), or None for 1/sqrt(head_dim)."
        )
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"scale = {scale} must be a finite positive number; pass None for 1/sqrt(head_dim).")
    return float(scale)


def check_varlen_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    scale: float | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    head_dims: Collection[int] | None = None,
    separate_v_head_dim: bool = True,
) -> VarlenShape:
    """Every check of the contract for one call (reads metadata on the host)."""
    shape = check_varlen_tensors(q, k, v, dtypes=dtypes, head_dims=head_dims, separate_v_head_dim=separate_v_head_dim)
    check_cu_seqlens(
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_k_padded=cu_seqlens_k_padded,
        total_q=shape.total_q,
        total_k=shape.total_k,
        device=q.device,
    )
    check_scale(scale, shape.head_dim)
    return shape


def check_causal(causal: object) -> bool:
    """`causal` must be a bool (a string such as "yes" is a mistake, not a truthy flag)."""
    if not isinstance(causal, bool):
        raise TypeError(
            f"causal must be a bool, got {type(causal).__name__} {causal!r}; pass causal=True or causal=False "
            "(window_size=(-1, 0) is the same as causal=True)."
        )
    return causal


def check_window_size(window_size: object) -> tuple[int, int]:
    """FlashAttention's window_size=(left, right): two ints >= -1, -1 meaning unbounded. No host sync.

    Query i of a sequence sees key j iff i + len_k - len_q - left <= j <= i + len_k - len_q + right.
    """
    if isinstance(window_size, (str, bytes, torch.Tensor)) or not isinstance(window_size, Sequence):
        raise TypeError(
            f"window_size must be a (left, right) pair of ints, got {type(window_size).__name__} {window_size!r}; "
            "e.g. window_size=(4096, 0) for a causal sliding window, (-1, -1) for none."
        )
    if len(window_size) != 2:
        raise ValueError(
            f"window_size must have 2 entries (left, right), got {len(window_size)}: {tuple(window_size)!r}; "
            "use -1 for an unbounded side, e.g. (-1, 0) for causal."
        )
    bounds = []
    for side, bound in zip(("left", "right"), window_size):
        if isinstance(bound, bool) or not hasattr(bound, "__index__"):
            raise TypeError(
                f"window_size {side} bound must be an int, got {type(bound).__name__} {bound!r}; "
                "pass whole numbers of keys, -1 for unbounded."
            )
        bound = int(bound)
        if bound < -1:
            raise ValueError(
                f"window_size {side} bound = {bound} is invalid: pass -1 (unbounded) or the number of keys >= 0 a "
                "query sees on that side of the diagonal, e.g. window_size=(4096, 0) for a causal sliding window."
            )
        bounds.append(bound)
    return bounds[0], bounds[1]
