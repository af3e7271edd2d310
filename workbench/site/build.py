"""The static post-mortem site: execute every notebook, render it, index it, swap it in.

`build()` executes each notebook under notebooks/ afresh (`varlen_workbench.workbench.site.execute`: in parallel, one
kernel per notebook, on the default device: the Triton interpreter without a GPU), renders it
with nbconvert and the templates under site/templates/, and writes site/_build/:

* `<id>.html` for each post-mortem: a header rendered from META and its upstream status (kept
  apart from our verdict, a badge with the evidence level of its headline claim, fix type), the
  executed notebook (its header cell dropped: the page header replaces it; code inputs folded
  behind a toggle, outputs visible; headings with anchors), the static explorer frames, and a
  provenance footer;
* `<name>.html` for each plain notebook (no META: the instruments demo), listed apart with the
  first sentences of its introduction;
* `index.html`: a "start here" paragraph, the "I see this symptom" table (data/symptoms.toml, each
  route backed by its page: `varlen_workbench.workbench.symptoms`), then every post-mortem with its impact line, category
  (training or tooling bug), upstream status, our verdict, claims and evidence level, filterable
  by tag; `manifest.json`: the same rows for `varlen-workbench list`;
* `static/`: the site's CSS and JavaScript and JupyterLab's notebook CSS (`lab.css`), written once
  and linked from every page rather than inlined into each.

Claim verdicts come from the claims cell's output metadata (`varlen_workbench.workbench.registry.recorded_verdicts`),
never from printed text; a post-mortem page must show the reader block and an evidence level for
every claim (`page_problems`).

The build writes into a sibling directory and swaps it in only when every notebook executed,
every claim held and no page references anything off-site, so a failed build leaves the
previous site untouched. Pages are deterministic apart from the provenance footer (and the
manifest's provenance).
"""

from __future__ import annotations

import functools
import html
import itertools
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from varlen_workbench.workbench.affected import PADDING_KINDS
from varlen_workbench.workbench.cli.scaffold import ALT_KEY
from varlen_workbench.workbench.errors import BuildError
from varlen_workbench.workbench.postmortem import READER_SECTIONS, Evidence
from varlen_workbench.workbench.registry import HEADER_TAG, PostMortem, Registry, RegistryError, check_notebook, recorded_verdicts
from varlen_workbench.workbench.site.execute import describe_error, execute_all, first_error
from varlen_workbench.workbench.site.pasteblocks import TAG as _TAG
from varlen_workbench.workbench.symptoms import SYMPTOMS_FILE, Route, read_routes, route_problems, unrouted

SITE = Path(__file__).resolve().parents[2] / "site"  # templates and static assets of every page
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NO_ALT = "No description has been provided for this image"  # what nbconvert writes where a figure has none
# A request the page would make by itself (not a link a reader may follow).
_EXTERNAL = re.compile(
    r"""<(?:script|link|img|iframe|source|embed|video|audio)\b[^>]*?\b(?:src|href)\s*=\s*["']?((?:https?:)?//[^"'\s>]+)"""
    r"""|url\(\s*["']?((?:https?:)?//[^"')\s]+)|@import\s+["']((?:https?:)?//[^"']+)""",
    re.IGNORECASE,
)


# nbconvert settings, not code: heading anchors on, so a reader can link to a section; no
# highlighting CSS inlined into each page (static/lab.css carries it once, see `lab_css`). The
# template (site/templates/postmortem) links static/lab.css and folds code inputs.
EXPORTER_CONFIG = {
    "HTMLExporter": {"exclude_anchor_links": False, "anchor_link_text": "\u00b6"},
    "CSSHTMLHeaderPreprocessor": {"enabled": False},
}


