"""Tiles of the fixed kernel: every native candidate computes the contract (also under the
interpreter, pinned), the on-device work lists, and the tuner's choices on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernel_varlen import assert_contract, fast_only, varlen_attention
from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen.launch import (
    BLOCK_SIZES,
    KEYS,
    QUERIES,
    WorkList,
    native_tiles,
    tuner,
    work_lists,
)
from varlen_workbench.kernels.varlen.op import HEAD_DIMS
from varlen_workbench.kernels.varlen.tuner import MIN_TIMED_WORK, NATIVE_TILES, Tile, TileTuner
from varlen_workbench.workbench.layout import Case, pack

# Both sides of the causal diagonal and ragged ends against 16..128-row tiles: len_q > len_k
# (rows that see no key), len_q < len_k, an empty sequence, GQA, gaps and a tail.
ON_INTERPRETER = interpreted(default_device())  # the tests' batches are on the default device
CAUSAL_CASE = Case((140, 0, 37), seqlens_k=(129, 3, 150), align=8, tail_q=3, heads=2, kv_heads=1, causal=True, dtype="float16")
FULL_CASE = Case((131, 20), padded_q=(133, 24), heads=2, dtype="float16")


@pytest.mark.parametrize("row_bytes", fast_only([128, 256], {128}))
@pytest.mark.parametrize("index", fast_only(range(4), {0}))
def test_every_native_candidate_tile_keeps_the_contract(row_bytes, index):
    """Pinned tile `index` of each kernel's candidates for fp16 rows of `row_bytes`. The
    interpreter runs them at head dim 16: what a tile changes is the blocking of rows and keys,
    and numpy's cost grows with the head dim."""
    tiles = {kernel: by_bytes[row_bytes][index] for kernel, by_bytes in NATIVE_TILES.items()}
    head_dim = 16 if ON_INTERPRETER else row_bytes // 2
    # The causal case runs every mask path; without the mask only the ragged end differs.
    cases = (CAUSAL_CASE, FULL_CASE) if index == 0 else (CAUSAL_CASE,)
    with tuner().pinned(**tiles):
        for case in cases:
            assert_contract(case.with_(head_dim=head_dim))


@pytest.mark.parametrize("window", fast_only([(20, 0), (0, 40), (33, 17)], {(33, 17)}), ids=str)
@pytest.mark.parametrize("index", fast_only(range(4), {0}))
def test_every_native_candidate_tile_keeps_the_contract_under_windows(index, window):
    """Windows narrower and wider than the 16..128-row blocks: key blocks skipped on both sides,
    masked edges, rows that see no key (len_q > len_k), for each pinned tile."""
    tiles = {kernel: by_bytes[256][index] for kernel, by_bytes in NATIVE_TILES.items()}
    with tuner().pinned(**tiles):
        assert_contract(CAUSAL_CASE.with_(causal=False, head_dim=16 if ON_INTERPRETER else 128), window_size=window)


def test_pinned_names_kernels():
    with pytest.raises(ValueError, match=r"pinned\(\) got \['backward'\]"):
        with tuner().pinned(backward=Tile(64, 64, 4, 1)):
            pass


