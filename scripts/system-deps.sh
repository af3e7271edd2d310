#!/usr/bin/env bash
# System packages the test command needs: Debian's chromium, which the browser test drives
# through Playwright's Python package (executable_path=/usr/bin/chromium; Playwright never
# downloads a browser here). Idempotent: does nothing when chromium is already installed.
set -euo pipefail

CHROMIUM=/usr/bin/chromium
if [ -x "$CHROMIUM" ]; then
    exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "scripts/system-deps.sh: $CHROMIUM is missing; install Debian's chromium as root: apt-get install -y chromium" >&2
        exit 1
    fi
    SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
# Try the cached package lists first; refresh them only if that fails (fresh containers have none).
if ! "${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium; then
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium
fi
test -x "$CHROMIUM"
