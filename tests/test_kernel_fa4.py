"""`varlen_attention(backend=...)`: the dispatch to FlashAttention-4 and the wrapper that keeps
the contract around it (kernels/varlen/fa4.py), on CPU with a stand-in for FA4.

The stand-in answers as FA4 4.0.0b36's private `_flash_attn_fwd` and `_flash_attn_bwd`
(flash_attn/cute/interface.py) do: cu_seqlens where sequences start in memory, seqused their
real rows, None an unbounded window side; the forward writes into the caller's `out` (T_q, H,
D) and `lse` (H, T_q) float32 and the backward into its `dq`, `dk`, `dv`, after the same shape
checks, and an empty q or k side is answered without a launch (out 0, lse -inf, gradients 0).
Values come from the float64 oracle, and it leaves what FA4 may leave: NaN on every padding row
it sees of out and of the gradients, garbage on lse's padding rows, +inf (FlashAttention's
convention) on rows that see no key. It also reads what FA4's tiles read, pessimistically:
every padding row of q, k, v and dO it is given enters every REAL row of out and of the
gradients with weight 0, so NaN or inf there makes them NaN, as on the H200
(data/gpu/audit-fa4.json, padding-leak). The wrapper must hand back the contract regardless.
"""

from __future__ import annotations

import functools

import pytest
import torch

import varlen_workbench.kernels.varlen.fa4 as fa4
from tests.test_kernel_varlen import nan_on_padding
from varlen_workbench.kernels import caches
from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted, use_interpreter
from varlen_workbench.kernels.varlen import VarlenMetadata, varlen_attention
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.layout import Case, Region, pack, region_labels
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.reference import reference_attention

GARBAGE = 12345.0


class _GarbageGradients(torch.autograd.Function):
    """Identity whose backward writes NaN into the gradients' padding rows, as FA4 may leave them."""

    @staticmethod
    def forward(ctx, q, k, v, q_padding, k_padding):
        ctx.save_for_backward(q_padding, k_padding)
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        q_padding, k_padding = ctx.saved_tensors
        nan = float("nan")
        return (
            dq.masked_fill(q_padding[:, None, None], nan),
            *(g.masked_fill(k_padding[:, None, None], nan) for g in (dk, dv)),
            None,
            None,
        )


class _ReadsPadding(torch.autograd.Function):
    """out unchanged on finite padding; 0 x (every padding row of q, k, v, and of dO in the
    backward) added to every REAL row of out and of dq, dk, dv: FA4's tiles multiplying the
    rows past a sequence's end by zero weights."""

    @staticmethod
    def forward(ctx, out, q, k, v, q_padding, k_padding):
        ctx.save_for_backward(q_padding, k_padding)
        ctx.shapes = (q.shape, k.shape, v.shape)
        ctx.read = 0 * (q[q_padding].float().sum() + k[k_padding].float().sum() + v[k_padding].float().sum())
        return out + ctx.read.to(out.dtype) * (~q_padding)[:, None, None]

    @staticmethod
    def backward(ctx, d_out):
        q_padding, k_padding = ctx.saved_tensors
        read = ctx.read + 0 * d_out[q_padding].float().sum()
        paddings = (q_padding, k_padding, k_padding)
        on_real = [(read * (~padding)[:, None, None]).expand(shape) for padding, shape in zip(paddings, ctx.shapes)]
        return d_out, *on_real, None, None


