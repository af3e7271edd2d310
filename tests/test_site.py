"""The site build: executed pages, index, determinism, offline pages, loud failures, atomic swap;
every post-mortem page with the reader block and an evidence level per claim; and nbval over a
scaffolded notebook (it passes untouched, and fails naming a broken claim)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import FAST_FIX, PLANTED_BUG, scaffold_variant
from conftest import plain_notebook as _plain_notebook

from varlen_workbench.workbench.errors import BuildError
from varlen_workbench.workbench.postmortem import METADATA_KEY, OURS, READER_SECTIONS, ClaimVerdict, claims_table
from varlen_workbench.workbench.registry import Registry
from varlen_workbench.workbench.site.build import SITE, build, describe, external_resources, for_site, page_problems
from varlen_workbench.workbench.site.execute import execute_in_place, kernel_env

FOOTER = re.compile(r'<footer class="wb-provenance">.*?</footer>', re.DOTALL)


def _pages(out):
    """Every file of a built site, the provenance footer blanked (the one part that may differ)."""
    files = {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = json.loads(files.pop("manifest.json"))
    manifest.pop("provenance")
    return {name: FOOTER.sub("<footer/>", text) for name, text in files.items()}, manifest


def test_pages_index_and_manifest(built_site):
    project, out = built_site
    assert sorted(p.name for p in out.glob("*.html")) == [
        "index.html",
        "oracle-variant.html",
        "plain-notes.html",
        "scaffold-demo.html",
        "use.html",  # "Use the fixed kernel": every site has it, every page links it
    ]
    page = (out / "scaffold-demo.html").read_text()
    assert '<h1 class="wb-title">A scaffolded post-mortem</h1>' in page
    assert 'class="wb-status wb-status-not-checked">not checked</span>' in page and "2/2 claims hold" in page
    # Upstream status and our verdict apart; the evidence badge names the headline claim's level (our kernel here).
    assert '<dt>Our verdict</dt><dd class="wb-our-verdict">scaffold: nothing of an upstream report verified yet</dd>' in page
    assert '<span class="wb-evidence wb-evidence-ours"' in page and "bug shown by: our fixed kernel, run here" in page
    assert "header_markdown(" not in page, "the header cell is replaced by the page header"
    assert "HOLDS" in page and "Not recorded yet." in page
    # Code folded behind a toggle, outputs visible; anchors on headings; lab CSS linked, not inlined.
    assert page.count('<details class="wb-code"') == page.count("jp-CodeCell") > 0
    assert page.count('<details class="wb-code" open="">') == 1, "the check-your-run cell (tag wb-show-code) opens unfolded"
    assert '<h2 id="TL;DR">TL;DR<a class="anchor-link" href="#TL;DR">' in page
    assert 'href="static/lab.css"' in page and "<style" not in page
    assert "--jp-icon-add-above" in (out / "static" / "lab.css").read_text() and "--jp-icon-add-above" not in page
    assert re.search(r"Built with Python [\d.]+, torch \S+, triton \S+\s+on .+ \((Triton interpreter|native)\), commit", page)
    assert "42" in (out / "plain-notes.html").read_text()

    index = (out / "index.html").read_text()
    assert '<a class="wb-postmortem-link" href="scaffold-demo.html">' in index
    assert """<tr data-tags='["scaffold"]'>""" in index and 'data-tag="scaffold"' in index
    assert '<section class="wb-start-here">' in index and 'What "claims hold" verifies.' in index
    assert "(one line for the index: what breaks, for whom, how badly)" in index, "the impact line"
    assert '<span class="wb-category wb-category-training-bug">training bug</span>' in index
    assert '<a class="wb-notebook-link" href="plain-notes.html">A plain notebook</a>' in index
    assert all((out / "static" / name).exists() for name in ("site.css", "site.js", "lab.css"))

    rows = json.loads((out / "manifest.json").read_text())["postmortems"]
    assert [(r["id"], r["verdict"], r["tags"], r["levels"], r["category"]) for r in rows] == [
        ("oracle-variant", "2/2 claims hold", ["scaffold", "oracle"], ["our kernel"], "training bug"),
        ("scaffold-demo", "2/2 claims hold", ["scaffold"], ["our kernel"], "training bug"),
    ]


def test_every_postmortem_page_has_the_reader_block_and_labelled_claims(built_site):
    _, out = built_site
    for name in ("scaffold-demo.html", "oracle-variant.html"):
        assert page_problems((out / name).read_text()) == [], name


def test_page_problems_name_a_missing_reader_section_and_an_unlabelled_claim(built_site):
    """The check above can fail: a page without one reader section, or with a claim whose
    evidence level is blank or unknown, is named with what it lacks."""
    _, out = built_site
    page = (out / "scaffold-demo.html").read_text()
    without = re.sub(r"<h2 id=\"Who-is-affected\">.*?</h2>", "", page, count=1, flags=re.DOTALL)
    assert without != page
    assert any("heading 2 must be 'Who is affected'" in p for p in page_problems(without))
    unlabelled = page.replace("<td>our kernel</td>", "<td></td>", 1)
    assert unlabelled != page
    assert page_problems(unlabelled) == [
        "claim 'padding rows of out, dq, dk, dv are exactly 0' has no evidence level (one of "
        + str(sorted({"upstream GPU", "upstream CPU", "replica", "toy model", "source", "our kernel"}))
        + ")"
    ]
    no_claims = re.sub(r"<table class=\"wb-table\"><thead><tr><th>verdict</th>.*?</table>", "", page, flags=re.DOTALL)
    assert any("no claims table" in p for p in page_problems(no_claims))
    assert len(READER_SECTIONS) == 5


@pytest.mark.parametrize(
    "cells, expected",
    [
        (
            ["# Title\n\nFirst sentence is short. Second one adds what the page shows, with a [link](https://x.y) and `code`."],
            ("Title", "First sentence is short. Second one adds what the page shows, with a link and code."),
        ),
        (
            ["# Title", "Intro that ends in a lead-in to a block:\n\n```\ncmd\n```"],
            ("Title", "Intro that ends in a lead-in to a block:"),
        ),
        (["# Only a title"], ("Only a title", "")),
    ],
)
def test_plain_pages_are_described_by_their_introduction(cells, expected):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(c) for c in cells]
    assert describe(nb) == expected
    nb.metadata["description"] = "Given in the notebook's metadata."
    assert describe(nb) == (expected[0], "Given in the notebook's metadata.")


def test_pages_request_nothing_off_site(built_site):
    _, out = built_site
    for page in out.glob("*.html"):
        assert external_resources(page.read_text()) == [], page.name


def test_execution_is_deterministic(built_site, tmp_path):
    """Executing afresh gives the committed outputs exactly: an executed build and a build of
    the committed notebooks agree on every file apart from the provenance footer."""
    project, out = built_site
    build(project, tmp_path / "again", execute_notebooks=False, log=lambda message: None)
    (again, again_manifest), (first, first_manifest) = _pages(tmp_path / "again"), _pages(out)
    assert sorted(again) == sorted(first) and again_manifest == first_manifest
    for name in first:
        assert again[name] == first[name], name


def test_off_site_resources_are_detected():
    page = """<script src="https://cdn.example/require.js"></script><link href="//cdn.example/x.css" rel="stylesheet">
    <img src='http://example.org/a.png'><style>@import "https://fonts.example/f.css"; b { background: url(https://x.example/b.png) }</style>
    <a href="https://github.com/pytorch/pytorch/issues/1">links a reader follows are fine</a><img src="data:image/png;base64,AAAA">"""
    assert external_resources(page) == [
        "//cdn.example/x.css",
        "http://example.org/a.png",
        "https://cdn.example/require.js",
        "https://fonts.example/f.css",
        "https://x.example/b.png",
    ]


def test_for_site_drops_live_widgets_and_the_header_cell(scaffolded):
    pm = scaffolded.get("scaffold-demo")
    nb = nbformat.read(pm.notebook, as_version=4)
    widget = {"application/vnd.jupyter.widget-view+json": {"model_id": "abc"}, "text/plain": "IntSlider(value=1)"}
    both = dict(widget, **{"text/html": '<div class="wb-explorer">frames</div>'})
    nb.metadata["widgets"] = {"state": {}}
    nb.cells[1:1] = [
        nbformat.v4.new_code_cell("explore()", outputs=[nbformat.v4.new_output("display_data", data=d) for d in (widget, both)])
    ]
    shown = for_site(nb, pm)
    assert "widgets" not in shown.metadata and "widgets" in nb.metadata, "the executed notebook stays intact"
    assert "header_markdown(" not in shown.cells[0].source
    assert [o.data for o in shown.cells[0].outputs] == [
        {"text/plain": "IntSlider(value=1)", "text/html": '<div class="wb-explorer">frames</div>'}
    ]


@pytest.mark.slow
def test_failures_name_notebook_and_cell_and_keep_the_old_site(project, tmp_path):
    out = tmp_path / "site" / "_build"
    # A cell that raises on purpose says so with the tag nbclient and nbval share.
    _plain_notebook(project.notebooks_dir / "fine.ipynb", "x = 1", "raise KeyError('on purpose')")
    notebook = nbformat.read(project.notebooks_dir / "fine.ipynb", as_version=4)
    notebook.cells[2].metadata["tags"] = ["raises-exception"]
    nbformat.write(notebook, project.notebooks_dir / "fine.ipynb")
    build(project, out, log=lambda message: None)
    before = _pages(out)
    assert "on purpose" in before[0]["fine.html"]

    _plain_notebook(project.notebooks_dir / "broken.ipynb", "x = 1", "import math\nmath.sqrt(-1)")
    with pytest.raises(BuildError, match=r"broken\.ipynb: cell 2 \(`import math`\) raised ValueError: math domain error"):
        build(project, out, log=lambda message: None)
    assert _pages(out) == before

    # This one fails while pages are being written: the half-built site must vanish.
    cdn = "from IPython.display import HTML\nHTML('<script src=\"https://cdn.example/widgets.js\"></script>')"
    _plain_notebook(project.notebooks_dir / "broken.ipynb", cdn)
    with pytest.raises(BuildError, match=r"broken\.html would fetch off-site resources .*: https://cdn\.example/widgets\.js"):
        build(project, out, log=lambda message: None)
    assert _pages(out) == before
    assert [p.name for p in out.parent.iterdir()] == ["_build"], "no staging directory is left behind"


@pytest.mark.slow
def test_failing_claim_is_named_in_execute_and_render_modes(project, tmp_path):
    module_path, notebook_path = scaffold_variant(project, "planted-bug", PLANTED_BUG)
    with pytest.raises(
        BuildError, match=r"planted-bug\.ipynb: cell \d+ .*ClaimFailed: 2 of 2 claims do not hold: 'padding rows of out"
    ):
        build(project, tmp_path / "_build", log=lambda message: None)

    # A committed notebook whose claims cell carries failing verdicts (say, it called claims.check) is refused too.
    nb = nbformat.read(notebook_path, as_version=4)
    failed = [ClaimVerdict(s, False, "0/1 cases", OURS) for s in project.get("planted-bug").claims.statements]
    nb.cells[-1].outputs = [
        nbformat.v4.new_output(
            "display_data",
            data={"text/plain": str(claims_table(failed))},
            metadata={METADATA_KEY: {"claims": [v.to_dict() for v in failed]}},
        )
    ]
    nbformat.write(nb, notebook_path)
    with pytest.raises(BuildError, match=r"claims do not hold: 'padding rows of out, dq, dk, dv are exactly 0'"):
        build(project, tmp_path / "_build", execute_notebooks=False, log=lambda message: None)
    assert not (tmp_path / "_build").exists()


def _nbval(project, notebook):
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "--nbval-lax",
        "--nbval-current-env",
        "--nbval-sanitize-with",
        str(SITE.parent / "tests" / "nbval-sanitize.cfg"),
        str(notebook),
    ]
    run = subprocess.run(command, cwd=project.root, env=kernel_env(project.root), capture_output=True, text=True, timeout=600)
    return run.returncode, re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)  # nbval colours its report


@pytest.mark.slow
def test_scaffold_passes_nbval_untouched(scaffolded):
    notebook = scaffolded.get("scaffold-demo").notebook
    status, report = _nbval(scaffolded, notebook)
    assert status == 0, report
    code_cells = sum(c.cell_type == "code" for c in nbformat.read(notebook, as_version=4).cells)
    assert re.search(rf"\b{code_cells} passed", report), report


@pytest.mark.slow
def test_nbval_fails_naming_the_claim_that_no_longer_holds(project):
    """Committed while its claims held; then the code regresses; nbval names the claim."""
    module_path, notebook_path = scaffold_variant(project, "regresses", FAST_FIX)
    execute_in_place(notebook_path, project.root)
    module_path.write_text(module_path.read_text().replace(FAST_FIX, PLANTED_BUG))
    status, report = _nbval(project, notebook_path)
    assert status == 1, report
    assert "ClaimFailed: 2 of 2 claims do not hold: 'padding rows of out, dq, dk, dv are exactly 0'" in report, report


def test_registry_errors_stop_the_build(project, tmp_path):
    project.scaffold("no-notebook", "Title")
    (project.notebooks_dir / "no-notebook.ipynb").unlink()
    with pytest.raises(ValueError, match="notebooks are missing"):
        build(project, tmp_path / "_build", log=lambda message: None)
    assert Registry(project.package).ids() == ["no-notebook"]


def test_kernel_env_puts_the_root_on_the_path_absolute(tmp_path, monkeypatch):
    """Kernels run in the notebook's directory: a relative root must not stay relative."""
    monkeypatch.chdir(tmp_path)
    first = kernel_env(Path("."))["PYTHONPATH"].split(os.pathsep)[0]
    assert first == str(tmp_path.resolve())


def test_the_index_gives_each_bug_the_level_its_headline_claim_shows_it_at(published_site):
    """The evidence column says how the bug itself was shown (its headline claim), not the strongest
    level any claim reached: the interpreter's bug is shown on the CPU although a GPU control ran; TE's
    by TE itself on the GPU, its replica's claims aside."""
    rows = {row["id"]: row for row in json.loads((published_site / "manifest.json").read_text())["postmortems"]}
    for pm in Registry().postmortems():
        assert rows[pm.id]["evidence_kind"] == pm.claims.headline_level.kind, pm.id
    assert rows["triton-interpreter-bf16-dot"]["evidence_kind"] == "upstream-cpu"
    assert rows["te-thd-2892"]["evidence_kind"] == "upstream-gpu"


def test_a_figure_carries_its_cells_description_and_a_bare_figure_is_found():
    """The site gives each picture of a cell the `wb-alt` metadata of that cell (what the figure shows);
    `undescribed_figures` counts the pictures a build refuses: no alt, an empty one, nbconvert's placeholder."""
    from varlen_workbench.workbench.site.build import NO_ALT, undescribed_figures

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("plot()")
    cell.metadata["wb-alt"] = 'Bar chart: "error" per tensor'
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}),
        nbformat.v4.new_output("display_data", data={"text/html": '<div><img class="wb-explorer-img" src="x" alt=""></div>'}),
    ]
    nb.cells = [cell]
    shown = for_site(nb, None).cells[0]
    assert shown.outputs[0].metadata["image/png"]["alt"] == 'Bar chart: "error" per tensor'
    assert shown.outputs[1].data["text/html"] == (
        '<div><img alt="Bar chart: &quot;error&quot; per tensor" class="wb-explorer-img" src="x"></div>'
    )
    assert "wb-alt" not in nb.cells[0].outputs[0].get("metadata", {}), "the executed notebook stays intact"
    bare = ['<img src="a">', '<img src="a" alt="">', f'<img src="a" alt="{NO_ALT}">', '<img alt="a chart of errors" src="a">']
    assert undescribed_figures("".join(bare)) == 3


_CSS_RULE = re.compile(r"([^{}]+)\{([^{}]*)\}")


def test_figures_are_scaled_to_the_column_on_every_screen():
    """site.css shows every figure whole (max-width 100%, height auto), on a phone too; only the
    lightbox (site.js: a click opens a figure full size) lets a figure keep its drawn width."""
    css = re.sub(r"/\*.*?\*/", "", (SITE / "static" / "site.css").read_text(), flags=re.DOTALL)
    rules = [(selector.strip(), body) for selector, body in _CSS_RULE.findall(css)]
    scaled = [s for s, body in rules if ".jp-RenderedImage img" in s and "max-width: 100%" in body and "height: auto" in body]
    assert scaled, "no rule scales .jp-RenderedImage img to the column"
    unscaled = [s for s, body in rules if "img" in s and "max-width: none" in body and not s.startswith(".wb-lightbox")]
    assert unscaled == [], unscaled
    assert "wb-lightbox" in (SITE / "static" / "site.js").read_text()
