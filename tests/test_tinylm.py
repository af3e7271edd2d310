"""The tiny LM's pieces: dense attention keeps the contract, RoPE positions, packing, training."""

from __future__ import annotations

import math

import pytest
import torch

from varlen_workbench.workbench.instruments.tinylm import (
    IGNORE,
    PAD_TOKEN,
    LMConfig,
    SyntheticTask,
    TinyLM,
    apply_rope,
    dense_attention,
    mask_tokens,
    rope_positions,
    train,
)
from varlen_workbench.workbench.layout import Case, Fill, cumulative, pack
from varlen_workbench.workbench.probes import probe


@pytest.mark.parametrize(
    "case",
    [
        Case(
            (7, 3, 5),
            padded_q=(9, 3, 8),
            seqlens_k=(4, 6, 5),
            padded_k=(5, 6, 8),
            tail_q=2,
            tail_k=3,
            heads=4,
            kv_heads=2,
            head_dim=16,
            causal=True,
        ),
        Case((6, 0, 5), seqlens_k=(3, 2, 0), padded_k=(4, 2, 1), tail_q=2, heads=2, head_dim=16),
        Case((9, 4), align=8, heads=2, head_dim=16, causal=True, fill=Fill.POS_INF),
    ],
    ids=["gqa-causal-cross", "empty-sequences", "inf-padding"],
)
def test_dense_attention_keeps_the_contract(case):
    record = probe(dense_attention, pack(case, "cpu"))
    assert record.real_finite and record.padding_exactly_zero and record.real_within_bound, record.summary()


def test_rope_positions_follow_the_padded_layout():
    cu, cu_padded = cumulative([3, 2]), cumulative([4, 4])
    assert rope_positions(cu, cu_padded, 10).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    # Real boundaries on a padded layout: the second sequence starts counting at row 3, a pad row.
    assert rope_positions(cu, None, 8).tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


def test_rope_scores_depend_only_on_relative_position():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 16, generator=generator, dtype=torch.float64).unbind(0)
    score = lambda m, n: float((apply_rope(q, torch.tensor([m])) * apply_rope(k, torch.tensor([n]))).sum())
    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-12)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-6)


def test_packed_layouts():
    task = SyntheticTask(seed=0)
    aligned = task.batch((5, 9), align=8)
    assert aligned.cu_seqlens.tolist() == [0, 5, 14] and aligned.cu_seqlens_padded.tolist() == [0, 8, 24]
    assert (aligned.tokens[5:8] == PAD_TOKEN).all() and (aligned.targets[4:8] == IGNORE).all()
    assert aligned.tokens[8:17].ne(PAD_TOKEN).all()
    tail = task.batch((5, 9), tail_align=8)
    assert tail.cu_seqlens_padded.tolist() == [0, 5, 16] and tail.padding_fraction == pytest.approx(2 / 16)
    with pytest.raises(ValueError, match="not both"):
        task.batch((5,), align=8, tail_align=8)
    with pytest.raises(ValueError, match="needs >= 2 tokens"):
        task.batch((1, 5))


def test_sequences_are_periodic():
    seq = SyntheticTask(min_period=3, max_period=3, seed=1).sequence(10)
    assert torch.equal(seq[3:], seq[:-3]) and seq.ne(PAD_TOKEN).all()


def test_training_learns_the_task():
    task = SyntheticTask(seed=0)
    batches = [task.batch((12, 20, 9, 15), align=8) for _ in range(40)]
    run, _ = train("t", batches, SyntheticTask(seed=1).batch((12, 20, 9, 15), align=8), config=LMConfig(layers=1))
    assert run.final_loss < run.losses[0] - 0.5
    assert math.isfinite(run.eval_perplexity) and run.eval_perplexity < math.exp(run.losses[0])


def test_mask_tokens_hides_only_real_tokens():
    batch = SyntheticTask(seed=0).batch((20, 13), align=16)
    masked = mask_tokens(batch, 24, 0.5, torch.Generator().manual_seed(0))
    hidden = masked.tokens == 24
    assert hidden.any() and torch.equal(masked.targets[hidden], batch.tokens[hidden])
    assert (masked.targets[~hidden] == IGNORE).all() and (masked.tokens[batch.tokens == PAD_TOKEN] == PAD_TOKEN).all()
    with pytest.raises(ValueError, match="rate = 1.0 must be in"):
        mask_tokens(batch, 24, 1.0, torch.Generator())


def test_bidirectional_config_sees_later_tokens():
    batch = SyntheticTask(seed=0).batch((12, 9), align=8)
    later = batch.tokens.clone()
    later[5] = (later[5] % 23) + 1  # change one token in the middle of the first sequence
    changed = type(batch)(later, batch.targets, batch.cu_seqlens, batch.cu_seqlens_padded, batch.max_seqlen)
    for causal in (True, False):
        model = TinyLM(LMConfig(causal=causal))
        with torch.no_grad():
            moved = (model(batch) - model(changed)).abs().amax(-1)
        assert bool(moved[:5].any()) is not causal  # rows before the change see it only without the causal mask