def _padding(cu_starts: torch.Tensor, seqused: torch.Tensor | None, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(real boundaries, padding-row mask) of FA4's (cu_seqlens, seqused) description."""
    real = cu_starts if seqused is None else torch.nn.functional.pad(seqused.cumsum(0), (1, 0)).to(torch.int32)
    padded = None if seqused is None else cu_starts
    return real, (region_labels(real, padded, rows) != Region.REAL).to(cu_starts.device)


def _attend(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, window_size_left, window_size_right, **options):
    """(out, lse, q's padding rows) as FA4's kernels leave them, differentiable in q, k, v."""
    real_q, q_padding = _padding(cu_seqlens_q, seqused_q, q.shape[0])
    real_k, k_padding = _padding(cu_seqlens_k, seqused_k, k.shape[0])
    q, k, v = _GarbageGradients.apply(q, k, v, q_padding, k_padding)
    out, lse = reference_attention(
        q,
        k,
        v,
        real_q,
        real_k,
        options["max_seqlen_q"],
        options["max_seqlen_k"],
        cu_seqlens_q_padded=None if seqused_q is None else cu_seqlens_q,
        cu_seqlens_k_padded=None if seqused_k is None else cu_seqlens_k,
        causal=options["causal"],
        window_size=tuple(-1 if w is None else w for w in (window_size_left, window_size_right)),
        scale=options["softmax_scale"],
        return_lse=True,
    )
    out = _ReadsPadding.apply(out.to(q.dtype), q, k, v, q_padding, k_padding)
    return out.masked_fill(q_padding[:, None, None], float("nan")), lse.detach().float(), q_padding


class FakeFA4:
    """Stands for 4.0.0b36's `_flash_attn_fwd` and `_flash_attn_bwd`; records their calls."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.backward_calls: list[dict] = []
        self.kernels = fa4.Kernels(self.forward, self.backward)

    def forward(self, q, k, v, *, out, lse, **arguments):
        self.calls.append(
            dict(
                arguments,
                data_ptrs=[t.data_ptr() for t in (q, k, v)],
                rows=[t.shape[0] for t in (q, k, v)],
                out=out.untyped_storage().data_ptr(),  # the buffer it writes into (an empty view has no data_ptr)
                lse=lse.untyped_storage().data_ptr(),
            )
        )
        # FA4's checks of the buffers it is given (_validate_tensor, validate_output_layout)
        assert out.shape == (*q.shape[:2], v.shape[-1]) and out.dtype == q.dtype and out.stride(-1) == 1
        assert lse.shape == q.shape[1::-1] and lse.dtype == torch.float32 and lse.stride(-1) == 1
        if q.shape[0] == 0 or k.shape[0] == 0:  # FA4 answers an empty side without a launch
            out.zero_()
            lse.fill_(float("-inf"))
            return out, lse, None, None, None
        result, reference_lse, q_padding = _attend(q, k, v, **arguments)
        out.copy_(result)
        lse.copy_(
            torch.where(reference_lse == float("-inf"), float("inf"), reference_lse).masked_fill(q_padding[None, :], GARBAGE)
        )
        return out, lse, None, None, None

    def backward(self, q, k, v, out, dout, lse, *, dq, dk, dv, **arguments):
        self.backward_calls.append(
            dict(buffers=[t.untyped_storage().data_ptr() for t in (dq, dk, dv)], rows=[t.shape[0] for t in (dq, dk, dv)])
        )
        assert out.shape == dout.shape == (*q.shape[:2], v.shape[-1]) and lse.shape == q.shape[1::-1]
        assert all(g.shape == t.shape and g.dtype == t.dtype for g, t in zip((dq, dk, dv), (q, k, v)))
        if q.shape[0] == 0 or k.shape[0] == 0:
            return dq.zero_(), dk.zero_(), dv.zero_()
        assert not (lse == float("-inf")).any(), "FA4's backward reads its own lse: +inf, not -inf, where no key is seen"
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            result, _, _ = _attend(*leaves, **arguments)
            grads = torch.autograd.grad(result, leaves, dout)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(grad)
        return dq, dk, dv


@pytest.fixture
def fake_fa4(monkeypatch) -> FakeFA4:
    fake = FakeFA4()
    monkeypatch.setattr(fa4, "load", lambda: fake.kernels)
    monkeypatch.setattr(fa4, "platform_reason", lambda q: None)  # as on an H200
    monkeypatch.setattr(fa4, "device_capability", lambda device: (9, 0))
    return fake


# GAP and TAIL rows on both sides, an empty key side (rows that see no key), GQA, bf16 and fp16.
PADDED = Case(
    (5, 0, 7),
    seqlens_k=(4, 3, 0),
    padded_q=(8, 2, 7),
    padded_k=(4, 5, 1),
    tail_q=3,
    tail_k=2,
    heads=2,
    head_dim=64,
    dtype="bfloat16",
)
CAUSAL = Case((9, 3), seqlens_k=(4, 6), align=4, tail_q=1, heads=4, kv_heads=2, head_dim=64, causal=True, dtype="float16")
# Documents past varlen_workbench.kernels.varlen.backends.SHORT_DOCUMENTS, TAIL rows only: "auto" takes FA4.
LONGER = Case((300, 20), seqlens_k=(300, 20), tail_q=3, tail_k=3, heads=2, head_dim=64, dtype="float16")
# TAIL rows only (a batch padded to a fixed size): FA4 gets views that end at the last real row.
TAIL = Case((6, 0, 9), seqlens_k=(7, 2, 5), tail_q=3, tail_k=4, heads=4, kv_heads=2, head_dim=64, dtype="bfloat16")


@pytest.mark.parametrize(
    "case, window",
    [
        (PADDED, (-1, -1)),
        (CAUSAL, (-1, -1)),
        (PADDED, (2, 1)),
        (TAIL, (-1, -1)),
        (TAIL.with_(causal=True), (3, 0)),
        (TAIL.with_(seqlens_k=(0, 0, 0)), (-1, -1)),
    ],
    ids=["padded", "causal-gqa", "window", "tail-only", "tail-only-causal-window", "tail-only-no-real-key"],
)
def test_the_fa4_wrapper_keeps_the_contract(fake_fa4, case, window):
    """Real rows (and their gradients) within bound of the oracle, every padding row exactly 0,
    under poisoned memory and NaN gradients on padding rows, whatever FA4 left there."""
    batch = pack(case)
    record = probe(varlen_attention, batch, grad_out=nan_on_padding(batch), poisoned=True, backend="fa4", window_size=window)
    assert len(fake_fa4.calls) == 1
    assert record.real_within_bound, "\n".join(map(str, record.errors.values()))
    assert record.padding_exactly_zero, record.max_abs


def test_fa4_gets_the_layout_as_padded_starts_and_real_lengths(fake_fa4):
    batch = pack(PADDED)
    batch.call(varlen_attention, backend="fa4", window_size=(3, -1))
    call = fake_fa4.calls[0]
    assert torch.equal(call["cu_seqlens_q"], batch.cu_seqlens_q_padded)
    assert call["seqused_q"].tolist() == [5, 0, 7] and call["seqused_k"].tolist() == [4, 3, 0]
    assert (call["window_size_left"], call["window_size_right"]) == (3, None)
    causal = pack(CAUSAL)
    varlen_attention(*causal.args(), causal=True, backend="fa4")  # no padded boundaries: every row is real
    # no seqused where no padding lies between sequences (natively FA4 gets the device check's
    # safe copies, other tensors than the caller's, and still no seqused)
    assert fake_fa4.calls[1]["seqused_q"] is None and fake_fa4.calls[1]["seqused_k"] is None
    assert fake_fa4.calls[1]["causal"]


@pytest.mark.slow  # every check and 8 fuzzed layouts; the fast loop keeps the contract tests above
@pytest.mark.skipif(
    not interpreted(default_device()),
    reason="its Triton fallback runs on CPU tensors under the interpreter only; "
    "on a GPU, data/gpu/audit-ours-fa4.json audits the real FA4 behind the wrapper",
)
def test_the_guarded_path_passes_the_audit_on_the_stand_in(fake_fa4):
    """`varlen-workbench audit varlen_workbench.kernels.varlen:varlen_attention_fa4`, every check and a few fuzzed layouts, on
    the CPU: what the H200 audit of the real FA4 behind the wrapper must also find."""
    import dataclasses

    from varlen_workbench.kernels.varlen import varlen_attention_fa4
    from varlen_workbench.workbench.audit import ADAPTERS, adapt, audit

    adapter = ADAPTERS["ours-fa4"]
    anywhere = dataclasses.replace(  # the adapter less its CUDA-only limit: the stand-in runs on the CPU
        adapter, lacks=lambda fn, device: {k: v for k, v in adapter.lacks_for(fn, device).items() if k != "run"}
    )
    report = audit(adapt(varlen_attention_fa4, anywhere, "cpu"), budget=8)
    assert report.passed and report.validation == "validates", report.table()
    assert report.fuzz is not None and report.fuzz.tried == 8 and not report.fuzz.failures
    assert {r.verdict.value for r in report.results} == {"pass", "validates"}, report.table()
    assert fake_fa4.calls and {len(c["data_ptrs"]) for c in fake_fa4.calls} == {3}


def test_fa4_reads_copies_only_of_a_side_with_gap_rows(fake_fa4):
    """A side with padding between sequences (GAP rows) goes to FA4 as a copy with them zeroed;
    a side whose padding is TAIL rows only as a view of the caller's tensor that ends at its last
    real row; a side without padding as the caller's own tensor: only GAP rows cost a copy."""
    tail_q = pack(Case((5, 3), seqlens_k=(4, 6), tail_q=2, heads=2, head_dim=64, dtype="bfloat16"))
    tail_q.call(varlen_attention, backend="fa4")
    call = fake_fa4.calls[0]
    assert call["data_ptrs"] == [t.data_ptr() for t in (tail_q.q, tail_q.k, tail_q.v)]
    assert call["rows"] == [8, 10, 10]  # q's 2 TAIL rows left out
    gap_k = pack(Case((5, 3), seqlens_k=(4, 6), padded_k=(6, 6), heads=2, head_dim=64, dtype="bfloat16"))
    gap_k.call(varlen_attention, backend="fa4")
    q, k, v = fake_fa4.calls[1]["data_ptrs"]
    assert q == gap_k.q.data_ptr() and k != gap_k.k.data_ptr() and v != gap_k.v.data_ptr()


@pytest.mark.parametrize("case", [TAIL, TAIL.with_(seqlens_k=(0, 0, 0))], ids=["tail-only", "no-real-key"])
def test_a_tail_only_side_costs_no_appended_copy(fake_fa4, case):
    """FA4 writes out and the gradients into views (up to the last real row) of the full-size
    tensors the wrapper returns: no TAIL row is appended by a copy, and under poisoned memory
    the TAIL rows FA4 never sees are exactly 0. An all-TAIL key side reaches FA4 empty."""
    batch = pack(case).fresh()
    real = int(batch.cu_seqlens_q[-1]), int(batch.cu_seqlens_k[-1])
    with poisoned_memory():
        out = batch.call(varlen_attention, backend="fa4")
        grads = torch.autograd.grad(out, (batch.q, batch.k, batch.v), nan_on_padding(batch))
    (forward,), (backward,) = fake_fa4.calls, fake_fa4.backward_calls
    assert forward["rows"] == backward["rows"] == [real[0], real[1], real[1]]
    assert forward["out"] == out.data_ptr() and backward["buffers"] == [g.data_ptr() for g in grads]
    for tensor, rows in zip((out, *grads), (real[0], *real, real[1])):
        assert (tensor[rows:] == 0).all() and tensor[:rows].isfinite().all()
    expected = batch.call(reference_attention)
    torch.testing.assert_close(out[: real[0]].double(), expected[: real[0]], atol=2e-2, rtol=2e-2)


def test_the_fa4_layout_is_read_off_the_host_check_once():
    """Boundaries in host memory are checked on the host, which gives FA4's layout for free: the
    real rows of each side, and FA4's seqused on a side with GAP rows only (padded boundaries
    equal to the real ones say the same layout without it). Built once per batch."""
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    padded_k = torch.tensor([0, 6, 11], dtype=torch.int32)
    batch = VarlenMetadata(
        cu_q, cu_k, 3, 5, cu_seqlens_q_padded=cu_q.clone(), cu_seqlens_k_padded=padded_k, total_q=6, total_k=12
    )
    layout = fa4.fa4_layout(batch)
    assert (layout.real_q, layout.real_k, layout.seqused_q) == (5, 9, None) and layout.seqused_k.tolist() == [4, 5]
    assert fa4.fa4_layout(batch) is layout  # kept by the backend (kernels/caches.py), not on the object
    assert not any(isinstance(value, fa4.Fa4Layout) for value in vars(batch).values())
    assert batch.has_gaps() == (False, True) and batch.padding_to_fill()


@pytest.fixture
def host_reads(fake_fa4, monkeypatch) -> list[int]:
    """The native path, the metadata checked by the device kernel (here under the interpreter),
    nothing remembered, and every host read of a tensor's values counted (`tolist`, `item`):
    for each, how many FA4 forwards had run before it. The stand-in's own reads (its float64
    oracle) are not the wrapper's and go uncounted."""
    import varlen_workbench.kernels.varlen.metadata as metadata

    monkeypatch.setattr(metadata, "checks_on_device", lambda boundary: True)
    monkeypatch.setattr(caches, "LAST", caches.Memo())
    reads: list[int] = []
    in_stand_in = [False]

    def counting(read):
        def counted(tensor, *args):
            if not in_stand_in[0]:
                reads.append(len(fake_fa4.calls))
            return read(tensor, *args)

        return counted

    def uncounted(kernel):
        def run(*args, **kwargs):
            in_stand_in[0] = True
            try:
                return kernel(*args, **kwargs)
            finally:
                in_stand_in[0] = False

        return run

    for name in ("tolist", "item"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    monkeypatch.setattr(fake_fa4, "kernels", fa4.Kernels(uncounted(fake_fa4.forward), uncounted(fake_fa4.backward)))
    return reads


def test_the_fa4_path_reads_the_device_once_per_new_metadata(host_reads, fake_fa4):
    """New metadata: one read, before FA4 runs, of the device check's verdict and FA4's layout
    together; the same metadata again (the layers of one step): none. The layout FA4 gets is
    the check's: real rows up to the last, seqused where GAP rows lie."""
    batch, tail = pack(PADDED), pack(TAIL)
    grad = nan_on_padding(batch)
    host_reads.clear()  # packing reads the layouts on the host
    for _ in range(2):
        out = batch.fresh().call(varlen_attention, backend="fa4")
    out.backward(grad)
    assert host_reads == [0]
    for call in fake_fa4.calls:
        assert call["rows"] == [batch.q.shape[0], batch.k.shape[0], batch.k.shape[0]]  # GAP rows on both sides: copies
        assert call["seqused_q"].tolist() == [5, 0, 7] and call["seqused_k"].tolist() == [4, 3, 0]
    host_reads.clear()
    tail.call(varlen_attention, backend="fa4")
    assert host_reads == [2]
    assert fake_fa4.calls[2]["rows"] == [15, 14, 14]  # TAIL rows only: views up to the last real row
    assert fake_fa4.calls[2]["seqused_q"] is None and fake_fa4.calls[2]["seqused_k"] is None


def test_malformed_metadata_raises_before_fa4_runs(host_reads, fake_fa4):
    """The device check's verdict is read before FA4 is called: a malformed call raises the host
    check's error, and FA4 never runs, not even on the check's all-padding safe copy."""
    import dataclasses

    batch = pack(PADDED)
    bad = batch.cu_seqlens_q_padded.clone()
    bad[-1] = 10**6
    malformed = dataclasses.replace(batch, cu_seqlens_q_padded=bad).fresh()
    host_reads.clear()
    with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
        malformed.call(varlen_attention, backend="fa4")
    assert not fake_fa4.calls and host_reads == [0]


@pytest.mark.parametrize("case", [PADDED, TAIL], ids=["padded", "tail-only"])
def test_a_returned_lse_is_minus_inf_on_padding_and_keyless_rows(fake_fa4, case):
    batch = pack(case)
    with torch.no_grad():  # a differentiable lse runs on the Triton kernel
        _, lse = batch.call(varlen_attention, backend="fa4", return_lse=True)
        _, expected = batch.call(reference_attention, return_lse=True)
    assert fake_fa4.calls
    keyless = expected == float("-inf")  # padding rows (and in PADDED the rows of sequence 2: no key)
    assert keyless.any() and torch.equal(lse == float("-inf"), keyless)
    torch.testing.assert_close(lse[~keyless].double(), expected[~keyless], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(dtype="float32"), "float16 and bfloat16 only"),
        (dict(head_dim=192), r"head dims 192 \(q, k\) and 192 \(v\): FA4 on sm100 takes .* 192/128"),
    ],
)
def test_what_fa4_cannot_express_runs_on_triton_under_auto_and_is_refused_under_fa4(fake_fa4, monkeypatch, change, reason):
    monkeypatch.setattr(fa4, "device_capability", lambda device: (10, 0))  # a B200: FA4 takes 192 with v of 128 only
    batch = pack(CAUSAL.with_(**change))
    with use_interpreter():  # "auto" as on a GPU: on CPU tensors the torch backend outranks the Triton kernel
        out = batch.call(varlen_attention, backend="auto")
    assert not fake_fa4.calls and torch.equal(out, batch.call(varlen_attention, backend="triton"))
    with pytest.raises(ValueError, match=rf'backend="fa4" cannot run this call: .*{reason}.*backend="auto"'):
        batch.call(varlen_attention, backend="fa4")


