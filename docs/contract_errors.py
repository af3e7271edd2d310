"""Prints the error table of docs/contract.md from the code: every malformed call of
`varlen_workbench.workbench.malformed.CATALOGUE`, made against `varlen_workbench.kernels.varlen.varlen_attention` on CPU tensors, with
the exception and message a user gets, and whether `validate=False` still raises it.

    python docs/contract_errors.py        # the table, to paste between the doc's markers

`tests/test_contract_doc.py` fails when the doc's table and this output differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import varlen_workbench.kernels.varlen.metadata as metadata
import varlen_workbench.kernels.varlen.op as op
from varlen_workbench.kernels.varlen.backends import registered
from varlen_workbench.workbench.malformed import CATALOGUE, base_args, split_call

ROOT = Path(__file__).resolve().parent.parent

BEGIN, END = "<!-- error-table:begin (python docs/contract_errors.py) -->", "<!-- error-table:end -->"

# In our words: what is wrong with the call. Every catalogue case needs one.
WHAT = {
    "cu-not-tensor": "`cu_seqlens_q` is a Python list",
    "cu-float": "`cu_seqlens_q` is a float tensor",
    "cu-2d": "`cu_seqlens_k` is 2-D",
    "cu-too-short": "`cu_seqlens_q` holds one boundary: no sequence",
    "cu-not-from-zero": "`cu_seqlens_q` starts at 1",
    "cu-decreasing": "`cu_seqlens_k` decreases",
    "padded-decreasing": "`cu_seqlens_q_padded` decreases",
    "padded-not-from-zero": "`cu_seqlens_k_padded` starts at 2",
    "batch-mismatch-q-k": "q and k describe different numbers of sequences",
    "batch-mismatch-padded": "`cu_seqlens_q_padded` describes fewer sequences than `cu_seqlens_q`",
    "real-longer-than-padded": "a sequence's real length exceeds its padded slot",
    "padded-end-past-q": "the padded layout ends past q's last row",
    "real-end-past-k-no-padded": "the layout ends past k's last row",
    "max-seqlen-too-small": "`max_seqlen_q` is below the longest real sequence",
    "max-seqlen-not-int": "`max_seqlen_k` is a tensor",
    "max-seqlen-bool": "`max_seqlen_k` is a bool",
    "heads-not-multiple": "q's heads are not a multiple of k's",
    "head-dim-unsupported": "a head dim that is not a multiple of 8 (20)",
    "head-dim-v-unsupported": "v's head dim is not a multiple of 8 (20)",
    "head-dim-q-k-differ": "q and k differ in head dim",
    "q-not-3d": "q is 2-D",
    "k-v-shape-differ": "k and v differ in rows",
    "k-v-heads-differ": "k and v differ in heads",
    "dtype-mixed": "q, k and v differ in dtype",
    "dtype-unsupported": "float64 inputs",
    "q-integer": "q is an integer tensor",
    "q-not-tensor": "q is a nested list",
    "device-differs": "`cu_seqlens_q` is on another device than q",
    "scale-negative": "`scale` is negative",
    "scale-nan": "`scale` is NaN",
    "scale-tensor": "`scale` is a tensor",
    "window-not-pair": "`window_size` is one int, not a (left, right) pair",
    "window-three-entries": "`window_size` has three entries",
    "window-below-minus-one": "a `window_size` bound below -1, (-2, 0)",
    "window-bound-float": "a `window_size` bound is a float, (0, 1.5)",
    "window-bound-bool": "a `window_size` bound is a bool, (True, 0)",
}


class Launched(Exception):
    """The call passed every check and reached the kernel (which is not run here)."""


@contextlib.contextmanager
def checks_only() -> Iterator[None]:
    """`varlen_attention` with its checks and without its kernel: a call that passes them
    raises `Launched` instead of running Triton (which a malformed layout could crash)."""

    def launched(*args, **kwargs):
        raise Launched

    with contextlib.ExitStack() as stack:
        for backend in registered():  # where `varlen_attention` hands the call over, whichever backend
            stack.enter_context(mock.patch.object(backend, "run", launched))
        stack.enter_context(mock.patch.object(op, "check_kernel_device", lambda *a: None))
        # natively the boundary values are checked by a kernel after the launch; the host check
        # raises the same errors (tests/test_kernel_device_check.py) before it
        stack.enter_context(mock.patch.object(metadata, "checks_on_device", lambda boundary: False))
        yield


@dataclass(frozen=True)
class Row:
    id: str
    what: str
    exception: str
    message: str
    without_validation: bool  # validate=False raises the same

    def markdown(self) -> str:
        message = self.message.replace("|", "\\|")
        return f"| {self.what} | `{self.exception}`: {message} | {'yes' if self.without_validation else 'no'} |"


def outcome(call: dict, validate: bool) -> BaseException | None:
    positional, keywords = split_call(call)
    with checks_only():
        try:
            op.varlen_attention(*positional, **keywords, validate=validate)
        except Launched:
            return None
        except (TypeError, ValueError) as exc:
            return exc
    raise AssertionError("unreachable: the call neither raised nor launched")


def rows() -> list[Row]:
    found = []
    for case in CATALOGUE:
        if case.id not in WHAT:
            raise KeyError(f"docs/contract_errors.py: say in WHAT what catalogue case {case.id!r} gets wrong.")
        call = case.build(base_args())
        checked = outcome(call, validate=True)
        if checked is None:
            raise AssertionError(f"{case.id}: varlen_attention accepted a malformed call")
        unchecked = outcome(call, validate=False)
        same = unchecked is not None and type(unchecked) is type(checked) and str(unchecked) == str(checked)
        found.append(Row(case.id, WHAT[case.id], type(checked).__name__, str(checked), same))
    return found


def table() -> str:
    header = ["| malformed input | what `varlen_attention` raises | also with `validate=False` |", "| --- | --- | --- |"]
    return "\n".join([BEGIN, *header, *(r.markdown() for r in rows()), END])


if __name__ == "__main__":
    print(table())
