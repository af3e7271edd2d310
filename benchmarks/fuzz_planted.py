"""Planted bugs: does the fuzzer find and shrink them as well with the shared strategy as before?

    python benchmarks/fuzz_planted.py [--seeds 10] [--budget 100] [--profile tiny] [--device cpu] [--record FILE]
    python benchmarks/fuzz_planted.py --summarize FILE    # the table of a recorded run

Each planted bug is the oracle (`varlen_workbench.workbench.reference.reference_attention`, CPU) made wrong exactly where
one layout feature appears: TAIL rows, a GAP row, an empty sequence, GQA, len_q != len_k. For
each bug and each fuzzing seed, both generators draw layouts the way the audit's fuzzer does
(layout `i` of run `s` from `random.Random(s * 1_000_003 + i)`), under the same poisoned probe
and checks; at the first layout that fails the bug's check, the fuzzer's own bounded shrinker
(`varlen_workbench.workbench.audit.fuzz.shrink`, the profile's probe budget) shrinks it. Reported per bug:
layouts to the first detection (a miss counts as the budget) and rows (q + k) of the shrunk
layout, mean over seeds, for the old generator (`old_random_case` below: the fuzzer's own
`_draw` before varlen_workbench.workbench.strategies, kept here only for this comparison) and the new one
(`varlen_workbench.workbench.audit.fuzz.random_case`: a `LayoutSpace` sample), and new / old ratios (< 1: better).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from varlen_workbench.workbench.audit import adapt
from varlen_workbench.workbench.audit.adapters import Adapted
from varlen_workbench.workbench.audit.fuzz import PROFILES, Profile, _allowed, random_case, run_layout, shrink
from varlen_workbench.workbench.layout import Case, Fill
from varlen_workbench.workbench.records import write_record
from varlen_workbench.workbench.reference import reference_attention

# -- the generator before varlen_workbench.workbench.strategies (the fuzzer's `_draw` at commit 6f6bf41) ----------


def old_random_case(rng: random.Random, impl: Adapted, profile: Profile) -> Case:
    while True:
        case = _old_draw(rng, impl, profile)
        if case.total_rows("q") and case.total_rows("k"):
            return case


def _old_draw(rng: random.Random, impl: Adapted, profile: Profile) -> Case:
    lacks = impl.lacks
    batch = rng.randint(1, profile.batch)

    def length() -> int:
        return rng.choice(profile.lengths) if rng.random() < 0.6 else rng.randint(0, profile.longest)

    seqlens_q = tuple(length() for _ in range(batch))
    seqlens_k = tuple(length() for _ in range(batch)) if "unequal" not in lacks and rng.random() < 0.5 else None
    padded = {}
    if "padded" not in lacks and rng.random() < 0.6:
        padded["padded_q"] = tuple(n + rng.randint(0, profile.extra_padding) for n in seqlens_q)
        padded["padded_k"] = tuple(n + rng.randint(0, profile.extra_padding) for n in (seqlens_k or seqlens_q))
    tails = {}
    if "tail" not in lacks and rng.random() < 0.6:
        tails = {"tail_q": rng.randint(0, profile.tail), "tail_k": rng.randint(0, profile.tail)}
    heads = rng.choice(profile.heads)
    kv_heads = (
        rng.choice([d for d in range(1, heads) if heads % d == 0] or [None])
        if "gqa" not in lacks and rng.random() < 0.5
        else None
    )
    dtypes, dims = _allowed(profile, impl)
    return Case(
        seqlens_q,
        seqlens_k,
        **padded,
        **tails,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=rng.choice(dims),
        dtype=rng.choice(dtypes),
        causal="causal" not in lacks and rng.random() < 0.5,
        seed=rng.randrange(2**16),
        fill=rng.choice(list(Fill)),
    )


GENERATORS: dict[str, Callable[[random.Random, Adapted, Profile], Case]] = {"old": old_random_case, "new": random_case}

# -- planted bugs ------------------------------------------------------------------------------


def _oracle(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, causal=False, scale=None):
    out = reference_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_k_padded=cu_seqlens_k_padded,
        causal=causal,
        scale=scale,
        validate=False,
    )
    return out.to(q.dtype)


def _sequences(cu_q, cu_k, padded_q):
    """(start row, len_q, len_k) of each sequence."""
    real_q, real_k = cu_q.tolist(), cu_k.tolist()
    starts = (real_q if padded_q is None else padded_q.tolist())[:-1]
    return [(s, real_q[i + 1] - real_q[i], real_k[i + 1] - real_k[i]) for i, s in enumerate(starts)]


def _shift_rows(out: torch.Tensor, rows: list[int], heads: slice = slice(None)) -> torch.Tensor:
    """out + 1 on these rows (and heads): a wrong REAL result, keeping the oracle's gradients."""
    delta = torch.zeros_like(out)
    if rows:
        delta[rows, heads] = 1.0
    return out + delta