# -- rendering ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    """One rendered notebook: its file name and, for a post-mortem, its index row; for a plain
    notebook, the first sentences of its introduction (`description`)."""

    source: Path
    file: str
    title: str
    postmortem: PostMortem | None
    verdicts: tuple = ()
    description: str = ""

    def row(self) -> dict[str, Any]:
        from varlen_workbench.workbench.postmortem import overall_verdict

        if self.postmortem is None:
            raise ValueError(f"{self.file} is a plain notebook: it has no index row.")
        meta, status = self.postmortem.meta, self.postmortem.status
        headline = next(v.level for v in self.verdicts if v.claim == self.postmortem.claims.headline)
        return {
            "id": meta.id,
            "title": meta.title,
            "component": meta.component,
            "status": status.label,
            "status_class": status.css_class,
            "status_note": status.sentence(),
            "fix_type": meta.fix_type,
            "tags": list(meta.tags),
            "page": self.file,
            "verdict": overall_verdict(self.verdicts),
            "category": meta.category,
            "impact": self.postmortem.impact,
            "our_verdict": meta.our_verdict,
            # The level at which the bug itself was shown: its headline claim's (a control claim's
            # stronger level, or our kernel's run, says nothing of how the bug was shown).
            "evidence": headline.label,
            "evidence_kind": headline.kind,
            "levels": [level.short for level in _distinct(v.level for v in self.verdicts)],
            "all_hold": all(v.holds for v in self.verdicts),
        }


def _distinct(levels) -> list[Evidence]:
    """The evidence levels among `levels`, strongest first, each once."""
    return sorted(set(levels), key=lambda e: (e.rank, e.at))


_MARKDOWN_LINK = re.compile(r"\[([^\]]+)\]\([^)]*\)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def describe(nb, limit: int = 280) -> tuple[str, str]:
    """(title, description) of a plain notebook: its first `# ` heading, and its metadata's
    `description` or else the first complete sentences of the paragraph after the heading (links
    as their text, no code marks), at most about `limit` characters."""
    title, paragraph = "", ""
    given = nb.metadata.get("description", "")
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        lines = cell.source.strip().splitlines()
        if not title and lines and lines[0].startswith("# "):
            title, lines = lines[0][2:].strip(), lines[1:]
        text = "\n".join(lines).strip()
        if text and not text.startswith(("#", "```", "|")):
            paragraph = text.split("\n\n")[0]
            break
    paragraph = _MARKDOWN_LINK.sub(r"\1", " ".join(paragraph.split())).replace("`", "")
    kept = ""
    for sentence in _SENTENCE_END.split(paragraph):
        if not sentence.endswith((".", "!", "?")) or (kept and len(kept) + len(sentence) > limit):
            break
        kept = f"{kept} {sentence}".strip()
        if len(kept) >= 80:
            break
    kept = given or kept or paragraph
    if len(kept) > limit:  # one long sentence: cut at a word
        kept = kept[:limit].rsplit(" ", 1)[0] + " …"
    return title, kept


def for_site(nb, postmortem: PostMortem | None) -> Any:
    """The executed notebook as the site shows it.

    The header cell goes (the page header renders META). Live widget views go: their
    JavaScript manager lives on a CDN, and the explorer's static frames (text/html in the same
    output) stand in for them.
    Comments for the test harness (nbval's markers) go from code inputs.
    """
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))  # a deep copy; the executed notebook stays intact
    nb.metadata.pop("widgets", None)
    if postmortem is not None:
        nb.cells = [c for c in nb.cells if HEADER_TAG not in c.metadata.get("tags", [])]
    for cell in nb.cells:
        outputs = []
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data is not None and WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                if set(data) <= {"text/plain"}:
                    continue  # only the widget's Python repr is left: nothing a reader can use
            outputs.append(output)
        if cell.cell_type == "code":
            cell.outputs = outputs
            cell.source = _TEST_MARKER.sub("", cell.source).lstrip("\n")
            _describe_figures(cell)
    return nb


_IMG = re.compile(r"<img\b[^>]*>", re.IGNORECASE)
_ALT = re.compile(r"""\salt\s*=\s*(?:"[^"]*"|'[^']*')""", re.IGNORECASE)
_ALT_VALUE = re.compile(r'\salt\s*=\s*"([^"]*)"', re.IGNORECASE)
IMAGE_TYPES = ("image/png", "image/jpeg")


def _describe_figures(cell) -> None:
    """Gives every figure of `cell` the description its metadata `wb-alt` holds (what the figure
    shows, written in the notebook): as the alt of a PNG output (the template reads it) and of the
    pictures in an HTML output (an explorer's frames)."""
    alt = cell.metadata.get(ALT_KEY)
    if not alt:
        return
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        for kind in IMAGE_TYPES:
            if kind in data:
                output.setdefault("metadata", {}).setdefault(kind, {})["alt"] = alt
        if "text/html" in data:
            data["text/html"] = _IMG.sub(lambda m: _with_alt(m.group(0), alt), data["text/html"])