@pytest.mark.parametrize(
    "major, dims, takes",
    [
        (9, (48, None), True),
        (9, (192, 128), True),
        (9, (256, 40), True),
        (10, (96, None), True),
        (10, (192, 128), True),
        (10, (128, 192), False),
        (10, (256, 128), False),
    ],
    ids=str,
)
def test_auto_takes_fa4_at_the_head_dims_fa4_takes_on_the_gpu(fake_fa4, monkeypatch, major, dims, takes):
    """FA4's own rule (its _validate_head_dims): on sm90 every head dim of ours, q/k's and v's
    apart; on sm100 up to 128 each, or 192/128 (DeepSeek) and 256/256. The contract holds either way."""
    monkeypatch.setattr(fa4, "device_capability", lambda device: (major, 0))
    head_dim, head_dim_v = dims
    batch = pack(LONGER.with_(head_dim=head_dim, head_dim_v=head_dim_v))  # the rule's pick is FA4 where FA4 can run it
    with use_interpreter():  # "auto" as on a GPU: on CPU tensors the torch backend outranks the Triton kernel
        out = batch.call(varlen_attention, backend="auto")
    assert out.shape == (batch.q.shape[0], 2, head_dim_v or head_dim)
    assert bool(fake_fa4.calls) == takes
    assert fa4.fa4_takes_head_dims(head_dim, head_dim_v or head_dim, major) == takes
    if takes:
        record = probe(functools.partial(varlen_attention, backend="fa4"), batch, poisoned=True)
        assert record.real_within_bound and record.padding_exactly_zero, record.errors


