"""One implementation's forward + backward on a padded layout: the program compute-sanitizer watches.

    python scripts/audit_sanitize.py ROW          # ROW: a row of varlen_workbench.workbench.audit.adapters.MATRIX

The layout has GAP rows (where the path can express a padded layout), TAIL rows (where it can
express them), an empty sequence, unequal lengths and GQA where expressible, 4 heads, head
dim 64, bfloat16: the rows a kernel might leave unwritten or read uninitialised. The oracle
is skipped (it runs on the CPU, which the sanitizer does not watch).

What the row cannot run as written, the program gives up and says so, one line each
("ROW: reduced: ..."), so that the tools still watch what the row runs: a layout its adapter
refuses (an SDPA backend without a kernel for it: "No available kernel") loses GQA, then
unequal lengths, then causality, until one is taken; a backward that raises where the forward
runs (flash-dmattn 1.2.2's Triton backward without a bias returns a gradient for the None
input, and autograd raises) leaves the forward alone. The counts cover every attempt. The last
line names the layout and what ran: "ROW: LAYOUT forward+backward in S s" (or "forward only").
Runs on a machine with only torch and triton (plus the audited package).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

# What a refused layout gives up, in turn: (the feature, the layout without it, said as).
REDUCTIONS: tuple[tuple[str, Callable[[Any], Any], str], ...] = (
    ("gqa", lambda c: c.with_(kv_heads=None), "without GQA"),
    ("unequal", lambda c: c.with_(seqlens_k=None, padded_k=c.padded_q), "with equal query and key lengths"),
    ("causal", lambda c: c.with_(causal=False), "without causality"),
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def watch(impl, case, say: Callable[[str], None]) -> tuple[Any, str]:
    """Runs `case` forward and backward through `impl` on the device, or what of it the row can
    run (see the module docstring), saying each reduction; (the layout run, what ran)."""
    from varlen_workbench.workbench.audit.adapters import AdapterRefused
    from varlen_workbench.workbench.layout import pack
    from varlen_workbench.workbench.probes import probe

    def run(case, backward: bool) -> None:
        probe(impl, pack(case, impl.device), reference=False, backward=backward, **impl.case_kwargs(case))

    if not impl.backward:  # the adapter says why this device runs no backward
        say(f"reduced: forward only: {impl.lacks.get('backward', 'the adapter runs no backward here')}")
        run(case, backward=False)
        return case, "forward only"
    refused = ""
    for _, reduce, said in ((None, None, ""), *REDUCTIONS):
        if reduce is not None:
            smaller = reduce(case)
            if smaller == case:
                continue
            say(f"reduced: {said} (the layout with it was refused: {refused})")
            case = smaller
        try:
            run(case, backward=True)
            return case, "forward+backward"
        except AdapterRefused as exc:
            refused = str(exc)
        except Exception as exc:  # the forward alone tells whether the backward is what raised
            run(case, backward=False)  # raises again if the forward is what fails
            say(f"reduced: forward only: the backward raises {_first_line(exc)[:300]} (the counts include that attempt)")
            return case, "forward only"
    raise AdapterRefused(f"every layout was refused, the last: {refused}")


def main(row: str) -> int:
    import torch

    from varlen_workbench.workbench.audit import adapt
    from varlen_workbench.workbench.audit.adapters import MATRIX
    from varlen_workbench.workbench.audit.checks import Context
    from varlen_workbench.workbench.audit.sanitizer import NOT_APPLICABLE
    from varlen_workbench.workbench.layout import Fill

    rows = {name: (target, adapter) for name, target, adapter in MATRIX}
    if row not in rows:
        print(
            f"audit_sanitize: row {row!r} is not in varlen_workbench.workbench.audit.adapters.MATRIX: {sorted(rows)}",
            file=sys.stderr,
        )
        return 2
    impl = adapt(rows[row][0], rows[row][1], "cuda")
    why = impl.why_not()
    if why:
        print(f"{row}: {NOT_APPLICABLE}: {why}")
        return 3
    ctx = Context(impl, "bfloat16", head_dim=64)
    unequal = "unequal" not in impl.lacks
    gqa = "gqa" not in impl.lacks
    case = ctx.case(
        (37, 0, 100, 64),
        seqlens_k=(40, 5, 100, 64) if unequal else None,
        padded_q=(48, 3, 128, 64),
        padded_k=(48, 8, 112, 70) if unequal else (48, 3, 128, 64),
        tail_q=5,
        tail_k=3,
        heads=4,
        kv_heads=2 if gqa else None,
        causal="causal" not in impl.lacks,
        fill=Fill.ZEROS,
    )
    start = time.perf_counter()
    ran, what = watch(impl, case, lambda line: print(f"{row}: {line}", flush=True))
    torch.cuda.synchronize()
    print(f"{row}: {ran.label()} {what} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]) if len(sys.argv) == 2 else 2)
