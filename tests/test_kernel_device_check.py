"""validate=True's device check (kernels/varlen/device_check.py) decides as the host check does,
and `VarlenMetadata` raises its error when it says it does.

Natively, the boundary values are checked by a kernel; here the same kernel runs under the
interpreter, forced on the CPU, and must agree with the host check on every malformed call of
the catalogue, on valid layouts, and on random boundary vectors. A stand-in for the CUDA event
behind a check (`HeldEvent`) keeps it "running on the device" until a test lets it finish, to
show when its verdict is read: a positional call waits for it before it returns; a call on a
`VarlenMetadata` never waits in its forward, raises the error at the object's next use once the
device has reported it, at `check()`, and in its backward before any gradient leaves, and
until then its outputs are NaN. Calls pin the Triton kernel (`varlen_attention_triton`): on CPU
tensors "auto" is the torch backend, which waits for the verdict and launches none of this.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import varlen_workbench.kernels.varlen.metadata as metadata
from varlen_workbench.kernels import caches
from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.contract import check_cu_seqlens
from varlen_workbench.kernels.varlen import VarlenMetadata, varlen_attention_triton
from varlen_workbench.kernels.varlen.device_check import CHUNK, check_on_device
from varlen_workbench.kernels.varlen.launch import work_lists
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.malformed import CATALOGUE, base_args, split_call

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    """No metadata remembered from another test's positional calls."""
    monkeypatch.setattr(caches, "LAST", caches.Memo())


@pytest.fixture
def device_path(monkeypatch):
    """varlen_attention_triton as it runs natively: the metadata's values checked by the kernel."""
    monkeypatch.setattr(metadata, "checks_on_device", lambda boundary: True)


def _raised(call) -> tuple[type, str] | None:
    try:
        call()
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    return None


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_the_device_path_raises_what_the_host_path_raises(case, monkeypatch):
    positional, keywords = split_call(case.build(base_args(device=default_device())))
    monkeypatch.setattr(metadata, "checks_on_device", lambda boundary: False)
    host = _raised(lambda: varlen_attention_triton(*positional, **keywords))
    monkeypatch.setattr(metadata, "checks_on_device", lambda boundary: True)
    monkeypatch.setattr(caches, "LAST", caches.Memo())  # nothing remembered from the host call
    assert _raised(lambda: varlen_attention_triton(*positional, **keywords)) == host
    assert host is not None and host[0] is case.exception


def test_the_device_path_computes_what_the_host_path_computes(device_path):
    """...and takes numpy integers for max_seqlen, as the host check does (test_contract.py)."""
    args = base_args(device=default_device())
    args["max_seqlen_q"], args["max_seqlen_k"] = np.int64(args["max_seqlen_q"]), np.int32(args["max_seqlen_k"])
    positional, keywords = split_call(args)
    on_device = varlen_attention_triton(*positional, **keywords, return_lse=True)
    host = varlen_attention_triton(*positional, **keywords, return_lse=True, validate=False)
    for a, b in zip(on_device, host):
        assert torch.equal(a, b)


def test_a_failed_check_hands_the_kernels_all_zero_boundaries():
    """Every row is then padding: the kernels read no row and write nothing outside the tensors.
    The work lists the check writes are those of its safe copy: all zero after a failure."""
    args = base_args(device=default_device())
    bad_end = args["cu_seqlens_q_padded"].clone()
    bad_end[-1] = 10**6  # addresses rows far past q's end
    safe, check = check_on_device(args["cu_seqlens_q"], args["cu_seqlens_k"], bad_end, args["cu_seqlens_k_padded"], 15, 15, 9, 9)
    assert check.failed() and all(int(v.abs().sum()) == 0 for v in safe)
    assert int(_listed(check.work, 3).abs().sum()) == 0
    good = (args["cu_seqlens_q"], args["cu_seqlens_k"], args["cu_seqlens_q_padded"], args["cu_seqlens_k_padded"])
    safe, check = check_on_device(*good, 15, 15, 9, 9)
    assert not check.failed() and all(torch.equal(a, b) for a, b in zip(safe, good))
    assert torch.equal(_listed(check.work, 3), _listed(work_lists(*safe[:2]), 3))


