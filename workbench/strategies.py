"""One definition of packed layouts, drawn by Hypothesis in the tests and by the audit's fuzzer.

A `LayoutSpace` bounds the layouts (`varlen_workbench.workbench.layout.Case`): how many sequences, how long, how much
padding and TAIL, which heads, head dims, dtypes and fills, which features are left out. One
function builds a layout from a source of choices; there are two sources:

* `space.strategy()` (or `layouts(...)`): a Hypothesis strategy, for `@given` tests. Hypothesis
  shrinks its failures and its replay database (`.hypothesis/`, git-ignored) replays them.
* `space.sample(rng)`: the same layouts from a `random.Random`, for the audit's fuzzer. One
  layout costs seconds in the Triton interpreter, so the fuzzer decides how many it tries and
  shrinks with its own bounded probe budget; layout `i` of a run is the same in every process.
  (Hypothesis draws only inside runs it drives: `.example()` is for interactive use and
  unseeded, and its engine also mixes in literals found in the local modules imported so far,
  so the same seed could give a fuzzer and its worker processes different layouts.)

Every layout is valid by construction, and every shrink keeps it so: a padded length is drawn
as real length + *extra* rows, never on its own; GQA's kv_heads is a divisor of the heads
drawn. Each choice shrinks towards the simpler layout: fewer and shorter sequences, no padding,
no TAIL, fewer heads, the first head dim / dtype / fill listed, not causal, no window (a
window's bounded side shrinks to 0 keys, then to unbounded).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from varlen_workbench.workbench.layout import DTYPE_NAMES, Case, Fill

T = TypeVar("T")

# The features a layout can have beyond plain back-to-back sequences; the names are the audit
# adapters' (varlen_workbench.workbench.audit.adapters.FEATURES), so `without=impl.lacks` leaves out what an
# implementation cannot express (names that are not layout features, e.g. "scale", are ignored).
LAYOUT_FEATURES = ("padded", "tail", "gqa", "causal", "unequal", "window")


class _Choices(Protocol):
    """Where a layout's choices come from. Each choice shrinks towards `lo`, False, `options[0]`."""

    def integer(self, lo: int, hi: int) -> int: ...

    def boolean(self, p: float = 0.5) -> bool:
        """True with probability about `p` (a sampling weight; Hypothesis picks its own)."""
        ...

    def choice(self, options: Sequence[T]) -> T: ...

    def repeat(self, element: Callable[[_Choices], T], max_size: int) -> list[T]:
        """1..max_size elements, each drawn by `element`."""
        ...


class _HypothesisChoices:
    def __init__(self, draw: Callable[[SearchStrategy[Any]], Any]) -> None:
        self.draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def boolean(self, p: float = 0.5) -> bool:
        return self.draw(st.booleans())

    def choice(self, options: Sequence[T]) -> T:
        return self.draw(st.sampled_from(options))

    def repeat(self, element: Callable[[_Choices], T], max_size: int) -> list[T]:
        # One list element per sequence: deleting one while shrinking drops all its numbers together.
        return self.draw(st.lists(_drawn_by(element), min_size=1, max_size=max_size))


# Defined once: st.composite reads its function's source (ast and tokenize) each time it is
# applied, a third of a layout draw's cost when it was applied inside `repeat`.
@st.composite
def _drawn_by(draw: Callable[[SearchStrategy[Any]], Any], element: Callable[[_Choices], T]) -> T:
    """The strategy of what `element` draws through Hypothesis."""
    return element(_HypothesisChoices(draw))


class _RandomChoices:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def boolean(self, p: float = 0.5) -> bool:
        return self.rng.random() < p

    def choice(self, options: Sequence[T]) -> T:
        return self.rng.choice(options)

    def repeat(self, element: Callable[[_Choices], T], max_size: int) -> list[T]:
        return [element(self) for _ in range(self.rng.randint(1, max_size))]