def _with_alt(tag: str, alt: str) -> str:
    """An `<img ...>` tag with `alt` as its only alt attribute."""
    return _ALT.sub("", tag).replace("<img", f'<img alt="{html.escape(alt, quote=True)}"', 1)


def undescribed_figures(text: str) -> int:
    """The pictures of a rendered page with no description (no alt, or nbconvert's placeholder)."""
    alts = [_ALT_VALUE.search(tag) for tag in _IMG.findall(text)]
    return sum(1 for m in alts if m is None or not m.group(1).strip() or m.group(1) == NO_ALT)


# nbval's markers (`# NBVAL_CHECK_OUTPUT`) and comments about nbval steer the test run, not the reader.
_TEST_MARKER = re.compile(r"[ \t]*#[^\n]*\bnbval[^\n]*", re.IGNORECASE)


def external_resources(text: str) -> list[str]:
    """URLs a page would fetch by itself: scripts, styles, images, CSS imports off-site."""
    return sorted({next(g for g in m.groups() if g) for m in _EXTERNAL.finditer(text)})


@functools.cache
def _exporter(site_dir: Path):
    """One exporter per template directory, reused for every page: a new one compiles its Jinja
    templates again (a fifth of a site's rendering time). Jinja reloads a template whose file changed."""
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    return HTMLExporter(
        config=Config(EXPORTER_CONFIG), template_name="postmortem", extra_template_basedirs=[str(site_dir / "templates")]
    )


def lab_css(site_dir: Path = SITE) -> str:
    """JupyterLab's notebook CSS (the lab template's index.css and light theme) and the code
    highlighting rules: one file, `static/lab.css`, that every page links instead of inlining."""
    from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor

    exporter = _exporter(site_dir)
    parts = []
    for name in ("index.css", "theme-light.css"):
        found = next((Path(d) / "static" / name for d in exporter.template_paths if (Path(d) / "static" / name).is_file()), None)
        if found is None:
            raise BuildError(
                f"nbconvert's lab template has no static/{name} (searched {exporter.template_paths}); reinstall nbconvert."
            )
        parts.append(f"/* nbconvert lab template: {name} */\n{found.read_text()}")
    highlight = CSSHTMLHeaderPreprocessor()._generate_header({"config_dir": ""})
    parts.append("/* code highlighting (pygments, JupyterLab style) */\n" + "\n".join(highlight))
    return "\n".join(parts)


def page_records(nb) -> list:
    """The freshness of each GPU record the notebook read when it was executed (its metadata's
    `gpu_records`, `varlen_workbench.workbench.site.execute`), for the stamps atop its page."""
    from varlen_workbench.workbench.gpu_records.freshness import freshness
    from varlen_workbench.workbench.provenance import GPU_DATA
    from varlen_workbench.workbench.records import read_record

    return [freshness({**read_record(GPU_DATA / name), "file": name}) for name in nb.metadata.get("gpu_records", [])]


def render_page(nb, page: Page, provenance: dict[str, str], site_dir: Path) -> str:
    exporter = _exporter(site_dir)
    # nbconvert names some output divs with uuid4(): a per-page counter keeps pages deterministic.
    counter = itertools.count()
    exporter.environment.globals["uuid4"] = lambda: f"wb-output-{next(counter)}"
    resources = {
        "metadata": {"name": page.title},
        "inlining": {"css": []},  # the highlighting CSS is in static/lab.css (EXPORTER_CONFIG turns its preprocessor off)
        "wb": {
            "meta": page.postmortem.meta if page.postmortem else None,
            "status": page.postmortem.status if page.postmortem else None,
            "row": page.row() if page.postmortem else None,
            "verdicts": page.verdicts,
            "levels": _distinct(v.level for v in page.verdicts),
            "provenance": provenance,
            "records": page_records(nb),
        },
    }
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    return body


