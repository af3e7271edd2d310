"""A tiny causal language model over packed (THD) synthetic data, with pluggable attention.

It is the smallest training loop in which a packed-layout bug can show up as a loss curve:
token and position handling, RoPE, pre-norm blocks, attention through any implementation of
the contract (`varlen_attention`'s signature), next-token loss on real tokens only.

    data = SyntheticTask(vocab=24, seed=0)
    model = TinyLM(LMConfig())
    batch = data.batch(seqlens=(20, 13, 31), align=8)   # FP8-style alignment padding per sequence
    loss = model.loss(batch)                             # cu_seqlens real, cu_seqlens_padded padded
    loss = model.loss(batch, cu_seqlens=batch.cu_seqlens_padded)   # VERL's workaround

The synthetic language is periodic: each sequence repeats a random motif of 2-6 tokens, so after
one period every token is predictable, but only by attending to earlier tokens of the *same*
sequence. Anything that mixes sequences or padding into attention costs loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from varlen_workbench.workbench.layout import cumulative

IGNORE = -100  # targets that carry no loss (padding, each sequence's last token)
PAD_TOKEN = 0


def _row_layout(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None, total_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: owning sequence, position from the sequence's memory start, and whether it is real."""
    padded = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    rows = torch.arange(total_rows, device=cu_seqlens.device)
    owner = (torch.searchsorted(padded[1:].contiguous(), rows.to(padded.dtype), right=True)).clamp(max=padded.numel() - 2)
    position = rows - padded[owner]
    real = (position < cu_seqlens.diff()[owner]) & (rows < padded[-1])
    return owner, position, real


