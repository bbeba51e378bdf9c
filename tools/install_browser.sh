#!/usr/bin/env bash
# Install the browser that the end-to-end tests drive (tests/browser/).
#
# Idempotent: if /usr/bin/chromium exists, it says so and exits 0.
# Otherwise it installs Debian's `chromium` package (apt-get update first).
# It never runs `playwright install`: Playwright's own browser download is not
# needed (the tests launch /usr/bin/chromium) and fails on offline CI machines.
#
# Usage: tools/install_browser.sh        (as root, or with sudo available)
set -euo pipefail

CHROMIUM=/usr/bin/chromium

if [ -x "$CHROMIUM" ]; then
    echo "install_browser: $CHROMIUM is already installed ($("$CHROMIUM" --version 2>/dev/null || echo 'version unknown')); nothing to do."
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: $CHROMIUM is missing and apt-get is not available." >&2
    echo "install_browser: install Chromium with your system's package manager so that $CHROMIUM exists," >&2
    echo "install_browser: or run only the fast tests: make test-fast" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_browser: need root (or sudo) to run apt-get install chromium." >&2
        exit 1
    fi
fi

echo "install_browser: installing Debian package 'chromium' (provides $CHROMIUM) with apt-get ..."
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium
echo "install_browser: installed $("$CHROMIUM" --version 2>/dev/null || echo chromium)."
