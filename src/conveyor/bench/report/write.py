"""The report's files: report.md, dashboard.csv and report.html (plots embedded; also plots/*.png).

Kept apart from dashboard.py so that the HTML page, which renders the dashboard's tables, and the tables
themselves import one way only.
"""

from __future__ import annotations

import pathlib

from conveyor.bench.report.dashboard import Analysis, format_csv, format_markdown


def write_report(analysis: Analysis, out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """report.md, dashboard.csv and a self-contained report.html (plots embedded; also plots/*.png)."""
    from conveyor.bench.report.report_html import write_html  # matplotlib is loaded only when writing plots

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "report.md", "csv": out_dir / "dashboard.csv"}
    paths["markdown"].write_text(format_markdown(analysis))
    paths["csv"].write_text(format_csv(analysis))
    paths["html"] = write_html(analysis, out_dir)
    return paths