def dense_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    cu_seqlens_q_padded=None,
    cu_seqlens_k_padded=None,
    causal=False,
    scale=None,
):
    """The contract as one masked (T_q x T_k) attention in the inputs' dtype.

    Same semantics as the oracle (tested against it), but two matmuls per call instead of a
    Python loop over sequences: training the tiny LM on CPU takes seconds, where the
    interpreted Triton kernel would take seconds per step. Tiny layouts only (T x T scores).
    """
    seq_q, pos_q, real_q = _row_layout(cu_seqlens_q, cu_seqlens_q_padded, q.shape[0])
    seq_k, pos_k, real_k = _row_layout(cu_seqlens_k, cu_seqlens_k_padded, k.shape[0])
    visible = (seq_q[:, None] == seq_k[None, :]) & real_q[:, None] & real_k[None, :]
    if causal:  # bottom-right aligned, as the contract says
        offset = cu_seqlens_k.diff()[seq_q] - cu_seqlens_q.diff()[seq_q]
        visible &= pos_k[None, :] <= (pos_q + offset)[:, None]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    has_key = visible.any(-1)
    # Padding (and key-less) rows never reach softmax: their values may be NaN or Inf.
    q = torch.where(has_key[:, None, None], q, torch.zeros_like(q))
    k = torch.where(real_k[:, None, None], k, torch.zeros_like(k))
    v = torch.where(real_k[:, None, None], v, torch.zeros_like(v))
    scores = torch.einsum("qhd,khd->hqk", q, k).mul(scale).masked_fill(~(visible | ~has_key[:, None]), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return torch.where(has_key[:, None, None], out, torch.zeros_like(out))


def rope_positions(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None, total_rows: int) -> torch.Tensor:
    """Position of every row of a packed layout (int64): 0, 1, ... from each sequence's start.

    Sequence i starts at row `cu_seqlens_padded[i]` (its memory start), so padded rows keep
    counting after the real ones. Passing the *real* boundaries as `cu_seqlens_padded` (or
    None) measures positions from the wrong rows whenever padding precedes a sequence.
    TAIL rows continue the last sequence's count.
    """
    starts = (cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded).tolist()[:-1]
    rows = torch.arange(total_rows)
    # The sequence a row belongs to is the last start at or before it.
    owner = torch.searchsorted(torch.tensor(starts), rows, right=True) - 1
    return (rows - torch.tensor(starts)[owner.clamp(min=0)]).clamp(min=0)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of x (T, H, D) at `positions` (T,)."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = positions.to(torch.float64)[:, None] * freq[None, :]
    cos, sin = (f(angle).to(x.device, x.dtype)[:, None, :] for f in (torch.cos, torch.sin))
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention_metadata(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, causal: bool = True) -> dict:
    """The keyword arguments of a self-attention call on a packed layout (the contract's names)."""
    longest = int(cu_seqlens.diff().max())
    return dict(
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_k=longest,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_k_padded=cu_seqlens_padded,
        causal=causal,
    )


@dataclass(frozen=True)
class PackedTokens:
    """One packed training batch: tokens in a padded THD layout and its two boundary vectors."""

    tokens: torch.Tensor  # (T,) int64, PAD_TOKEN on padding rows
    targets: torch.Tensor  # (T,) int64, IGNORE on padding rows and on each sequence's last token
    cu_seqlens: torch.Tensor  # int32 (B+1,) real boundaries
    cu_seqlens_padded: torch.Tensor  # int32 (B+1,) memory boundaries
    max_seqlen: int

    @property
    def padding_fraction(self) -> float:
        return 1.0 - int(self.cu_seqlens[-1]) / self.tokens.numel()


@dataclass(frozen=True)
class SyntheticTask:
    """Periodic sequences: a random motif of `min_period`..`max_period` tokens, repeated."""

    vocab: int = 24
    min_period: int = 2
    max_period: int = 6
    seed: int = 0
    _generator: torch.Generator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 2 <= self.min_period <= self.max_period or self.vocab < 3:
            raise ValueError(f"SyntheticTask needs vocab >= 3 and 2 <= min_period <= max_period, got {self}.")
        object.__setattr__(self, "_generator", torch.Generator().manual_seed(self.seed))

    def sequence(self, length: int) -> torch.Tensor:
        period = int(torch.randint(self.min_period, self.max_period + 1, (1,), generator=self._generator))
        motif = torch.randint(1, self.vocab, (period,), generator=self._generator)  # 0 is PAD_TOKEN
        return motif.repeat(-(-length // period))[:length]

    def batch(self, seqlens: Sequence[int], *, align: int | None = None, tail_align: int | None = None) -> PackedTokens:
        """Packs sequences of `seqlens` tokens.

        `align` pads every sequence to a multiple of it (padding between sequences);
        `tail_align` instead packs sequences back to back and extends only the last padded
        boundary to a multiple of it (the "alignment padding at the end" layout).
        """
        if align is not None and tail_align is not None:
            raise ValueError("give align (per-sequence padding) or tail_align (padding at the end only), not both.")
        if min(seqlens) < 2:
            raise ValueError(f"seqlens = {list(seqlens)}: every sequence needs >= 2 tokens to have a next-token target.")
        padded = [-(-n // align) * align if align else n for n in seqlens]
        if tail_align:
            padded[-1] += -sum(padded) % tail_align
        cu, cu_padded = cumulative(seqlens), cumulative(padded)
        tokens = torch.full((int(cu_padded[-1]),), PAD_TOKEN, dtype=torch.int64)
        targets = torch.full_like(tokens, IGNORE)
        for n, start in zip(seqlens, cu_padded.tolist()):
            seq = self.sequence(n)
            tokens[start : start + n] = seq
            targets[start : start + n - 1] = seq[1:]
        return PackedTokens(tokens, targets, cu, cu_padded, max(seqlens))


def mask_tokens(batch: PackedTokens, mask_token: int, rate: float, generator: torch.Generator) -> PackedTokens:
    """`batch` for a masked-token objective: a `rate` share of real tokens replaced by
    `mask_token`, targets the original tokens there and IGNORE elsewhere.

    A bidirectional model (`LMConfig(causal=False)`) would read next-token targets straight
    from its input; masked tokens are predictable only from the rest of their own sequence.
    """
    if not 0.0 < rate < 1.0:
        raise ValueError(f"rate = {rate} must be in (0, 1): the share of real tokens to mask.")
    _, _, real = _row_layout(batch.cu_seqlens, batch.cu_seqlens_padded, batch.tokens.numel())
    picked = real & (torch.rand(batch.tokens.shape, generator=generator) < rate)
    targets = torch.where(picked, batch.tokens, torch.full_like(batch.tokens, IGNORE))
    return PackedTokens(
        batch.tokens.masked_fill(picked, mask_token), targets, batch.cu_seqlens, batch.cu_seqlens_padded, batch.max_seqlen
    )


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 24
    dim: int = 32
    heads: int = 2
    layers: int = 2
    seed: int = 0
    causal: bool = True  # False: a bidirectional encoder (train it on a masked-token objective)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class Block(nn.Module):
    def __init__(self, config: LMConfig, attention: Callable):
        super().__init__()
        self.config, self.attention = config, attention
        self.norm1, self.norm2 = nn.RMSNorm(config.dim), nn.RMSNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.proj = nn.Linear(config.dim, config.dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(config.dim, 4 * config.dim), nn.GELU(), nn.Linear(4 * config.dim, config.dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, metadata: dict) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).view(x.shape[0], 3, self.config.heads, self.config.head_dim).unbind(1)
        q, k = apply_rope(q, positions), apply_rope(k, positions)
        out = self.attention(q, k, v, **metadata)
        x = x + self.proj(out.reshape(x.shape))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, `layers` pre-norm blocks with RoPE and varlen attention (causal unless `config.causal` is False), tied head."""

    def __init__(self, config: LMConfig = LMConfig(), attention: Callable = dense_attention):
        super().__init__()
        self.config = config
        torch.manual_seed(config.seed)
        self.embed = nn.Embedding(config.vocab, config.dim)
        nn.init.normal_(self.embed.weight, std=config.dim**-0.5)  # tied head: unit-scale logits at init
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.dim)

    def forward(
        self, batch: PackedTokens, *, cu_seqlens: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (T, vocab). `cu_seqlens` overrides the real boundaries given to attention
        (the workaround passes `batch.cu_seqlens_padded`); `positions` overrides RoPE positions."""
        metadata = attention_metadata(
            batch.cu_seqlens if cu_seqlens is None else cu_seqlens, batch.cu_seqlens_padded, self.config.causal
        )
        if positions is None:
            positions = rope_positions(batch.cu_seqlens, batch.cu_seqlens_padded, batch.tokens.numel())
        x = self.embed(batch.tokens)
        for block in self.blocks:
            x = block(x, positions, metadata)
        return self.norm(x) @ self.embed.weight.T

    def loss(self, batch: PackedTokens, **overrides) -> torch.Tensor:
        """Mean next-token cross-entropy over real tokens (padding and last tokens ignored)."""
        return nn.functional.cross_entropy(self(batch, **overrides), batch.targets, ignore_index=IGNORE)


@dataclass
class TrainingRun:
    """Per-step losses (and optional monitor) of one training run."""

    name: str
    losses: list[float]
    eval_loss: float

    @property
    def final_loss(self) -> float:
        """Mean of the last 10% of steps: robust to one noisy batch."""
        tail = self.losses[-max(1, len(self.losses) // 10) :]
        return sum(tail) / len(tail)

    @property
    def eval_perplexity(self) -> float:
        return math.exp(self.eval_loss) if math.isfinite(self.eval_loss) else math.inf


def train(
    name: str,
    batches: Sequence[PackedTokens],
    eval_batch: PackedTokens,
    *,
    config: LMConfig = LMConfig(),
    attention: Callable = dense_attention,
    workaround: bool = False,
    lr: float = 3e-3,
    monitor_factory: Callable | None = None,
) -> tuple[TrainingRun, object]:
    """Trains a fresh `TinyLM` (seeded by `config.seed`) one step per batch with AdamW.

    `workaround=True` passes `cu_seqlens_padded` as the real boundaries (VERL's workaround).
    Evaluation is always done with the correct contract on `eval_batch`, so every run is judged
    on the same question: how well does the model predict real tokens of real sequences.
    `monitor_factory(model, optimizer)` builds a gradient-health monitor whose `step(loss)` is
    called after every optimizer step; it is returned with the run.
    """
    model = TinyLM(config, attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    monitor = monitor_factory(model, optimizer) if monitor_factory else None
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matmuls this small lose more to thread hand-offs than they gain
    try:
        for batch in batches:
            loss = model.loss(batch, cu_seqlens=batch.cu_seqlens_padded if workaround else None)
            loss.backward()
            optimizer.step()
            if monitor is not None:
                monitor.step(loss)
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        with torch.no_grad():
            eval_loss = float(model.loss(eval_batch))
    finally:
        torch.set_num_threads(threads)
    return TrainingRun(name, losses, eval_loss), monitor