_H2 = re.compile(r"<h2\b[^>]*>(.*?)</h2>", re.DOTALL)
_TABLE = re.compile(r"<table\b[^>]*>(.*?)</table>", re.DOTALL)
_ROW = re.compile(r"<tr\b[^>]*>(.*?)</tr>", re.DOTALL)
_CELL = re.compile(r"<t([dh])\b[^>]*>(.*?)</t\1>", re.DOTALL)
CLAIMS_HEADER = ("verdict", "level", "claim", "evidence")


def _text(fragment: str) -> str:
    return html.unescape(_TAG.sub("", fragment)).replace("\u00b6", "").strip()


def page_problems(text: str) -> list[str]:
    """What a post-mortem page lacks: the reader block (`READER_SECTIONS` as its first level-2
    headings, in order), a claims table, and an evidence level for every claim. [] when complete."""
    problems = []
    headings = [_text(h) for h in _H2.findall(text)]
    for i, section in enumerate(READER_SECTIONS):
        found = headings[i] if i < len(headings) else None
        if found is None or not found.startswith(section):
            problems.append(f"reader block: heading {i + 1} must be {section!r} (found {found!r})")
    shorts = {Evidence(kind, "x/y@0000000" if kind == "source" else "").short for kind in Evidence.LEVELS}
    claims = []
    for table in _TABLE.findall(text):
        rows = [[_text(c) for _, c in _CELL.findall(r)] for r in _ROW.findall(table)]
        if rows and tuple(rows[0]) == CLAIMS_HEADER:
            claims += rows[1:]
    if not claims:
        problems.append(f"no claims table (a table headed {', '.join(CLAIMS_HEADER)}: claims.report(results))")
    for row in claims:
        if len(row) != len(CLAIMS_HEADER) or row[1] not in shorts:
            problems.append(f"claim {row[2] if len(row) > 2 else row!r} has no evidence level (one of {sorted(shorts)})")
    return problems


USE_PAGE = "use.html"  # "Use the fixed kernel", linked from every page


