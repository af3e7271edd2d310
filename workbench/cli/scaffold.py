"""Renders the templates `varlen-workbench new` starts a post-mortem from (workbench/cli/templates/).

Pure text and nbformat: the caller (`varlen_workbench.workbench.registry.Registry.scaffold`) maps the id to its
module name, so this module never imports the registry (no registry <-> scaffold cycle).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from string import Template

TEMPLATES = Path(__file__).resolve().parent / "templates"
_MARKER = re.compile(r"^# %%(?P<markdown> \[markdown\])?(?: tags=(?P<tags>[\w,-]+))?(?: alt=(?P<alt>.+?))?\s*$")
ALT_KEY = "wb-alt"  # cell metadata: what the cell's figures show, the alt text the site gives them


def _fields(postmortem_id: str, module: str, package: str) -> dict[str, str]:
    return {
        "id": postmortem_id,
        "module": module,
        "package": package,
        "today": datetime.date.today().isoformat(),
    }


def python_string(text: str) -> str:
    """`text` as the string literal `ruff format` writes: double quotes unless the text holds more
    double quotes than single ones, the chosen quote and backslashes escaped."""
    quote = "'" if text.count('"') > text.count("'") else '"'
    body = "".join(
        "\\\\" if ch == "\\" else "\\" + ch if ch == quote else ch if ch.isprintable() else repr(ch)[1:-1] for ch in text
    )
    return quote + body + quote


def render_package(postmortem_id: str, module: str, title: str, package: str) -> dict[str, str]:
    """The files of package `<package>/<module>/` for post-mortem `postmortem_id`: name -> text."""
    fields = _fields(postmortem_id, module, package)
    files = {}
    for template in sorted((TEMPLATES / "postmortem").glob("*.py.tmpl")):
        # '$$' survives substitution, so a title with '$' in it stays as typed.
        text = template.read_text().replace('"$title"', python_string(title).replace("$", "$$"))
        files[template.name.removesuffix(".tmpl")] = Template(text).substitute(fields)
    return files


def parse_cells(text: str) -> list:
    """Cells of a percent-format template: `# %%` / `# %% [markdown]`, optional ` tags=a,b`, then
    optional ` alt=<what the cell's figure shows>` (to the end of the line)."""
    cells: list = []
    kind: str | None = None
    tags: list[str] = []
    alt: str | None = None
    lines: list[str] = []

    def close():
        if kind is not None:
            source = "\n".join(lines).strip("\n")
            import nbformat  # here: the registry imports this module on the CLI's Jupyter-free paths

            make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
            cell = make(source)
            if tags:
                cell.metadata["tags"] = tags
            if alt:
                cell.metadata[ALT_KEY] = alt
            cells.append(cell)

    for line in text.splitlines():
        match = _MARKER.match(line)
        if match:
            close()
            kind = "markdown" if match["markdown"] else "code"
            tags = match["tags"].split(",") if match["tags"] else []
            alt = match["alt"]
            lines = []
        else:
            lines.append(line)
    close()
    return cells


def render_notebook(postmortem_id: str, module: str, package: str):
    """`notebooks/<id>.ipynb`: the reader block first, then the outline every post-mortem follows."""
    text = Template((TEMPLATES / "notebook.tmpl").read_text()).substitute(_fields(postmortem_id, module, package))
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = parse_cells(text)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    # Deterministic cell ids: a re-scaffold gives the same file, and diffs stay readable.
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"
    return nb