def tail_nan(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded=None, **kw):
    """TAIL rows of out never written (torch varlen_attn's bug): they hold NaN."""
    out = _oracle(q, k, v, cu_q, cu_k, max_q, max_k, cu_seqlens_q_padded=cu_seqlens_q_padded, **kw)
    end = int((cu_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded)[-1])
    keep = torch.arange(out.shape[0], device=out.device)[:, None, None] < end
    return torch.where(keep, out, torch.full_like(out, float("nan")))


def gap_keys_attended(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_k_padded=None, **kw):
    """Keys span each sequence's padded length: GAP rows of k and v are attended."""
    cu_k_used = cu_k if cu_seqlens_k_padded is None else cu_seqlens_k_padded
    return _oracle(q, k, v, cu_q, cu_k_used, max_q, max_k, cu_seqlens_k_padded=cu_seqlens_k_padded, **kw)


def after_empty_wrong(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded=None, **kw):
    """A sequence right after an empty one (no query rows) gets a wrong result (an off-by-one
    in the program -> sequence map that skips empty sequences)."""
    out = _oracle(q, k, v, cu_q, cu_k, max_q, max_k, cu_seqlens_q_padded=cu_seqlens_q_padded, **kw)
    seqs = _sequences(cu_q, cu_k, cu_seqlens_q_padded)
    rows = [s + r for (_, prev_q, _), (s, lq, lk) in zip(seqs, seqs[1:]) if prev_q == 0 and lk > 0 for r in range(lq)]
    return _shift_rows(out, rows)


def gqa_wrong_head(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded=None, **kw):
    """With fewer kv heads than q heads, q heads past the kv head count read the wrong kv head."""
    out = _oracle(q, k, v, cu_q, cu_k, max_q, max_k, cu_seqlens_q_padded=cu_seqlens_q_padded, **kw)
    if k.shape[1] == q.shape[1]:
        return out
    rows = [s + r for s, lq, lk in _sequences(cu_q, cu_k, cu_seqlens_q_padded) if lk > 0 for r in range(lq)]
    return _shift_rows(out, rows, slice(k.shape[1], None))


def causal_top_left(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded=None, causal=False, **kw):
    """Causal masks aligned top-left instead of bottom-right: wrong wherever len_q != len_k."""
    out = _oracle(q, k, v, cu_q, cu_k, max_q, max_k, cu_seqlens_q_padded=cu_seqlens_q_padded, causal=causal, **kw)
    if not causal:
        return out
    rows = [s + r for s, lq, lk in _sequences(cu_q, cu_k, cu_seqlens_q_padded) if lk > 0 and lq != lk for r in range(lq)]
    return _shift_rows(out, rows)


# bug -> (implementation, the check that shows it)
BUGS = {
    "TAIL rows": (tail_nan, "tail-rows"),
    "GAP row": (gap_keys_attended, "real-accuracy"),
    "empty sequence": (after_empty_wrong, "real-accuracy"),
    "GQA": (gqa_wrong_head, "real-accuracy"),
    "len_q != len_k": (causal_top_left, "real-accuracy"),
}


def rows(case: Case) -> int:
    return case.total_rows("q") + case.total_rows("k")


def hunt(impl: Adapted, check: str, generator, profile: Profile, seed: int, budget: int) -> dict:
    """Layouts until the first that fails `check` (at most `budget`), then the bounded shrink."""
    for index in range(budget):
        case = generator(random.Random(seed * 1_000_003 + index), impl, profile)
        finding = next((f for f in run_layout(impl, case) if f.check == check), None)
        if finding:
            small, _, spent = shrink(impl, case, finding, profile)
            return {"found_at": index + 1, "rows": rows(case), "shrunk_rows": rows(small), "shrink_probes": spent}
    return {"found_at": None}