def _jinja(site_dir: Path):
    import jinja2

    return jinja2.Environment(
        # postmortem/ holds the macros the notebook pages share (the provenance footer).
        loader=jinja2.FileSystemLoader([site_dir / "templates", site_dir / "templates" / "postmortem"]),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


def render_use(provenance: dict[str, str], site_dir: Path) -> str:
    """The "Use the fixed kernel" page: every fact from `varlen_workbench.workbench.site.usage`, read now."""
    from varlen_workbench.kernels.hf import NAME
    from varlen_workbench.workbench.site import usage

    dist = usage.distribution()
    return (
        _jinja(site_dir)
        .get_template("use.html.j2")
        .render(
            dist=dist,
            extras=usage.user_extras(dist),
            range=usage.supported(),
            hf_name=NAME,
            import_name=usage.IMPORT_NAME,
            hf_distribution=usage.HF_DISTRIBUTION,
            transformers=usage.transformers_range(),
            beside=usage.beside_hub_kernels(),
            provenance=provenance,
        )
    )


def render_index(pages: list[Page], routes: list[Route], provenance: dict[str, str], site_dir: Path) -> str:
    env = _jinja(site_dir)
    rows = [p.row() for p in pages if p.postmortem]
    tags = sorted({t for r in rows for t in r["tags"]})
    others = [p for p in pages if not p.postmortem]
    levels = [Evidence(kind, "owner/repo@commit" if kind == "source" else "") for kind in Evidence.LEVELS]
    return env.get_template("site-index.html.j2").render(
        rows=rows,
        tags=tags,
        others=others,
        routes=routes,
        padding_kinds=PADDING_KINDS,
        provenance=provenance,
        levels=levels,
        sections=READER_SECTIONS,
    )


def checked_routes(root: Path, postmortems: list[PostMortem]) -> list[Route]:
    """The symptom routes of data/symptoms.toml, each backed by its page, and every post-mortem
    reached by one; a `BuildError` naming the route and what its page lacks otherwise."""
    routes = read_routes(root)
    if not routes:
        return routes
    pages = {pm.id: pm for pm in postmortems}
    problems = [f"route {r.symptom!r} -> {r.page}: {p}" for r in routes for p in route_problems(r, pages)]
    problems += [f"no route in {SYMPTOMS_FILE} leads to {page}" for page in unrouted(routes, pages)]
    if problems:
        raise BuildError("site not built; " + "; ".join(problems))
    return routes


# -- the build ----------------------------------------------------------------------------


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _swap_in(staging: Path, out: Path) -> None:
    """Replaces `out` by `staging` with two renames (a reader sees the old or the new site)."""
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def build(
    registry: Registry | None = None,
    out: Path | None = None,
    *,
    execute_notebooks: bool = True,
    jobs: int | None = None,
    log: Callable[[str], None] = _print,
) -> list[Page]:
    """Builds the site into `out` (default site/_build); see the module docstring."""
    from varlen_workbench.workbench.postmortem import claims_table
    from varlen_workbench.workbench.provenance import provenance

    registry = registry or Registry()
    site_dir = SITE
    out = Path(out) if out is not None else registry.root / "site" / "_build"
    started = time.perf_counter()
    notebooks = registry.notebooks()
    if not notebooks:
        raise BuildError(f"no notebooks under {registry.notebooks_dir}; `varlen-workbench new <id> <title>` starts one.")
    for path, pm in notebooks:
        if pm is not None:
            check_notebook(pm)
        if f"{path.stem}.html" in ("index.html", USE_PAGE):
            raise BuildError(f"{path} would render over the site's own {path.stem}.html; rename the notebook.")

    stamp = provenance()
    if execute_notebooks:
        jobs = jobs or min(len(notebooks), os.cpu_count() or 1)
        log(f"executing {len(notebooks)} notebooks with {jobs} kernels ({stamp['device']}, {stamp['mode']})")
        executed = execute_all([p for p, _ in notebooks], registry.root, jobs, log)
    else:
        log(f"rendering {len(notebooks)} committed notebooks without executing them")
        executed = {p: nbformat.read(p, as_version=4) for p, _ in notebooks}
        failed = [describe_error(p, *e) for p, nb in executed.items() if (e := first_error(nb))]
        if failed:
            raise BuildError("site not built; committed notebooks hold errors: " + "; ".join(failed))

    pages = []
    for path, pm in notebooks:
        nb = executed[path]
        if pm is None:
            title, description = describe(nb)
            pages.append(Page(path, f"{path.stem}.html", title or path.stem, None, description=description))
            continue
        try:
            verdicts = tuple(recorded_verdicts(pm, nb))
        except RegistryError as exc:
            raise BuildError(f"site not built; {exc}") from None
        failing = [v for v in verdicts if v.failed]
        if failing:
            raise BuildError(
                f"site not built; {path}: claims do not hold: {', '.join(repr(v.claim) for v in failing)}\n{claims_table(verdicts)}"
            )
        pages.append(Page(path, f"{pm.id}.html", pm.meta.title, pm, verdicts))

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(site_dir / "static", staging / "static")
        (staging / "static" / "lab.css").write_text(lab_css(site_dir))
        for page in pages:
            text = render_page(for_site(executed[page.source], page.postmortem), page, stamp, site_dir)
            problems = page_problems(text) if page.postmortem else []
            if undescribed_figures(text):
                problems.append(
                    f"{undescribed_figures(text)} figure(s) without a description: give each figure cell the metadata "
                    f"{ALT_KEY!r}, what its figure shows (the alt text)"
                )
            if problems:
                raise BuildError(f"site not built; {page.file} ({page.source}): " + "; ".join(problems))
            _write_checked(staging / page.file, text)
        routes = checked_routes(registry.root, [p.postmortem for p in pages if p.postmortem])
        _write_checked(staging / "index.html", render_index(pages, routes, stamp, site_dir))
        _write_checked(staging / USE_PAGE, render_use(stamp, site_dir))
        manifest = {
            "postmortems": [p.row() for p in pages if p.postmortem],
            "notebooks": [p.file for p in pages if not p.postmortem],
            "provenance": stamp,
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        _swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"site built: {len(pages)} pages in {out} ({time.perf_counter() - started:.0f} s)")
    return pages


def _write_checked(path: Path, text: str) -> None:
    external = external_resources(text)
    if external:
        raise BuildError(
            f"site not built; {path.name} would fetch off-site resources (the site must work offline): {', '.join(external)}"
        )
    path.write_text(text)
