"""Host time of one `varlen_attention` forward+backward, with the device work stubbed out.

    python -m benchmarks.host_cost [--calls 300] [--profile VARIANT]   # on the CPU or a GPU
    python -m benchmarks.host_cost --quick                               # each variant a few calls (CI)

A workload whose GPU work is shorter than the host work that issues it is timed at its host
time (64x256 documents, d64, short documents): this measures that host time alone, per
variant of the call, with the native code path of the wrapper and no kernel run. Stubbed:
every Triton kernel (the attention kernels, the work lists, the padding fill, the device
check of the metadata, which returns "passed"), the tuner's timing (the first candidate
tile), and FA4's private forward and backward. On the CPU the tensors are CPU tensors, the
native path is forced (`interpreted` answers False in the wrapper's modules) and the few CUDA-only
queries are answered as an H200 would (compute capability 9.0, q "on a GPU" for FA4's
platform check): their cost is then not counted, a GPU run counts it. What remains is
everything else our Python does per call: argument checks, the metadata cache, autograd,
allocations, views, fills. FA4's own host path (its `flash_attn_varlen_func`, its argument
handling and kernel cache lookup) cannot be stubbed the same way, so it is not here
(`benchmarks/fa4_wrapper.py` times bare FA4 against the wrapper on the H200).

The layout: 8 sequences of 128 tokens, 2 heads of 128 (host work does not grow with the
sizes; small CPU tensors keep allocation out of the figure), bf16, inputs requiring grad, the
gradients taken with `torch.autograd.grad` (nothing accumulates). Every variant passes a
`VarlenMetadata`, as a training step does: "same metadata" builds one and passes it to every
call (the layers of a step), "new metadata" builds one per call (every call a new step, from
two sets of boundary tensors in turn, without paying for a clone), so its figure includes the
construction and the check of the boundaries. `--profile VARIANT` prints cProfile's top functions for one variant. Time on a
shared machine moves with the other processes (the figure is the least of 15 runs); the counts
beside it do not: function calls, and Triton launches (natively tens of microseconds of host
time each, which the stubs do not cost here).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import pstats
from collections.abc import Callable, Iterator
from unittest import mock

import torch

import varlen_workbench.kernels.interpreter as interpreter
import varlen_workbench.kernels.varlen.device_check as device_check
import varlen_workbench.kernels.varlen.fa4 as fa4
import varlen_workbench.kernels.varlen.launch as launch
import varlen_workbench.kernels.varlen.metadata as metadata
import varlen_workbench.kernels.varlen.op as op
import varlen_workbench.kernels.varlen.tuner as tuner
from varlen_workbench.workbench.timing import host_us

SEQS, ROWS, HEADS, HEAD_DIM, TAIL = 8, 128, 2, 128, 32

# name: (backend, validate, new metadata every call, TAIL rows)
VARIANTS = {
    "triton, validate=False": ("triton", False, False, 0),
    "triton, validate=True, same metadata": ("triton", True, False, 0),
    "triton, validate=True, new metadata": ("triton", True, True, 0),
    "fa4, same metadata": ("fa4", True, False, 0),
    "fa4, same metadata, TAIL rows": ("fa4", True, False, TAIL),
    "fa4, new metadata": ("fa4", True, True, 0),
}
KERNELS = (
    (launch, "attention_forward_kernel"),
    (launch, "attention_backward_dq_kernel"),
    (launch, "attention_backward_dkdv_kernel"),
    (launch, "block_starts_kernel"),
    (launch, "fill_padding_rows_kernel"),
    (device_check, "check_metadata_kernel"),
)


class StubKernel:
    """A Triton kernel that launches nothing: `kernel[grid](*args)` only counts the launch."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid) -> Callable[..., None]:
        return self._launch

    def _launch(self, *args, **kwargs) -> None:
        self.launches += 1


class StubCheck(StubKernel):
    """The metadata check, passing: its safe copies and snapshot written, and its verdict: 0
    failed checks, no padding rows (the triton variants' layout has none), the real row counts
    and no GAP rows (no variant has padded boundaries); the work lists it writes are left as
    they are (only stubbed kernels read them). A few torch ops, counted in the time of
    the variants that check new metadata. On the CPU the verdict is known at once (no event to
    wait for), on an idle GPU within microseconds, so those calls skip the padding fills, as
    the later layers of a step do; in training the forward of a new batch finds its check
    still queued behind earlier work and fills."""

    def _launch(self, cu_q, cu_k, cu_q_padded, cu_k_padded, safe, verdict, work, n_seqs, *args, **kwargs) -> None:
        self.launches += 1
        safe[:, : n_seqs + 1] = torch.stack((cu_q, cu_k, cu_q_padded, cu_k_padded) * 2)
        verdict.zero_()
        verdict[2:4] = torch.stack((cu_q[-1], cu_k[-1]))