def test_the_check_writes_the_work_lists_of_more_sequences_than_one_chunk():
    """The work lists the check writes, over more sequences than one step of its loops, empty
    ones included, are those `work_lists` makes for the same boundaries."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 40, (2, CHUNK + 300), generator=generator)
    lengths[:, ::7] = 0
    cu_q, cu_k = (torch.nn.functional.pad(n.cumsum(0), (1, 0)).to(torch.int32).to(default_device()) for n in lengths)
    (q, k, *_), check = check_on_device(cu_q, cu_k, None, None, int(cu_q[-1]), int(cu_k[-1]), 40, 40)
    assert not check.failed() and torch.equal(_listed(check.work, CHUNK + 300), _listed(work_lists(cu_q, cu_k), CHUNK + 300))


def _listed(work: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """The entries of work lists that say something (their rows are padded for alignment)."""
    return work[:, :, : n_seqs + 1]


def _host_verdict(vectors, totals, limits) -> bool:
    try:
        check_cu_seqlens(
            *vectors[:2],
            *limits,
            cu_seqlens_q_padded=vectors[2],
            cu_seqlens_k_padded=vectors[3],
            total_q=totals[0],
            total_k=totals[1],
        )
    except ValueError:
        return False
    return True


def test_random_boundaries_get_the_host_checks_verdict():
    """Small random vectors, most nearly valid (one nudge away), with and without padded ones;
    and the layout read with the verdict."""
    generator = np.random.default_rng(0)
    for trial in range(48):
        n = int(generator.integers(1, 5))
        vectors = []
        for _ in range(2):
            lengths = generator.integers(0, 5, n)
            padded = lengths + generator.integers(0, 3, n)
            vectors.append([np.concatenate([[0], np.cumsum(lengths)]), np.concatenate([[0], np.cumsum(padded)])])
        (q, qp), (k, kp) = vectors
        for v in (q, qp, k, kp):
            if generator.random() < 0.2:
                v[int(generator.integers(0, n + 1))] += int(generator.integers(-3, 4))
        dtype = torch.int64 if trial % 3 == 0 else torch.int32
        tensors = [torch.tensor(v, dtype=dtype, device=default_device()) for v in (q, k, qp, kp)]
        if trial % 2:
            tensors[2:] = [None, None]
        totals = [int(generator.integers(0, 25)) for _ in range(2)]
        limits = [int(generator.integers(0, 6)) for _ in range(2)]
        _, check = check_on_device(*tensors, *totals, *limits)
        passed = _host_verdict(tensors, totals, limits)
        assert (not check.failed()) == passed, (trial, tensors, totals, limits)
        # read with the verdict: the safe copy's layout (all zeros after a failure), as FA4 needs it
        real_q, real_k = (int(tensors[side][-1]) if passed else 0 for side in (0, 1))
        gaps = (passed and padded is not None and not torch.equal(real, padded) for real, padded in zip(tensors[:2], tensors[2:]))
        assert check.layout() == (real_q, real_k, *gaps), (trial, tensors)


def test_validation_inside_a_cuda_graph_capture_is_a_clear_error(monkeypatch):
    """The check waits on the device, which a capture forbids: say so instead of a CUDA error."""
    monkeypatch.setattr(metadata, "capturing", lambda: True)
    positional, keywords = split_call(base_args(device=default_device()))
    with pytest.raises(ValueError, match="a CUDA graph capture allows no wait; build the VarlenMetadata before capturing"):
        varlen_attention_triton(*positional, **keywords)


# -- when a failure surfaces ---------------------------------------------------------------------


class HeldEvent:
    """Stands for the CUDA event behind a check, on the CPU: `query()` is False until the test
    lets the check finish or something waits for it (`waits` counts the waits: a synchronize
    on a finished event waits for nothing)."""

    def __init__(self) -> None:
        self.finished, self.waits = False, 0

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.waits += not self.finished
        self.finished = True


@pytest.fixture
def held(device_path, monkeypatch):
    """The device path with every check still running on the device until released: the
    events of the checks launched, in order."""
    events: list[HeldEvent] = []

    def launch(*args):
        safe, check = check_on_device(*args)
        check.copied = events.append(HeldEvent()) or events[-1]
        return safe, check

    monkeypatch.setattr(metadata, "check_on_device", launch)
    return events


def _call(args: dict, **extra):
    positional, keywords = split_call(args)
    return varlen_attention_triton(*positional, **keywords, **extra)


BOUNDARIES = ("cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_q_padded", "cu_seqlens_k_padded")


def _metadata(args: dict) -> VarlenMetadata:
    """The VarlenMetadata of base_args' batch (its max_seqlen is 4 on both sides), rows bound: its
    check is launched at once."""
    q, k, q_padded, k_padded = (args[n] for n in BOUNDARIES)
    totals = {"total_q": args["q"].shape[0], "total_k": args["k"].shape[0]}
    return VarlenMetadata(q, k, 4, 4, cu_seqlens_q_padded=q_padded, cu_seqlens_k_padded=k_padded, **totals)


def _on(args: dict, batch: VarlenMetadata, **extra):
    """A call on `batch` with args' q, k, v."""
    return varlen_attention_triton(args["q"], args["k"], args["v"], metadata=batch, **extra)