def test_fa4_head_dim_rule_is_fa4s():
    takes = fa4.fa4_takes_head_dims
    assert all(takes(d, v, 9) for d in range(8, 257, 8) for v in (8, 128, 256))
    assert not any(takes(d, 64, 9) for d in (4, 20, 264))
    assert takes(128, 128, 10) and takes(192, 128, 10) and takes(256, 256, 10)
    assert not takes(192, 192, 10) and not takes(160, 128, 10) and not takes(256, 128, 10)


@pytest.mark.parametrize(
    "case, on_fa4",
    [
        (LONGER, True),  # no GAP rows, no GQA, a document past SHORT_DOCUMENTS: FA4
        (LONGER.with_(padded_q=(300, 24)), False),  # GAP rows: the wrapper's copies cost more than FA4 saves
        (LONGER.with_(kv_heads=1), False),  # GQA on documents under GQA_SHORT_ROWS rows on average
        (TAIL.with_(kv_heads=None), False),  # every document short: both host-bound, ours the faster
    ],
    ids=["tail-only", "gap-rows", "gqa-short-documents", "short-documents"],
)
def test_the_default_takes_the_faster_backend_by_the_rule(fake_fa4, case, on_fa4):
    """backend="auto", the default, runs FA4 where it can run the call and the record's rule
    (varlen_workbench.kernels.varlen.backends) says FA4 is the faster; the Triton kernel elsewhere."""
    batch = pack(case)
    with use_interpreter():  # "auto" as on a GPU: on CPU tensors the torch backend outranks the Triton kernel
        out = batch.call(varlen_attention)
        assert bool(fake_fa4.calls) == on_fa4
        if not on_fa4:
            assert torch.equal(out, batch.call(varlen_attention, backend="triton"))
            return
        fresh = batch.fresh(requires_grad=True)
        fresh.call(varlen_attention, return_lse=True, backend="auto")  # lse with a gradient: ours
        fresh.call(varlen_attention, validate=False, backend="auto")  # max_seqlen unchecked: ours
    assert len(fake_fa4.calls) == 1
    with pytest.raises(ValueError, match="lse carries no gradient"):
        fresh.call(varlen_attention, return_lse=True, backend="fa4")


