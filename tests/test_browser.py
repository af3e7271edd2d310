"""The published site and the live notebooks in a real headless Chromium (Debian's chromium,
driven by Playwright with executable_path; `make test` installs it with scripts/system-deps.sh).

Static site: the index loads without console errors or off-site requests, every page it links
resolves, every image renders, the tag filter filters, code inputs are folded behind toggles while
outputs stay visible, headings carry anchors a reader can link to, a long table unfolds its rows,
no page scrolls sideways at 1280 px or on a 390 px phone, every figure shows whole and opens full
size, and moving an explorer slider changes the plot. Live: JupyterLab on localhost runs a
scaffolded post-mortem notebook, and moving the explorer's slider redraws the plot from the kernel.
"""

import functools
import http.server
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from varlen_workbench.workbench.registry import Registry
from varlen_workbench.workbench.site.build import build
from varlen_workbench.workbench.site.execute import kernel_env
from varlen_workbench.workbench.site.pasteblocks import paste_blocks

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: `make test` installs it (scripts/system-deps.sh)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


class Watched:
    """A page that records console errors, uncaught exceptions and every off-site request
    (which it also blocks, so the test never depends on the network)."""

    def __init__(self, browser, allowed_origin: str):
        self.context = browser.new_context()
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.errors, self.external = [], []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

        def route(route):
            url = route.request.url
            if url.startswith((allowed_origin, "data:", "blob:")):
                route.continue_()
            else:
                self.external.append(url)
                route.abort()

        self.page.route("**/*", route)

    def close(self):
        self.context.close()


