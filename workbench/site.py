"""The static post-mortem site: execute every notebook, render it, index it, swap it in.

`build()` executes each notebook under notebooks/ afresh with nbclient (in parallel, one
kernel per notebook, on the default device: the Triton interpreter without a GPU), renders it
with nbconvert and the templates under site/templates/, and writes site/_build/:

* `<id>.html` for each post-mortem: a header rendered from META (upstream status apart from
  our verdict, a badge with the strongest evidence level its claims reached, fix type), the
  executed notebook (its header cell dropped: the page header replaces it; code inputs folded
  behind a toggle, outputs visible; headings with anchors), the static explorer frames, and a
  provenance footer;
* `<name>.html` for each plain notebook (no META: the instruments demo), listed apart with the
  first sentences of its introduction;
* `index.html`: a "start here" paragraph, then every post-mortem with its impact line, category
  (training or tooling bug), upstream status, our verdict, claims and evidence level, filterable
  by tag; `manifest.json`: the same rows for `workbench list`;
* `static/`: the site's CSS and JavaScript and JupyterLab's notebook CSS (`lab.css`), written once
  and linked from every page rather than inlined into each.

Claim verdicts come from the claims cell's output metadata (`workbench.registry.recorded_verdicts`),
never from printed text; a post-mortem page must show the reader block and an evidence level for
every claim (`page_problems`).

The build writes into a sibling directory and swaps it in only when every notebook executed,
every claim held and no page references anything off-site, so a failed build leaves the
previous site untouched. Pages are deterministic apart from the provenance footer (and the
manifest's provenance).
"""

from __future__ import annotations

import html
import itertools
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from workbench.errors import BuildError
from workbench.postmortem import READER_SECTIONS, Evidence
from workbench.registry import HEADER_TAG, PostMortem, Registry, RegistryError, check_notebook, recorded_verdicts

SITE = Path(__file__).resolve().parent.parent / "site"  # templates and static assets of every page
CELL_TIMEOUT_S = 900
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
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


# -- execution ----------------------------------------------------------------------------


def _first_error(nb) -> tuple[int, Any, Any] | None:
    """The first unexpected error output: cells tagged `raises-exception` (the tag nbclient and
    nbval share) show an error on purpose."""
    for index, cell in enumerate(nb.cells):
        if "raises-exception" in cell.metadata.get("tags", []):
            continue
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                return index, cell, output
    return None


def _describe(path: Path, index: int, cell, output) -> str:
    line = next((s for s in cell.source.splitlines() if s.strip() and not s.startswith("#")), "")
    return f"{path}: cell {index} (`{line.strip()[:60]}`) raised {output.ename}: {output.evalue}"


# The IPython profile of the kernels that execute our notebooks (kernel_env points IPYTHONDIR
# at it). nbclient starts each kernel on 127.0.0.1 over TCP, every message signed with the
# connection file's key; ipykernel >= 7 logs on each start that the transport is not encrypted,
# a warning about traffic crossing a network that this local, signed channel never does.
# The profile drops that one record, and keeps the user's own ~/.ipython (startup scripts,
# history) out of published runs.
KERNEL_PROFILE = """\
# Written by workbench.site.kernel_env for the kernels that execute notebooks; edit it there.
import logging


class LocalTcpWarning(logging.Filter):
    def filter(self, record):
        return "running over TCP without encryption" not in record.getMessage()


logging.getLogger("IPKernelApp").addFilter(LocalTcpWarning())
c.HistoryManager.enabled = False
"""


def _kernel_ipython_dir() -> Path:
    """A per-user IPYTHONDIR holding KERNEL_PROFILE (rewritten when it differs)."""
    import tempfile

    directory = Path(tempfile.gettempdir()) / f"workbench-ipython-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    config = directory / "profile_default" / "ipython_kernel_config.py"
    if not config.exists() or config.read_text() != KERNEL_PROFILE:
        config.parent.mkdir(parents=True, exist_ok=True)
        partial = config.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(KERNEL_PROFILE)
        partial.replace(config)  # atomic: parallel builds never read half a file
    return directory


def kernel_env(root: Path, *, static: bool = False) -> dict[str, str]:
    """A kernel's environment: ours, with the project root first on the import path, and with
    `static`, explorers in their static form (precomputed frames, see workbench.explorer)."""
    # Absolute: the kernel runs in the notebook's directory, where a relative root means nothing.
    paths = [str(Path(root).resolve()), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "IPYTHONDIR": str(_kernel_ipython_dir())}
    if static:
        env["WORKBENCH_STATIC"] = "1"
    return env


