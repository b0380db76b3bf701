"""Monitoring: where every rank's save and load time went (records, reports, metrics).

record.py   Recorder (spans per phase, per thread), PHASES, the record format, logging events
report.py   analyze (per-phase table, stragglers), render, chrome_trace (pure)
plot.py     the Gantt picture (matplotlib, imported on use)
metrics.py  SaveStats (SaveHandle.stats), checkpoint/... metrics, MetricsFeed for the adapters
"""
from .metrics import MetricsFeed, SaveStats, load_metrics
from .record import (
    LOGGER,
    OFF,
    PHASES,
    SCHEMA,
    AsideWrites,
    Phase,
    Recorder,
    kind_of,
    new_op_id,
    parse_record,
    record_key,
    recorder,
    write_record,
)
from .report import StatsReport, Straggler, analyze, chrome_trace, render, render_many

__all__ = ["LOGGER", "OFF", "PHASES", "SCHEMA", "AsideWrites", "Phase", "Recorder", "kind_of", "new_op_id",
           "parse_record", "record_key", "recorder", "write_record", "MetricsFeed", "SaveStats", "load_metrics",
           "StatsReport", "Straggler", "analyze", "chrome_trace", "render", "render_many"]
