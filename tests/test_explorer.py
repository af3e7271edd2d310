"""Explorer: one call gives a live widget or a self-contained static page whose controls switch frames."""

import base64
import html
import json
import re

import pytest
from matplotlib.figure import Figure

from varlen_workbench.workbench.instruments.explorer import explore

CALLS = []


def draw(n, color):
    CALLS.append((n, color))
    fig = Figure(figsize=(2, 1))
    fig.subplots().plot(range(n + 1), color=color)
    return fig


def test_static_form_precomputes_every_frame(monkeypatch):
    monkeypatch.setenv("WORKBENCH_STATIC", "1")
    CALLS.clear()
    explorer = explore(draw, n=[1, 2, 4], color=["red", "blue"])
    assert sorted(CALLS) == sorted((n, c) for n in (1, 2, 4) for c in ("red", "blue"))
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" not in bundle
    page = bundle["text/html"]
    assert 'class="wb-explorer"' in page and 'data-frames="6"' in page
    assert page.count('class="wb-explorer-slider"') == 2
    assert '<input type="range" class="wb-explorer-slider" data-axis="n" min="0" max="2"' in page
    assert '<select class="wb-explorer-slider" data-axis="color"' in page
    frames = json.loads(re.search(r'<script type="application/json">(.*?)</script>', page).group(1))
    assert sorted(frames) == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]
    assert len(set(frames.values())) == 6
    assert base64.b64decode(frames["2-1"].split(",", 1)[1])[:4] == b"\x89PNG"
    assert re.search(r'<img class="wb-explorer-img" src="([^"]+)"', page).group(1) == frames["0-0"]
    assert "http" not in page.replace(html.escape(""), "")  # no CDN, no request


def test_live_form_redraws_when_a_control_moves(monkeypatch):
    monkeypatch.delenv("WORKBENCH_STATIC", raising=False)
    CALLS.clear()
    explorer = explore(draw, n=[1, 2], color=["red", "blue"])
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "<img" in bundle["text/html"]
    box = explorer.widget()
    slider, dropdown, image = box.children
    assert type(slider).__name__ == "SelectionSlider" and type(dropdown).__name__ == "Dropdown"
    first = image.value
    slider.value = 1
    assert CALLS[-1] == (2, "red") and image.value != first
    dropdown.value = 1
    assert CALLS[-1] == (2, "blue")
    slider.value = 0
    assert CALLS[-1] == (1, "blue")
    calls = len(CALLS)
    slider.value = 1  # drawn before: served from the cache
    assert len(CALLS) == calls


def test_errors_name_the_problem(monkeypatch):
    monkeypatch.setenv("WORKBENCH_STATIC", "1")
    with pytest.raises(TypeError, match="must return a matplotlib Figure"):
        explore(lambda n: None, n=[1])
    with pytest.raises(ValueError, match="max_frames"):
        explore(draw, n=list(range(10)), color=["a"] * 10)
    with pytest.raises(ValueError, match="non-empty list"):
        explore(draw, n=[], color=["red"])
    with pytest.raises(ValueError, match="mode"):
        explore(draw, mode="movie", n=[1], color=["red"])
