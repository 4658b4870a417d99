"""Monitoring for ElChe runs: record log, scalar roll-ups, sub-epoch reports, dashboard, timeline.

``Trainer(strategy=ElCheStrategy(...), callbacks=[ElCheMonitor(record_log_dir="runs/elche",
dashboard_html="runs/elche.html")])``; see ``docs/monitoring.md``.
"""

from lightning_elche.monitor.callback import ElCheMonitor
from lightning_elche.monitor.dashboard import dashboard_data, dashboard_from_log, render_dashboard, write_dashboard
from lightning_elche.monitor.record import RecordLog, epoch_rollup, read_records, reduce_values, rollup
from lightning_elche.monitor.reports import ReportScheduler
from lightning_elche.monitor.timeline import Timeline

__all__ = [
    "ElCheMonitor",
    "RecordLog",
    "ReportScheduler",
    "Timeline",
    "dashboard_data",
    "dashboard_from_log",
    "epoch_rollup",
    "read_records",
    "reduce_values",
    "render_dashboard",
    "rollup",
    "write_dashboard",
]
