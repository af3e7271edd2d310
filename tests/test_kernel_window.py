"""Sliding windows (`window_size=(left, right)`) and the `varlen_attn`-shaped entry point, by the
criteria of torch's own varlen tests, re-stated:

- through a small attention block (qkv projection, attention, output projection), every
  sequence's output and input gradient is within 2x the error that SDPA with an explicit mask
  makes in the same dtype, both measured against the same block in fp32 (plus the fp32
  rounding floor torch's test allows);
- permuting the sequences of a batch permutes every sequence's output and gradients bitwise;
- the 11 window shapes torch's test_varlen_attention.py parametrizes, in fp16 and bf16 (bf16
  under the interpreter goes through the kernel's upcast path).

Plus the padding contract with windows (poisoned memory, NaN padding, rows that see no key)
and the argument checks. Under the interpreter the cases stay tiny; natively they take torch's
sizes (4 sequences of up to 1024 tokens, 16 heads of 64).
"""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from tests.test_kernel_varlen import assert_contract, fast_only, varlen_attention
from varlen_workbench.kernels import caches
from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen import AuxRequest, varlen_attn
from varlen_workbench.kernels.varlen import varlen_attention as default_attention  # varlen_attn's backend: auto
from varlen_workbench.workbench.bounds import lse_error
from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.reference import reference_attention, visible_keys

# The window shapes of torch's test_varlen_vs_sdpa (pytorch/pytorch test/test_varlen_attention.py).
TORCH_WINDOWS = [(-1, -1), (-1, 0), (4, 0), (-1, 4), (0, 0), (1, 0), (0, 1), (0, -1), (4, 4), (8, 2), (1025, 1025)]
DEVICE = default_device()
ON_INTERPRETER = interpreted(DEVICE)  # the interpreter: small sizes


# -- the padding contract with windows -----------------------------------------------------

# Padding everywhere, len_q > len_k (rows that see no key once the window is bounded),
# len_q < len_k, an empty sequence, GQA; lengths past one 64-row block so that the window's
# block skipping and its masked edges both run.
WINDOW_CASE = Case(
    (70, 0, 9, 130), seqlens_k=(70, 4, 20, 97), align=8, tail_q=3, tail_k=2, heads=2, kv_heads=1, head_dim=16, dtype="float16"
)


@pytest.mark.parametrize("window", fast_only(TORCH_WINDOWS, {(-1, 0), (0, 0), (8, 2)}), ids=str)
def test_windows_keep_the_contract(window):
    assert_contract(WINDOW_CASE, window_size=window)


@pytest.mark.parametrize("window", fast_only([(3, 0), (0, 2), (16, -1)], {(3, 0)}), ids=str)
def test_windows_combine_with_causal_and_bf16(window):
    """causal=True bounds the right side at 0 (FlashAttention's rule), whatever right says."""
    assert_contract(WINDOW_CASE.with_(causal=True, dtype="bfloat16"), window_size=window)


def test_causal_is_window_minus_one_zero_bitwise():
    batch = pack(WINDOW_CASE.with_(fill=Fill.ZEROS), requires_grad=False)
    by_flag = batch.call(varlen_attention, causal=True)
    by_window = batch.call(varlen_attention, causal=False, window_size=(-1, 0))
    assert torch.equal(by_flag, by_window)


def test_rows_outside_every_window_give_zero_output_minus_inf_lse_and_zero_grads():
    """Window (0, 0) with len_q > len_k: the first len_q - len_k rows see no key (bottom-right)."""
    case = Case((12,), seqlens_k=(5,), tail_q=2, heads=1, head_dim=16, fill=Fill.NAN)
    batch = pack(case)
    out, lse = batch.call(varlen_attention, window_size=(0, 0), return_lse=True)
    blind = slice(0, 12 - 5)
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    assert torch.isneginf(lse[:, blind]).all()
    oracle_out, oracle_lse = batch.call(reference_attention, window_size=(0, 0), return_lse=True)
    assert lse_error(lse.detach(), oracle_lse.detach().float()) < 1e-4
    out.sum().backward()
    assert torch.equal(batch.q.grad[blind], torch.zeros_like(batch.q.grad[blind]))
    assert all(torch.isfinite(t.grad).all() for t in (batch.q, batch.k, batch.v))


