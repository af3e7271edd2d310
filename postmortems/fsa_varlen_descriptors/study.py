"""The study of fsa-varlen-descriptors: the library's calls under the interpreter, every descriptor
recorded, bare and with the workarounds; and the H200 records.

`repacked(function, multiple)` is the workaround, with flash-sparse-attn's own function: it calls
`function` on a copy of the batch in which no sequence is empty and each sequence's query rows are
padded to a multiple of `multiple` with dummy rows placed at its START, then takes the real rows
back. flash-sparse-attn aligns a causal mask to the bottom right (block_info.py: key index n is
visible to query m when n <= m + seqlen_k - seqlen_q), so with p dummy rows in front a real query
keeps exactly its keys and the dummy rows see none (causal) or all of them (not causal); their
outputs are dropped, so their dO is 0 and they add nothing to dk, dv.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from postmortems.fsa_varlen_descriptors.audit import first_call
from postmortems.fsa_varlen_descriptors.cases import (
    AUDITS,
    CASES,
    EMPTY_CHECK,
    FUNCTIONS,
    LSE_ALIGNMENT,
    MISALIGNED_CHECKS,
    PREPROCESS_FILE,
    SANITIZERS,
    WITH_EMPTY,
    WORKAROUND_H200,
)
from postmortems.fsa_varlen_descriptors.upstream import load, recorded_descriptors, summarize_descriptors
from workbench import Case, pack, probe
from workbench.postmortem import Results
from workbench.provenance import GPU_DATA
from workbench.records import read_record
from workbench.upstream import installed_file

_BASE = re.compile(r"(\w+_base) = seqlen_info\.offset_batch_Q\((?:[^()]|\([^()]*\))*?USE_PADDED=(True|False)", re.S)

BARE, NO_EMPTY, ALIGNED = "as is", "(a) empty sequences dropped", f"(b) queries padded to a multiple of {LSE_ALIGNMENT}"
MULTIPLES = {NO_EMPTY: 1, ALIGNED: LSE_ALIGNMENT}


def misaligned_lse_bases(cu_seqlens_q: torch.Tensor, rows_q: int, heads: int) -> list[tuple[int, int]]:
    """The (sequence, head) pairs whose lse descriptor base, LSE + h * rows_q + cu_seqlens_q[b] float32
    elements (lse is (heads, rows_q), rows_q counting TAIL rows), is not 16-byte aligned: what the
    backward preprocess kernel's programs for them build, empty sequences included."""
    starts = cu_seqlens_q.tolist()[:-1]
    return [(b, h) for h in range(heads) for b, start in enumerate(starts) if (h * rows_q + start) % LSE_ALIGNMENT]


def repack_plan(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, rows_q: int, multiple: int):
    """Where each row of the call's batch comes from, and where each of the caller's query rows goes.

    Returns (rows_q_call, cu_q_call, rows_k_call, cu_k_call, back), host lists: the call's query row i
    is the caller's row rows_q_call[i], or a dummy (zero) row where it is `rows_q`; back[r] is the
    call's row holding the caller's query row r, or len(rows_q_call) (a zero row) for a row the call
    does not see (a sequence dropped, a TAIL row). A sequence with no query or no key is dropped:
    its query rows have no key to attend, so their output is 0 and no descriptor of extent 0 is built.
    """
    if multiple < 1:
        raise ValueError(f"multiple={multiple}: pass a positive row multiple (4 aligns fsa's float32 lse)")
    sq, sk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(sq) != len(sk):
        raise ValueError(f"cu_seqlens_q has {len(sq)} entries and cu_seqlens_k {len(sk)}: one boundary list per batch")
    rows_q_call: list[int] = []
    rows_k_call: list[int] = []
    cu_q_call, cu_k_call = [0], [0]
    back: list[int | None] = [None] * rows_q
    for b in range(len(sq) - 1):
        length_q, length_k = sq[b + 1] - sq[b], sk[b + 1] - sk[b]
        if length_q == 0 or length_k == 0:
            continue
        rows_q_call += [rows_q] * (-length_q % multiple)  # dummy rows first: the real rows keep their causal keys
        for r in range(sq[b], sq[b + 1]):
            back[r] = len(rows_q_call)
            rows_q_call.append(r)
        rows_k_call += range(sk[b], sk[b + 1])
        cu_q_call.append(len(rows_q_call))
        cu_k_call.append(len(rows_k_call))
    unseen = len(rows_q_call)
    return rows_q_call, cu_q_call, rows_k_call, cu_k_call, [unseen if r is None else r for r in back]


def repacked(function: Callable, multiple: int = LSE_ALIGNMENT) -> Callable:
    """flash-sparse-attn's varlen `function` (its signature) called on the repacked batch of
    `repack_plan`: no empty sequence, every sequence start a multiple of `multiple` (4: every lse
    base 16-byte aligned). Gathers only: autograd gives dropped and dummy rows no gradient."""

    def call(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False, **kwargs):
        rows_q, cu_q, rows_k, cu_k, back = repack_plan(cu_seqlens_q, cu_seqlens_k, query.shape[0], multiple)
        device = query.device
        if not rows_q:  # no sequence has both queries and keys: every output row is 0
            return torch.where(torch.zeros_like(query, dtype=torch.bool), query, 0)
        index = torch.tensor(rows_q, device=device)
        q = torch.cat([query, query.new_zeros(1, *query.shape[1:])])[index]
        k, v = (t[torch.tensor(rows_k, device=device)] for t in (key, value))
        lengths_q, lengths_k = torch.tensor(cu_q).diff(), torch.tensor(cu_k).diff()
        out = function(
            q, k, v, torch.tensor(cu_q, dtype=torch.int32, device=device), torch.tensor(cu_k, dtype=torch.int32, device=device),
            int(lengths_q.max()), int(lengths_k.max()), is_causal=is_causal, **kwargs,
        )  # fmt: skip
        return torch.cat([out, out.new_zeros(1, *out.shape[1:])])[torch.tensor(back, device=device)]

    return call


