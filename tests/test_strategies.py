"""varlen_workbench.workbench.strategies: every layout drawn is valid, shrinking keeps it valid, every feature is drawn."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis.database import InMemoryExampleDatabase

from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.strategies import LAYOUT_FEATURES, LayoutSpace, layouts

SPACE = LayoutSpace(max_batch=3, longest=6, extra_padding=2, tail=2, heads=(1, 2, 4), dtypes=("float32", "bfloat16"), aligns=(4,))

# What each feature looks like in a Case (the coverage tests look for every one).
FEATURES = {
    "empty sequence": lambda c: 0 in c.seqlens_q,
    "length 1": lambda c: 1 in c.seqlens_q,
    "several sequences": lambda c: c.batch > 1,
    "GAP rows": lambda c: sum(c.padded_lengths("q")) > sum(c.seqlens_q),
    "aligned": lambda c: c.align is not None,
    "TAIL rows of q": lambda c: c.tail_q > 0,
    "TAIL rows of k": lambda c: c.tail_k > 0,
    "GQA": lambda c: c.kv_heads is not None and c.kv_heads < c.heads,
    "len_q != len_k": lambda c: c.seqlens_k is not None and c.seqlens_k != c.seqlens_q,
    "causal": lambda c: c.causal,
    "window": lambda c: c.windowed,
    "zero-width window side": lambda c: 0 in c.window,
    "one-sided window": lambda c: c.windowed and -1 in c.window,
    "bfloat16": lambda c: c.dtype == "bfloat16",
    **{f"fill {f.value}": (lambda c, f=f: c.fill is f) for f in Fill},
}


def assert_valid(case: Case, space: LayoutSpace) -> None:
    """Within the space's bounds, and what `pack` builds matches the description."""
    assert isinstance(case, Case)  # Case validates itself on construction
    assert 1 <= case.batch <= space.max_batch
    for side in ("q", "k"):
        real, padded = case.real_lengths(side), case.padded_lengths(side)
        assert all(0 <= n <= max(space.longest, *space.edge_lengths, 0) for n in real)
        assert all(p >= n for n, p in zip(real, padded))
        if case.align is None:
            assert all(p - n <= space.extra_padding for n, p in zip(real, padded))
    assert case.tail_q <= space.tail and case.tail_k <= space.tail
    assert case.heads in space.heads and case.heads % (case.kv_heads or case.heads) == 0
    assert case.head_dim in space.head_dims and case.dtype in space.dtypes and case.fill in space.fills
    if space.nonempty:
        assert case.total_rows("q") > 0 and case.total_rows("k") > 0
    batch = pack(case, device="cpu", requires_grad=False)
    assert batch.q.shape == (case.total_rows("q"), case.heads, case.head_dim)
    assert batch.k.shape == (case.total_rows("k"), case.kv_heads or case.heads, case.head_dim)


@settings(max_examples=100)
@given(SPACE.strategy())
def test_every_hypothesis_layout_is_valid(case):
    assert_valid(case, SPACE)


def test_every_sampled_layout_is_valid_and_the_seed_fixes_it():
    rng = random.Random(0)
    for _ in range(300):
        assert_valid(SPACE.sample(rng), SPACE)
    assert [SPACE.sample(random.Random(5)) for _ in range(2)] == [SPACE.sample(random.Random(5))] * 2
    assert SPACE.sample(random.Random(5)) != SPACE.sample(random.Random(6))


@pytest.mark.parametrize("feature", FEATURES)
def test_hypothesis_draws_each_feature_and_shrinks_to_a_valid_minimal_layout(feature):
    """`find` shrinks to the simplest layout with the feature: every step of shrinking built a
    Case (an invalid one raises), and the result is as small as the feature allows."""
    seen: list[Case] = []

    def has_feature(case: Case) -> bool:
        seen.append(case)
        return FEATURES[feature](case)

    found = find(SPACE.strategy(), has_feature, settings=settings(database=None, max_examples=2000, derandomize=True))
    assert len(seen) > 1 and FEATURES[feature](found)
    for case in seen:
        assert_valid(case, SPACE)
    # A gap can come from an explicit padded length or from `align`; Hypothesis may settle on either,
    # and align's smallest (4 rows a side over one token) is as simple a layout as the feature allows.
    assert found.total_rows("q") + found.total_rows("k") <= {"aligned": 8, "GAP rows": 8, "several sequences": 4}.get(
        feature, 3
    ), found
    # An empty sequence may sit beside a one-token one: Hypothesis's search settles on either minimum.
    assert found.batch <= (2 if feature in ("several sequences", "empty sequence") else 1)
    assert found.head_dim == 16 and found.seed == 0