def _malformed(requires_grad: bool) -> dict:
    """A call whose padded q layout ends past q's rows (the host check's message names it)."""
    args = base_args(device=default_device())
    args["cu_seqlens_q_padded"] = args["cu_seqlens_q_padded"].clone()
    args["cu_seqlens_q_padded"][-1] = 10**6
    for name in "qkv":
        args[name].requires_grad_(requires_grad)
    return args


def _host_message(args: dict) -> str:
    q, k, q_padded, k_padded = (args[n] for n in BOUNDARIES)
    totals = {"total_q": args["q"].shape[0], "total_k": args["k"].shape[0]}
    with pytest.raises(ValueError) as error:
        check_cu_seqlens(q, k, 4, 4, cu_seqlens_q_padded=q_padded, cu_seqlens_k_padded=k_padded, **totals)
    return str(error.value)


@pytest.mark.parametrize("grad", ["requires_grad", "no_grad"])
def test_a_positional_call_raises_before_it_returns(held, grad):
    """FlashAttention's and torch's behaviour: the call waits for its check, whatever follows."""
    args = _malformed(requires_grad=grad == "requires_grad")
    with pytest.raises(ValueError) as error:
        _call(args)
    assert held[0].waits == 1 and str(error.value) == _host_message(args)


def test_positional_calls_on_the_same_tensors_wait_once(held):
    """The layers of one step, called positionally with the very same tensors: one check, one wait."""
    args = base_args(device=default_device())
    for _ in range(3):
        _call(args)
    assert len(held) == 1 and held[0].waits == 1


def test_a_call_on_metadata_waits_only_in_its_backward(held):
    args = base_args(device=default_device())
    for name in "qkv":
        args[name].requires_grad_(True)
    batch = _metadata(args)
    out = _on(args, batch)
    assert len(held) == 1 and held[0].waits == 0  # forward returned without waiting for the check
    out.backward(torch.ones_like(out))
    assert held[0].waits == 1
    expected = [t.detach().clone().requires_grad_(True) for t in (args["q"], args["k"], args["v"])]
    reference = _call({**args, **dict(zip("qkv", expected))}, validate=False)
    reference.backward(torch.ones_like(reference))
    assert torch.equal(out, reference)
    assert all(torch.equal(args[n].grad, e.grad) for n, e in zip("qkv", expected))


