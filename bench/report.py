"""Markdown table and bandwidth plot from one results JSON (bench/results/*.json).

    python -m bench.report bench/results/h100-2026-11-21.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

IMPLS = ["ours", "ours_tuned", "ours_int64", "ours_static", "ours_welford", "ours_two_pass", "ours_one_pass",
         "ours_spelled", "torch_eager", "torch_compile", "tvm_dlight", "torch_eager_spelled", "torch_compile_spelled",
         "tvm_dlight_spelled", "copy"]


def _label(row) -> str:
    n = row.get("n")
    return row["case"] + (" " + ",".join(f"{k}={v}" for k, v in n.items()) if n else "")


def _grouped(result: dict) -> dict:
    table: dict = {}
    for row in result["rows"]:
        table.setdefault(_label(row), {})[row["impl"]] = row
    return table


def markdown(result: dict) -> str:
    impls = [i for i in IMPLS if any(r["impl"] == i for r in result["rows"])]
    head = (f"{result['device']}, {result['date']}, torch {result['torch']}, TVM {result['tvm']}; "
            f"device copy {result['copy_gbps']:.0f} GB/s. GB/s = effective bandwidth (bytes that must cross HBM "
            "once / time); speed-up = their time / our time (>1: we are faster); times are device times (the host "
            "kept ahead), the wall column do_bench's (host included); err = max abs error of ours vs "
            "PyTorch eager.\n\n")
    strategies = any("strategy" in r for r in result["rows"])
    spelled = "ours_spelled" in impls  # a spelled-out pattern beside the single op: its own two ratios
    walls = any("wall_us" in r for r in result["rows"])
    cols = ["case", "ours us"] + [f"{i} GB/s" for i in impls] + [
        "vs torch.compile"] + (["vs torch.compile, wall"] if walls else []) + ["vs dlight", "ours % of copy", "ours % of same-size copy", "ours err",
        "kernels ours/dlight"] + (
        ["spelled: single op / spelled", "spelled vs torch.compile (spelled)", "kernels spelled ours/dlight"]
        if spelled else []) + (["strategy"] if strategies else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for label, by_impl in _grouped(result).items():
        ours = by_impl.get("ours", {})
        speed = lambda other, key="us": (f"{by_impl[other][key] / ours[key]:.2f}x"  # noqa: E731
                                         if key in by_impl.get(other, {}) and key in ours else "-")
        gbps = [f"{by_impl[i]['gbps']:.0f}" if "gbps" in by_impl.get(i, {}) else "fail" if i in by_impl else "-"
                for i in impls]
        pct = f"{100 * ours['gbps'] / result['copy_gbps']:.0f}%" if "gbps" in ours else "-"
        pct_same = f"{by_impl['copy']['us'] / ours['us']:.0%}" if "us" in ours and "us" in by_impl.get("copy", {}) else "-"
        err = f"{ours['max_abs_err']:.2g}" if "max_abs_err" in ours else "-"
        kern = f"{ours.get('kernels', '-')}/{by_impl.get('tvm_dlight', {}).get('kernels', '-')}"
        us = f"{ours['us']:.1f}" if "us" in ours else "fail"
        ratio = lambda a, b: (f"{by_impl[a]['us'] / by_impl[b]['us']:.2f}x"  # noqa: E731
                              if "us" in by_impl.get(a, {}) and "us" in by_impl.get(b, {}) else "-")
        spelled_cols = [ratio("ours", "ours_spelled"), ratio("torch_compile_spelled", "ours_spelled"),
                        f"{by_impl.get('ours_spelled', {}).get('kernels', '-')}/"
                        f"{by_impl.get('tvm_dlight_spelled', {}).get('kernels', '-')}"] if spelled else []
        extra = [ours.get("strategy", "-")] if strategies else []
        wall = [speed("torch_compile", "wall_us")] if walls else []
        lines.append("| " + " | ".join([label, us] + gbps + [speed("torch_compile")] + wall + [
            speed("tvm_dlight"), pct, pct_same, err, kern] + spelled_cols + extra) + " |")
    return head + "\n".join(lines) + "\n" + summary(result)


def _geomean(values: list) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(result: dict) -> str:
    """Geometric means over the static cases (no symbolic dims) where ours ran: of copy, of the
    same-size copy, and ours against torch.compile, with the count at or above 1.0x."""
    static = [by for by in _grouped(result).values() if "us" in by.get("ours", {}) and not by["ours"].get("n")]
    if not static:
        return ""
    parts = [f"{len(static)} static cases: ours {_geomean([b['ours']['gbps'] for b in static]) / result['copy_gbps']:.0%} "
             "of copy (geometric mean)"]
    same = [b["copy"]["us"] / b["ours"]["us"] for b in static if "us" in b.get("copy", {})]
    if same:
        parts.append(f"{_geomean(same):.0%} of the same-size copy")
    compiled = [b["torch_compile"]["us"] / b["ours"]["us"] for b in static if "us" in b.get("torch_compile", {})]
    if compiled:
        parts.append(f"{_geomean(compiled):.2f}x torch.compile, {sum(r >= 1 for r in compiled)} of {len(compiled)} "
                     "at 1.0x or more")
    return "\n" + "; ".join(parts) + ".\n"


def plot(result: dict, path: str) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    table = _grouped(result)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in result["rows"])]
    labels = list(table)
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(10, 0.5 * len(labels)), 6))
    for k, impl in enumerate(impls):
        values = [table[l].get(impl, {}).get("gbps", 0) for l in labels]
        ax.bar([i + k * width for i in range(len(labels))], values, width, label=impl)
    ax.axhline(result["copy_gbps"], color="black", linestyle="--", label=f"device copy {result['copy_gbps']:.0f}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("effective GB/s")
    ax.set_title(f"Fused reduce subgraphs on {result['device']} ({result['date']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json_and_markdown(prefix: str, result: dict, table: str) -> None:
    """PREFIX.json (the numbers) and PREFIX.md (their table), as the search benches write them."""
    with open(prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    with open(prefix + ".md", "w", encoding="utf-8") as f:
        f.write(table + "\n")
    print(table)


def write_reports(json_path: str) -> str:
    with open(json_path, encoding="utf-8") as f:
        result = json.load(f)
    stem = json_path[: -len(".json")]
    table = markdown(result)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(table)
    try:
        plot(result, stem + ".png")
    except ImportError:
        print("matplotlib not installed: no plot written", file=sys.stderr)
    return table


def table_cli(argv, doc: str, analyse, markdown_of) -> tuple:
    """The command line of a bench that reads a measured space table (bench.measure_spaces) and
    writes PREFIX.json / PREFIX.md: (its --out prefix, the result)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md")
    args = ap.parse_args(argv)
    with open(args.table, encoding="utf-8") as f:
        result = analyse(json.load(f))
    write_json_and_markdown(args.out, result, markdown_of(result))
    return args.out, result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a results JSON of bench.run; NAME.md and NAME.png are written beside it")
    args = ap.parse_args(argv)
    if not args.results.endswith(".json"):
        ap.error(f"{args.results!r} is not a .json results file")
    try:
        print(write_reports(args.results))
    except (OSError, ValueError) as err:
        ap.error(f"cannot read {args.results}: {err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
