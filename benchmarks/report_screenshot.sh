#!/usr/bin/env bash
# Screenshot-level check that a conveyor HTML report renders: headless Chromium draws the page to a PNG,
# then the PNG must be tall, mostly non-blank and show the embedded plots (non-white, non-text colours).
# Needs Debian's chromium (apt-get install -y chromium); not part of CI's required steps.
#   bash benchmarks/report_screenshot.sh conveyor-demo/report/report.html /tmp/report.png
set -euo pipefail
REPORT=${1:-conveyor-demo/report/report.html}
OUT=${2:-report-screenshot.png}
BROWSER=$(command -v chromium || command -v chromium-browser || true)
[ -n "$BROWSER" ] || { echo "chromium not installed (apt-get install -y chromium)" >&2; exit 2; }
"$BROWSER" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,6000 \
    --screenshot="$OUT" "file://$(realpath "$REPORT")" >/dev/null 2>&1
python3 - "$OUT" <<'PY'
import sys
import matplotlib.image as mpimg
import numpy as np
img = mpimg.imread(sys.argv[1])[..., :3]
ink = (img < 0.9).any(axis=2).mean()            # anything not near-white
colour = (img.max(axis=2) - img.min(axis=2) > 0.25).mean()  # saturated pixels: plot lines, verdict colours
print(f"{sys.argv[1]}: {img.shape[1]}x{img.shape[0]}, {ink:.1%} ink, {colour:.2%} colour")
sys.exit(0 if ink > 0.03 and colour > 0.001 else 1)
PY