def test_a_malformed_batch_gives_nan_until_its_error_is_raised(held):
    """Never zeros that could pass for a result: the fills read the verdict on the device."""
    args = _malformed(requires_grad=False)
    out, lse = _on(args, _metadata(args), return_lse=True)
    assert held[0].waits == 0 and bool(out.isnan().all()) and bool(lse.isnan().all())


def test_the_backward_raises_before_returning_a_gradient(held):
    args = _malformed(requires_grad=True)
    out = _on(args, _metadata(args))  # no wait, no error yet
    assert held[0].waits == 0
    with pytest.raises(ValueError) as error:
        out.backward(torch.ones_like(out))
    assert str(error.value) == metadata._BACKWARD + _host_message(args)
    assert all(args[n].grad is None for n in "qkv")


def test_the_next_use_raises_once_the_device_has_reported(held):
    """Without waiting; a call on other metadata is not this batch's and raises nothing."""
    args = _malformed(requires_grad=True)
    message = _host_message(args)
    batch = _metadata(args)
    _on(args, batch)
    args["cu_seqlens_q_padded"].copy_(base_args()["cu_seqlens_q_padded"])  # fixed in place: the error keeps what was checked
    good = base_args(device=default_device())
    other = _metadata(good)
    _on(good, other)  # the checks still run on the device: no wait, no error
    assert [e.waits for e in held] == [0, 0]
    held[0].finished = True
    _on(good, other)  # another batch: not its error
    with pytest.raises(ValueError) as error:
        _on(args, batch)
    assert str(error.value) == metadata._REPORTED + message and held[0].waits == 0
    with pytest.raises(ValueError):
        _on(args, batch)  # a malformed batch stays malformed


def test_check_waits_for_the_verdict_once_and_raises(held):
    args = _malformed(requires_grad=True)
    batch = _metadata(args)
    _on(args, batch)
    for _ in range(2):
        with pytest.raises(ValueError) as error:
            batch.check()
        assert str(error.value) == _host_message(args)
    assert held[0].waits == 1  # the verdict is kept
    good = _metadata(base_args(device=default_device()))
    assert good.check() is good and held[1].waits == 1


def test_the_layers_of_a_step_share_one_check(held):
    """The same metadata in every layer: one check launched, no wait until the backward."""
    args = _malformed(requires_grad=True)
    batch = _metadata(args)
    outs = [_on(args, batch) for _ in range(3)]
    assert len(held) == 1 and held[0].waits == 0
    with pytest.raises(ValueError, match="its check ran on the device, read here"):
        sum(o.sum() for o in outs).backward()


def test_metadata_from_host_memory_is_checked_at_once():
    """Boundaries a collator made on the CPU: the host check, in the constructor, costs no sync."""
    args = _malformed(requires_grad=False)
    host = {n: args[n].cpu() for n in BOUNDARIES}
    with pytest.raises(ValueError) as error:
        VarlenMetadata(
            host["cu_seqlens_q"],
            host["cu_seqlens_k"],
            4,
            4,
            cu_seqlens_q_padded=host["cu_seqlens_q_padded"],
            cu_seqlens_k_padded=host["cu_seqlens_k_padded"],
            total_q=args["q"].shape[0],
            total_k=args["k"].shape[0],
            device=default_device(),
        )
    assert str(error.value) == _host_message(args)


def test_metadata_built_for_other_rows_is_a_clear_error():
    args = base_args(device=default_device())
    batch = _metadata(args)
    assert "total_q=15, total_k=15" in repr(batch)
    _on(args, batch)
    shorter = {**args, "q": args["q"][:-1]}
    with pytest.raises(ValueError, match="describes q of 15 rows and k of 15, but the call passes q of 14"):
        _on(shorter, batch)