def test_visible_keys_is_bottom_right_aligned():
    """Query i sees key j iff i + len_k - len_q - left <= j <= i + len_k - len_q + right."""
    for len_q, len_k, left, right in itertools.product((1, 3, 6), (1, 4, 6), (-1, 0, 2), (-1, 0, 1)):
        seen = visible_keys(len_q, len_k, (left, right))
        for i, j in itertools.product(range(len_q), range(len_k)):
            off = len_k - len_q
            expected = (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
            assert bool(seen[i, j]) == expected, (len_q, len_k, left, right, i, j)


# -- argument checks -----------------------------------------------------------------------


def _small():
    return pack(Case((5, 3), heads=1, head_dim=16, fill=Fill.ZEROS), requires_grad=False)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"causal": "yes"}, TypeError, r"causal must be a bool, got str 'yes'"),
        ({"causal": 1}, TypeError, r"causal must be a bool, got int"),
        ({"window_size": 4}, TypeError, r"window_size must be a \(left, right\) pair of ints"),
        ({"window_size": "4,0"}, TypeError, r"window_size must be a \(left, right\) pair"),
        ({"window_size": (4, 0, 1)}, ValueError, r"window_size must have 2 entries"),
        ({"window_size": (-2, 0)}, ValueError, r"window_size left bound = -2 is invalid"),
        ({"window_size": (0, -5)}, ValueError, r"window_size right bound = -5 is invalid"),
        ({"window_size": (1.5, 0)}, TypeError, r"window_size left bound must be an int, got float"),
        ({"window_size": (0, True)}, TypeError, r"window_size right bound must be an int, got bool"),
    ],
)
@pytest.mark.parametrize("validate", [True, False])
def test_bad_mask_arguments_name_themselves(kwargs, error, match, validate):
    """Also with validate=False: these checks need no sync, and a bad flag must never reach
    the op schema (whose RuntimeError names no argument)."""
    with pytest.raises(error, match=match):
        _small().call(varlen_attention, validate=validate, **kwargs)


def test_oracle_checks_the_window_too():
    with pytest.raises(ValueError, match="window_size left bound"):
        _small().call(reference_attention, window_size=(-3, 0))


# -- validate=True reads the metadata once --------------------------------------------------


def test_validation_is_remembered_for_the_same_unchanged_metadata(monkeypatch):
    from varlen_workbench.kernels import contract
    from varlen_workbench.kernels.varlen import metadata

    # A check of the boundary values is one host copy of all four (CPU) or one check kernel (natively).
    copies = []
    real, real_on_device = contract._to_host, metadata.check_on_device
    monkeypatch.setattr(caches, "LAST", caches.Memo())
    monkeypatch.setattr(contract, "_to_host", lambda tensors: copies.append(len(tensors)) or real(tensors))
    monkeypatch.setattr(metadata, "check_on_device", lambda *args: copies.append(4) or real_on_device(*args))
    batch = _small()
    batch.call(varlen_attention)
    batch.call(varlen_attention)
    assert copies == [4], "the same tensors, unchanged: checked once, in one copy of all four"
    batch.cu_seqlens_q.add_(0)  # an in-place write bumps the version counter: checked again
    batch.call(varlen_attention)
    assert len(copies) == 2
    fresh = batch.cu_seqlens_k.clone()
    batch.call(varlen_attention, cu_seqlens_k_padded=fresh)
    assert len(copies) == 3
    batch.cu_seqlens_q[1] = 7  # corrupted in place after a successful check: caught
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        batch.call(varlen_attention)


# -- varlen_attn: torch's signature and return convention -----------------------------------

