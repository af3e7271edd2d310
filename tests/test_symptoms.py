"""The index's "I see this symptom" routes (data/symptoms.toml, varlen_workbench.workbench.symptoms): each
backed by its page's WHO and META, every post-mortem reached, an unbacked route refused, the table on the index."""

import dataclasses
import functools
import html
import re

import pytest

from varlen_workbench.workbench.affected import MaskedBatch, padding_kinds
from varlen_workbench.workbench.errors import BuildError
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.registry import Registry
from varlen_workbench.workbench.site.build import checked_routes
from varlen_workbench.workbench.symptoms import SYMPTOMS_FILE, Route, read_routes, route_problems, unrouted

ROUTES = read_routes(Registry().root)


@functools.cache
def _pages():
    return {pm.id: pm for pm in Registry().postmortems()}


def test_padding_kinds_are_read_off_the_declared_batch():
    assert padding_kinds(Case((5, 3), tail_q=2)) == {"TAIL"}
    assert padding_kinds(Case((5, 3), padded_q=(8, 4), padded_k=(8, 4))) == {"GAP"}
    assert padding_kinds(Case((5, 0, 3))) == {"none", "empty sequence"}
    assert padding_kinds(MaskedBatch(lengths_k=(8, 5), seq=8)) == {"right"}
    assert padding_kinds(MaskedBatch(lengths_k=(8, 5), seq=8, left=True)) == {"left"}
    assert padding_kinds(MaskedBatch(lengths_k=(8, 0), seq=8)) == {"right", "empty sequence"}
    assert padding_kinds(MaskedBatch(lengths_k=(8, 8), seq=8, mask_shape="none")) == {"none"}


@pytest.mark.parametrize("route", ROUTES, ids=[f"{r.page}:{r.padding}:{i}" for i, r in enumerate(ROUTES)])
def test_each_route_is_backed_by_its_page(route):
    assert route_problems(route, _pages()) == []


def test_every_postmortem_is_reached_by_a_route():
    assert ROUTES and unrouted(ROUTES, _pages()) == []


def _route(**changes) -> Route:
    tail = next(r for r in ROUTES if r.page == "torch-varlen-176793" and r.padding == "TAIL")
    return dataclasses.replace(tail, **changes)


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"page": "no-such-page"}, "is no post-mortem"),
        ({"padding": "left"}, "padding 'left': layout"),
        ({"layout": "Buffers exactly `cu_seqlens[-1]` rows long"}, "is declared not affected"),
        ({"layout": "Right padding"}, "no layout 'Right padding'"),
        ({"library": "FlashAttention-4"}, "is no part of META.component"),
        ({"dtype": "fp8"}, "is none of META.tags"),
        ({"tensors": ("loss",)}, "tensor 'loss': the page never names it"),
        ({"test": "varlen-workbench repro te-thd-2892"}, "reproduces 'te-thd-2892'"),
        ({"test": "varlen-workbench audit torch.nn.attention.varlen:varlen_attn --checks tail-row"}, "no audit check 'tail-row'"),
        ({"test": "varlen-workbench audit m:f --adapter no-such"}, "no adapter 'no-such'"),
        ({"test": "varlen-workbench repro torch-varlen-176793 --devices cuda"}, "varlen-workbench refuses its arguments"),
        ({"test": 'python -c "import ("'}, "does not compile"),
        (
            {"page": "te-thd-2892", "library": "TransformerEngine", "test": "varlen-workbench repro te-thd-2892"},
            "declares no layouts",
        ),
    ],
)
def test_a_route_its_page_does_not_back_is_refused(changes, problem):
    problems = route_problems(_route(**changes), _pages())
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tensors": ()}, "tensors"),
        ({"tensors": ("dx",)}, "tensors"),
        ({"padding": "middle"}, "padding"),
        ({"test": "pytest"}, "test"),
    ],
)
def test_a_malformed_route_is_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        _route(**changes)


def test_the_build_refuses_an_unbacked_route_and_an_unreached_page(tmp_path):
    pages = list(_pages().values())
    (tmp_path / SYMPTOMS_FILE).parent.mkdir()
    (tmp_path / SYMPTOMS_FILE).write_text(
        '[[route]]\nsymptom = "NaN"\ntensors = ["out"]\npadding = "left"\nwhen = ""\nlibrary = "varlen_attn"\n'
        'page = "torch-varlen-176793"\nlayout = "TAIL rows of the queries only"\ntest = "varlen-workbench repro torch-varlen-176793"\n'
    )
    with pytest.raises(BuildError) as error:
        checked_routes(tmp_path, pages)
    assert "padding 'left'" in str(error.value) and "no route in data/symptoms.toml leads to fa4-unwritten-padding" in str(
        error.value
    )
    assert checked_routes(tmp_path / "elsewhere", pages) == []  # a project without the file has no table


def test_the_index_shows_each_route_linking_to_its_page(published_site):
    index = (published_site / "index.html").read_text()
    section = re.search(r'<section class="wb-symptoms".*?</section>', index, re.DOTALL)
    assert section is not None
    rows = re.findall(r"<tr>(.*?)</tr>", section.group(0), re.DOTALL)[1:]  # past the header row
    assert len(rows) == len(ROUTES)
    for row, route in zip(rows, ROUTES):
        assert f'href="{route.page}.html#Who-is-affected"' in row and route.test in html.unescape(row)
        assert 'id="Who-is-affected"' in (published_site / f"{route.page}.html").read_text()
