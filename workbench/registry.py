"""The registry of post-mortems: the package `postmortems/<module>/` + `notebooks/<id>.ipynb`.

A post-mortem's id names files and URLs ("torch-varlen-176793"); its module name is the id
with '-' turned into '_' ("torch_varlen_176793"), so that `from postmortems import ...`
works. The registry is the only place that maps one to the other and the only place that
imports post-mortem modules for the CLI and the site (the rule: `workbench` never imports
`postmortems` except through here).

A notebook under `notebooks/` whose name is not a post-mortem id (the instruments demo) is a
plain notebook: it is executed, tested and published, but has no META, claims or verdict.

A figure in an impact line (`META.impact`, the index's one line) is a `{name}` field, filled in by
the module's `impact_figures()` from the committed records (`PostMortem.impact`), so the index
never types a number the records could contradict.

Notebook conventions, checked by `check_notebook` so that a broken convention fails CI:

* the first cell is a code cell tagged `wb-header` that imports the post-mortem module and
  displays `META.header_markdown(STATUS)` (the site replaces it with a header rendered from META
  and the upstream status);
* the reader block comes first: its level-2 headings start with `READER_SECTIONS` in order
  (TL;DR, Who is affected, Check your run, Workarounds, Upstream status);
* the last code cell calls `.claims.report(...)` and is marked for nbval (`# NBVAL_CHECK_OUTPUT`
  comment or `nbval-check-output` tag), so its printed verdict table is compared exactly; the
  verdicts themselves are read back from that output's metadata (`recorded_verdicts`), never
  parsed from the printed text.

`Registry.scaffold` renders `workbench/cli/templates/` through `varlen_workbench.workbench.cli.scaffold`, which never
imports this module (no import cycle).
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import json
import keyword
import pkgutil
import shutil
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from varlen_workbench.workbench.cli.scaffold import render_notebook, render_package
from varlen_workbench.workbench.errors import RegistryError
from varlen_workbench.workbench.upstream_status import STATUS_FILE, scaffold_entry, statuses
from varlen_workbench.workbench.usercode import UserModuleError, import_user_module

PACKAGE = "varlen_workbench.postmortems"
HEADER_TAG = "wb-header"
CHECK_OUTPUT_MARKERS = ("# NBVAL_CHECK_OUTPUT", "nbval-check-output")


def module_name(postmortem_id: str) -> str:
    """The module that holds post-mortem `postmortem_id` ('te-thd-2892' -> 'te_thd_2892')."""
    name = postmortem_id.replace("-", "_")
    if not name.isidentifier() or keyword.iskeyword(name) or not name.isascii() or name.startswith("_"):
        raise RegistryError(
            f"post-mortem id {postmortem_id!r} does not map to a Python module name; use lowercase "
            "letters, digits and '-', starting with a letter (e.g. 'torch-varlen-176793')."
        )
    return name


def postmortem_id(module: str) -> str:
    """The id of the post-mortem in module `module` (the inverse of `module_name`)."""
    return module.replace("_", "-")


@dataclass(frozen=True)
class PostMortem:
    """A validated post-mortem module and where its notebook lives."""

    module: ModuleType
    notebook: Path

    @property
    def meta(self):  # varlen_workbench.workbench.postmortem.Meta
        return self.module.META

    @property
    def id(self) -> str:
        return self.module.META.id

    @property
    def name(self) -> str:
        return self.module.__name__.rpartition(".")[2]

    @property
    def claims(self):  # varlen_workbench.workbench.postmortem.Claims
        return self.module.claims

    @property
    def status(self):  # varlen_workbench.workbench.upstream_status.UpstreamStatus: where upstream stands
        return self.module.STATUS

    @property
    def impact(self) -> str:
        """META.impact with its {figures} filled in by the module's `impact_figures()`, which
        computes them from the committed records: an index figure is never typed."""
        names = impact_fields(self.meta.impact)
        if not names:
            return self.meta.impact
        figures = self.module.impact_figures()
        if set(figures) != set(names):
            raise RegistryError(
                f"post-mortem {self.id!r}: META.impact names {sorted(names)}, impact_figures() gives {sorted(figures)}."
            )
        return self.meta.impact.format_map(figures)

    def reproduce(self, device: str | None = None) -> Any:
        return self.module.reproduce(device=device)


def impact_fields(impact: str) -> list[str]:
    """The {figures} an impact line names (str.format fields)."""
    return [name for _, name, _, _ in string.Formatter().parse(impact) if name]


def validate_module(module: ModuleType) -> None:
    """Raises `RegistryError` naming the module, the attribute and the fix when a post-mortem
    module lacks META, STATUS, CASES, reproduce(device=...) or claims."""
    from varlen_workbench.workbench.layout import Case
    from varlen_workbench.workbench.postmortem import Claims, Meta
    from varlen_workbench.workbench.upstream_status import UpstreamStatus

    where = f"post-mortem module {module.__name__} ({getattr(module, '__file__', '?')})"
    meta = getattr(module, "META", None)
    if not isinstance(meta, Meta):
        raise RegistryError(f"{where}: META must be a varlen_workbench.workbench.postmortem.Meta, got {type(meta).__name__}.")
    short = module.__name__.rpartition(".")[2]
    if module_name(meta.id) != short:
        raise RegistryError(
            f"{where}: META.id = {meta.id!r} belongs in module {module_name(meta.id)!r}; rename the "
            f"file to {module_name(meta.id)}.py or set META.id = {postmortem_id(short)!r}."
        )
    status = getattr(module, "STATUS", None)
    if not isinstance(status, UpstreamStatus):
        raise RegistryError(
            f"{where}: STATUS must be its entry of data/upstream-status.toml: "
            "STATUS = varlen_workbench.workbench.upstream_status.finding_status(META.id, __file__) in cases.py, exported."
        )
    try:
        meta.check_status(status)
    except ValueError as exc:
        raise RegistryError(f"{where}: {exc}") from None
    cases = getattr(module, "CASES", None)
    if not isinstance(cases, Sequence) or not cases or not all(isinstance(c, Case) for c in cases):
        raise RegistryError(
            f"{where}: CASES must be a non-empty tuple of varlen_workbench.workbench.layout.Case (the cases the post-mortem studies)."
        )
    reproduce = getattr(module, "reproduce", None)
    if not callable(reproduce) or "device" not in inspect.signature(reproduce).parameters:
        raise RegistryError(f"{where}: define reproduce(device=None) returning the results its claims check.")
    claims = getattr(module, "claims", None)
    if not isinstance(claims, Claims) or not len(claims):
        raise RegistryError(
            f"{where}: claims must be a varlen_workbench.workbench.postmortem.Claims with at least one registered claim."
        )
    if not claims.headline:
        raise RegistryError(
            f"{where}: mark the claim that shows the bug itself with @claims(..., headline=True): its evidence level is "
            "the one the index gives the post-mortem."
        )
    if impact_fields(meta.impact) and not callable(getattr(module, "impact_figures", None)):
        raise RegistryError(
            f"{where}: META.impact names {impact_fields(meta.impact)}; define impact_figures() returning each, "
            "computed from the committed records."
        )


def _source(cell) -> str:
    return cell.source if isinstance(cell.source, str) else "".join(cell.source)


def _code_cells(nb) -> list[tuple[int, Any]]:
    return [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def check_notebook(pm: PostMortem, nb=None) -> None:
    """Raises `RegistryError` naming the notebook and the fix when it breaks the conventions."""
    if not pm.notebook.exists():
        raise RegistryError(f"post-mortem {pm.id!r} has no notebook: expected {pm.notebook} (`varlen-workbench new` writes one).")
    if nb is None:
        import nbformat  # here, not at the top: the CLI's torch-only commands import this module

        nb = nbformat.read(pm.notebook, as_version=4)
    first = nb.cells[0] if nb.cells else None
    if (
        first is None
        or first.cell_type != "code"
        or HEADER_TAG not in first.metadata.get("tags", [])
        or pm.name not in _source(first)
        or "header_markdown(" not in _source(first)
    ):
        raise RegistryError(
            f"{pm.notebook}: the first cell must be a code cell tagged {HEADER_TAG!r} that imports "
            f"postmortems.{pm.name} and displays META.header_markdown(STATUS) (see workbench/cli/templates/notebook.tmpl)."
        )
    problems = reader_block_problems(nb)
    if problems:
        raise RegistryError(
            f"{pm.notebook}: the reader block comes first (see workbench/cli/templates/notebook.tmpl): " + "; ".join(problems)
        )
    index, last = _code_cells(nb)[-1]
    if ".claims.report(" not in _source(last) or not _marked_for_check(last):
        raise RegistryError(
            f"{pm.notebook}: the last code cell (cell {index}) must call <module>.claims.report(results) and "
            "carry the nbval marker '# NBVAL_CHECK_OUTPUT', so CI compares the verdict table."
        )


def _marked_for_check(cell) -> bool:
    lines = [line.strip() for line in _source(cell).splitlines()]
    return CHECK_OUTPUT_MARKERS[0] in lines or CHECK_OUTPUT_MARKERS[1] in cell.metadata.get("tags", [])


def recorded_verdicts(pm: PostMortem, nb) -> list:
    """The claims' verdicts an executed notebook's claims cell carries in its output metadata
    (`Claims.report` writes them there), in the order the module registers its claims.

    A claim the module registers but the output lacks, or an output without verdicts (a
    notebook executed before the claims cell ran), is a `RegistryError`.
    """
    from varlen_workbench.workbench.postmortem import METADATA_KEY, ClaimVerdict

    index, cell = _code_cells(nb)[-1]
    shown = [o.get("metadata", {}).get(METADATA_KEY, {}).get("claims") for o in cell.get("outputs", [])]
    carried = next((c for c in shown if c), None)
    if carried is None:
        raise RegistryError(
            f"{pm.notebook}: cell {index} shows no claim verdicts; execute the notebook (`varlen-workbench execute {pm.id}`)."
        )
    by_claim = {d["claim"]: ClaimVerdict.from_dict(d) for d in carried}
    missing = [s for s in pm.claims.statements if s not in by_claim]
    if missing:
        raise RegistryError(
            f"{pm.notebook}: cell {index} did not show a verdict for claim {missing[0]!r}; re-execute the notebook."
        )
    return [by_claim[s] for s in pm.claims.statements]


def reader_block_problems(nb) -> list[str]:
    """What the notebook's reader block lacks: its first level-2 headings must be
    `READER_SECTIONS`, in order, with no code cell of ours before them but the header."""
    from varlen_workbench.workbench.postmortem import READER_SECTIONS

    headings = [
        line[3:].strip()
        for cell in nb.cells
        if cell.cell_type == "markdown"
        for line in _source(cell).splitlines()
        if line.startswith("## ")
    ]
    found = headings[: len(READER_SECTIONS)]
    problems = []
    for i, section in enumerate(READER_SECTIONS):
        if i >= len(found) or not found[i].startswith(section):
            problems.append(f"section {i + 1} must be '## {section}...' (found {found[i] if i < len(found) else 'nothing'!r})")
    return problems


@dataclass(frozen=True)
class Registry:
    """The post-mortems of one package and the notebooks next to it.

    `package` is importable by name; its parent directory is the project root and holds
    `notebooks/`. The default is read when a Registry is made, so tests can point the CLI at a
    scaffolded package in a temporary directory.
    """

    package: str = field(default_factory=lambda: PACKAGE)

    @property
    def package_dir(self) -> Path:
        module = importlib.import_module(self.package)
        # One folder: a regular package's, or the one postmortems/ that varlen_workbench.postmortems maps
        # to (an editable install adds its finder's placeholder entry to a namespace's path).
        folders = [entry for entry in getattr(module, "__path__", []) if Path(entry).is_dir()]
        if len(folders) != 1:
            raise RegistryError(f"package {self.package!r} must be one folder of post-mortems; it is {folders or 'a module'}.")
        return Path(folders[0])

    @property
    def root(self) -> Path:
        return self.package_dir.parent

    @property
    def notebooks_dir(self) -> Path:
        return self.root / "notebooks"

    def ids(self) -> list[str]:
        names = [m.name for m in pkgutil.iter_modules([str(self.package_dir)]) if not m.name.startswith("_")]
        return sorted(postmortem_id(n) for n in names)

    def get(self, postmortem_id: str) -> PostMortem:
        """Imports and validates one post-mortem; unknown ids get the list of known ones."""
        name = module_name(postmortem_id)
        if postmortem_id not in self.ids():
            known = ", ".join(self.ids()) or "none yet"
            raise RegistryError(f"no post-mortem {postmortem_id!r} in {self.package_dir} (known: {known}).")
        try:
            module = import_user_module(f"{self.package}.{name}")
        except UserModuleError as exc:  # its own code raised: say what, and where
            raise RegistryError(f"post-mortem {postmortem_id!r} does not import: {exc}") from exc
        validate_module(module)
        return PostMortem(module, self.notebooks_dir / f"{module.META.id}.ipynb")

    def postmortems(self) -> list[PostMortem]:
        return [self.get(i) for i in self.ids()]

    def notebooks(self) -> list[tuple[Path, PostMortem | None]]:
        """Every notebook under notebooks/ with its post-mortem (None for a plain notebook)."""
        by_notebook = {pm.notebook: pm for pm in self.postmortems()}
        missing = [pm.notebook for pm in by_notebook.values() if not pm.notebook.exists()]
        if missing:
            raise RegistryError(
                f"post-mortem notebooks are missing: {', '.join(map(str, missing))} (`varlen-workbench new` writes one)."
            )
        return [(path, by_notebook.get(path)) for path in sorted(self.notebooks_dir.glob("*.ipynb"))]

    def scaffold(self, postmortem_id: str, title: str) -> tuple[Path, Path]:
        """Writes the package postmortems/<module>/ and notebooks/<id>.ipynb from the templates.

        Returns both paths; the notebook is not executed yet (see `varlen_workbench.workbench.site.execute.execute_in_place`).
        """
        name = module_name(postmortem_id)
        package_path = self.package_dir / name
        notebook_path = self.notebooks_dir / f"{postmortem_id}.ipynb"
        for path in (package_path, package_path.with_suffix(".py"), notebook_path):
            if path.exists():
                raise RegistryError(f"{path} already exists; pick another id or edit the existing post-mortem.")
        if not title.strip() or "\n" in title:
            raise RegistryError(f"title {title!r} must be one non-empty line; give it in quotes.")
        status_file = self.root / STATUS_FILE
        status_before = status_file.read_text() if status_file.exists() else None
        if postmortem_id in statuses(self.root):
            raise RegistryError(f"{status_file} already has an entry [{postmortem_id}]; pick another id or remove it.")
        status_file.parent.mkdir(parents=True, exist_ok=True)
        status_file.write_text((status_before or "") + scaffold_entry(postmortem_id, datetime.date.today().isoformat()))
        package_path.mkdir()
        for file_name, text in render_package(postmortem_id, name, title.strip(), self.package).items():
            (package_path / file_name).write_text(text)
        importlib.invalidate_caches()
        # Validate before writing the notebook: a template that breaks the shape must not leave files behind.
        try:
            validate_module(importlib.import_module(f"{self.package}.{name}"))
        except Exception:
            shutil.rmtree(package_path)
            if status_before is None:
                status_file.unlink()
            else:
                status_file.write_text(status_before)
            forget_modules(f"{self.package}.{name}")
            raise
        self.notebooks_dir.mkdir(exist_ok=True)
        import nbformat

        nbformat.write(render_notebook(postmortem_id, name, self.package), notebook_path)
        return package_path, notebook_path


def forget_modules(package: str) -> None:
    """Drops `package` and its submodules from `sys.modules`, so the next import reads the files again."""
    for loaded in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[loaded]


def read_manifest(site_dir: Path) -> dict[str, Any]:
    """The last site build's manifest (verdicts, provenance), or {} if the site was never built."""
    path = site_dir / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}