@pytest.fixture
def uncached_load():
    """`fa4.load` asked afresh (it caches its answer), and its cache emptied again after the test."""
    fa4.load.cache_clear()
    yield
    fa4.load.cache_clear()


@pytest.mark.parametrize(
    "installed, reason",
    [
        (None, r"flash-attn-4 is not installed \(pip install"),
        (
            "4.0.0b40",
            r"flash-attn-4 4.0.0b40 is installed; the FA4 path is built on 4.0.0b36's private .*'flash-attn-4==4.0.0b36'",
        ),
    ],
    ids=["not-installed", "other-release"],
)
def test_without_the_pinned_fa4_auto_runs_triton_and_fa4_is_a_clear_error(monkeypatch, uncached_load, installed, reason):
    monkeypatch.setattr(fa4, "installed_version", lambda: installed)  # also where flash-attn-4 is installed
    monkeypatch.setattr(fa4, "platform_reason", lambda q: None)  # as on an H200
    batch = pack(CAUSAL)
    with use_interpreter():  # "auto" as on a GPU: on CPU tensors the torch backend outranks the Triton kernel
        auto = batch.call(varlen_attention, backend="auto")
    assert torch.equal(auto, batch.call(varlen_attention, backend="triton"))
    with pytest.raises(ValueError, match=rf'backend="fa4" cannot run this call: {reason}'):
        batch.call(varlen_attention, backend="fa4")
    with pytest.raises(ValueError, match="backend = 'flash' is not one of 'auto', 'triton', 'fa4', 'torch'"):
        batch.call(varlen_attention, backend="flash")


