"""The benchmark's workloads: packed batches shaped like real training (equal lengths, long-tailed
and log-uniform document mixes, GQA, long causal sequences, a sliding window), and the work each
does (FLOPs counted over the key/query pairs a window or causality leaves visible)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varlen_workbench.workbench.layout import Case, Fill


def visible_pairs(len_q: int, len_k: int, window: tuple[int, int]) -> int:
    """(query, key) pairs of one sequence inside FlashAttention's window (bottom-right aligned)."""
    if len_q == 0 or len_k == 0:
        return 0
    left, right = window
    rows = torch.arange(len_q, dtype=torch.int64) + (len_k - len_q)
    lo = (rows - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    hi = (rows + right).clamp(max=len_k - 1) if right >= 0 else torch.full_like(rows, len_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


@dataclass(frozen=True)
class Workload:
    """A benchmark configuration; `window` is FlashAttention's (left, right), -1 = unbounded
    (combined with the case's causality: causal bounds the right at 0)."""

    name: str
    case: Case
    window: tuple[int, int] = (-1, -1)

    @property
    def sliding(self) -> bool:
        return self.window[0] >= 0

    def flops(self, backward: bool) -> float:
        c = self.case
        lengths = list(zip(c.real_lengths("q"), c.real_lengths("k")))
        if self.sliding or self.window[1] >= 0:
            window = (self.window[0], 0 if c.causal else self.window[1])
            per_doc = sum(visible_pairs(lq, lk, window) for lq, lk in lengths)
            forward: float = 4 * c.heads * c.head_dim * per_doc
        else:
            forward = 4 * c.heads * c.head_dim * sum(lq * lk for lq, lk in lengths) * (0.5 if c.causal else 1.0)
        return forward * (3.5 if backward else 1.0)

    def bytes_moved(self, backward: bool) -> float:
        """Compulsory HBM traffic: q, k, v read and out written once (plus dO/dq/dk/dv in backward)."""
        c = self.case
        elem = torch.empty((), dtype=c.torch_dtype).element_size()
        tokens_q, tokens_k = sum(c.real_lengths("q")), sum(c.real_lengths("k"))
        kv = c.kv_heads or c.heads
        forward = (2 * tokens_q * c.heads + 2 * tokens_k * kv) * c.head_dim * elem
        return forward * (3.0 if backward else 1.0)


def log_uniform_lengths(total: int, seed: int, shortest: int, longest: int) -> tuple[int, ...]:
    """Document lengths drawn log-uniformly in [shortest, longest], summing to `total`."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        u = float(torch.rand((), generator=generator))
        lengths.append(int(shortest * (longest / shortest) ** u))
    lengths[-1] -= sum(lengths) - total
    return tuple(n for n in lengths if n > 0)


def long_tailed_lengths(total: int, seed: int, shortest: int = 16, longest: int = 4096) -> tuple[int, ...]:
    """Document lengths from a Pareto(1.2) law (many short, few long) summing to `total`."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        u = float(torch.rand((), generator=generator))
        lengths.append(int(min(longest, shortest / (1.0 - u) ** (1 / 1.2))))
    lengths[-1] -= sum(lengths) - total
    return tuple(n for n in lengths if n > 0)


SLIDING_WINDOW = (4096, 0)  # left 4096, causal: Mistral-style


def workloads(quick: bool = False) -> list[Workload]:
    """Issue 17's configurations (bf16; hidden 2048 unless said); `quick` keeps one of each kind."""
    out = []
    for head_dim in (64, 128):
        for causal in (False, True):
            out.append(
                Workload(
                    f"8x2048 d{head_dim}{' causal' if causal else ''}",
                    Case(
                        (2048,) * 8, heads=2048 // head_dim, head_dim=head_dim, dtype="bfloat16", causal=causal, fill=Fill.ZEROS
                    ),
                )
            )
    out.append(
        Workload(
            "8x2048 GQA 32/8 d128 causal",
            Case((2048,) * 8, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", causal=True, fill=Fill.ZEROS),
        )
    )
    out.append(
        Workload(
            "4x16384 d128 causal", Case((16384,) * 4, heads=16, head_dim=128, dtype="bfloat16", causal=True, fill=Fill.ZEROS)
        )
    )
    docs = long_tailed_lengths(16384, seed=0)
    packed = Case(docs, heads=16, head_dim=128, dtype="bfloat16", causal=True, fill=Fill.ZEROS)
    out.append(Workload(f"16k long-tail ({len(docs)} docs) d128 causal", packed))
    out.append(
        Workload("16k long-tail padded (align 64, tail 256)", packed.with_(align=64, tail_q=256, tail_k=256, fill=Fill.NAN))
    )
    # Documents up to 16k long; seed 18 draws one of 16384 tokens (half the mix), on which a
    # window of 4096 binds, beside 242 short ones.
    long_docs = long_tailed_lengths(32768, seed=18, longest=16384)
    long_mix = Case(long_docs, heads=16, head_dim=128, dtype="bfloat16", causal=True, fill=Fill.ZEROS)
    out.append(Workload(f"32k long-tail ({len(long_docs)} docs, <=16k) d128 causal", long_mix))
    out.append(Workload(f"32k long-tail sliding window {SLIDING_WINDOW[0]} d128", long_mix, SLIDING_WINDOW))
    for longest, seed in ((256, 3), (512, 1)):
        short = Case(
            long_tailed_lengths(16384, seed=seed, longest=longest),
            heads=16,
            head_dim=128,
            dtype="bfloat16",
            causal=True,
            fill=Fill.ZEROS,
        )
        out.append(Workload(f"16k short docs ({short.batch} docs, <={longest}) d128 causal", short))
    # The mixes a FlashAttention-4 comparison needs (issue 23): long-tail documents log-uniform in
    # 32-8192, short ones in 16-256, a GQA long tail, and the 4x16k window of 4095 (left), causal.
    log_mix = Case(
        log_uniform_lengths(32768, 0, 32, 8192), heads=16, head_dim=128, dtype="bfloat16", causal=True, fill=Fill.ZEROS
    )
    out.append(Workload(f"32k log-uniform 32-8192 ({log_mix.batch} docs) d128 causal", log_mix))
    shorts = Case(log_uniform_lengths(32768, 0, 16, 256), heads=16, head_dim=128, dtype="bfloat16", causal=True, fill=Fill.ZEROS)
    out.append(Workload(f"32k log-uniform 16-256 ({shorts.batch} docs) d128 causal", shorts))
    out.append(Workload(f"16k long-tail GQA 32/8 ({len(docs)} docs) d128 causal", packed.with_(heads=32, kv_heads=8)))
    out.append(
        Workload(
            "4x16384 d128 causal window 4095",
            Case((16384,) * 4, heads=16, head_dim=128, dtype="bfloat16", causal=True, fill=Fill.ZEROS),
            (4095, 0),
        )
    )
    if quick:
        return [w for w in out if w.name.startswith(("8x2048 d128 causal", "16k long-tail", "32k long-tail sliding"))]
    return out