def _ascending(values: Sequence[int], name: str, minimum: int, allow_empty: bool = False) -> tuple[int, ...]:
    out = tuple(sorted({int(v) for v in values}))
    if not out and not allow_empty:
        raise ValueError(f"LayoutSpace.{name} is empty; give at least one value.")
    if out and out[0] < minimum:
        raise ValueError(f"LayoutSpace.{name} holds {out[0]}; every value must be >= {minimum}.")
    return out


@dataclass(frozen=True)
class LayoutSpace:
    """Bounds of the layouts drawn (defaults: tiny layouts for the Triton interpreter).

    max_batch: 1 to this many sequences. longest: real lengths 0..longest; `edge_lengths` are
    drawn as often as the whole range (block edges such as 63, 64, 65, which a uniform draw
    rarely hits). extra_padding: GAP rows per sequence, at most (padded = real + extra).
    tail: TAIL rows of q and of k, at most. heads: query head counts; with GQA kv_heads is a
    proper divisor of the count drawn. head_dims, dtypes, fills: drawn from these (the first
    listed is the one shrinking goes to). head_dims_v: v's head dim drawn from these (empty: v
    has q and k's). aligns: also pad by rounding lengths up (Case.align).
    without: features left out, names from LAYOUT_FEATURES (e.g. an audit adapter's `lacks`);
    "window" is FlashAttention's window_size (`Case.window`), each side unbounded or 0..longest
    keys, small bounds (0, 1: zero-width and one-key windows) drawn as often as the range.
    nonempty: at least one row of q and one of k (what a probe needs).
    """

    max_batch: int = 4
    longest: int = 12
    edge_lengths: tuple[int, ...] = ()
    extra_padding: int = 3
    tail: int = 3
    heads: tuple[int, ...] = (1, 2)
    head_dims: tuple[int, ...] = (16,)
    head_dims_v: tuple[int, ...] = ()
    dtypes: tuple[str, ...] = ("float32",)
    fills: tuple[Fill, ...] = tuple(Fill)
    aligns: tuple[int, ...] = ()
    without: frozenset[str] = field(default_factory=frozenset)
    nonempty: bool = True

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"LayoutSpace.max_batch = {self.max_batch} must be >= 1 (a layout has at least one sequence).")
        for name in ("longest", "extra_padding", "tail"):
            if getattr(self, name) < 0:
                raise ValueError(f"LayoutSpace.{name} = {getattr(self, name)} counts rows and must be >= 0.")
        object.__setattr__(self, "edge_lengths", _ascending(self.edge_lengths, "edge_lengths", 0, allow_empty=True))
        object.__setattr__(self, "heads", _ascending(self.heads, "heads", 1))
        object.__setattr__(self, "head_dims", _ascending(self.head_dims, "head_dims", 1))
        object.__setattr__(self, "head_dims_v", _ascending(self.head_dims_v, "head_dims_v", 1, allow_empty=True))
        object.__setattr__(self, "aligns", _ascending(self.aligns, "aligns", 1, allow_empty=True))
        dtypes = tuple(self.dtypes)
        if not dtypes or any(d not in DTYPE_NAMES for d in dtypes):
            raise ValueError(f"LayoutSpace.dtypes = {dtypes!r}: give one or more of {sorted(DTYPE_NAMES)}.")
        object.__setattr__(self, "dtypes", dtypes)
        fills = tuple(Fill(f) for f in self.fills)
        if not fills:
            raise ValueError(f"LayoutSpace.fills is empty; give one or more of {[f.value for f in Fill]}.")
        object.__setattr__(self, "fills", fills)
        object.__setattr__(self, "without", frozenset(self.without))

    def has(self, feature: str) -> bool:
        return feature not in self.without

    # -- the one definition ---------------------------------------------------------------
    def _build(self, choose: _Choices) -> Case:
        # Sampling weights (ignored by Hypothesis): padding, TAIL rows and edge lengths are drawn a
        # little more often than not, where most layout bugs live (the fuzzer's weights before
        # this module; benchmarks/fuzz_planted.py measures them).
        unequal = self.has("unequal") and choose.boolean()
        modes = (["extra"] if self.extra_padding else []) + (["align"] if self.aligns else [])
        padding = choose.choice(modes) if self.has("padded") and modes and choose.boolean(0.6) else "none"

        def length(c: _Choices) -> int:
            if self.edge_lengths and c.boolean(0.6):
                return c.choice(self.edge_lengths)
            return c.integer(0, self.longest)

        def sequence(c: _Choices) -> tuple[int, int, int, int]:
            """(len_q, extra_q, len_k, extra_k): one sequence's numbers."""
            len_q = length(c)
            extra_q = c.integer(0, self.extra_padding) if padding == "extra" else 0
            len_k = length(c) if unequal else len_q
            extra_k = c.integer(0, self.extra_padding) if padding == "extra" else 0
            return len_q, extra_q, len_k, extra_k

        seqs = choose.repeat(sequence, self.max_batch)
        fields: dict[str, Any] = {}
        if unequal:
            fields["seqlens_k"] = tuple(s[2] for s in seqs)
        if padding == "extra":
            fields["padded_q"] = tuple(n + e for n, e, _, _ in seqs)
            fields["padded_k"] = tuple(n + e for _, _, n, e in seqs)
        elif padding == "align":
            fields["align"] = choose.choice(self.aligns)
        if self.has("tail") and self.tail and choose.boolean(0.6):
            fields["tail_q"] = choose.integer(0, self.tail)
            fields["tail_k"] = choose.integer(0, self.tail)
        heads = choose.choice(self.heads)
        divisors = [d for d in range(1, heads) if heads % d == 0]
        if self.has("gqa") and divisors and choose.boolean():
            fields["kv_heads"] = choose.choice(divisors)
        head_dim, dtype = choose.choice(self.head_dims), choose.choice(self.dtypes)
        causal = self.has("causal") and choose.boolean()
        seed, fill = choose.integer(0, 2**16 - 1), choose.choice(self.fills)
        # Drawn last: a space without windows draws the layouts it drew before windows existed.
        if self.has("window") and choose.boolean(0.4):
            fields["window"] = (self._window_side(choose), self._window_side(choose))
        if self.head_dims_v:  # after the rest, for the same reason
            fields["head_dim_v"] = choose.choice(self.head_dims_v)
        return Case(
            tuple(s[0] for s in seqs), **fields, heads=heads, head_dim=head_dim, dtype=dtype, causal=causal, seed=seed, fill=fill
        )

    def _window_side(self, choose: _Choices) -> int:
        """One side of a window: -1 (unbounded) or a key count, 0 and 1 as often as the rest."""
        if not choose.boolean(0.8):
            return -1
        return choose.choice((0, 1)) if choose.boolean(0.5) else choose.integer(0, self.longest)

    def _wanted(self, case: Case) -> bool:
        return not self.nonempty or (case.total_rows("q") > 0 and case.total_rows("k") > 0)

    # -- the two sources ------------------------------------------------------------------
    def strategy(self) -> SearchStrategy[Case]:
        """A Hypothesis strategy of these layouts (for `@given`)."""
        drawn = st.composite(lambda draw: self._build(_HypothesisChoices(draw)))()
        return drawn.filter(self._wanted) if self.nonempty else drawn

    def sample(self, rng: random.Random) -> Case:
        """One of these layouts from `rng` (the same rng state gives the same layout)."""
        while True:
            case = self._build(_RandomChoices(rng))
            if self._wanted(case):
                return case


def layouts(**bounds: Any) -> SearchStrategy[Case]:
    """`LayoutSpace(**bounds).strategy()`: e.g. `@given(layouts(longest=70, head_dims=(16, 32)))`."""
    return LayoutSpace(**bounds).strategy()
