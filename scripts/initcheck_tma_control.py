"""Does compute-sanitizer's initcheck see a store made through a tensor descriptor (TMA)? A control for
the audit matrix's initcheck counts, whose largest fall on memory that a TMA-storing kernel wrote
(cuDNN's fused attention, FlashAttention-4) and another kernel then read.

    python scripts/initcheck_tma_control.py --variant pointer|descriptor      # one program (GPU or CPU)
    python scripts/initcheck_tma_control.py [--record data/gpu/initcheck-tma-control-h200.json]   # GPU

One program allocates an output with `torch.empty` (never written), writes every element of it with
one Triton kernel, by pointer stores (`tl.store`) or through a tensor descriptor
(`tl.make_tensor_descriptor(...).store`, a TMA store on sm_90), then compares it with its source in a
torch kernel, which reads every element: "written exactly: True" proves that every element was
written before that read. The driver runs both programs under initcheck (each tensor its own
allocation) and records its reports, with the frame of each. Every element being written, any report
on the descriptor program, and none on the pointer program's, is a false positive of initcheck in a
program that writes through a tensor descriptor: its counts on TMA-storing paths then say nothing by
themselves about unwritten memory. Where the reports fall (the torch read of the output, or the
kernel's own descriptor) says which memory initcheck misses: the frames tell.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from varlen_workbench.kernels.runtime import jit  # compiled on CUDA tensors, through the Triton interpreter on CPU tensors

# isort: split
import torch
import triton
import triton.language as tl

ROWS, DIM, BLOCK = 512, 64, 64  # bf16 rows of 128 bytes: TMA's 16-byte rules hold
VARIANTS = ("pointer", "descriptor")
PRINT_LIMIT = 100_000
WRITTEN = "written exactly:"


@jit
def copy_rows_kernel(Src, Dst, n_rows, DIM: tl.constexpr, BLOCK: tl.constexpr, DESCRIPTOR: tl.constexpr):
    start = tl.program_id(0) * BLOCK
    rows = start + tl.arange(0, BLOCK)
    offsets = rows[:, None] * DIM + tl.arange(0, DIM)[None, :]
    x = tl.load(Src + offsets, mask=rows[:, None] < n_rows)
    if DESCRIPTOR:
        tl.make_tensor_descriptor(Dst, shape=[n_rows, DIM], strides=[DIM, 1], block_shape=[BLOCK, DIM]).store([start, 0], x)
    else:
        tl.store(Dst + offsets, x, mask=rows[:, None] < n_rows)


def program(variant: str) -> bool:
    """Writes an uninitialised tensor by `variant` stores, then reads it back in torch: whether
    every element holds its source's value."""
    from varlen_workbench.kernels._compat import default_device
    from varlen_workbench.kernels.varlen.hopper import ensure_descriptor_allocator

    device = default_device()
    ensure_descriptor_allocator(device)  # device-side descriptors take their scratch from Triton's allocator
    src = torch.randn(ROWS, DIM, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_rows_kernel[(triton.cdiv(ROWS, BLOCK),)](src, dst, ROWS, DIM=DIM, BLOCK=BLOCK, DESCRIPTOR=variant == "descriptor")
    return bool(torch.equal(dst, src))  # the read initcheck watches


def frames(log: str) -> dict[str, int]:
    """Printed reports per device frame ('copy_rows_kernel in initcheck_tma_control.py:48'): whether
    initcheck flags the torch read of the output or the copy kernel's own descriptor."""
    found = re.findall(r"^=+\s+at (.+?)\+0x[0-9a-f]+(?: in (\S+))?$", log, re.M)
    return dict(Counter(f"{name} in {Path(where).name}" if where else name for name, where in found))


def sanitized(variant: str, exe: str) -> dict:
    """One program under initcheck: its reports (`varlen_workbench.workbench.audit.sanitizer.parse`) and its own verdict."""
    from varlen_workbench.workbench.audit.sanitizer import parse

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "initcheck.log"
        # Every report printed (8,448 on the H200 at 4727608), so that the frames account for the whole count.
        command = [
            exe,
            "--tool",
            "initcheck",
            "--report-api-errors",
            "no",
            "--print-limit",
            str(PRINT_LIMIT),
            "--log-file",
            str(log),
        ]
        env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
        done = subprocess.run(
            [*command, sys.executable, __file__, "--variant", variant], capture_output=True, text=True, env=env, timeout=300
        )
        text = log.read_text(errors="replace") if log.exists() else ""
        run = parse(text, "initcheck")
    output = done.stdout + done.stderr
    return {
        "variant": variant,
        "errors": run.errors,
        "first": run.first,
        "frames": frames(text),
        "written": f"{WRITTEN} True" in output,
        "rc": done.returncode,
    }


def conclusion(runs: dict[str, dict]) -> str:
    """What the two runs say about initcheck and TMA stores (both programs must have written every
    element); where the descriptor program's printed frames account for its whole count, also which
    reads it flagged: inside the copy kernel, or torch's read of the memory written through it."""
    pointer, descriptor = runs["pointer"], runs["descriptor"]
    if not (pointer["written"] and descriptor["written"]) or None in (pointer["errors"], descriptor["errors"]):
        return "inconclusive: a program did not write every element, or initcheck gave no count"
    if pointer["errors"] == descriptor["errors"] == 0:
        return "initcheck sees TMA stores: no report on either read"
    if pointer["errors"] != 0:
        return "inconclusive: the pointer program's read is reported too"
    frames = descriptor.get("frames") or {}
    in_copy = sum(n for frame, n in frames.items() if frame.startswith("copy_rows_kernel "))
    if sum(frames.values()) != descriptor["errors"]:
        return (
            "initcheck reports false positives in a program that writes every element through a tensor descriptor "
            "(none with pointer stores); not every report was printed, so which reads it flags is open"
        )
    if in_copy == descriptor["errors"]:
        return (
            "initcheck reports false positives inside the kernel that stores through a tensor descriptor, none on "
            "torch's read of the memory written through it: that memory counts as written"
        )
    return (
        f"initcheck misses TMA stores: {descriptor['errors'] - in_copy} of its reports fall outside the copy kernel, "
        "on the read of memory written through the descriptor"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, help="run one program (what the driver runs under initcheck)")
    parser.add_argument("--record", help="write the driver's runs and conclusion here, with provenance")
    args = parser.parse_args()
    if args.variant:
        print(f"{args.variant}: {WRITTEN} {program(args.variant)}")
        return 0
    from varlen_workbench.workbench.audit.sanitizer import executable

    exe = executable()
    if exe is None or not torch.cuda.is_available():
        print("initcheck_tma_control: needs a CUDA GPU and compute-sanitizer; run --variant alone elsewhere", file=sys.stderr)
        return 2
    runs = {variant: sanitized(variant, exe) for variant in VARIANTS}
    for run in runs.values():
        print(f"{run['variant']:<11} written {run['written']}, initcheck errors {run['errors']}; first: {run['first'] or '-'}")
    verdict = conclusion(runs)
    print(verdict)
    if args.record:
        from varlen_workbench.workbench.records import write_record

        write_record(args.record, {"rows": ROWS, "dim": DIM, "block": BLOCK, "runs": runs, "conclusion": verdict})
    return 0


if __name__ == "__main__":
    sys.exit(main())
