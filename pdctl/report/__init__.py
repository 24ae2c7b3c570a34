"""`pdctl report`: look at a decomposition. A stage's training curves, and for a decomposition
its components (CI on one-hot inputs permuted by the Hungarian match, MMCS / ML2R, norms, the
TMS 2-D picture), CI histograms and activation densities on the evaluation batch, and for LMs
the CE / KL of the masked models and the top contexts of the most active components, as PNGs
(plus the data behind them) and one static index.html.

- `build_report(project, stage="train", out=None, progress=None) -> ReportResult`
- `eval_summary(stage_state) -> str`: the final evaluation in a few words (`pdctl status`)
- `report_line(project) -> str | None`: the `report:` line of `pdctl status`
- `progress_bar(console)`: a rich Progress for `build_report`, silent off a terminal
"""

from typing import Any

from pdctl.report.status import eval_summary, report_line

__all__ = ["ReportResult", "build_report", "eval_summary", "progress_bar", "report_line"]


def __getattr__(name: str) -> Any:
    # `pdctl status` needs only the status texts: matplotlib, JAX and orbax load on first use
    # of the report builder.
    if name in ("ReportResult", "build_report", "progress_bar"):
        from pdctl.report import build

        return getattr(build, name)
    raise AttributeError(f"module 'pdctl.report' has no attribute {name!r}")