def test_metadata_and_boundaries_together_are_a_clear_error():
    args = base_args(device=default_device())
    positional, keywords = split_call(args)
    with pytest.raises(ValueError, match="got metadata= and cu_seqlens_q, cu_seqlens_k"):
        varlen_attention_triton(*positional, **keywords, metadata=_metadata(args))
    with pytest.raises(ValueError, match="got metadata= and validate"):
        _on(args, _metadata(args), validate=False)
    with pytest.raises(TypeError, match="cu_seqlens_k, max_seqlen_q, max_seqlen_k missing"):
        varlen_attention_triton(args["q"], args["k"], args["v"], args["cu_seqlens_q"])


@pytest.mark.slow
def test_the_cost_benchmark_runs_every_variant():
    """`python -m benchmarks.validate_cost --quick`: each variant once on a tiny layout (the GPU times them)."""
    command = [sys.executable, "-m", "benchmarks.validate_cost", "--quick"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=os.environ | {"WORKBENCH_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ran (not timed)") == 4, done.stdout


def _counted(monkeypatch, module, name: str, *also) -> list[int]:
    """Counts the calls of module.name (patched there and in `also`), which still run: the
    number of arguments of each."""
    counts: list[int] = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        counts.append(len(args))
        return real(*args, **kwargs)

    for where in (module, *also):
        monkeypatch.setattr(where, name, counted)
    return counts


EVERY_ROW_REAL = Case((5, 9), seqlens_k=(7, 9), heads=2, head_dim=16, causal=True)


@pytest.mark.parametrize("case", [EVERY_ROW_REAL, EVERY_ROW_REAL.with_(padded_q=(8, 9))], ids=["every-row-real", "gap-rows"])
def test_calls_on_checked_metadata_launch_only_what_it_needs(device_path, monkeypatch, case):
    """Once the device check of these boundaries is known to have passed with every row real,
    forward and backward launch no padding fill (there is nothing to fill); with padding rows
    they do, and without a check (validate=False) too. The work lists of the check's safe copy
    are the check's own: only validate=False launches `work_lists`. Outputs and gradients are bitwise those of a call that
    makes and fills everything (validate=False)."""
    import varlen_workbench.kernels.varlen.launch as launch

    batch = pack(case)
    fills = _counted(monkeypatch, launch, "fill_padding_rows")
    work_lists = _counted(monkeypatch, launch, "work_lists")
    results = []
    for validate in (True, True, False):
        fresh = batch.fresh()
        out = fresh.call(varlen_attention_triton, validate=validate)
        out.backward(torch.ones_like(out))
        results.append((out, fresh.q.grad, fresh.k.grad, fresh.v.grad))
    # the interpreter runs the check before returning: its outcome is known from the first call on
    assert fills == ([2, 3] * 3 if case.padded_q else [2, 3])
    assert len(work_lists) == 1  # validate=False's own: the check wrote those of its safe copy
    for with_check, without in zip(results[0], results[2]):
        assert torch.equal(with_check, without)
    for first, second in zip(results[0], results[1]):
        assert torch.equal(first, second)


@pytest.mark.gpu
def test_a_read_verdict_buffer_serves_the_next_check_and_an_unread_one_none():
    """The pinned buffer (and event) of a check whose verdict was read is the next check's; one
    whose verdict is unread is never handed out: each check reads its own verdict."""
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device="cuda")
    decreasing = torch.tensor([0, 3, 2], dtype=torch.int32, device="cuda")
    _, first = check_on_device(cu, cu, None, None, 5, 5, 3, 3)
    _, unread = check_on_device(decreasing, decreasing, None, None, 5, 5, 3, 3)
    assert unread.verdict.data_ptr() != first.verdict.data_ptr()
    assert not first.failed()
    _, second = check_on_device(cu, cu, None, None, 5, 5, 3, 3)
    assert second.verdict.data_ptr() == first.verdict.data_ptr()
    assert unread.failed() and not second.failed() and not first.failed()
