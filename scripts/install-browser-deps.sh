#!/usr/bin/env bash
# Install Debian's headless Chromium and its WebDriver for tests/view/test_view_browser.py (the live view in a
# real browser; Selenium drives it). No-op if already present.
set -euo pipefail

PKGS=(chromium chromium-driver)

have_deps() { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }

have_deps && exit 0

source "$(dirname "$0")/apt-install.sh"
apt_install install-browser-deps "${PKGS[@]}" || exit 1

have_deps || { echo "install-browser-deps: installed, but chromium/chromedriver not on PATH" >&2; exit 1; }
