"""How to get the fixed kernel: the facts the site's "Use the fixed kernel" page states, read from
the code and the environment at build time, never typed.

* `distribution()`: the name, extras and source address in pyproject.toml (no public address yet:
  the page says "from a clone of this repository");
* `supported()`: the dtypes and head dims `kernels.varlen_attention` takes (`kernels.varlen.DTYPES`,
  `HEAD_DIMS`), head dims said as runs ("8 to 256 in steps of 8");
* `name_clash()`: our import name `kernels` is also Hugging Face's `kernels` distribution, which
  transformers probes by name; what transformers concludes in this environment.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import tomllib

from workbench.provenance import REPO

IMPORT_NAME = "kernels"  # our package: `import kernels`
HF_DISTRIBUTION = "kernels"  # Hugging Face's Hub-kernel loader on PyPI (`pip install kernels`; `from kernels import get_kernel`)
SOURCE_KEYS = ("Source", "Repository", "Homepage")  # [project.urls] keys that name where the code lives
# The extras a user of the kernel may want (the others, lab and test, serve the workbench's own tests).
USER_EXTRAS = {"fa4": "FlashAttention-4 behind the contract's wrapper on Hopper and Blackwell: backend='fa4' or 'auto'"}


@dataclass(frozen=True)
class Distribution:
    name: str
    extras: dict[str, list[str]]  # extra -> its requirements
    source: str | None  # the repository's address, None while it has no public home


def distribution(pyproject: Path = REPO / "pyproject.toml") -> Distribution:
    """Our distribution as pyproject.toml declares it."""
    with open(pyproject, "rb") as handle:
        project = tomllib.load(handle)["project"]
    urls = project.get("urls", {})
    source = next((urls[key] for key in SOURCE_KEYS if key in urls), None)
    return Distribution(project["name"], dict(project.get("optional-dependencies", {})), source)


def user_extras(dist: Distribution) -> dict[str, str]:
    """{extra: what it adds} for the extras a kernel user may install; an extra gone from pyproject.toml raises."""
    missing = set(USER_EXTRAS) - set(dist.extras)
    if missing:
        raise ValueError(f"pyproject.toml declares no extra {sorted(missing)}; update workbench.usage.USER_EXTRAS.")
    return dict(USER_EXTRAS)


def runs(values: tuple[int, ...]) -> str:
    """Sorted integers said briefly: arithmetic runs of 4 or more as "8 to 256 in steps of 8", the rest listed."""
    values = tuple(sorted(set(values)))
    parts, i = [], 0
    while i < len(values):
        j = i + 1
        if j < len(values):
            step = values[j] - values[i]
            while j + 1 < len(values) and values[j + 1] - values[j] == step:
                j += 1
            if j - i + 1 >= 4:
                parts.append(f"{values[i]} to {values[j]} in steps of {step}")
                i = j + 1
                continue
        parts.append(str(values[i]))
        i += 1
    return ", ".join(parts)


@dataclass(frozen=True)
class Supported:
    dtypes: tuple[str, ...]  # "float16", ...
    head_dims: str  # as `runs` says them


def supported() -> Supported:
    """What `kernels.varlen_attention` takes, from the constants its input checks use."""
    from kernels.varlen import DTYPES, HEAD_DIMS

    return Supported(tuple(str(dtype).removeprefix("torch.") for dtype in DTYPES), runs(tuple(HEAD_DIMS)))


@dataclass(frozen=True)
class NameClash:
    """What an environment holding our `kernels` tells transformers about Hugging Face's."""

    our_version: str  # the version transformers reads for the module named `kernels`: ours
    transformers: str | None  # transformers' version, None when it is not installed
    hub_min_version: str | None  # the oldest Hugging Face `kernels` that transformers accepts
    hub_kernels_available: bool | None  # transformers' verdict on Hub kernels here


def name_clash() -> NameClash:
    """Asks transformers, as it asks itself, whether Hub kernels are available where ours is installed."""
    owners = importlib.metadata.packages_distributions().get(IMPORT_NAME, [])
    if importlib.util.find_spec(IMPORT_NAME) is None or not owners:
        raise RuntimeError(f"`import {IMPORT_NAME}` finds no installed distribution here; install this repository first.")
    ours = importlib.metadata.version(owners[0])
    try:
        import transformers
        from transformers.utils import import_utils
    except ImportError:
        return NameClash(ours, None, None, None)
    return NameClash(ours, transformers.__version__, import_utils.KERNELS_MIN_VERSION, import_utils.is_kernels_available())


__all__ = [
    "HF_DISTRIBUTION",
    "IMPORT_NAME",
    "USER_EXTRAS",
    "Distribution",
    "NameClash",
    "Supported",
    "distribution",
    "name_clash",
    "runs",
    "supported",
    "user_extras",
]