def test_sampling_draws_each_feature():
    rng = random.Random(1)
    cases = [SPACE.sample(rng) for _ in range(400)]
    missing = [name for name, has in FEATURES.items() if not any(has(c) for c in cases)]
    assert not missing


@pytest.mark.parametrize("feature", LAYOUT_FEATURES)
def test_without_leaves_a_feature_out_of_both_sources(feature):
    space = LayoutSpace(heads=(2,), without={feature})
    shows = {
        "padded": lambda c: c.padded_q is not None or c.align is not None,
        "tail": lambda c: c.tail_q or c.tail_k,
        "gqa": lambda c: c.kv_heads is not None,
        "causal": lambda c: c.causal,
        "unequal": lambda c: c.seqlens_k is not None,
        "window": lambda c: c.windowed,
    }[feature]
    rng = random.Random(2)
    assert not any(shows(space.sample(rng)) for _ in range(300))
    assert any(shows(LayoutSpace(heads=(2,)).sample(rng)) for _ in range(300))

    @settings(max_examples=60, database=None)
    @given(space.strategy())
    def check(case):
        assert not shows(case)

    check()


def test_edge_lengths_are_drawn_often():
    space = LayoutSpace(longest=600, edge_lengths=(63, 64, 65), max_batch=1)
    rng = random.Random(3)
    hits = sum(space.sample(rng).seqlens_q[0] in (63, 64, 65) for _ in range(400))
    assert hits > 150  # about half; a uniform draw of 0..600 would give about 2


def test_nonempty_false_draws_layouts_without_rows():
    found = find(layouts(nonempty=False), lambda c: c.total_rows("q") == 0, settings=settings(database=None))
    assert found.seqlens_q == (0,) and found.padded_q is None and found.tail_q == 0


def test_v_head_dims_are_drawn_only_where_given():
    """head_dims_v draws v's head dim for every layout; without it no layout has one."""
    rng = random.Random(0)
    apart = [LayoutSpace(head_dims=(8, 48), head_dims_v=(16, 96)).sample(rng) for _ in range(100)]
    assert {c.head_dim_v for c in apart} == {16, 96} and {c.head_dim for c in apart} == {8, 48}
    assert all(pack(c, "cpu", requires_grad=False).v.shape[2] == c.head_dim_v for c in apart[:10])
    assert all(SPACE.sample(random.Random(i)).head_dim_v is None for i in range(50))


def test_bad_bounds_name_the_argument():
    with pytest.raises(ValueError, match=r"LayoutSpace.max_batch = 0 must be >= 1"):
        LayoutSpace(max_batch=0)
    with pytest.raises(ValueError, match=r"LayoutSpace.tail = -1 counts rows"):
        LayoutSpace(tail=-1)
    with pytest.raises(ValueError, match=r"LayoutSpace.heads is empty"):
        LayoutSpace(heads=())
    with pytest.raises(ValueError, match=r"LayoutSpace.head_dims holds 0"):
        LayoutSpace(head_dims=(0, 16))
    with pytest.raises(ValueError, match=r"LayoutSpace.head_dims_v holds -8"):
        LayoutSpace(head_dims_v=(-8,))
    with pytest.raises(ValueError, match=r"LayoutSpace.dtypes = \('fp8',\): give one or more of"):
        LayoutSpace(dtypes=("fp8",))
    with pytest.raises(ValueError, match="'purple' is not a padding fill; choose one of"):
        LayoutSpace(fills=("purple",))


def test_a_failing_layout_is_saved_and_replayed_first():
    """What the test suite relies on: Hypothesis's database stores the shrunk failure and the next
    run starts from it (here an in-memory database; the suite's is .hypothesis/)."""
    assert settings().database is not None  # the profile from conftest keeps it on
    db, calls = InMemoryExampleDatabase(), []

    def run():
        @settings(database=db, max_examples=200, suppress_health_check=list(HealthCheck))
        @given(layouts())
        def gap_after_empty(case):
            calls.append(case)
            assert not any(n == 0 and p > 0 for n, p in zip(case.seqlens_q, case.padded_lengths("q")))

        with pytest.raises(AssertionError):
            gap_after_empty()

    run()
    first_run, shrunk = len(calls), calls[-1]
    assert shrunk.seqlens_q == (0,) and shrunk.padded_q == (1,)
    calls.clear()
    run()
    assert calls[0] == shrunk and len(calls) < first_run
