"""The errors the `workbench` command turns into one line and an exit status.

They live here, apart from the modules that raise them, so that the command line can catch
them without importing those modules (`varlen_workbench.workbench.site.execute` and `varlen_workbench.workbench.site.build` need the Jupyter packages, which a
GPU machine with only torch and triton lacks). `varlen_workbench.workbench.registry.RegistryError` and
the `BuildError` of `varlen_workbench.workbench.site.execute` and `varlen_workbench.workbench.site.build` are these same classes.
"""

from __future__ import annotations


class RegistryError(ValueError):
    """A post-mortem module or notebook does not have the shape the pipeline needs."""


class BuildError(RuntimeError):
    """A notebook failed to execute, a claim failed, or a page would reach off-site."""


__all__ = ["BuildError", "RegistryError"]
