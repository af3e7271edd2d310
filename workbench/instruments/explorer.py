"""Explorer: one call, a live widget in JupyterLab and a precomputed, script-switched picture on the static page.

    explore(lambda tail_q, impl: plot_token_norms(run(tail_q, impl)), tail_q=[0, 2, 8], impl=["buggy", "fixed"])

`fn(**point)` returns a matplotlib Figure. Numeric axes get sliders, the others drop-downs.

Two forms, chosen by the environment variable `WORKBENCH_STATIC` (or `mode=`):

* live (default): an ipywidgets box that recomputes and redraws the figure when a control moves
  (frames are cached). Its display bundle also carries a `text/html` still of the first frame
  for viewers without a kernel.
* static (`WORKBENCH_STATIC=1`, set by the site build): every frame of the product of the axes
  is rendered to PNG up front and emitted as one self-contained `text/html` snippet: the frames
  as base64 data URIs, `<input type="range">`/`<select>` controls and a few lines of inline
  JavaScript that swap the `<img>` source. No kernel, no CDN, no request: it works offline.

Stable CSS classes for pages and tests: the container `wb-explorer`, every control
`wb-explorer-slider` (range inputs and selects alike), the picture `wb-explorer-img`; the
container's `data-frames` attribute counts the frames.
"""

from __future__ import annotations

import base64
import html
import itertools
import json
import math
import os
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

from matplotlib.figure import Figure

from varlen_workbench.workbench.plots import render_png

MODES = ("auto", "live", "static")
MAX_FRAMES = 64  # the static page carries every frame: keep axes small


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, Real) and not isinstance(v, bool) for v in values)


def _static_requested(mode: str) -> bool:
    if mode not in MODES:
        raise ValueError(f"mode = {mode!r} must be one of {MODES}.")
    if mode == "auto":
        return os.environ.get("WORKBENCH_STATIC", "0") not in ("", "0", "false", "no")
    return mode == "static"


