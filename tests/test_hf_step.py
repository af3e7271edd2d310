"""The transformers swap builds the batch's `VarlenMetadata` once per forward, with at most one
host read, whatever the batch kind; the layers after the first read nothing and build nothing.

On the CPU a host read costs no sync, so the count is of the swap's reads (`varlen_workbench.kernels.hf._read`, its
one way to read values) and of the metadata it builds; the H200's profiler count of real syncs,
ours and transformers' apart, is `varlen_workbench.workbench.bench.stepbench`'s record.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from varlen_workbench.kernels import caches, hf
from varlen_workbench.workbench.instruments import realclient as rc

SIZE = dataclasses.replace(rc.SIZES["cpu"], layers=2)  # a second layer finds the first one's metadata


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """The swap's host reads and the metadata it builds, counted; nothing remembered before."""
    counts = {"reads": 0, "built": 0, "attention calls": 0}
    monkeypatch.setattr(caches, "LAST", caches.Memo())
    read, build = hf._read, hf._build

    def counting_read(*tensors):
        counts["reads"] += 1
        return read(*tensors)

    def counting_build(*args):
        counts["built"] += 1
        return build(*args)

    monkeypatch.setattr(hf, "_read", counting_read)
    monkeypatch.setattr(hf, "_build", counting_build)
    forward = hf.attention_forward

    def counting_forward(varlen):
        inner = forward(varlen)

        def run(*args, **kwargs):
            counts["attention calls"] += 1
            return inner(*args, **kwargs)

        return run

    monkeypatch.setattr(hf, "attention_forward", counting_forward)
    return counts


def _batches() -> dict[str, tuple[dict, int]]:
    """Each batch kind transformers hands the attention, and the host reads its metadata costs."""
    packed = rc.pack(SIZE)
    rows = packed["input_ids"].shape[1]
    ids = packed["input_ids"]
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    return {
        "cu_seq_lens with int max lengths": (packed, 0),
        "cu_seq_lens without max lengths": ({**packed, "max_length_q": None, "max_length_k": None}, 1),
        "position_ids restarting per document": ({k: packed[k] for k in ("input_ids", "position_ids")}, 1),
        "right-padded batch": ({"input_ids": ids[:, :12].expand(2, 12).contiguous(), "attention_mask": mask}, 1),
        "plain batch": ({"input_ids": ids[:, : rows // 2].expand(2, rows // 2).contiguous()}, 1),
    }


@pytest.mark.parametrize("kind", list(_batches()))
def test_one_build_and_at_most_one_read_per_forward(counted, kind):
    inputs, reads = _batches()[kind]
    model = rc.llama(SIZE)
    rc.set_implementation(model, hf.register())
    for forward in (1, 2):  # two steps: the second batch's tensors are new (as the collator's are)
        batch = {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
        with torch.no_grad():
            model(**{"use_cache": False, **batch})
        assert counted["attention calls"] == SIZE.layers * forward, counted
        assert counted["built"] == forward and counted["reads"] == reads * forward, (kind, counted)
