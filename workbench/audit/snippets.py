"""Shrunk failures as plain-torch snippets, pasteable into an upstream issue.

`torch_snippet(impl, case, finding)` writes a script that imports only torch and the audited
function: it builds the layout's tensors with literal cu_seqlens, calls the function the way
the adapter does (a varlen function's call as inferred from its signature, the others spelled
out per adapter in `CALLS`), runs backward,
computes the fp64 answer sequence by sequence, and prints the damaged rows of out, dq, dk, dv
(REAL rows off the fp64 answer, padding rows not exactly 0). Fresh buffers are NaN-filled with
torch's own switch (`torch.utils.deterministic.fill_uninitialized_memory`), so rows a kernel
never writes show up as NaN. Adapters without a spelled-out call get None: the workbench
replay (`varlen_workbench.workbench.audit.fuzz.snippet`) stands alone then.
"""

from __future__ import annotations

from collections.abc import Callable

from varlen_workbench.workbench.layout import Case, Fill, pack

_FILL_SOURCE = {
    Fill.ZEROS: "0.0",
    Fill.NAN: 'float("nan")',
    Fill.POS_INF: 'float("inf")',
    Fill.NEG_INF: 'float("-inf")',
    Fill.HUGE: "torch.finfo(dt).max",
    Fill.GARBAGE: "1e4",  # times randn below
}

_PADDED_BATCH = """\
# The padded batch a user builds: (B, S, H, D), padding positions holding the same fill.
B, S_q, S_k = len(lens_q), max(lens_q + [1]), max(lens_k + [1])
def to_bshd(x, starts, lens, S):
    out = torch.full((B, S, *x.shape[1:]), 0.0, device=dev, dtype=dt)
    out = out + fill_value(out) if fill != "zeros" else out
    rows = [(b, i) for b in range(B) for i in range(lens[b])]
    src = torch.tensor([starts[b] + i for b, i in rows], device=dev, dtype=torch.long)
    return out.index_put((torch.tensor([b for b, _ in rows], device=dev), torch.tensor([i for _, i in rows], device=dev)), x[src]) if rows else out
q4, k4, v4 = to_bshd(q, starts_q, lens_q, S_q), to_bshd(k, starts_k, lens_k, S_k), to_bshd(v, starts_k, lens_k, S_k)
allowed = torch.zeros(B, S_q, S_k, dtype=torch.bool, device=dev)  # True: query i of sequence b may attend key j
for b in range(B):
    allowed[b, : lens_q[b], : lens_k[b]] = visible(lens_q[b], lens_k[b])
def from_bshd(out4):
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])  # v's head dim
    for b in range(B):
        out[starts_q[b] : starts_q[b] + lens_q[b]] = out4[b, : lens_q[b]]
    return out
"""


# Which key j query i of a sequence sees (bottom-right aligned): causal, then the window.
_VISIBLE = """\
def visible(n, m):  # (n queries, m keys) bool: query i sees key j iff i + m - n - left <= j <= i + m - n + right
    left, right = window[0], 0 if causal else window[1]  # -1: unbounded; causal bounds the right side at 0
    i, j = torch.arange(n, device=dev)[:, None] + (m - n), torch.arange(m, device=dev)[None, :]
    ok = torch.ones(n, m, dtype=torch.bool, device=dev)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok
"""


def _sdpa(backend: str) -> Callable[[str, str], list[str]]:
    def lines(module: str, name: str) -> list[str]:
        return [
            "import torch.nn.functional as F",
            "from torch.nn.attention import SDPBackend, sdpa_kernel",
            *_PADDED_BATCH.splitlines(),
            f"with sdpa_kernel(SDPBackend.{backend}):",
            "    out4 = F.scaled_dot_product_attention(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2),",
            "        attn_mask=allowed[:, None], scale=scale, enable_gqa=H != H_kv).transpose(1, 2)",
            "out = from_bshd(out4)",
        ]

    return lines


def _dmattn(module: str, name: str) -> list[str]:
    return [
        f"from {module} import {name}",
        *_PADDED_BATCH.splitlines(),
        "mask = allowed[:, None].expand(-1, H, -1, -1).to(dt).contiguous()  # 1: may attend (causality inside)",
        f"out = from_bshd({name}(q4, k4, v4, attn_mask=mask, attn_bias=None, is_causal=False, softmax_scale=scale))",
    ]


