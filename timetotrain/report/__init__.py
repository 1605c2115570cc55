"""`ttt report`: eval-curve plots and a markdown score summary of a tree of result logs.

Reads results through `timetotrain.mlperf`; nothing under `timetotrain.mlperf` imports this package.
"""

from timetotrain.report.plots import (
    RCP_MEAN_COLOR,
    RCP_MIN_COLOR,
    RUNS_COLOR,
    metric_label,
    plot_group,
    point_label,
    target_of,
)
from timetotrain.report.summary import Report, make_report, summary_markdown

__all__ = [
    "RCP_MEAN_COLOR",
    "RCP_MIN_COLOR",
    "RUNS_COLOR",
    "Report",
    "make_report",
    "metric_label",
    "plot_group",
    "point_label",
    "summary_markdown",
    "target_of",
]
