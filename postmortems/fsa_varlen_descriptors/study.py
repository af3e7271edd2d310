"""The study of fsa-varlen-descriptors: the library's calls under the interpreter, every descriptor
recorded, bare and with the workarounds; and the H200 records.

`repacked(function, multiple)` is the workaround, with flash-sparse-attn's own function: it calls
`function` on a copy of the batch in which no sequence is empty and each sequence's query rows are
padded to a multiple of `multiple` with dummy rows placed at its START, then takes the real rows
back. flash-sparse-attn aligns a causal mask to the bottom right (block_info.py: key index n is
visible to query m when n <= m + seqlen_k - seqlen_q), so with p dummy rows in front a real query
keeps exactly its keys and the dummy rows see none (causal) or all of them (not causal); their
outputs are dropped, so their dO is 0 and they add nothing to dk, dv. Rows the call does not see (TAIL
rows, dropped sequences) come back 0, with gradient 0.

`real_rows(function)` is the smallest workaround for the unwritten TAIL rows alone: the call on the rows
up to cu_seqlens[-1], its output padded with zeros, so autograd gives q's TAIL rows gradient 0 too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from varlen_workbench.postmortems.fsa_varlen_descriptors.audit import first_call
from varlen_workbench.postmortems.fsa_varlen_descriptors.cases import (
    AUDITS,
    CASES,
    EMPTY_CHECK,
    FUNCTIONS,
    LSE_ALIGNMENT,
    MISALIGNED_CHECKS,
    MISALIGNED_H200,
    NO_QUERY_CHECK,
    PREPROCESS_FILE,
    SANITIZERS,
    TAIL_CASES,
    WITH_EMPTY,
    WORKAROUND_H200,
)
from varlen_workbench.postmortems.fsa_varlen_descriptors.upstream import load, recorded_descriptors, summarize_descriptors
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.postmortem import Results
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import read_record
from varlen_workbench.workbench.upstream import installed_file

_BASE = re.compile(r"(\w+_base) = seqlen_info\.offset_batch_Q\((?:[^()]|\([^()]*\))*?USE_PADDED=(True|False)", re.S)

BARE, NO_EMPTY, ALIGNED = "as is", "(a) empty sequences dropped", f"(b) queries padded to a multiple of {LSE_ALIGNMENT}"
REAL_ROWS = "(c) real rows only, zeros after"
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


def real_rows(function: Callable) -> Callable:
    """flash-sparse-attn's varlen `function` (its signature) on the rows up to cu_seqlens_q[-1] and
    cu_seqlens_k[-1] only, its output padded with zero rows back to q's: the rows past the end (TAIL),
    which fsa never writes, come back 0, and autograd gives q's, k's and v's TAIL rows gradient 0."""

    def call(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        rows_q, rows_k = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
        if rows_q == 0 or rows_k == 0:  # no real query or no real key: every output row is 0 (the graph kept)
            return torch.where(torch.zeros_like(query, dtype=torch.bool), query, 0)
        out = function(
            query[:rows_q], key[:rows_k], value[:rows_k], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs
        )
        return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, query.shape[0] - rows_q))

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


def measure(called: Callable, case: Case, name: str, poisoned: bool = False) -> tuple[Any, list[dict]]:
    """`called` (fsa's varlen signature) forward and backward on `case` under the interpreter: its
    probe against the float64 oracle (`poisoned`: fresh memory NaN, `varlen_workbench.workbench.instruments.poison.poisoned_memory`),
    and its descriptors summarized."""
    load("cpu")
    # numpy's warnings for the -inf lse of rows without a key, which the kernels handle: not news
    with recorded_descriptors() as records, np.errstate(divide="ignore", invalid="ignore"):
        record = probe(contract(called), pack(case, "cpu"), name=name, poisoned=poisoned)
    return record, summarize_descriptors(records)


def run(function: str, variant: str, case: Case, poisoned: bool = False) -> Call:
    """`function` of flash-sparse-attn (bare, or with a workaround) on `case`, under the interpreter
    (`poisoned`: in NaN-poisoned memory)."""
    called = getattr(load("cpu"), function)
    if variant == REAL_ROWS:
        called = real_rows(called)
    elif variant != BARE:
        called = repacked(called, MULTIPLES[variant])
    return Call(function, variant, case, *measure(called, case, f"{function} {variant}", poisoned))