class StubFA4:
    """FA4's private forward and backward, writing nothing; counts their calls."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, q, k, v, *, out, lse, **arguments):
        self.calls += 1
        return out, lse, None, None, None

    def backward(self, q, k, v, out, d_out, lse, *, dq, dk, dv, **arguments):
        self.calls += 1
        return dq, dk, dv


@contextlib.contextmanager
def stubbed(device: torch.device) -> Iterator[dict[str, StubKernel | StubFA4]]:
    """The native wrapper with every kernel, the tuner's timing and spill reading, and FA4's
    functions stubbed."""
    stubs: dict[str, StubKernel | StubFA4] = {
        name: StubCheck() if name == "check_metadata_kernel" else StubKernel() for _, name in KERNELS
    }
    stub_fa4 = stubs["fa4"] = StubFA4()
    with contextlib.ExitStack() as stack:
        for module, name in KERNELS:
            stack.enter_context(mock.patch.object(module, name, stubs[name]))
        for module in (metadata, launch, fa4, interpreter):
            stack.enter_context(mock.patch.object(module, "interpreted", lambda where: False))
        stack.enter_context(mock.patch.object(launch.tuner(), "_time", lambda key, candidates, run: candidates[0]))
        stack.enter_context(mock.patch.object(launch.tuner(), "_spills", lambda key, candidates, run, **_: {candidates[0]: 0}))
        stack.enter_context(mock.patch.object(launch.tuner(), "chosen", {}))
        # cached as the real `load` is: its per-call cost, a cache lookup, stays
        kernels = fa4.Kernels(stub_fa4.forward, stub_fa4.backward)
        stack.enter_context(mock.patch.object(fa4, "load", functools.cache(lambda: kernels)))
        if device.type != "cuda":  # the CUDA-only queries, answered as on an H200
            stack.enter_context(mock.patch.object(op, "check_kernel_device", lambda name, tensor: None))
            stack.enter_context(mock.patch.object(launch, "device_capability", lambda device: (9, 0)))
            stack.enter_context(mock.patch.object(tuner, "_may_synchronize", lambda: True))  # no capture
            stack.enter_context(mock.patch.object(fa4, "platform_reason", lambda q: None))
        yield stubs


def check_stubs_ran(name: str, calls: int, ran: dict[str, int]) -> None:
    """That the variant's `calls` went where it says (`ran`: calls of each stub during them):
    the attention kernel or FA4 (forward and backward) every call, the metadata check every
    call on new metadata, none on the same (checked once, when it was built, before the calls),
    never without validation."""
    backend, validate, fresh, _ = VARIANTS[name]
    expected = {
        "attention_forward_kernel": calls if backend == "triton" else 0,
        "fa4": 2 * calls if backend == "fa4" else 0,
        "check_metadata_kernel": (calls if fresh else 0) if validate else 0,
    }
    wrong = {stub: (ran[stub], runs) for stub, runs in expected.items() if ran[stub] != runs}
    if wrong:
        raise AssertionError(f"{name}: stub calls (made, expected) differ: {wrong}")


def variant_call(name: str, device: torch.device) -> Callable[[], object]:
    """One forward+backward of the variant, as a zero-argument call."""
    backend, validate, fresh, tail = VARIANTS[name]
    lengths = torch.full((SEQS,), ROWS)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(device)
    rows = SEQS * ROWS + tail
    boundaries = [(cu.clone(), cu.clone()) for _ in range(2 if fresh else 1)]
    q, k, v = (torch.randn(rows, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    turn = [0]

    def batch_metadata() -> metadata.VarlenMetadata:
        return metadata.VarlenMetadata(*boundaries[turn[0]], ROWS, ROWS, total_q=rows, total_k=rows, validate=validate)

    step = [batch_metadata()]

    def call():
        if fresh:
            turn[0] ^= 1
            step[0] = batch_metadata()
        out = op.varlen_attention(q, k, v, metadata=step[0], causal=True, backend=backend)
        return torch.autograd.grad(out, (q, k, v), grad)

    return call


def profiled(call: Callable[[], object], calls: int) -> pstats.Stats:
    call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    return pstats.Stats(profiler)


def function_calls(call: Callable[[], object], calls: int = 20) -> float:
    """Python and builtin function calls per call (torch's methods among them), as cProfile
    counts them: a figure that, unlike time, contention from other processes cannot move."""
    return profiled(call, calls).total_calls / calls  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--profile", choices=VARIANTS, help="print cProfile's top functions for this variant")
    parser.add_argument("--quick", action="store_true", help="each variant a few calls, untimed (CI)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    with stubbed(device) as stubs:
        if args.profile:
            profiled(variant_call(args.profile, device), args.calls).sort_stats("tottime").print_stats(40)
            return 0
        print(f"device {device}, torch {torch.__version__}; per forward+backward, kernels stubbed:")
        print(f"{'variant':40s} {'host us':>8s} {'function calls':>15s} {'launches':>9s}")
        for name in VARIANTS:
            calls = [0]
            step = variant_call(name, device)

            def call(step=step, calls=calls):
                calls[0] += 1
                step()

            before = {stub: counted(s) for stub, s in stubs.items()}
            if args.quick:
                for _ in range(3):
                    call()
                print(f"{name:40s} ran (not timed)")
            else:
                us, n = host_us(call, args.calls, repeats=15), function_calls(call)
                print(f"{name:40s} {us:8.1f} {n:15.0f} {launches_per_call(stubs, call):9.1f}")
            check_stubs_ran(name, calls[0], {stub: counted(s) - before[stub] for stub, s in stubs.items()})
    return 0


def launches_per_call(stubs: dict[str, StubKernel | StubFA4], call: Callable[[], object], calls: int = 10) -> float:
    """Triton launches per call (the metadata check's among them), in the steady state."""
    before = sum(s.launches for s in stubs.values() if isinstance(s, StubKernel))
    for _ in range(calls):
        call()
    return (sum(s.launches for s in stubs.values() if isinstance(s, StubKernel)) - before) / calls


def counted(stub: StubKernel | StubFA4) -> int:
    return stub.launches if isinstance(stub, StubKernel) else stub.calls


if __name__ == "__main__":
    raise SystemExit(main())
