"""The forward kernel's Hopper switches (`ForwardConfig`): every combination keeps the contract.

Under the interpreter the descriptor path runs as it is (Triton 3.6's interpreter implements
`tl.make_tensor_descriptor` with zero padding), `warp_specialize` is ignored and the persistent
walk runs on 4 programs. Each case is the same poisoned-memory check as the kernel's own
tests: NaN in every padding row of q, k, v and dO, errors within FlashAttention's bound on
REAL rows, exact zeros elsewhere.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_kernel_varlen import assert_contract
from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen.hopper import (
    ForwardConfig,
    check_descriptor_alignment,
    forward_config,
    longest_first,
    warp_specialize_fails,
)
from varlen_workbench.kernels.varlen.tuner import Tile
from varlen_workbench.workbench.layout import Case

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [ForwardConfig(*switches) for switches in itertools.product((False, True), repeat=3)][1:]
ALL = "descriptors+warp_specialize+persistent"


def _case(dtype: str) -> Case:
    # Ragged lengths past a block, an empty sequence, TAIL and GAP rows, GQA, causal with len_q != len_k.
    return Case(
        (1, 70, 0, 17),
        seqlens_k=(5, 70, 3, 9),
        align=16,
        tail_q=3,
        tail_k=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        causal=True,
        dtype=dtype,
    )


# The fast loop: descriptors alone in bf16 (the interpreter's raw-bits dot; the switch that changes
# loads and stores), all three in fp32; the full suite runs every combination in both dtypes.
FAST = {(c, "bfloat16") for c in CONFIGS if str(c) == "descriptors"} | {(c, "float32") for c in CONFIGS if str(c) == ALL}


def _marks(config: ForwardConfig, dtype: str):
    """Interpreted, a combination with warp_specialize computes exactly what its twin without it
    does (the interpreter's tl.range drops the keyword; no tile is refused without a capability):
    there the twin alone runs where it is a case of its own here, and the flag still runs alone
    (the default's twin) and with both other switches (ALL). Natively, every combination runs."""
    twin = ForwardConfig(config.descriptors, False, config.persistent)
    if interpreted(default_device()) and config.warp_specialize and twin in CONFIGS and str(config) != ALL:
        return pytest.mark.skip(reason=f"interpreted, warp_specialize is ignored: the same run as {twin}-{dtype}")
    return () if (config, dtype) in FAST else pytest.mark.slow


@pytest.mark.parametrize(
    "config, dtype",
    [pytest.param(c, dtype, id=f"{c}-{dtype}", marks=_marks(c, dtype)) for c in CONFIGS for dtype in ("float32", "bfloat16")],
)
def test_every_switch_combination_keeps_the_contract(config, dtype):
    with forward_config(config):
        assert_contract(_case(dtype))


@pytest.mark.parametrize("dims", [(48, None), (192, 128)], ids=["48", "192-128"])
def test_descriptors_at_padded_head_dims(dims):
    """Descriptors over [len, D] rows in blocks of [BLOCK, lanes]: the lanes past D (and past
    D_v for v and out) load as zeros and are never stored, as the masked loads do."""
    head_dim, head_dim_v = dims
    with forward_config(ForwardConfig(descriptors=True)):
        assert_contract(_case("bfloat16").with_(head_dim=head_dim, head_dim_v=head_dim_v))


def test_sliding_window_with_every_switch():
    with forward_config(ForwardConfig(True, True, True)):
        assert_contract(Case((40, 90), tail_q=2, heads=2, head_dim=32, causal=True, window=(20, -1), dtype="bfloat16"))


def test_misaligned_rows_are_refused_by_name():
    q = torch.zeros(8, 2, 17, device=default_device())[:, :, 1:]  # 4-byte offset, 68-byte rows
    with pytest.raises(ValueError, match=r"descriptors=True\) needs q"):
        check_descriptor_alignment(("q", q))


def test_longest_first_orders_work_items_by_keys_visited():
    device = default_device()
    cu = torch.tensor([0, 16, 80, 112], dtype=torch.int32, device=device)  # lengths 16, 64, 32
    starts = torch.tensor([0, 1, 3, 4], dtype=torch.int32, device=device)  # blocks of 32 rows
    order = longest_first(starts, 3, 6, cu, cu, 32, causal=True).tolist()
    # Causal costs: item 0 (seq 0) 16 keys, 1 and 2 (seq 1) 32 and 64, 3 (seq 2) 32; 4 and 5 surplus.
    assert order == [2, 1, 3, 0, 4, 5]
    assert longest_first(starts, 3, 6, cu, cu, 32, causal=False).tolist() == [1, 2, 3, 0, 4, 5]


def test_warp_specialize_is_kept_off_four_warp_tiles_on_hopper_only():
    ws, w4, w8 = ForwardConfig(warp_specialize=True), Tile(64, 64, 4, 3), Tile(128, 64, 8, 3)
    assert warp_specialize_fails(ws, w4, (9, 0))
    assert not warp_specialize_fails(ws, w8, (9, 0))
    assert not warp_specialize_fails(ws, w4, (10, 0)) and not warp_specialize_fails(ws, w4, None)
    assert not warp_specialize_fails(ForwardConfig(descriptors=True), w4, (9, 0))


@pytest.mark.slow
def test_benchmark_quick_run_checks_every_variant(tmp_path):
    """`python -m benchmarks.hopper_forward --quick`: every variant checked on the CPU, none timed."""
    from varlen_workbench.workbench.bench.hopper_report import hopper_rows, refusals
    from varlen_workbench.workbench.records import read_record

    record = tmp_path / "quick.json"
    command = [sys.executable, "-m", "benchmarks.hopper_forward", "--quick", "--record", str(record)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=os.environ | {"WORKBENCH_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_record(record)["rows"]
    assert [r["variant"] for r in rows] == ["current", "descriptors", "warp_specialize", "persistent", "all three"]
    assert all(r["check"] == "ok" and r["error"] is None and r["forward_ms"] is None for r in rows), rows
    assert "check ok (not timed)" in done.stdout
    read_back = hopper_rows(read_record(record))  # as the performance page reads the GPU's record
    assert len(read_back) == len(rows) and not refusals(read_back)