def contract(function: Callable) -> Callable:
    """flash-sparse-attn's varlen call shape behind the contract's signature, for `probe`."""

    def call(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, scale=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None):
        padded = ((p, cu) for p, cu in ((cu_seqlens_q_padded, cu_q), (cu_seqlens_k_padded, cu_k)) if p is not None)
        if any(not torch.equal(p, cu) for p, cu in padded):
            raise ValueError("flash-sparse-attn's varlen functions take no padded layout: study cases without GAP rows")
        return function(q, k, v, cu_q.int(), cu_k.int(), max_q, max_k, is_causal=causal, softmax_scale=scale)

    return call


@dataclass
class Call:
    """One forward + backward of flash-sparse-attn under the interpreter: its probe against the float64
    oracle, and every descriptor its kernels built (summarized per kernel and source line)."""

    function: str
    variant: str
    case: Case
    probe: Any
    descriptors: list[dict]

    @property
    def misaligned(self) -> int:
        """Programs that built a descriptor breaking Triton's 16-byte rule (a fault on the GPU)."""
        return sum(n for d in self.descriptors if "violation" in d for m, n in d["base_mod16"].items() if int(m) % 16)

    @property
    def zero_extent(self) -> int:
        """Programs that built a descriptor over no element."""
        return sum(d.get("zero_extent", 0) for d in self.descriptors)

    def violations(self) -> set[tuple[str, str]]:
        return {(d["kernel"], d["site"].rsplit(":", 1)[0]) for d in self.descriptors if "violation" in d}


def measure(called: Callable, case: Case, name: str) -> tuple[Any, list[dict]]:
    """`called` (fsa's varlen signature) forward and backward on `case` under the interpreter: its
    probe against the float64 oracle, and its descriptors summarized."""
    load("cpu")
    # numpy's warnings for the -inf lse of rows without a key, which the kernels handle: not news
    with recorded_descriptors() as records, np.errstate(divide="ignore", invalid="ignore"):
        record = probe(contract(called), pack(case, "cpu"), name=name)
    return record, summarize_descriptors(records)


def run(function: str, variant: str, case: Case) -> Call:
    """`function` of flash-sparse-attn (bare, or with a workaround) on `case`, under the interpreter."""
    called = getattr(load("cpu"), function)
    if variant != BARE:
        called = repacked(called, MULTIPLES[variant])
    return Call(function, variant, case, *measure(called, case, f"{function} {variant}"))


def first_call_layout(check: str) -> dict[str, Any]:
    """The layout of the first call `check` made on the H200 (the same for both functions): its lse
    bases misaligned, of how many, and its empty sequences. Arithmetic on the boundaries only."""
    _, case, _ = first_call(check, FUNCTIONS[0])
    batch = pack(case, "cpu")
    rows, heads = batch.q.shape[0], batch.q.shape[1]
    lengths_q = batch.cu_seqlens_q.diff().tolist()
    return {
        "layout": case.label(),
        "misaligned": len(misaligned_lse_bases(batch.cu_seqlens_q, rows, heads)),
        "bases": heads * len(lengths_q),
        "empty": lengths_q.count(0),  # sequences with no query: the forward's descriptors of extent 0
    }


@dataclass
class FsaDescriptorResults(Results):
    """The calls under the interpreter, the layouts of the audit checks' first calls, and the H200
    records (audit and sanitizer per row, the workaround's calls)."""

    calls: list[Call]
    first_calls: dict[str, dict[str, Any]]
    audits: dict[str, dict[str, Any]]
    sanitizers: dict[str, dict[str, Any]]
    workaround_h200: dict[str, Any]

    def call(self, function: str, variant: str, case: Case) -> Call:
        return next(c for c in self.calls if (c.function, c.variant, c.case) == (function, variant, case))


def preprocess_source() -> dict[str, bool]:
    """{base: USE_PADDED} of each descriptor base in the installed wheel's backward preprocess kernel."""
    text = installed_file("flash-sparse-attn", PREPROCESS_FILE).read_text()
    return {name: padded == "True" for name, padded in _BASE.findall(text) if name in ("lse_base", "dpsum_base", "lse_log2_base")}


def gpu_record(name: str) -> dict[str, Any]:
    """One committed H200 record under data/gpu, with its file name."""
    return {**read_record(GPU_DATA / name), "file": name}


def reproduce(device=None) -> FsaDescriptorResults:
    """Every case bare and with (b), the cases with an empty sequence with (a) too, through both functions."""
    if device not in (None, "cpu"):
        raise ValueError(f"device={device!r}: this study runs the library under the interpreter; its GPU runs are the records")
    plan = [(v, c) for c in CASES for v in (BARE, NO_EMPTY, ALIGNED) if v != NO_EMPTY or c in WITH_EMPTY]
    return FsaDescriptorResults(
        calls=[run(f, v, c) for f in FUNCTIONS for v, c in plan],
        first_calls={check: first_call_layout(check) for check in (*MISALIGNED_CHECKS, EMPTY_CHECK)},
        audits={row: gpu_record(name) for row, name in AUDITS.items()},
        sanitizers={row: gpu_record(name) for row, name in SANITIZERS.items()},
        workaround_h200=gpu_record(WORKAROUND_H200),
    )