def _mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (nan where there are no values)."""
    if not values:
        return float("nan"), float("nan")
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def summarize(runs: dict[str, dict[str, list[dict]]], budget: int) -> dict[str, dict]:
    """Per bug and generator: runs that found it, layouts to detection and shrunk rows (mean, se);
    and the new / old ratios of the means."""
    summary = {}
    for bug, by_gen in runs.items():
        row: dict[str, Any] = {}
        for gen, results in by_gen.items():
            hits = [r for r in results if r["found_at"]]
            row[gen] = {
                "runs": len(results),
                "found": len(hits),
                "layouts": _mean_se([r["found_at"] or budget for r in results]),
                "shrunk_rows": _mean_se([r["shrunk_rows"] for r in hits]),
            }
        old, new = row["old"], row["new"]
        row["layouts_ratio"] = new["layouts"][0] / old["layouts"][0]
        row["rows_ratio"] = new["shrunk_rows"][0] / old["shrunk_rows"][0] if old["found"] and new["found"] else float("nan")
        summary[bug] = row
    return summary


def table(summary: dict[str, dict]) -> str:
    def cell(mean_se: tuple[float, float]) -> str:
        return f"{mean_se[0]:.2f} ± {mean_se[1]:.2f}"

    head = ("bug", "found old", "found new", "layouts old", "layouts new", "ratio", "rows old", "rows new", "ratio")
    body = [
        (
            bug,
            f"{r['old']['found']}/{r['old']['runs']}",
            f"{r['new']['found']}/{r['new']['runs']}",
            cell(r["old"]["layouts"]),
            cell(r["new"]["layouts"]),
            f"{r['layouts_ratio']:.2f}",
            cell(r["old"]["shrunk_rows"]),
            cell(r["new"]["shrunk_rows"]),
            f"{r['rows_ratio']:.2f}",
        )
        for bug, r in summary.items()
    ]
    widths = [max(len(str(x[i])) for x in (head, *body)) for i in range(len(head))]
    lines = [
        "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
        for row in (head, *body)
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="fuzzing runs per bug and generator (default 10)")
    parser.add_argument("--budget", type=int, default=100, help="layouts per run at most (default 100)")
    parser.add_argument("--profile", default="tiny", choices=sorted(PROFILES), help="the fuzzer's profile (default tiny)")
    parser.add_argument("--device", default="cpu", help="where the planted bugs and the oracle run (default cpu)")
    parser.add_argument(
        "--record", help="write every run's numbers here (JSON with provenance, varlen_workbench.workbench.records)"
    )
    parser.add_argument("--summarize", metavar="FILE", help="only print the table of a recorded run")
    args = parser.parse_args(argv)
    if args.summarize:
        record = json.loads(Path(args.summarize).read_text())
        summary = summarize(record["runs"], record["args"]["budget"])
        print(_title(record["args"]))
        print(table(summary))
        return summary
    if args.seeds < 1 or args.budget < 1:
        parser.error(f"--seeds ({args.seeds}) and --budget ({args.budget}) must be >= 1")
    profile = PROFILES[args.profile]
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    start = time.perf_counter()
    runs: dict[str, dict[str, list[dict]]] = {}
    for bug, (fn, check) in BUGS.items():
        impl = adapt(fn, "contract", device=args.device)
        runs[bug] = {
            g: [hunt(impl, check, gen, profile, s, args.budget) for s in range(args.seeds)] for g, gen in GENERATORS.items()
        }
        print(f"{bug}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    summary = summarize(runs, args.budget)
    print(_title(vars(args)))
    print(table(summary))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.record:
        command = "python benchmarks/fuzz_planted.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_record(args.record, {"args": vars(args), "seconds": time.perf_counter() - start, "runs": runs}, command=command)
    return summary


def _title(args: dict) -> str:
    profile = PROFILES[args["profile"]]
    return (
        f"profile {profile.name} on {args.get('device', 'cpu')}, {args['seeds']} seeds per bug and generator, at most {args['budget']} layouts, "
        f"shrink budget {profile.shrink_probes} probes\n"
        "layouts: to the first detection (a miss counts as the budget); rows: q + k rows of the shrunk layout; "
        "mean ± standard error; ratio: new / old (< 1: better)"
    )


if __name__ == "__main__":
    main()
