"""validate=True's device check (kernels/varlen/device_check.py) decides as the host check does.

Natively, `varlen_attention` checks the boundary values with a kernel and raises the host
check's error before it returns; here the same kernel runs under the interpreter, forced on
the CPU, and must agree with the host check on every malformed call of the catalogue, on
valid layouts, and on random boundary vectors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels.varlen.op as op
from kernels import default_device
from kernels.contract import check_cu_seqlens
from kernels.varlen.device_check import check_on_device
from workbench.malformed import CATALOGUE, base_args, split_call


@pytest.fixture
def device_path(monkeypatch):
    """varlen_attention as it runs natively: the metadata's values checked by the kernel."""
    monkeypatch.setattr(op, "_checks_on_device", lambda: True)


def _raised(call) -> tuple[type, str] | None:
    try:
        call()
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    return None


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_the_device_path_raises_what_the_host_path_raises(case, monkeypatch):
    positional, keywords = split_call(case.build(base_args(device=default_device())))
    monkeypatch.setattr(op, "_checks_on_device", lambda: False)
    host = _raised(lambda: op.varlen_attention(*positional, **keywords))
    monkeypatch.setattr(op, "_checks_on_device", lambda: True)
    op._VALIDATED.refs = ()  # nothing remembered from the host call
    assert _raised(lambda: op.varlen_attention(*positional, **keywords)) == host
    assert host is not None and host[0] is case.exception


def test_the_device_path_computes_what_the_host_path_computes(device_path):
    """...and takes numpy integers for max_seqlen, as the host check does (test_contract.py)."""
    args = base_args(device=default_device())
    args["max_seqlen_q"], args["max_seqlen_k"] = np.int64(args["max_seqlen_q"]), np.int32(args["max_seqlen_k"])
    positional, keywords = split_call(args)
    on_device = op.varlen_attention(*positional, **keywords, return_lse=True)
    host = op.varlen_attention(*positional, **keywords, return_lse=True, validate=False)
    for a, b in zip(on_device, host):
        assert torch.equal(a, b)


def test_a_failed_check_hands_the_kernels_all_zero_boundaries():
    """Every row is then padding: the kernels read no row and write nothing outside the tensors."""
    args = base_args(device=default_device())
    bad_end = args["cu_seqlens_q_padded"].clone()
    bad_end[-1] = 10**6  # addresses rows far past q's end
    safe, check = check_on_device(args["cu_seqlens_q"], args["cu_seqlens_k"], bad_end, args["cu_seqlens_k_padded"], 15, 15, 9, 9)
    assert check.failed() and all(int(v.abs().sum()) == 0 for v in safe)
    good = (args["cu_seqlens_q"], args["cu_seqlens_k"], args["cu_seqlens_q_padded"], args["cu_seqlens_k_padded"])
    safe, check = check_on_device(*good, 15, 15, 9, 9)
    assert not check.failed() and all(torch.equal(a, b) for a, b in zip(safe, good))


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
    """Small random vectors, most nearly valid (one nudge away), with and without padded ones."""
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
        assert (not check.failed()) == _host_verdict(tensors, totals, limits), (trial, tensors, totals, limits)


def test_validation_inside_a_cuda_graph_capture_is_a_clear_error(monkeypatch):
    """The check waits on the device, which a capture forbids: say so instead of a CUDA error."""
    monkeypatch.setattr(op, "_capturing", lambda: True)
    op._VALIDATED.refs = ()
    positional, keywords = split_call(base_args(device=default_device()))
    with pytest.raises(ValueError, match="a CUDA graph capture allows no wait; pass validate=False"):
        op.varlen_attention(*positional, **keywords)
