"""The index's "I see this symptom" routes (data/symptoms.toml): from what a user sees to the page
that explains it, and the one line that confirms it.

A route is data, and its page must back it (`route_problems`): the page exists; the library is part
of its META.component and a narrowed dtype one of its tags; each wrong tensor is named by its
impact, detection or "Who is affected"; and where the page declares its layouts (`WHO`,
`varlen_workbench.workbench.affected`), the route names an affected one whose batch has the route's
padding. The site build refuses a route its page does not back, and a post-mortem no route leads to.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, fields
from pathlib import Path

import tomllib

from varlen_workbench.workbench.affected import PADDING_KINDS, Affected, padding_kinds
from varlen_workbench.workbench.registry import PostMortem

SYMPTOMS_FILE = Path("data") / "symptoms.toml"  # under the project's root
ANY = "any"  # a route not narrowed to a padding kind or dtype
# The tensors a route may name, and the words a page uses for each.
TENSORS = {
    "out": r"\bout\b|output|result",
    "dq": r"\bdq\b",
    "dk": r"\bdk\b",
    "dv": r"\bdv\b",
    "grads": r"gradient",
    "weight grads": r"weight gradient",
    "loss": r"\bloss\b",
    "error": r"error",
}
TEST_COMMANDS = ("varlen-workbench repro ", "varlen-workbench audit ", "python -c ")


@dataclass(frozen=True)
class Route:
    """One row of the index's symptom table; see the header of data/symptoms.toml."""

    symptom: str
    tensors: tuple[str, ...]
    padding: str
    when: str
    library: str
    page: str
    test: str
    layout: str = ""
    dtype: str = ANY

    def __post_init__(self) -> None:
        unknown = [t for t in self.tensors if t not in TENSORS]
        if not self.tensors or unknown:
            raise ValueError(f"route {self.symptom!r}: tensors {list(self.tensors)} must be some of {list(TENSORS)}.")
        if self.padding not in (*PADDING_KINDS, ANY):
            raise ValueError(f"route {self.symptom!r}: padding {self.padding!r} must be one of {[*PADDING_KINDS, ANY]}.")
        if not self.test.startswith(TEST_COMMANDS):
            raise ValueError(f"route {self.symptom!r}: test {self.test!r} must start with one of {TEST_COMMANDS}.")


def read_routes(root: Path) -> list[Route]:
    """The routes of `root`'s symptoms file, in its order; none where the project has no such file
    (a scaffolded project: its index shows no symptom table)."""
    path = Path(root) / SYMPTOMS_FILE
    if not path.exists():
        return []
    with path.open("rb") as handle:
        entries = tomllib.load(handle).get("route", [])
    known = {f.name for f in fields(Route)}
    routes = []
    for i, entry in enumerate(entries):
        if set(entry) - known:
            raise ValueError(f"{path}: route {i + 1} has unknown fields {sorted(set(entry) - known)}; known: {sorted(known)}.")
        try:
            routes.append(Route(**{**entry, "tensors": tuple(entry.get("tensors", ()))}))
        except TypeError as exc:  # a field missing
            raise ValueError(f"{path}: route {i + 1}: {exc}") from None
    return routes


def who_text(pm: PostMortem) -> str:
    """The page's "Who is affected": its WHO's text, or the section as its notebook writes it."""
    who = getattr(pm.module, "WHO", None)
    if isinstance(who, Affected):
        return who.markdown()
    import nbformat  # here: only a page without WHO needs its notebook read

    cells = nbformat.read(pm.notebook, as_version=4).cells
    return next((c.source for c in cells if c.cell_type == "markdown" and c.source.startswith("## Who is affected")), "")


def route_problems(route: Route, pages: dict[str, PostMortem]) -> list[str]:
    """What the route's page does not back ([] when it backs all of it); `pages` by post-mortem id."""
    pm = pages.get(route.page)
    if pm is None:
        return [f"page {route.page!r} is no post-mortem (known: {sorted(pages)})"]
    meta, problems = pm.meta, []
    if route.library.lower() not in meta.component.lower():
        problems.append(f"library {route.library!r} is no part of META.component {meta.component!r}")
    if route.dtype != ANY and route.dtype not in meta.tags:
        problems.append(f"dtype {route.dtype!r} is none of META.tags {list(meta.tags)}")
    who = getattr(pm.module, "WHO", None)
    words = " ".join((pm.impact, meta.detection, who_text(pm))).lower()
    if isinstance(who, Affected):
        try:
            layout = who.layout(route.layout)
        except KeyError as exc:
            return [*problems, str(exc.args[0])]
        words += " " + layout.why.lower()
        if not layout.affected:
            problems.append(f"layout {route.layout!r} is declared not affected")
        if route.padding not in padding_kinds(layout.inputs):
            problems.append(f"padding {route.padding!r}: layout {route.layout!r} has {sorted(padding_kinds(layout.inputs))}")
    elif route.layout or route.padding != ANY:
        problems.append('the page declares no layouts (no WHO): give layout = "" and padding = "any"')
    problems += [f"tensor {t!r}: the page never names it" for t in route.tensors if not re.search(TENSORS[t], words)]
    return problems + _test_problems(route)


def _test_problems(route: Route) -> list[str]:
    """What is wrong with the route's one-line test: a CLI line the CLI's own parser refuses, a
    repro of another page, an audit check or adapter that does not exist, Python that does not compile."""
    if route.test.startswith("python -c "):
        try:
            compile(shlex.split(route.test)[2], "<route test>", "exec")
        except SyntaxError as exc:
            return [f"test {route.test!r} does not compile: {exc.msg}"]
        return []
    from varlen_workbench.workbench.audit.adapters import ADAPTERS
    from varlen_workbench.workbench.audit.checks import CHECKS
    from varlen_workbench.workbench.cli.parser import build_parser

    try:
        args = build_parser().parse_args(shlex.split(route.test)[1:])
    except SystemExit:
        return [f"test {route.test!r}: varlen-workbench refuses its arguments"]
    if route.test.startswith("varlen-workbench repro "):
        return [] if args.id == route.page else [f"test {route.test!r} reproduces {args.id!r}, not {route.page!r}"]
    problems = [f"test {route.test!r}: no audit check {c!r}" for c in (args.checks or "").split(",") if c and c not in CHECKS]
    if args.adapter and args.adapter not in ADAPTERS:
        problems.append(f"test {route.test!r}: no adapter {args.adapter!r}")
    return problems


def unrouted(routes: list[Route], pages: dict[str, PostMortem]) -> list[str]:
    """The post-mortems no route leads to."""
    return sorted(set(pages) - {route.page for route in routes})
