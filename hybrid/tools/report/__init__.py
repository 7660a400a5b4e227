"""The report of a sweep's runs (``python -m hybrid.report``): :mod:`.build` reads the runs and writes
report.md and its figures; the other modules are its parts, one job each (the job as read, the cost model's
fit, the headlines and their crossing points, the tables, the figures, the loss curves, the shared formats)."""

from hybrid.tools.report.build import (
                                       Job,
                                       calibrate_from_jobs,
                                       comm_label,
                                       headlines,
                                       is_reference,
                                       load_jobs,
                                       main,
                                       peers_table,
                                       report_figure,
                                       write_report,
)

__all__ = ["Job", "calibrate_from_jobs", "comm_label", "headlines", "is_reference", "load_jobs", "main",
           "peers_table", "report_figure", "write_report"]
