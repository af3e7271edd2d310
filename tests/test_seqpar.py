"""Sequence-parallel sizing on torch.distributed: padded boundaries exact, real boundaries a clear error."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.workbench.instruments.seqpar import (
    SizingError,
    _spawn,
    gather_tokens,
    gathered_rows,
    layer_forward,
    run_sequence_parallel,
    sequence_parallel_forward,
    shard,
)
from varlen_workbench.workbench.instruments.tinylm import LMConfig, SyntheticTask, TinyLM


@pytest.fixture
def one_rank_group():
    """A world of one, in this process: the collectives' size checks without spawning."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def packed_layer():
    model = TinyLM(LMConfig(seed=1))
    batch = SyntheticTask(seed=2).batch((20, 13, 27, 9), align=16)  # 69 real tokens in 96 rows
    with torch.no_grad():
        return model.blocks[0], model.embed(batch.tokens), batch


@pytest.mark.slow  # two gloo ranks spawned three times; the one-rank tests below keep the sizing clauses fast
def test_two_ranks_padded_sizing_is_exact_and_real_sizing_fails_clearly():
    block, x, batch = packed_layer()
    device = default_device()
    study = run_sequence_parallel(block, x, batch.cu_seqlens, batch.cu_seqlens_padded, device=device)
    assert (study.world_size, study.layout_rows, study.real_rows) == (2, 96, 69)
    padded, real, unchecked = study.run("padded"), study.run("real"), study.run("real", validate=False)
    assert padded.exact and padded.errors == (None, None) and padded.out.shape == x.shape
    with torch.no_grad():  # the study's reference is the layer itself, run in one process
        here = layer_forward(block.to(device), x.to(device), batch.cu_seqlens.to(device), batch.cu_seqlens_padded.to(device))
    assert torch.allclose(study.reference, here.cpu(), rtol=1e-5, atol=1e-5)
    assert real.rows == 69 and real.out is None and not real.exact
    assert all(e.startswith("SizingError: sequence-parallel all-gather sized from cu_seqlens[-1] = 69 rows") for e in real.errors)
    assert "48 rows each (96 rows" in real.error and "from cu_seqlens_padded[-1]" in real.error
    # torch's own words (gloo: RuntimeError, NCCL: ValueError), with no hint of the fix
    assert unchecked.out is None and unchecked.error.split(":")[0] in ("RuntimeError", "ValueError")
    assert "cu_seqlens" not in unchecked.error


def test_gather_checks_its_size(one_rank_group):
    local = torch.arange(12.0).view(6, 2)
    assert torch.equal(gather_tokens(local, 6), local)
    with pytest.raises(SizingError, match=r"sized from cu_seqlens\[-1\] = 4 rows, but the 1 ranks hold 6 rows each"):
        gather_tokens(local, 4, size_from="real")
    with pytest.raises(RuntimeError):  # what the collective says without our check
        gather_tokens(local, 4, size_from="real", validate=False)


def test_sequence_parallel_forward_is_the_layer_on_one_rank(one_rank_group):
    block, x, batch = packed_layer()
    with torch.no_grad():
        whole = layer_forward(block, x, batch.cu_seqlens, batch.cu_seqlens_padded)
        assert torch.equal(sequence_parallel_forward(block, x, batch.cu_seqlens, batch.cu_seqlens_padded), whole)
        with pytest.raises(SizingError, match=r"cu_seqlens\[-1\] = 69 rows, but the 1 ranks hold 96 rows"):
            sequence_parallel_forward(block, x, batch.cu_seqlens, batch.cu_seqlens_padded, size_from="real")


def test_sizing_arguments_are_checked():
    cu, cu_padded = torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8])
    assert (gathered_rows(cu, cu_padded), gathered_rows(cu, cu_padded, "real")) == (8, 5)
    with pytest.raises(ValueError, match="size_from = 'tokens' must be one of"):
        gathered_rows(cu, cu_padded, "tokens")
    with pytest.raises(ValueError, match="7 rows, not a multiple of world_size = 2: pad the packed batch"):
        shard(torch.zeros(7, 2), 0, 2)
    block, x, batch = packed_layer()
    with pytest.raises(ValueError, match="x has 95 rows but cu_seqlens_padded"):
        run_sequence_parallel(block, x[:95], batch.cu_seqlens, batch.cu_seqlens_padded)


def _hang(rank: int, seconds: float) -> None:
    time.sleep(seconds)


def test_ranks_are_killed_and_joined_on_timeout():
    with pytest.raises(TimeoutError, match="did not finish within 0.5 s"):
        _spawn(_hang, (600.0,), 2, timeout_s=0.5)
    assert not multiprocessing.active_children()
