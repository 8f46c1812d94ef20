#!/usr/bin/env bash
# Render a report page in headless Chromium and save a PNG, to look at it:
#   bash mla_eval/report/screenshot.sh results/ci-smoke/report.html report.png
# (Debian: apt-get install chromium). Flags keep Chromium off the network.
set -euo pipefail
page=$(realpath "$1"); png=${2:-report.png}
profile=$(mktemp -d)
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$profile" --window-size=1300,2200 \
  --screenshot="$png" "file://$page" 2>/dev/null
rm -rf "$profile"
echo "wrote $png"
