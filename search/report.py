"""A picture of a tuning run, beside its log: per task, the best latency so far against the task's
trials (from the log, in the order they were measured), the bandwidth of each task's best
candidate against the device's copy, and for tasks with tensor-core work (matmuls, convolutions)
its TFLOP/s against the architecture's tensor-core peak."""

from __future__ import annotations

import math
import os

from tvm_ext.records import read_records


# Dense fp16/bf16 tensor-core peak with float32 accumulation, TFLOP/s, of each architecture's
# data-centre part (vendor datasheets: A100 SXM, H100 SXM; the H200 has the H100's). Others: no line.
TENSOR_PEAK_TFLOPS = {"sm_80": 312.0, "sm_90": 989.0}


def tensor_peak_tflops(target) -> float | None:
    """The tensor-core peak the picture draws for `target`, where the table knows its architecture."""
    return TENSOR_PEAK_TFLOPS.get(str(target.attrs.get("arch", "")).rstrip("a")) if target.kind.name == "cuda" else None


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


def write_report(log: str, reports: list, path: str, peak_tflops: float | None = None) -> str | None:
    """Draw the run of `log` (with the tuner's TaskReports) to `path`; None where matplotlib is not
    installed. A third panel shows the tasks with tensor-core work, against `peak_tflops` where given."""
    try:
        import matplotlib  # noqa: PLC0415
        import matplotlib.ticker  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    matmuls = [r for r in reports if r.knobs is not None and r.tflops > 0]
    fig, axes = plt.subplots(1, 3 if matmuls else 2, figsize=(19 if matmuls else 13, max(4.5, 0.35 * len(reports))))
    trials, bandwidth = axes[:2]
    for name, best in best_so_far(log).values():
        points = [(i + 1, us) for i, us in enumerate(best) if us < math.inf]
        if points:
            trials.step(*zip(*points), where="post", label=_short(name))
    trials.set(xlabel="trials of the task", ylabel="best latency so far (us)", yscale="log",
               title="best candidate against trials")
    trials.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if trials.get_legend_handles_labels()[0]:  # below the panel: inside, it hides the lines
        trials.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    measured = [r for r in reports if r.knobs is not None and r.gbps > 0]
    copy = next((r.gbps / r.copy_fraction for r in measured if r.copy_fraction), None)
    _bars(bandwidth, measured, [r.gbps for r in measured], copy and (copy, f"device copy {copy:.0f} GB/s"),
          "GB/s of the best candidate", "bandwidth reached")
    if matmuls:
        _bars(axes[2], matmuls, [r.tflops for r in matmuls],
              peak_tflops and (peak_tflops, f"tensor-core peak {peak_tflops:.0f} TFLOP/s"),
              "TFLOP/s of the best candidate", "tensor-core work")
    fig.suptitle(f"tuning run: {os.path.basename(log)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


SHORT = 36  # characters of a task name in the picture: longer fused names squeeze the panels


def _short(name: str) -> str:
    """`name`, its middle elided where it is longer than SHORT (the tables keep it whole)."""
    return name if len(name) <= SHORT else f"{name[:SHORT // 2 - 1]}...{name[-(SHORT // 2 - 2):]}"


def _bars(ax, reports: list, values: list, line, xlabel: str, title: str) -> None:
    """Horizontal bars of `values` per task, with a dashed yardstick `line` (value, label) where given."""
    ax.barh([_short(r.name) for r in reports], values)
    if line:
        ax.axvline(line[0], color="black", linestyle="--", label=line[1])
        ax.legend(fontsize=7)
    ax.set(xlabel=xlabel, title=title)