def _flex(module: str, name: str) -> list[str]:
    return [
        "from torch.nn.attention.flex_attention import create_block_mask, flex_attention",
        "T = max(128, 1 << (max(q.shape[0], k.shape[0]) - 1).bit_length())  # one bucket for both sides",
        "def docs(starts, lens):",
        "    doc, pos = torch.full((T,), -1, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)",
        "    for b, (s, n) in enumerate(zip(starts, lens)):",
        "        doc[s : s + n], pos[s : s + n] = b, torch.arange(n, dtype=torch.int32)",
        "    return doc.to(dev), pos.to(dev)",
        "doc_q, pos_q = docs(starts_q, lens_q)",
        "doc_k, pos_k = docs(starts_k, lens_k)",
        "shift = torch.tensor([m - n for n, m in zip(lens_q, lens_k)], device=dev, dtype=torch.int32)",
        "limit_q = pos_q + shift[doc_q.clamp(min=0).long()]  # last key each query row may see (bottom-right)",
        "def mask_mod(b, h, qi, ki):",
        "    same = (doc_q[qi] == doc_k[ki]) & (doc_q[qi] >= 0)",
        "    return same & (pos_k[ki] <= limit_q[qi]) if causal else same",
        "block_mask = create_block_mask(mask_mod, None, None, T, T, device=dev)",
        "pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, 0, 0, T - x.shape[0])).transpose(0, 1)[None]",
        "flex = torch.compile(flex_attention, dynamic=True)",
        "out = flex(pad(q), pad(k), pad(v), block_mask=block_mask, scale=scale, enable_gqa=H != H_kv)[0].transpose(0, 1)[: q.shape[0]]",
    ]


def _nested(module: str, name: str) -> list[str]:
    return [
        "import torch.nn.functional as F",
        "def jagged(x, starts, lens, offsets):",
        "    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)] + [torch.zeros(0, dtype=torch.long)]).to(dev)",
        "    return torch.nested.nested_tensor_from_jagged(x[rows], offsets=offsets).transpose(1, 2)",
        "off_q = cu_q.long(); off_k = off_q if torch.equal(cu_q, cu_k) else cu_k.long()",
        "o = F.scaled_dot_product_attention(jagged(q, starts_q, lens_q, off_q), jagged(k, starts_k, lens_k, off_k),",
        "    jagged(v, starts_k, lens_k, off_k), is_causal=causal, scale=scale).transpose(1, 2).values()",
        "out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])  # v's head dim",
        "out[torch.cat([torch.arange(s, s + n) for s, n in zip(starts_q, lens_q)]).to(dev)] = o",
    ]