def first_call_layout(check: str) -> dict[str, Any]:
    """The layout of the first call `check` made on the H200 (the same for both functions): its lse
    bases misaligned, of how many, and its empty sequences. Arithmetic on the boundaries only."""
    _, case, _ = first_call(check, FUNCTIONS[0])
    batch = pack(case, "cpu")
    rows, heads = batch.q.shape[0], batch.q.shape[1]
    lengths_q = batch.cu_seqlens_q.diff().tolist()
    return {
        "case": case,
        "layout": case.label(),
        "misaligned": len(misaligned_lse_bases(batch.cu_seqlens_q, rows, heads)),
        "bases": heads * len(lengths_q),
        "empty": lengths_q.count(0),  # sequences with no query: the forward's descriptors of extent 0
    }


@dataclass
class FsaDescriptorResults(Results):
    """The calls under the interpreter (`poisoned`: the calls with TAIL rows again, in NaN-poisoned
    memory), the layouts of the audit checks' first calls, and the H200 records (audit and sanitizer
    per row, each call alone with CUDA_LAUNCH_BLOCKING=1, the workaround's calls)."""

    calls: list[Call]
    poisoned: list[Call]
    first_calls: dict[str, dict[str, Any]]
    audits: dict[str, dict[str, Any]]
    sanitizers: dict[str, dict[str, Any]]
    misaligned_h200: dict[str, Any]
    workaround_h200: dict[str, Any]

    def call(self, function: str, variant: str, case: Case, poisoned: bool = False) -> Call:
        calls = self.poisoned if poisoned else self.calls
        return next(c for c in calls if (c.function, c.variant, c.case) == (function, variant, case))


def preprocess_source() -> dict[str, bool]:
    """{base: USE_PADDED} of each descriptor base in the installed wheel's backward preprocess kernel."""
    text = installed_file("flash-sparse-attn", PREPROCESS_FILE).read_text()
    return {name: padded == "True" for name, padded in _BASE.findall(text) if name in ("lse_base", "dpsum_base", "lse_log2_base")}


def varlen_allocations(file: str) -> dict[int, tuple[str, str]]:
    """{line: (function, the assignment)} of every `torch.empty_like(query` in the installed wheel's
    `file`, within its varlen forward or backward (`_flash_*_attn_varlen_*`)."""
    found, function = {}, ""
    for number, line in enumerate(installed_file("flash-sparse-attn", file).read_text().splitlines(), 1):
        if line.startswith("def "):
            function = line[4:].split("(")[0]
        if "torch.empty_like(query" in line and "_varlen_" in function:
            found[number] = (function, line.strip())
    return found


def gpu_record(name: str) -> dict[str, Any]:
    """One committed H200 record under data/gpu, with its file name."""
    return {**read_record(GPU_DATA / name), "file": name}


def reproduce(device=None) -> FsaDescriptorResults:
    """Every case bare and with (b), the cases with an empty sequence with (a) too, through both
    functions; the cases with TAIL rows bare, with (b) and with (c), in NaN-poisoned memory."""
    if device not in (None, "cpu"):
        raise ValueError(f"device={device!r}: this study runs the library under the interpreter; its GPU runs are the records")
    plan = [(v, c) for c in CASES for v in (BARE, NO_EMPTY, ALIGNED) if v != NO_EMPTY or c in WITH_EMPTY]
    return FsaDescriptorResults(
        calls=[run(f, v, c) for f in FUNCTIONS for v, c in plan],
        poisoned=[run(f, v, c, poisoned=True) for f in FUNCTIONS for c in TAIL_CASES for v in (BARE, ALIGNED, REAL_ROWS)],
        first_calls={check: first_call_layout(check) for check in (*MISALIGNED_CHECKS, EMPTY_CHECK, NO_QUERY_CHECK)},
        audits={row: gpu_record(name) for row, name in AUDITS.items()},
        sanitizers={row: gpu_record(name) for row, name in SANITIZERS.items()},
        misaligned_h200=gpu_record(MISALIGNED_H200),
        workaround_h200=gpu_record(WORKAROUND_H200),
    )
