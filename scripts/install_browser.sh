#!/usr/bin/env bash
# Install Debian's Chromium for the browser tests (tests/browser), only if it is missing.
# Idempotent: a second run does nothing. Never downloads a browser through Playwright.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    echo "chromium already installed at /usr/bin/chromium"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y chromium
/usr/bin/chromium --version 2>/dev/null || true