# The calls of the adapters that do not infer theirs from the signature (a varlen function's
# adapter spells its own: `VarlenSignature.source`).
CALLS: dict[str, Callable[[str, str], list[str]]] = {
    "flex-document": _flex,
    "sdpa-math": _sdpa("MATH"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-nested": _nested,
    "dmattn": _dmattn,
}


def whose(impl) -> str:
    """How a snippet names the audited function: ours, a library's, or the user's own."""
    from importlib.metadata import packages_distributions

    module = (impl.target or "").partition(":")[0]
    top = module.partition(".")[0]
    if module.startswith("varlen_workbench.kernels."):
        return "our kernel's call"
    if module.startswith("varlen_workbench.workbench.audit.adapters."):  # fsa_dense_varlen, cudnn_ragged_attention
        return "the upstream call, through our thin wrapper"
    return "the upstream call" if top in packages_distributions() else "your function's call"


def _spelling(impl) -> Callable[[str, str], list[str]] | None:
    signature = getattr(impl.impl, "signature", None)
    if signature is not None:
        return lambda module, name: [f"from {module} import {name}", *signature.source(name)]
    return CALLS.get(impl.adapter.name)


def torch_snippet(impl, case: Case, finding) -> str | None:
    """The plain-torch reproduction of `case` for `impl` (an Adapted), or None if its adapter
    spells out no call or the function is not importable by name."""
    spell = _spelling(impl)
    if spell is None or not impl.target:
        return None
    module, _, name = impl.target.partition(":")
    if "." in name:
        return None
    batch = pack(case, "cpu")
    cu_q, cu_k = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    starts_q, starts_k = batch.cu_seqlens_q_padded.tolist()[:-1], batch.cu_seqlens_k_padded.tolist()[:-1]
    padded = case.padded_q is not None or case.padded_k is not None
    device = impl.device.type
    lines = [
        f"# {finding.check}: {finding.evidence}",
        f"# Plain torch: the layout, {whose(impl)}, the fp64 answer per sequence, the damaged rows.",
        "import torch",
        "",
        "torch.use_deterministic_algorithms(True, warn_only=True)  # with the next line: fresh buffers are NaN-filled,",
        "torch.utils.deterministic.fill_uninitialized_memory = True  # so rows a kernel never writes read as NaN",
        f'dev, dt = "{device}", torch.{case.dtype}',
        f"H, H_kv, causal, scale = {case.heads}, {case.kv_heads or case.heads}, {case.causal}, None",
        f"D, D_v = {case.head_dim}, {case.value_head_dim}  # head dims of q and k, of v",
        f"window = {case.window}  # window_size=(left, right), FlashAttention's; (-1, -1): none",
        f"backward = {impl.backward}" + ("" if impl.backward else f"  # forward only: {impl.lacks['backward'].split(':')[0]}"),
        f"cu_q = torch.tensor({cu_q}, dtype=torch.int32, device=dev)  # real boundaries",
        f"cu_k = torch.tensor({cu_k}, dtype=torch.int32, device=dev)",
        f"starts_q, starts_k = {starts_q}, {starts_k}  # first row of each sequence"
        + (" (padded layout: GAP rows between)" if padded else ""),
        "lens_q, lens_k = cu_q.diff().tolist(), cu_k.diff().tolist()",
        f"rows_q, rows_k = {batch.q.shape[0]}, {batch.k.shape[0]}  # rows after the last sequence are TAIL padding",
        "max_q, max_k = max(lens_q + [0]), max(lens_k + [0])",
    ]
    if padded:
        pad_q, pad_k = batch.cu_seqlens_q_padded.tolist(), batch.cu_seqlens_k_padded.tolist()
        lines.append(
            f"cu_q_pad, cu_k_pad = torch.tensor({pad_q}, dtype=torch.int32, device=dev), torch.tensor({pad_k}, dtype=torch.int32, device=dev)"
        )
    else:
        lines.append("cu_q_pad = cu_k_pad = None")
    lines += [
        f'fill = "{case.fill.value}"  # what the padding rows hold',
        "fill_value = lambda x: "
        + ("torch.randn_like(x) * 1e4" if case.fill is Fill.GARBAGE else f"torch.full_like(x, {_FILL_SOURCE[case.fill]})"),
        f"g = torch.Generator().manual_seed({case.seed})",
        "def make(rows, heads, dim, starts, lens):",
        "    x = torch.randn(rows, heads, dim, generator=g).to(dev, dt)",
        "    real = torch.zeros(rows, dtype=torch.bool, device=dev)",
        "    for s, n in zip(starts, lens):",
        "        real[s : s + n] = True",
        "    x = torch.where(real[:, None, None], x, fill_value(x))",
        "    return x.requires_grad_(backward), real",
        "q, real_q = make(rows_q, H, D, starts_q, lens_q)",
        "k, real_k = make(rows_k, H_kv, D, starts_k, lens_k)",
        "v, _ = make(rows_k, H_kv, D_v, starts_k, lens_k)",
        *_VISIBLE.splitlines(),
        "",
        *spell(module, name),
        "d_out = torch.randn(out.shape, generator=g).to(dev, dt)",
        "if out.requires_grad:  # an output that depends on no input (no real query row) has zero gradients",
        "    out.backward(d_out)",
        "grad = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)",
        "got = {'out': out.detach(), 'dq': grad(q), 'dk': grad(k), 'dv': grad(v)}",
        "",
        "# The fp64 answer, sequence by sequence (bottom-right causal and window, padding rows 0; a row that sees no key: 0).",
        "q64, k64, v64 = (t.detach().double().nan_to_num(0.0).requires_grad_() for t in (q, k, v))",
        "ref = q64.new_zeros(rows_q, H, D_v) + 0 * q64.sum()  # in the graph even without a real row",
        "for s, n, t, m in zip(starts_q, lens_q, starts_k, lens_k):",
        "    if n == 0 or m == 0:",
        "        continue",
        "    kk, vv = (x[t : t + m].repeat_interleave(H // H_kv, 1) for x in (k64, v64))",
        "    w = torch.einsum('qhd,khd->hqk', q64[s : s + n], kk) * (scale or D**-0.5)",
        "    ok = visible(n, m)",
        "    sees = ok.any(-1, keepdim=True)",
        "    w = w.masked_fill(~ok, float('-inf')).masked_fill(~sees, 0.0)  # no NaN, forward or backward",
        "    ref[s : s + n] = torch.einsum('hqk,khd->qhd', torch.softmax(w, -1) * sees, vv)",
        "if ref.requires_grad:",
        "    ref.backward(torch.where(real_q[:, None, None], d_out.double(), 0.0))",
        "want = {'out': ref.detach(), 'dq': grad(q64), 'dk': grad(k64), 'dv': grad(v64)}",
        "tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dt]",
        "for name, real in (('out', real_q), ('dq', real_q), ('dk', real_k), ('dv', real_k))[: 4 if backward else 1]:",
        "    x, y = got[name].double(), want[name]",
        "    err = (x - y).abs().flatten(1).amax(1)  # NaN where x is NaN",
        "    bad_real = (real & ~(err <= tol * (1 + y.abs().max()))).nonzero().flatten().tolist()",
        "    bad_pad = (~real & ~(x.flatten(1) == 0).all(1)).nonzero().flatten().tolist()",
        "    print(f'{name}: damaged REAL rows {bad_real}, padding rows not 0 {bad_pad}')",
    ]
    return "\n".join(lines)
