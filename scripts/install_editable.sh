#!/usr/bin/env bash
# Installs this clone, editable, into the Python it is run with (python3, or $PYTHON), without
# touching any installed package and without an index: the GPU machine's image, before each
# session's first run. Everything then imports as varlen_workbench (pyproject.toml), and the
# scripts and `python3 -m varlen_workbench.workbench.cli.main ...` run from any directory.
#
# The build needs setuptools >= 77 (pyproject.toml: the licence as an SPDX expression). Where the
# installed one is older, carry the lock's setuptools wheel in .whl/setuptools/, made beforehand on a
# machine that reaches the index (or name another folder in SETUPTOOLS_WHEELS):
#     python3 -m pip download --no-deps -d .whl/setuptools "setuptools==$(grep -oP '^setuptools==\K\S+' requirements/cpu.lock)"
# It is then put on PYTHONPATH for the build alone: the image's own setuptools stays.
# The install writes only a .pth file and a finder module into site-packages (or the user's, where
# that is not writable), so it is allowed where the system Python is marked externally managed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
    found=$("$PY" -c 'import setuptools; print(setuptools.__version__)' 2>/dev/null || echo "none")
    wheels=${SETUPTOOLS_WHEELS:-.whl/setuptools}
    wheel=$(ls "$wheels"/setuptools-*.whl 2>/dev/null | tail -n 1 || true)
    if [ -z "$wheel" ]; then
        echo "install_editable.sh: setuptools $found here, and the build needs >= 77; carry a wheel in $wheels/ (see this script's header)." >&2
        exit 1
    fi
    build=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --target "$build" "$wheel"
    export PYTHONPATH="$build${PYTHONPATH:+:$PYTHONPATH}"
fi
PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
"$PY" -c 'import varlen_workbench.workbench.cli.main as cli; print("installed: varlen_workbench.workbench from", cli.__file__.rsplit("/", 3)[0])'