class Explorer:
    """The object `explore` returns; displaying it shows the live or the static form."""

    def __init__(self, fn: Callable[..., Figure], axes: dict[str, list[Any]], static: bool) -> None:
        self.fn, self.axes, self.static = fn, axes, static
        self._frames: dict[tuple[int, ...], bytes] = {}
        self._widget = None

    # -- frames ------------------------------------------------------------------------
    def frame(self, index: tuple[int, ...]) -> bytes:
        """PNG of the point at `index` (one position per axis), computed once."""
        if index not in self._frames:
            point = {name: values[i] for (name, values), i in zip(self.axes.items(), index)}
            fig = self.fn(**point)
            if not isinstance(fig, Figure):
                raise TypeError(
                    f"explore: fn({', '.join(f'{k}={v!r}' for k, v in point.items())}) returned "
                    f"{type(fig).__name__}; it must return a matplotlib Figure (e.g. a varlen_workbench.workbench.plots function's result)."
                )
            self._frames[index] = render_png(fig, dpi=90)
        return self._frames[index]

    def indices(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(len(v)) for v in self.axes.values())))

    # -- static form -------------------------------------------------------------------
    def static_html(self) -> str:
        """A self-contained HTML snippet with every frame and the script that switches them."""
        frames = {
            "-".join(map(str, i)): "data:image/png;base64," + base64.b64encode(self.frame(i)).decode() for i in self.indices()
        }
        controls = []
        for name, values in self.axes.items():
            label = html.escape(name)
            if _numeric(values):
                ticks = " ".join(html.escape(str(v)) for v in values)
                control = (
                    f'<input type="range" class="wb-explorer-slider" data-axis="{label}" min="0" max="{len(values) - 1}" '
                    f'step="1" value="0" aria-label="{label}" data-values="{html.escape(json.dumps([str(v) for v in values]))}">'
                    f'<output class="wb-explorer-value">{html.escape(str(values[0]))}</output>'
                    f'<span class="wb-explorer-ticks" style="color:#57606a;font-size:0.8em;margin-left:0.5em">({ticks})</span>'
                )
            else:
                options = "".join(f'<option value="{i}">{html.escape(str(v))}</option>' for i, v in enumerate(values))
                control = f'<select class="wb-explorer-slider" data-axis="{label}" aria-label="{label}">{options}</select>'
            controls.append(f'<label style="display:block;margin:0.2em 0"><code>{label}</code> {control}</label>')
        first = frames["-".join("0" for _ in self.axes)]
        script = (
            "(function(){"
            "var root=document.currentScript.closest('.wb-explorer');"
            "var frames=JSON.parse(root.querySelector('script[type=\"application/json\"]').textContent);"
            "var controls=root.querySelectorAll('.wb-explorer-slider');"
            "var img=root.querySelector('.wb-explorer-img');"
            "function update(){var key=[];controls.forEach(function(c){key.push(c.value);"
            "var out=c.nextElementSibling;if(out&&out.tagName==='OUTPUT'){out.textContent=JSON.parse(c.dataset.values)[+c.value];}});"
            "img.src=frames[key.join('-')];}"
            "controls.forEach(function(c){c.addEventListener('input',update);c.addEventListener('change',update);});"
            "})();"
        )
        return (
            f'<div class="wb-explorer" data-frames="{len(frames)}" style="background:#fff;color:#1f2328;padding:0.5em;border-radius:4px">'
            + "".join(controls)
            # alt: what the frames show, said by the notebook (the site fills it in from the cell's `wb-alt`)
            + f'<img class="wb-explorer-img" src="{first}" alt="">'
            + f'<script type="application/json">{json.dumps(frames)}</script>'
            + f"<script>{script}</script></div>"
        )

    # -- live form ---------------------------------------------------------------------
    def widget(self):
        """The ipywidgets box (built once): controls above an Image that redraws on change."""
        if self._widget is None:
            import ipywidgets as widgets

            controls = []
            for name, values in self.axes.items():
                options = [(str(v), i) for i, v in enumerate(values)]
                common = dict(options=options, value=0, description=name, style={"description_width": "initial"})
                if _numeric(values):
                    controls.append(widgets.SelectionSlider(continuous_update=False, **common))  # redraw on release
                else:
                    controls.append(widgets.Dropdown(**common))
            image = widgets.Image(value=self.frame(tuple(0 for _ in controls)), format="png")

            def redraw(_change: Any = None) -> None:
                image.value = self.frame(tuple(c.value for c in controls))

            for control in controls:
                control.observe(redraw, names="value")
            self._widget = widgets.VBox([*controls, image], layout=widgets.Layout(align_items="flex-start"))
            self._widget.add_class("wb-explorer")
            image.add_class("wb-explorer-img")
            for control in controls:
                control.add_class("wb-explorer-slider")
        return self._widget

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        if self.static:
            return {"text/html": self.static_html(), "text/plain": repr(self)}
        bundle = dict(self.widget()._repr_mimebundle_())
        still = base64.b64encode(self.frame(tuple(0 for _ in self.axes))).decode()
        bundle["text/html"] = (
            f'<img class="wb-explorer-img" src="data:image/png;base64,{still}" alt="first frame (run the notebook for the live explorer)">'
        )
        bundle["text/plain"] = repr(self)
        return bundle

    def __repr__(self) -> str:
        shape = " x ".join(f"{name}[{len(values)}]" for name, values in self.axes.items())
        return f"<Explorer {shape} ({'static' if self.static else 'live'})>"


def explore(fn: Callable[..., Figure], *, mode: str = "auto", max_frames: int = MAX_FRAMES, **axes: Sequence[Any]) -> Explorer:
    """Explores `fn(**point)` over the product of `axes`; display the result (end a cell with it).

    `mode="auto"` is static when `WORKBENCH_STATIC=1` is set (the site build), live otherwise.
    The static form renders all frames now; more than `max_frames` raises ValueError.
    """
    if not callable(fn):
        raise TypeError(f"explore: fn must be callable returning a matplotlib Figure, got {type(fn).__name__}.")
    if not axes:
        raise ValueError("explore needs at least one axis, e.g. explore(fn, tail_q=[0, 2, 8]).")
    checked = {}
    for name, values in axes.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"explore: axis {name!r} must be a non-empty list of values, e.g. {name}=[...].")
        checked[name] = list(values)
    static = _static_requested(mode)
    frames = math.prod(len(v) for v in checked.values())
    if static and frames > max_frames:
        raise ValueError(
            f"explore: the static form would render {frames} frames (> max_frames = {max_frames}); "
            "use fewer values per axis or raise max_frames."
        )
    explorer = Explorer(fn, checked, static)
    if static:
        explorer.static_html()  # render every frame now: failures surface in this cell, not at display
    return explorer