def test_work_lists_count_blocks_of_every_size_on_both_sides():
    """More sequences than one chunk of the kernel's running sum, empty ones included; the key
    side differs from the query side."""
    generator = torch.Generator().manual_seed(0)
    lengths = {
        QUERIES: torch.randint(0, 300, (2500,), generator=generator),
        KEYS: torch.randint(0, 300, (2500,), generator=generator),
    }
    lengths[QUERIES][::7] = 0
    lengths[KEYS][::5] = 0
    cu = {side: torch.nn.functional.pad(n.cumsum(0), (1, 0)).to(torch.int32).to(default_device()) for side, n in lengths.items()}
    work = work_lists(cu[QUERIES], cu[KEYS])
    for side in (QUERIES, KEYS):
        listed = WorkList(work[side], 2500, int(cu[side][-1]))
        for block in BLOCK_SIZES:
            starts, grid = listed.blocks(block)
            expected = torch.nn.functional.pad(((lengths[side] + block - 1) // block).cumsum(0), (1, 0))
            assert torch.equal(starts[:2501].cpu().long(), expected)
            assert grid >= int(expected[-1])
        assert listed.search_steps >= (2500).bit_length()


def test_candidate_tiles_cover_every_supported_row_width():
    """Compiled (the interpreter runs one tile), every head dim of the contract, v's the same or 128."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for head_dim, head_dim_v in ((d, dv) for d in HEAD_DIMS for dv in (None, 128)):
            for kernel in NATIVE_TILES:
                tiles = native_tiles(kernel, head_dim, dtype, head_dim_v)
                assert tiles and all(t.block_m in BLOCK_SIZES or kernel == "dkdv" for t in tiles)
                assert all(t.block_n in BLOCK_SIZES or kernel != "dkdv" for t in tiles)


class FakeCompiled:
    """What a native launch returns, as far as the tuner reads it."""

    def __init__(self, n_spills: int) -> None:
        self.n_spills, self.n_regs = n_spills, 255
        self.metadata = type("Metadata", (), {"shared": 0})()


def test_tuner_never_times_a_spilling_candidate(monkeypatch):
    """Spills are read from the compiled kernels first: where any candidate does not spill, only
    those are timed, however fast a spilling one would have looked."""
    import varlen_workbench.kernels.varlen.tuner as tuner_module

    spilling, fast_spilling = Tile(64, 64, 4, 2), Tile(128, 128, 8, 3)
    clean, slower_clean = Tile(128, 64, 8, 3), Tile(64, 32, 4, 3)
    spills = {spilling: 16, fast_spilling: 88, clean: 0, slower_clean: 0}
    speed = {spilling: 0.1, fast_spilling: 0.05, clean: 1.0, slower_clean: 2.0}
    launched: list[Tile] = []

    def launch(tile):
        launched.append(tile)
        return FakeCompiled(spills[tile])

    def do_bench(fn, **_):
        fn()
        return speed[launched[-1]]

    monkeypatch.setattr(tuner_module, "_may_synchronize", lambda: True)
    monkeypatch.setattr(tuner_module.triton.testing, "do_bench", do_bench)
    tuner = TileTuner()
    tuner.launch(("forward", "x"), tuple(spills), launch, MIN_TIMED_WORK)
    assert set(tuner.timings[("forward", "x")]) == {clean, slower_clean}
    assert tuner.chosen[("forward", "x")] == clean and tuner.report()[0]["spills"] == 0
    # every candidate spills: spilling less is not running faster, so all are timed
    tuner.launch(("dq", "x"), (spilling, fast_spilling), launch, MIN_TIMED_WORK)
    assert set(tuner.timings[("dq", "x")]) == {spilling, fast_spilling}
    assert tuner.chosen[("dq", "x")] == fast_spilling


def test_an_untimed_call_takes_the_first_candidate_that_does_not_spill(monkeypatch):
    """Under MIN_TIMED_WORK nothing is timed, but spills are still read: candidates compile in
    order up to the first clean one; where all spill, the first runs. While syncs are
    forbidden (CUDA graph capture) the first runs unread and nothing is remembered."""
    import varlen_workbench.kernels.varlen.tuner as tuner_module

    spilling, clean, later = Tile(32, 64, 4, 3), Tile(32, 128, 8, 3), Tile(64, 128, 8, 3)
    spills = {spilling: 16, clean: 0, later: 0}
    launched: list[Tile] = []

    def launch(tile):
        launched.append(tile)
        return FakeCompiled(spills[tile])

    monkeypatch.setattr(tuner_module, "_may_synchronize", lambda: True)
    tuner = TileTuner()
    tuner.launch(("dkdv", "small"), (spilling, clean, later), launch, MIN_TIMED_WORK - 1)
    assert launched == [spilling, clean, clean] and tuner.chosen[("dkdv", "small")] == clean
    assert ("dkdv", "small") not in tuner.timings and tuner.report()[0]["spills"] == 0
    spills[clean] = spills[later] = 8
    tuner.launch(("dkdv", "all spill"), (spilling, clean, later), launch, MIN_TIMED_WORK - 1)
    assert tuner.chosen[("dkdv", "all spill")] == spilling
    launched.clear()
    monkeypatch.setattr(tuner_module, "_may_synchronize", lambda: False)
    tuner.launch(("dkdv", "captured"), (spilling, clean), launch, MIN_TIMED_WORK - 1)
    assert launched == [spilling] and ("dkdv", "captured") not in tuner.chosen


@pytest.mark.gpu
@pytest.mark.skipif(ON_INTERPRETER, reason="times tiles with CUDA events")
def test_tuner_times_each_candidate_once_and_not_while_syncs_are_forbidden():
    tuner = TileTuner()
    launched = []
    candidates = (Tile(64, 64, 4, 2), Tile(128, 64, 8, 3))

    def launch(tile):
        launched.append(tile)
        torch.empty(1 << 20, device="cuda").fill_(tile.block_m)

    work = MIN_TIMED_WORK
    torch.cuda.set_sync_debug_mode("error")
    try:
        tuner.launch(("forward", "x"), candidates, launch, work)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert launched == [candidates[0]] and not tuner.chosen  # the default, nothing remembered
    tuner.launch(("forward", "x"), candidates, launch, work)
    assert set(tuner.timings[("forward", "x")]) == set(candidates)
    launched.clear()
    tuner.launch(("forward", "x"), candidates, launch, work)
    assert launched == [tuner.chosen[("forward", "x")]]
    assert tuner.report()[0]["tile"] == str(tuner.chosen[("forward", "x")])
    tuner.launch(("forward", "small"), candidates, launch, work - 1)  # launch-bound: untimed
    assert tuner.chosen[("forward", "small")] == candidates[0] and ("forward", "small") not in tuner.timings


@pytest.mark.gpu
@pytest.mark.skipif(ON_INTERPRETER, reason="reads the compiled kernels' registers")
def test_tuned_kernels_do_not_spill(monkeypatch):
    """A timed call (causal, 4k rows) and an untimed one (a sliding window over a few hundred
    rows, where the first dK/dV candidate spills) at bf16 head dim 128 get tiles that do not
    spill. A fresh tuner: the process-wide one holds other tests' choices, and under `-n 8` one
    of them spilled (GQA dK/dV at head dim 128, where every candidate spills, is one such)."""
    import varlen_workbench.kernels.varlen.launch as launch_module

    tuner = TileTuner()
    monkeypatch.setattr(launch_module, "tuner", lambda: tuner)
    for case in (
        Case((4096, 17, 513), heads=16, head_dim=128, dtype="bfloat16", causal=True),
        Case((200, 37), heads=2, head_dim=128, dtype="bfloat16", window=(64, 0)),
    ):
        pack(case, device="cuda").call(varlen_attention).sum().backward()
    resources = [r for r in tuner.report() if "regs" in r]
    assert sorted(r["kernel"] for r in resources) == ["dkdv", "dkdv", "dq", "dq", "forward", "forward"]
    assert [r for r in resources if r["spills"]] == []
