"""A picture of a tuning run, beside its log: per task, the best latency so far against the task's
trials (from the log, in the order they were measured), and the bandwidth of each task's best
candidate against the device's copy."""

from __future__ import annotations

import math
import os

from tvm_ext.records import read_records


def report_path(log: str) -> str:
    """Where a log's picture is written: NAME.report.png beside NAME.json."""
    return os.path.splitext(log)[0] + ".report.png"


def best_so_far(log: str) -> dict:
    """{task key: (task name, best latency after each of its trials, inf before the first success)}."""
    curves: dict = {}
    for rec in read_records(log):
        name, best = curves.setdefault(rec["key"], (rec.get("task") or rec["key"], []))
        us = rec.get("us") if rec.get("error") is None else None
        best.append(min(best[-1] if best else math.inf, us if us else math.inf))
    return curves


def write_report(log: str, reports: list, path: str) -> str | None:
    """Draw the run of `log` (with the tuner's TaskReports) to `path`; None where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415
        import matplotlib.ticker  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    fig, (trials, bandwidth) = plt.subplots(1, 2, figsize=(13, max(4.5, 0.35 * len(reports))))
    for name, best in best_so_far(log).values():
        points = [(i + 1, us) for i, us in enumerate(best) if us < math.inf]
        if points:
            trials.step(*zip(*points), where="post", label=name)
    trials.set(xlabel="trials of the task", ylabel="best latency so far (us)", yscale="log",
               title="best candidate against trials")
    trials.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if trials.get_legend_handles_labels()[0]:
        trials.legend(fontsize=7)
    measured = [r for r in reports if r.knobs is not None and r.gbps > 0]
    bandwidth.barh([r.name for r in measured], [r.gbps for r in measured])
    copy = next((r.gbps / r.copy_fraction for r in measured if r.copy_fraction), None)
    if copy:
        bandwidth.axvline(copy, color="black", linestyle="--", label=f"device copy {copy:.0f} GB/s")
        bandwidth.legend(fontsize=7)
    bandwidth.set(xlabel="GB/s of the best candidate", title="bandwidth reached")
    fig.suptitle(f"tuning run: {os.path.basename(log)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