# -- the real FA4 (on an sm90/sm100 GPU with flash-attn-4 installed) --------------------------

REAL_CASES = {
    "padded-tail-empty": Case(
        (300, 0, 77),
        seqlens_k=(129, 40, 0),
        padded_q=(320, 8, 80),
        tail_q=5,
        tail_k=3,
        heads=4,
        kv_heads=2,
        head_dim=128,
        dtype="bfloat16",
    ),
    "causal-len_q>len_k": Case(
        (200, 9, 513), seqlens_k=(60, 9, 700), align=8, heads=2, head_dim=128, causal=True, dtype="bfloat16"
    ),
    "d64-fp16-gqa": Case((64, 129), seqlens_k=(64, 300), tail_q=2, heads=8, kv_heads=1, head_dim=64, dtype="float16"),
    # TAIL rows only: FA4 writes into views of the returned buffers (438 rows, not a multiple of
    # 4: FA4's backward copies lse's view), and a key side of TAIL rows only (an empty view).
    "tail-only-both-sides": Case(
        (300, 77), seqlens_k=(129, 40), tail_q=61, tail_k=37, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16"
    ),
    "tail-only-no-real-key": Case((33, 20), seqlens_k=(0, 0), tail_q=3, tail_k=9, heads=2, head_dim=64, dtype="bfloat16"),
    # Head dims FA4 takes beyond 64 and 128 (where the GPU at hand takes them: sm100 not 48/192-192).
    "d48-gap": Case((130, 7), padded_q=(136, 8), tail_k=3, heads=4, kv_heads=2, head_dim=48, dtype="bfloat16"),
    "d96-causal-fp16": Case((77, 300), seqlens_k=(200, 300), tail_q=2, heads=2, head_dim=96, causal=True, dtype="float16"),
    "d192-v128-mla": Case(
        (257, 64), seqlens_k=(300, 9), padded_k=(304, 9), heads=4, kv_heads=1, head_dim=192, head_dim_v=128, dtype="bfloat16"
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(-1, -1), (64, 0), (0, 0)], ids=str)
@pytest.mark.parametrize("name", REAL_CASES)
def test_real_fa4_behind_the_wrapper_keeps_the_contract(name, window):
    """The wrapper on the installed FA4: poisoned memory, NaN padding in q, k, v and dO."""
    batch = pack(REAL_CASES[name])
    reason = fa4.unsupported(batch.q, batch.k, batch.v, (batch.cu_seqlens_q,), return_lse=False, validate=True)
    if reason:
        pytest.skip(reason)
    record = probe(varlen_attention, batch, grad_out=nan_on_padding(batch), poisoned=True, backend="fa4", window_size=window)
    assert record.real_within_bound, "\n".join(map(str, record.errors.values()))
    assert record.padding_exactly_zero, record.max_abs
    with torch.no_grad():
        _, lse = batch.call(varlen_attention, backend="fa4", window_size=window, return_lse=True)
        _, expected = batch.call(reference_attention, window_size=window, return_lse=True)
    assert torch.equal(lse == float("-inf"), expected == float("-inf"))  # padding and keyless rows