def _serve(directory: Path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


@pytest.fixture(scope="module", params=["scaffold", "repository"])
def site(request, tmp_path_factory):
    """The test project's executed site, and the repository's own notebooks rendered as
    committed (`varlen-workbench build --no-execute`): the pages a reader actually gets."""
    if request.param == "scaffold":
        _, out = request.getfixturevalue("built_site")
    else:
        if not Registry().notebooks():
            pytest.skip("the repository has no notebooks yet")
        out = tmp_path_factory.mktemp("repository-site") / "_build"
        build(out=out, execute_notebooks=False, log=lambda message: None)
    server, url = _serve(out)
    yield out, url
    server.shutdown()


def _links(page, selector):
    return page.eval_on_selector_all(selector, "links => links.map(a => a.getAttribute('href'))")


def test_index_loads_clean_and_filters_by_tag(browser, site):
    out, url = site
    watched = Watched(browser, url)
    page = watched.page
    assert page.goto(url + "index.html").ok
    rows = page.locator("table.wb-postmortems tbody tr[data-tags]")
    assert rows.count() >= 1
    tags = [t for t in page.eval_on_selector_all(".wb-tag-filter", "bs => bs.map(b => b.dataset.tag)") if t]
    for tag in tags:
        page.click(f'.wb-tag-filter[data-tag="{tag}"]')
        shown = page.eval_on_selector_all(
            "table.wb-postmortems tbody tr[data-tags]:not([hidden])", "rs => rs.map(r => JSON.parse(r.dataset.tags))"
        )
        expected = page.eval_on_selector_all(
            "table.wb-postmortems tbody tr[data-tags]",
            f"rs => rs.filter(r => JSON.parse(r.dataset.tags).includes({json.dumps(tag)})).length",
        )
        assert shown and all(tag in row_tags for row_tags in shown) and len(shown) == expected, tag
        assert urllib.parse.unquote(page.url.partition("#tag=")[2]) == tag
    page.click('.wb-tag-filter[data-tag=""]')
    assert page.locator("table.wb-postmortems tbody tr[data-tags]:not([hidden])").count() == rows.count()
    assert watched.errors == [] and watched.external == []
    watched.close()


def test_every_page_resolves_and_every_image_renders(browser, site):
    out, url = site
    watched = Watched(browser, url)
    page = watched.page
    page.goto(url + "index.html")
    postmortems = _links(page, "a.wb-postmortem-link")
    pages = postmortems + _links(page, "a.wb-notebook-link")
    assert pages, "the index links no page"
    images = 0
    for href in pages:
        response = page.goto(url + href)
        assert response is not None and response.ok, href
        if href in postmortems:
            assert page.locator("h1.wb-title").count() == 1, href
            assert page.locator("footer.wb-provenance").inner_text().startswith("Built with Python"), href
        page.wait_for_load_state("load")
        broken = page.eval_on_selector_all(
            "img", "imgs => imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt || i.src.slice(0, 60))"
        )
        assert broken == [], f"{href}: images that do not render: {broken}"
        images += page.locator("img").count()
    assert images > 0, "no page shows a single image"
    assert watched.errors == [], watched.errors
    assert watched.external == [], watched.external
    watched.close()


@pytest.mark.parametrize("width", [1280, 390])
def test_no_page_scrolls_sideways(browser, site, width):
    """On a desktop and on a 390 px phone every page fits the window's width: the header's facts
    wrap or stack, the index table stacks, wide tables and plots scroll inside their own box."""
    out, url = site
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    wide = []
    for html_file in sorted(out.glob("*.html")):
        page.goto(url + html_file.name)
        page.wait_for_load_state("load")
        scroll, client = page.evaluate("() => [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        if scroll > client:
            wide.append(f"{html_file.name}: {scroll} px of content in a {client} px window")
    context.close()
    assert wide == [], wide


def test_every_figure_is_described(browser, site):
    """Each picture (a figure, an explorer's frame) carries alt text saying what it shows, from its
    cell's `wb-alt` metadata; none keeps nbconvert's placeholder."""
    from varlen_workbench.workbench.site.build import NO_ALT

    out, url = site
    page = browser.new_page()
    bare = []
    for html_file in sorted(out.glob("*.html")):
        page.goto(url + html_file.name)
        alts = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.getAttribute('alt') || '')")
        bare += [f"{html_file.name}: image {i}" for i, alt in enumerate(alts) if len(alt.split()) < 4 or alt == NO_ALT]
    page.close()
    assert bare == [], bare


@pytest.mark.parametrize("width", [1280, 390])
def test_figures_show_whole_and_open_full_size(browser, site, width):
    """Every figure is shown whole, scaled down to its column (the audit heatmap's last columns
    included at 1280 px, every chart on a 390 px phone); one shown smaller than drawn opens full size
    on a click, in the lightbox, and Escape closes it."""
    out, url = site
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    cut, scaled = [], []
    for html_file in sorted(out.glob("*.html")):
        page.goto(url + html_file.name)
        page.wait_for_load_state("load")
        figures = page.eval_on_selector_all(
            ".jp-OutputArea-output img",
            """imgs => imgs.map(i => { const box = i.closest('.jp-RenderedImage, .wb-explorer');
                return [i.naturalWidth, i.getBoundingClientRect().width, box.clientWidth, box.scrollWidth]; })""",
        )
        for i, (natural, shown, box, scroll) in enumerate(figures):
            if shown > box + 1 or scroll > box + 1:
                cut.append(f"{html_file.name}: figure {i} shown {shown:.0f} px of {natural} in a {box} px box")
            if natural > shown + 1:
                scaled.append((html_file.name, i, natural))
    if scaled:  # the first scaled figure opens full size, and closes
        name, i, natural = scaled[0]
        page.goto(url + name)
        page.wait_for_load_state("load")
        page.locator(".jp-OutputArea-output img").nth(i).click()
        opened = page.locator(".wb-lightbox img")
        assert page.locator(".wb-lightbox").is_visible() and opened.evaluate("i => i.getBoundingClientRect().width") == natural
        page.keyboard.press("Escape")
        assert page.locator(".wb-lightbox").is_hidden()
    context.close()
    assert cut == [], cut
    if width == 390 and (out / "performance.html").exists():
        assert scaled, "the repository's site has figures wider than a phone: each is shown scaled"


def test_on_a_phone_the_index_labels_each_badge(browser, site):
    """The index table stacks on a phone and loses its header row: each cell says which column it is."""
    out, url = site
    context = browser.new_context(viewport={"width": 390, "height": 900})
    page = context.new_page()
    page.goto(url + "index.html")
    headers = page.eval_on_selector_all("table.wb-postmortems thead th", "ths => ths.slice(1).map(th => th.textContent)")
    first_row = page.eval_on_selector_all(
        "table.wb-postmortems tbody tr:first-child td[data-label]",
        "tds => tds.map(td => getComputedStyle(td, '::before').content)",
    )
    context.close()
    assert first_row == [f'"{label}: "' for label in headers]


def test_an_opened_audit_matrix_cell_gets_a_readable_width(browser, site):
    """At 1280 px an opened evidence cell of the audit matrix is wide enough to read (it once stacked
    its words in an 87 px column, the row thousands of pixels tall); the page still fits the window."""
    out, url = site
    if not (out / "audit-matrix.html").exists():
        pytest.skip("this site has no audit matrix")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(url + "audit-matrix.html")
    fuzzer = page.eval_on_selector_all("table.audit-matrix thead th", "ths => ths.map(th => th.textContent).indexOf('fuzzer')")
    cell = page.locator("table.audit-matrix tbody tr").nth(2).locator("td").nth(fuzzer)
    cell.locator("summary").first.click()
    width, text_width = cell.evaluate(
        "td => [td.getBoundingClientRect().width, td.querySelector('details[open] > p').getBoundingClientRect().width]"
    )
    sideways = page.evaluate("() => document.documentElement.scrollWidth > document.documentElement.clientWidth")
    context.close()
    assert width >= 320 and text_width >= 300, f"an opened cell is {width:.0f} px wide, its text {text_width:.0f} px"
    assert not sideways


def test_moving_a_static_explorer_slider_changes_the_plot(browser, site):
    out, url = site
    watched = Watched(browser, url)
    page = watched.page
    explorers = []
    for html_file in sorted(out.glob("*.html")):
        if 'class="wb-explorer"' in html_file.read_text():
            explorers.append(html_file.name)
    if not explorers:
        pytest.skip("no page of this site carries a static explorer")
    for name in explorers:
        page.goto(url + name)
        explorer = page.locator(".wb-explorer").first
        slider = explorer.locator("input[type=range].wb-explorer-slider, select.wb-explorer-slider").first
        image = explorer.locator("img.wb-explorer-img")
        before = image.get_attribute("src")
        if slider.evaluate("e => e.tagName") == "SELECT":
            slider.select_option(index=1)
        else:
            slider.focus()
            page.keyboard.press("ArrowRight")  # a real user's input: fires `input` and `change`
        after = image.get_attribute("src")
        assert after != before, f"{name}: moving the slider left the plot unchanged"
        assert image.evaluate("i => i.complete && i.naturalWidth > 0"), f"{name}: the new frame does not render"
    assert watched.errors == [] and watched.external == []
    watched.close()


def _postmortem_pages(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.html") if 'class="wb-page-header"' in p.read_text())


def test_code_inputs_fold_behind_toggles_and_outputs_stay_visible(browser, site):
    out, url = site
    watched = Watched(browser, url)
    page = watched.page
    pages = _postmortem_pages(out)
    assert pages, "the site has no post-mortem page"
    for name in pages:
        page.goto(url + name)
        folds = page.locator("details.wb-code")
        assert folds.count() == page.locator(".jp-CodeCell").count() > 0, name
        # The reader's own lines open unfolded: a cell tagged wb-show-code ("Check your run"), where
        # the page has one, or blocks fenced in its prose, which need no toggle. The rest fold.
        shown = page.locator("details.wb-code[open]")
        assert shown.count() <= 1, f"{name}: only the check-your-run cell's code opens unfolded"
        assert shown.count() == 0 or shown.first.locator(".jp-InputArea-editor").is_visible()
        assert paste_blocks((out / name).read_text()), f"{name}: the page offers no block to paste"
        first = folds.nth(page.eval_on_selector_all("details.wb-code", "ds => ds.findIndex(d => !d.open)"))
        editor = first.locator(".jp-InputArea-editor")
        assert not editor.is_visible(), f"{name}: code is not folded by default"
        assert page.locator(".jp-OutputArea-output").first.is_visible(), f"{name}: outputs must stay visible"
        first.locator("summary").click()
        assert editor.is_visible(), f"{name}: the toggle does not unfold the code"
        first.locator("summary").click()
        assert not editor.is_visible()
        toggle = page.locator("button.wb-code-all")
        toggle.click()
        assert page.eval_on_selector_all("details.wb-code", "ds => ds.every(d => d.open)"), name
        assert toggle.get_attribute("aria-pressed") == "true" and toggle.inner_text() == "fold all code"
        toggle.click()
        assert page.eval_on_selector_all("details.wb-code", "ds => ds.every(d => !d.open)"), name
    assert watched.errors == [] and watched.external == []
    watched.close()


def test_headings_carry_anchors_a_reader_can_link_to(browser, site):
    out, url = site
    watched = Watched(browser, url)
    page = watched.page
    for name in _postmortem_pages(out):
        page.goto(url + name)
        heading = page.locator("h2#Upstream-status")
        anchor = heading.locator("a.anchor-link")
        assert anchor.get_attribute("href") == "#Upstream-status", name
        assert not anchor.is_visible()
        heading.hover()
        assert anchor.is_visible(), f"{name}: the anchor does not show on hover"
        anchor.click()
        assert page.url.endswith(f"{name}#Upstream-status")
        top = heading.evaluate("h => h.getBoundingClientRect().top")
        assert -1 <= top < 100, f"{name}: following the anchor left the heading at y={top}"
        # A link to the section lands there from a fresh load, too.
        page.goto(url + "index.html")
        page.goto(f"{url}{name}#Upstream-status")
        assert -1 <= heading.evaluate("h => h.getBoundingClientRect().top") < 100
    assert watched.errors == [] and watched.external == []
    watched.close()


def test_a_long_table_unfolds_its_rows(browser, tmp_path):
    """varlen_workbench.workbench.postmortem.Table folds rows past `fold` behind a button; site.js unfolds them."""
    from varlen_workbench.workbench.postmortem import table
    from varlen_workbench.workbench.site.build import SITE

    (tmp_path / "static").mkdir()
    shutil.copy(SITE / "static" / "site.js", tmp_path / "static")
    shown = table(("n", "square"), [(i, i * i) for i in range(20)], fold=5)
    (tmp_path / "t.html").write_text(f'<html><body>{shown._repr_html_()}<script src="static/site.js"></script></body></html>')
    server, url = _serve(tmp_path)
    watched = Watched(browser, url)
    page = watched.page
    page.goto(url + "t.html")
    assert page.locator("tbody tr:visible").count() == 5
    button = page.locator("button.wb-more-rows")
    assert button.inner_text() == "15 more rows"
    button.click()
    assert page.locator("tbody tr:visible").count() == 20 and button.get_attribute("aria-expanded") == "true"
    button.click()
    assert page.locator("tbody tr:visible").count() == 5 and button.inner_text() == "15 more rows"
    assert watched.errors == [] and watched.external == []
    watched.close()
    server.shutdown()


# -- live: JupyterLab --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(built_site, tmp_path):
    """JupyterLab on localhost (random free port, random token) over a copy of the scaffold's
    notebook, so that autosave cannot touch the notebook other tests read."""
    project, _ = built_site
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    shutil.copy(project.notebooks_dir / "scaffold-demo.ipynb", notebooks)
    port, token = _free_port(), secrets.token_hex(16)
    env = kernel_env(project.root)
    env.pop("WORKBENCH_STATIC", None)  # live explorers
    for name in (
        "JUPYTER_CONFIG_DIR",
        "JUPYTER_DATA_DIR",
        "JUPYTER_RUNTIME_DIR",
        "JUPYTERLAB_WORKSPACES_DIR",
        "JUPYTERLAB_SETTINGS_DIR",
    ):
        env[name] = str(tmp_path / name.lower())
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={notebooks}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        *(["--allow-root"] if os.geteuid() == 0 else []),  # CI runs as root
    ]
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5):
                break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start: {(tmp_path / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.5)
    yield url, token, tmp_path
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


def test_live_explorer_redraws_from_the_kernel(browser, jupyterlab):
    url, token, logs = jupyterlab
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{url}/lab/tree/scaffold-demo.ipynb?token={token}")
    page.wait_for_function(
        "window.jupyterapp && window.jupyterapp.shell.currentWidget && window.jupyterapp.shell.currentWidget.sessionContext",
        timeout=120_000,
    )
    page.wait_for_function(
        "window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.connectionStatus === 'connected'", timeout=120_000
    )
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")

    # The claims cell printed its table: the whole notebook ran in the live kernel.
    # (run-all stops at the first error, and a failing claim raises: HOLDS alone proves both absent).
    try:
        page.wait_for_selector(".jp-OutputArea-output >> text=HOLDS", timeout=300_000)
    except Exception:
        page.screenshot(path=str(logs / "notebook.png"), full_page=True)
        pytest.fail(
            f"the notebook did not finish (screenshot: {logs / 'notebook.png'}); JupyterLab said:\n{(logs / 'jupyterlab.log').read_text()[-3000:]}"
        )

    explorer = page.locator(".jp-OutputArea .wb-explorer").first
    image = explorer.locator("img.wb-explorer-img")
    image.wait_for(timeout=120_000)
    before = image.get_attribute("src")
    handle = explorer.locator(".wb-explorer-slider .noUi-handle").first
    handle.focus()
    page.keyboard.press("ArrowRight")
    # The kernel recomputes the frame (a probe through the Triton interpreter) and sends it back.
    page.wait_for_function(
        "([img, before]) => img.src !== before && img.complete && img.naturalWidth > 0",
        arg=[image.element_handle(), before],
        timeout=180_000,
    )
    context.close()