def execute(path: Path, root: Path) -> Any:
    """Runs `path` top to bottom in a fresh kernel in its own directory, for publication
    (explorers static: a page and a committed notebook carry every frame); returns the notebook.

    Raises `BuildError` naming the notebook, the cell and the error (for a claim that no
    longer holds, `ClaimFailed` names the claim).
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,  # timestamps would make every build differ
        store_widget_state=False,  # live widget state is for JupyterLab; the site uses static frames
    )
    try:
        client.execute(env=kernel_env(root, static=True))
    except CellTimeoutError as exc:
        raise BuildError(f"{path}: a cell ran longer than {CELL_TIMEOUT_S} s: {exc}") from None
    except CellExecutionError as exc:
        failed = _first_error(nb)
        if failed is None:
            raise BuildError(f"{path}: {exc}") from None
        raise BuildError(_describe(path, *failed)) from None
    return nb


def execute_in_place(path: Path, root: Path) -> None:
    """Executes a notebook and saves it with its outputs (how `workbench new` commits one)."""
    nbformat.write(execute(path, root), path)


def _execute_job(path: str, root: str) -> tuple[str, str, float]:
    start = time.perf_counter()
    nb = execute(Path(path), Path(root))
    return path, nbformat.writes(nb), time.perf_counter() - start


def execute_all(paths: list[Path], root: Path, jobs: int, log: Callable[[str], None]) -> dict[Path, Any]:
    """Executes notebooks in `jobs` processes; collects every failure before raising."""
    executed, failures = {}, []
    # spawn: the parent has torch loaded, and forking a process that holds its threads is unsafe.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_execute_job, str(p), str(root)) for p in paths]
        for done, future in enumerate(as_completed(futures), 1):
            try:
                path, text, seconds = future.result()
            except BuildError as exc:
                failures.append(str(exc))
                log(f"  [{done}/{len(paths)}] FAILED {exc}")
                continue
            executed[Path(path)] = nbformat.reads(text, as_version=4)
            log(f"  [{done}/{len(paths)}] {Path(path).name} executed in {seconds:.1f} s")
    if failures:
        raise BuildError("site not built; " + "; ".join(failures))
    return executed


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
        from workbench.postmortem import overall_verdict, strongest

        if self.postmortem is None:
            raise ValueError(f"{self.file} is a plain notebook: it has no index row.")
        meta = self.postmortem.meta
        best = strongest(v.level for v in self.verdicts)
        return {
            "id": meta.id,
            "title": meta.title,
            "component": meta.component,
            "status": meta.upstream_status,
            "status_note": meta.status_note,
            "fix_type": meta.fix_type,
            "tags": list(meta.tags),
            "page": self.file,
            "verdict": overall_verdict(self.verdicts),
            "category": meta.category,
            "impact": meta.impact,
            "our_verdict": meta.our_verdict,
            # The strongest evidence about upstream that a claim reached ("ours": only our kernel was run).
            "evidence": best.label if best else Evidence("ours").label,
            "evidence_kind": best.kind if best else "ours",
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


def status_class(status: str) -> str:
    """CSS class of a status badge ('partially fixed' -> 'wb-status-partially-fixed')."""
    return "wb-status-" + re.sub(r"[^a-z]+", "-", status.lower()).strip("-")


def for_site(nb, postmortem: PostMortem | None) -> Any:
    """The executed notebook as the site shows it.

    The header cell goes (the page header renders META). Live widget views go: their
    JavaScript manager lives on a CDN, and the explorer's static frames (text/html in the same
    output) stand in for them.
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
    return nb


def external_resources(text: str) -> list[str]:
    """URLs a page would fetch by itself: scripts, styles, images, CSS imports off-site."""
    return sorted({next(g for g in m.groups() if g) for m in _EXTERNAL.finditer(text)})


def _exporter(site_dir: Path):
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
            "row": page.row() if page.postmortem else None,
            "verdicts": page.verdicts,
            "levels": _distinct(v.level for v in page.verdicts),
            "status_class": status_class(page.postmortem.meta.upstream_status) if page.postmortem else "",
            "provenance": provenance,
        },
    }
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    return body


_H2 = re.compile(r"<h2\b[^>]*>(.*?)</h2>", re.DOTALL)
_TAG = re.compile(r"<[^>]+>")
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


def render_index(pages: list[Page], provenance: dict[str, str], site_dir: Path) -> str:
    import jinja2

    env = jinja2.Environment(
        # postmortem/ holds the macros the notebook pages share (the provenance footer).
        loader=jinja2.FileSystemLoader([site_dir / "templates", site_dir / "templates" / "postmortem"]),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["status_class"] = status_class
    rows = [p.row() for p in pages if p.postmortem]
    tags = sorted({t for r in rows for t in r["tags"]})
    others = [p for p in pages if not p.postmortem]
    levels = [Evidence(kind, "owner/repo@commit" if kind == "source" else "") for kind in Evidence.LEVELS]
    return env.get_template("site-index.html.j2").render(
        rows=rows, tags=tags, others=others, provenance=provenance, levels=levels, sections=READER_SECTIONS
    )


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
    from workbench.postmortem import claims_table
    from workbench.provenance import provenance

    registry = registry or Registry()
    site_dir = SITE
    out = Path(out) if out is not None else registry.root / "site" / "_build"
    started = time.perf_counter()
    notebooks = registry.notebooks()
    if not notebooks:
        raise BuildError(f"no notebooks under {registry.notebooks_dir}; `workbench new <id> <title>` starts one.")
    for _path, pm in notebooks:
        if pm is not None:
            check_notebook(pm)

    stamp = provenance()
    if execute_notebooks:
        jobs = jobs or min(len(notebooks), os.cpu_count() or 1)
        log(f"executing {len(notebooks)} notebooks with {jobs} kernels ({stamp['device']}, {stamp['mode']})")
        executed = execute_all([p for p, _ in notebooks], registry.root, jobs, log)
    else:
        log(f"rendering {len(notebooks)} committed notebooks without executing them")
        executed = {p: nbformat.read(p, as_version=4) for p, _ in notebooks}
        failed = [_describe(p, *e) for p, nb in executed.items() if (e := _first_error(nb))]
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
            if problems:
                raise BuildError(f"site not built; {page.file} ({page.source}): " + "; ".join(problems))
            _write_checked(staging / page.file, text)
        _write_checked(staging / "index.html", render_index(pages, stamp, site_dir))
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