# torch 2.11's varlen_attn (torch/nn/attention/varlen.py): later versions add keyword-only
# parameters after these (enable_gqa, seqused_k, block_table, num_splits).
TORCH_211_PARAMETERS = [
    ("query", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
    ("key", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
    ("value", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
    ("cu_seq_q", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
    ("cu_seq_k", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
    ("max_q", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
    ("max_k", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
    ("return_aux", "KEYWORD_ONLY", None),
    ("scale", "KEYWORD_ONLY", None),
    ("window_size", "KEYWORD_ONLY", (-1, -1)),
]


def _described(fn) -> list[tuple]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


# torch 2.13 adds these after them (the fixed kernel honours enable_gqa and refuses the rest).
TORCH_213_ADDED = [
    ("enable_gqa", "KEYWORD_ONLY", False),
    ("seqused_k", "KEYWORD_ONLY", None),
    ("block_table", "KEYWORD_ONLY", None),
    ("num_splits", "KEYWORD_ONLY", None),
]


def test_varlen_attn_has_torch_213s_signature():
    assert _described(varlen_attn) == TORCH_211_PARAMETERS + TORCH_213_ADDED


def test_varlen_attn_signature_matches_the_installed_torch():
    """One signature is the other's beginning (torch 2.11's is ours without 2.13's keyword-only
    additions): every call to the installed torch's works on ours."""
    varlen = pytest.importorskip("torch.nn.attention.varlen", reason="torch < 2.10 has no varlen_attn")
    theirs = _described(varlen.varlen_attn)
    ours = _described(varlen_attn)
    shorter = min(len(theirs), len(ours))
    assert theirs[:shorter] == ours[:shorter] and {p[0] for p in theirs} <= {p[0] for p in ours}, (theirs, ours)
    assert AuxRequest._fields == varlen.AuxRequest._fields


@pytest.mark.parametrize(
    "keyword, value, reason",
    [
        ("seqused_k", torch.tensor([3, 2], dtype=torch.int32), "KV-cache decoding"),
        ("block_table", torch.zeros(2, 1, dtype=torch.int32), "paged KV caches"),
        ("num_splits", 1, "split-KV"),
    ],
)
def test_varlen_attn_refuses_what_the_kernel_cannot_honour(keyword, value, reason):
    batch = _small()
    with pytest.raises(
        ValueError, match=rf"varlen_attn got {keyword}: the fixed kernel does not do {reason}.*leave {keyword} unset"
    ):
        varlen_attn(*batch.args(), **{keyword: value})
    with pytest.raises(ValueError, match="cu_seq_k=None"):
        varlen_attn(*batch.args()[:4], None, *batch.args()[5:])


def test_varlen_attn_takes_gqa_as_the_installed_torch_does():
    """torch 2.13's varlen_attn refuses GQA without enable_gqa=True; 2.11's has no flag."""
    batch = pack(Case((5, 3), heads=4, kv_heads=2, head_dim=16))
    out = varlen_attn(*batch.args(), enable_gqa=True)
    assert torch.equal(out, batch.call(default_attention))
    flag = "enable_gqa" in inspect.signature(pytest.importorskip("torch.nn.attention.varlen").varlen_attn).parameters
    if flag:
        with pytest.raises(ValueError, match="pass enable_gqa=True"):
            varlen_attn(*batch.args())
    else:
        assert torch.equal(varlen_attn(*batch.args()), out)


def test_varlen_attn_return_convention():
    batch = _small()
    args = batch.args()
    out = varlen_attn(*args)
    assert isinstance(out, torch.Tensor) and out.shape == batch.q.shape
    assert isinstance(varlen_attn(*args, return_aux=AuxRequest()), torch.Tensor)
    out2, lse = varlen_attn(*args, return_aux=AuxRequest(lse=True), window_size=(-1, 0))
    assert lse.shape == (batch.q.shape[1], batch.q.shape[0]) and lse.dtype == torch.float32
    assert torch.equal(out2, batch.call(default_attention, causal=True))
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    _, lse2 = varlen_attn(*args, return_aux=varlen.AuxRequest(lse=True), window_size=(-1, 0))  # torch's own request
    assert torch.equal(lse, lse2)


# -- torch's criteria, re-stated ------------------------------------------------------------

if ON_INTERPRETER:
    EMBED, HEADS, MAX_LEN, BATCH, UNIT = 32, 2, 48, 3, 16  # head dim 16, sequences of 16..48 tokens
else:
    EMBED, HEADS, MAX_LEN, BATCH, UNIT = 1024, 16, 1024, 4, 64  # torch's own sizes


class Block(torch.nn.Module):
    """qkv projection, attention, output projection: torch's test block, in our words."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.qkv = torch.nn.Linear(EMBED, 3 * EMBED, bias=False, device=DEVICE, dtype=dtype)
        self.out = torch.nn.Linear(EMBED, EMBED, bias=False, device=DEVICE, dtype=dtype)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.unflatten(-1, (HEADS, EMBED // HEADS)) for t in self.qkv(x).chunk(3, dim=-1))

    def varlen(self, x, cu, max_len, window, scale):
        q, k, v = self.heads(x)
        return self.out(varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=window).flatten(-2))

    def dense(self, x, lengths, window, scale):
        """SDPA on the padded batch with an explicit mask: padding keys and the window."""
        q, k, v = (t.transpose(1, 2) for t in self.heads(x))  # (B, H, S, D)
        seq = x.shape[1]
        mask = torch.arange(seq, device=x.device)[None, :] < lengths[:, None]  # (B, S) real keys
        mask = mask[:, None, None, :] & visible_keys(seq, seq, window, x.device)[None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.out(out.transpose(1, 2).flatten(-2))


def _lengths(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [int(torch.randint(1, MAX_LEN // UNIT + 1, (), generator=generator)) * UNIT for _ in range(BATCH)]


def _rounding_floor(golden: torch.Tensor) -> float:
    """torch's allowance for the fp32 golden's own rounding: 2 * |(g + 0.3) - 0.3 - g|."""
    golden = golden.detach()
    return 2 * float((golden + 0.3 - 0.3 - golden).abs().max())


def _within_twice_sdpa(name, ours, sdpa, golden, dtype):
    ours_error = float((ours.detach() - golden.to(dtype)).abs().max())
    sdpa_error = float((sdpa.detach() - golden.to(dtype)).abs().max())
    floor = _rounding_floor(golden)
    if ON_INTERPRETER:
        # The interpreter's tiny blocks make both errors a few roundings to `dtype`, so that one
        # rounding more flips the comparison: allow one unit in the last place of the largest
        # value. Natively, at torch's sizes, the bound is torch's own.
        floor = max(floor, torch.finfo(dtype).eps * float(golden.abs().max()))
    bound = 2 * sdpa_error + floor
    assert math.isfinite(ours_error) and ours_error <= bound, (
        f"{name}: ours {ours_error:.3g} > 2 x SDPA {sdpa_error:.3g} (+ floor)"
    )


def _criteria(dtype: torch.dtype, window: tuple[int, int], scale: float | None, seed: int = 0) -> None:
    torch.manual_seed(seed)
    lengths = _lengths(seed)
    longest, total = max(lengths), sum(lengths)
    golden_block = Block(torch.float32)
    block = Block(dtype)
    block.load_state_dict({k: v.to(dtype) for k, v in golden_block.state_dict().items()})
    x32 = torch.randn(total, EMBED, device=DEVICE)
    padded32 = torch.zeros(len(lengths), longest, EMBED, device=DEVICE)
    starts = [0, *itertools.accumulate(lengths)]
    for i, n in enumerate(lengths):
        padded32[i, :n] = x32[starts[i] : starts[i + 1]]
    x = x32.to(dtype).requires_grad_()
    padded = padded32.to(dtype).requires_grad_()
    golden_in = padded32.clone().requires_grad_()
    cu = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(lengths, device=DEVICE)

    ours = block.varlen(x, cu, longest, window, scale)
    sdpa = block.dense(padded, lens, window, scale)
    golden = golden_block.dense(golden_in, lens, window, scale)
    for i, n in enumerate(lengths):
        _within_twice_sdpa(f"out of sequence {i}", ours[starts[i] : starts[i + 1]], sdpa[i, :n], golden[i, :n], dtype)

    grad = torch.randn_like(ours)
    grad_padded = torch.zeros_like(sdpa)
    for i, n in enumerate(lengths):
        grad_padded[i, :n] = grad[starts[i] : starts[i + 1]]
    (d_ours,) = torch.autograd.grad(ours, x, grad)
    (d_sdpa,) = torch.autograd.grad(sdpa, padded, grad_padded)
    (d_golden,) = torch.autograd.grad(golden, golden_in, grad_padded.float())
    for i, n in enumerate(lengths):
        _within_twice_sdpa(f"dx of sequence {i}", d_ours[starts[i] : starts[i + 1]], d_sdpa[i, :n], d_golden[i, :n], dtype)


@pytest.mark.parametrize("window", fast_only(TORCH_WINDOWS, {(-1, 0), (8, 2)}), ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_within_twice_sdpa_error_through_an_attention_block(dtype, window):
    _criteria(dtype, window, scale=None)


@pytest.mark.parametrize("window", [(-1, 0), (8, 2)], ids=str)
def test_within_twice_sdpa_error_with_a_custom_scale(window):
    _criteria(torch.bfloat16, window, scale=0.1, seed=1)


@pytest.mark.parametrize(
    "window",
    fast_only([(-1, -1), (4, 4), (-1, 0), (0, -1)], {(4, 4)}),
    ids=str,
)
def test_batch_invariance_under_permutation(window):
    """Sequence i's output, lse and gradients are bitwise the same wherever it sits in the batch."""
    lengths = [37, 5, 70, 16] if ON_INTERPRETER else [1000, 17, 513, 64, 2048, 1]
    heads, kv_heads, head_dim = (2, 1, 16) if ON_INTERPRETER else (8, 2, 128)
    generator = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, heads + 2 * kv_heads, head_dim, generator=generator).to(torch.bfloat16) for n in lengths]
    grads = [torch.randn(n, heads, head_dim, generator=generator).to(torch.bfloat16) for n in lengths]

    def run(order):
        seqs = [xs[i] for i in order]
        qkv = torch.cat(seqs).to(DEVICE)
        q, k, v = (t.contiguous().requires_grad_() for t in qkv.split([heads, kv_heads, kv_heads], dim=1))
        cu = torch.tensor([0, *itertools.accumulate(len(s) for s in seqs)], dtype=torch.int32, device=DEVICE)
        longest = max(lengths)
        out, lse = varlen_attention(q, k, v, cu, cu, longest, longest, window_size=window, return_lse=True)
        out.backward(torch.cat([grads[i] for i in order]).to(DEVICE))
        bounds = cu.tolist()
        pieces = {}
        for slot, i in enumerate(order):
            rows = slice(bounds[slot], bounds[slot + 1])
            pieces[i] = (out[rows], lse[:, rows], q.grad[rows], k.grad[rows], v.grad[rows])
        return pieces

    identity = run(list(range(len(lengths))))
    permuted = run([2, 0, 3, 1] + list(range(4, len(lengths))))
    for i in range(len(lengths)):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), identity[i], permuted[i]):
            assert torch.equal(a, b), f"sequence {i}: {name} changes with its place in the batch"


def test_docstring_example_runs():
    """varlen_attention's docstring example, as doctest runs it."""
    import doctest

    from varlen_workbench.kernels.varlen import varlen_attention

    finder = doctest.DocTestFinder()
    (test,) = [t for t in finder.find(varlen_attention, "varlen_attention") if t.examples]
    result = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE).run(test, out=lambda _: None)
    assert result.attempted >= 5 and result.failed == 0
