"""One implementation's forward + backward on a padded layout: the program compute-sanitizer watches.

    python scripts/audit_sanitize.py ROW          # ROW: a row of workbench.audit.adapters.MATRIX

The layout has GAP rows (where the path can express a padded layout), TAIL rows (where it can
express them), an empty sequence, unequal lengths and GQA where expressible, 4 heads, head
dim 64, bfloat16: the rows a kernel might leave unwritten or read uninitialised. The oracle
is skipped (it runs on the CPU, which the sanitizer does not watch). Prints one line: the
row, the case and the seconds. Runs on a machine with only torch and triton (plus the
audited package).
"""

from __future__ import annotations

import sys
import time


def main(row: str) -> int:
    import torch

    from workbench.audit import adapt
    from workbench.audit.adapters import MATRIX
    from workbench.audit.checks import Context
    from workbench.audit.sanitizer import NOT_APPLICABLE
    from workbench.layout import Fill, pack
    from workbench.probes import probe

    rows = {name: (target, adapter) for name, target, adapter in MATRIX}
    if row not in rows:
        print(f"audit_sanitize: row {row!r} is not in workbench.audit.adapters.MATRIX: {sorted(rows)}", file=sys.stderr)
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
    probe(impl, pack(case, impl.device), reference=False, **impl.case_kwargs(case))
    torch.cuda.synchronize()
    print(f"{row}: {case.label()} forward+backward in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]) if len(sys.argv) == 2 else 2)
