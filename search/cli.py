"""Tune a model's fused reduce subgraphs and write a tuning log that tvm_ext.build reads.

    tvm-ext-tune --model my_model.py --target cuda --trials 64 --log tuning_logs/mine.json
    tvm-ext-tune --model my_model.py ... --resume                    # continue an interrupted run
    tvm-ext-tune --model my_model.py ... --export-metaschedule ms/   # also a MetaSchedule database
    tvm-ext-tune --model my_model.py ... --rpc-tracker 10.0.0.1:9190 --rpc-key h100   # on TVM's RPC servers
    python scripts/tune.py --model suite:ln-8192x4096-f16 --target llvm --trials 8 --log tuning_logs/ln.json
    python scripts/tune.py --model torch:bert-seq128 --target cuda --trials 64 --log tuning_logs/bert.json

MODEL: a Python file defining build_module() -> tvm.IRModule; in the repository checkout also an
example model (examples/NAME.py), `torch:NAME` (a PyTorch model of examples/torch_models.py, e.g.
torch:llama-seq512; needs PyTorch), `suite` (every public benchmark case) or `suite:ID` (one case of
bench/suite.json). Then: tvm_ext.build(mod, target, database="tuning_logs/NAME.json").
"""

import argparse
import importlib
import importlib.util
import json
import os
import signal
import sys

import tvm

from tvm_ext import _CHECKOUT
from tvm_ext.records import read_records
from tvm_ext.target import parse_target

from .metaschedule import export_metaschedule
from .report import report_path, tensor_peak_tflops, write_report
from .tasks import extract_tasks
from .tuner import check_log, model_path, tune_model

EXAMPLES = os.path.join(_CHECKOUT, "examples")  # the repository's; an installed package has none


def _prog() -> str:
    return os.path.basename(sys.argv[0]) or "tvm-ext-tune"


def _from_checkout(module: str, model: str):
    """A module of the repository checkout (bench/, examples/), which a wheel does not install."""
    if os.path.isdir(EXAMPLES) and _CHECKOUT not in sys.path:
        sys.path.append(_CHECKOUT)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name not in (module, module.split(".")[0]):
            raise
        raise SystemExit(f"{_prog()}: --model {model} needs the tvm_ext repository checkout ({module} is not "
                         "installed with the package): run from the checkout, or pass a .py file defining "
                         "build_module()") from None


def load_model(name: str):
    """An IRModule (or a list of them, for the suite) for the --model argument."""
    if name == "suite" or name.startswith("suite:"):
        suite = _from_checkout("bench.suite", name)
        cases = {case["id"]: case for case in suite.load_suite()}
        wanted = list(cases) if name == "suite" else [name.split(":", 1)[1]]
        unknown = [w for w in wanted if w not in cases]
        if unknown:
            raise SystemExit(f"{_prog()}: no suite case {unknown[0]!r}; cases: {', '.join(cases)}")
        return [suite.relax_module(cases[w]["op"], cases[w]["shape"], cases[w]["dtype"]) for w in wanted]
    if name.startswith("torch:"):  # a PyTorch model of examples/torch_models.py (needs PyTorch)
        import tvm_ext  # noqa: PLC0415

        models = _from_checkout("examples.torch_models", name)
        if name[6:] not in models.CONFIGS:
            raise SystemExit(f"{_prog()}: no PyTorch model {name[6:]!r}; models: {', '.join(models.CONFIGS)}")
        return tvm_ext.from_torch(*models.make(name[6:]))
    path = name if name.endswith(".py") else os.path.join(EXAMPLES, f"{name}.py")
    if not os.path.isfile(path):
        examples = sorted(f[:-3] for f in os.listdir(EXAMPLES)
                          if f.endswith(".py") and f not in ("__init__.py", "torch_models.py")) if os.path.isdir(EXAMPLES) else []
        raise SystemExit(f"{_prog()}: no model {name!r}: expected a .py file defining build_module()"
                         + (f", one of {examples}, torch:NAME, suite or suite:ID" if examples else ""))
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "build_module"):
        raise SystemExit(f"{_prog()}: {path} defines no build_module() returning a tvm.IRModule")
    return module.build_module()


def parse_dims(text: str) -> dict:
    try:
        return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}
    except ValueError:
        raise SystemExit(f"{_prog()}: --dims expects NAME=INT[,NAME=INT...], got {text!r}") from None


def table(reports) -> str:
    lines = ["| task | measured at | calls | trials | heuristic us | best us | speed-up | GB/s | % of copy | best knobs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        at = ", ".join(f"{name}={size}" for name, size in r.sizes.items()) or "-"  # symbolic dims (--dims, else 4096)
        if r.knobs is None:  # the budget ran out before this task (or every candidate failed)
            lines.append(f"| {r.name} | {at} | {r.weight} | {r.trials} | - | - | - | - | - | not measured: the heuristic's |")
            continue
        heuristic = f"{r.heuristic_us:.1f}" if r.heuristic_us else "-"
        speedup = f"{r.speedup:.2f}x" if r.speedup else "-"
        lines.append(f"| {r.name} | {at} | {r.weight} | {r.trials} | {heuristic} | {r.best_us:.1f} | {speedup} | "
                     f"{r.gbps:.0f} | {100 * r.copy_fraction:.0f}% | {json.dumps(r.knobs, sort_keys=True)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--target", default="cuda", help="cuda (this GPU), llvm, or a JSON target dict")
    ap.add_argument("--trials", type=int, required=True, help="measurements in all, over every task")
    ap.add_argument("--log", required=True, help="JSON-lines tuning log to write (appended to with --resume)")
    ap.add_argument("--resume", action="store_true", help="continue the run that wrote --log")
    ap.add_argument("--warm-start", nargs="*", default=[], metavar="LOG", help="other logs to train the model on")
    ap.add_argument("--dims", default="", help="values of symbolic dims while measuring, e.g. n=8192 (default 4096)")
    ap.add_argument("--builders", type=int, default=None, help="parallel build processes (default min(8, CPUs))")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a candidate may take to build or run")
    ap.add_argument("--batch", type=int, default=8, help="candidates measured per round")
    ap.add_argument("--rpc-tracker", metavar="HOST:PORT", default=None,
                    help="measure on the servers of TVM's RPC tracker (python -m tvm.exec.rpc_tracker), not on this "
                         "machine; needs --rpc-key")
    ap.add_argument("--rpc-key", metavar="KEY", default=None, help="the device key the servers registered under "
                    "(python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY)")
    ap.add_argument("--export-metaschedule", metavar="DIR", default=None,
                    help="also write the log's best record of each task as a MetaSchedule JSONDatabase in DIR "
                         "(tasks whose kernel a trace cannot replay are listed with the reason)")
    ap.add_argument("--variance", choices=["welford", "tuned"], default="welford",
                    help="tuned: tune each statistic (LayerNorm, variance, ...) with Welford and with two passes, for "
                         'a build with variance="tuned" to take the faster (default: welford)')
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # what timeout, Slurm and Kubernetes send: stop as on Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C stops it even where it started with SIGINT
    # ignored (a background job of a script: Python then leaves it ignored)
    try:
        if (args.rpc_tracker is None) != (args.rpc_key is None):
            raise ValueError("--rpc-tracker and --rpc-key go together: the tracker's address and the servers' key")
        rpc = (args.rpc_tracker, args.rpc_key) if args.rpc_tracker else None
        target = measuring_target(args.target, remote=rpc is not None)
        check_log(args.log, args.resume)  # before the model loads: a log that cannot take records stops here
        model = load_model(args.model)
        reports = tune_model(model, target, args.trials, args.log, args.resume,
                             args.warm_start, parse_dims(args.dims), args.builders, args.timeout, args.batch,
                             variance=args.variance, rpc=rpc)
        exported = (export_metaschedule(args.log, extract_tasks(model, target, variance=args.variance), target,
                                        args.export_metaschedule) if args.export_metaschedule else None)
    except (ValueError, OSError) as err:
        print(f"{_prog()}: {err}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Terminated) as stop:
        print(f"\n{_prog()}: {'terminated' if isinstance(stop, _Terminated) else 'interrupted'}; every finished "
              f"measurement is in {args.log}: add --resume to continue", file=sys.stderr)
        return 143 if isinstance(stop, _Terminated) else 130
    print(table(reports))
    picture = write_report(args.log, reports, report_path(args.log), tensor_peak_tflops(target))
    print(f"log: {args.log}   cost model: {model_path(args.log)}   "
          + (f"report: {picture}" if picture else "no report picture: matplotlib is not installed"))
    if exported is not None:
        print(export_summary(exported, args.export_metaschedule))
    if args.trials and all(r.knobs is None for r in reports):
        print(f"{_prog()}: no candidate could be measured; the first failure: {first_error(args.log)}", file=sys.stderr)
        return 1
    return 0


class _Terminated(BaseException):
    """SIGTERM, raised where the run is, so that its workers stop and its scratch files go as on Ctrl-C."""


def _terminated(_signum, _frame):
    raise _Terminated


def measuring_target(text: str, remote: bool = False):
    """The target of --target (a name or a JSON dict), refused in one line when it is not a target
    or when this machine has no device to measure it on (unless the servers of `remote` measure)."""
    try:
        target = parse_target(json.loads(text) if text.lstrip().startswith("{") else text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--target {text!r} is not valid JSON: {err.msg} at column {err.colno}") from None
    if target.kind.name == "cuda" and not remote and not tvm.cuda(0).exist:
        raise ValueError(f"--target {text!r}: no CUDA GPU is visible to measure on; tune on a machine with one, "
                         "or pass --target llvm")
    return target


def export_summary(result: dict, out_dir: str) -> str:
    """What --export-metaschedule wrote, and each task it could not export with the reason."""
    lines = [f"MetaSchedule database in {out_dir}: {len(result['exported'])} task(s) exported"
             + (f" ({', '.join(sorted(e['task'] for e in result['exported'].values()))})" if result["exported"] else "")]
    lines += [f"  not exported: {s['task']}: {s['reason']}" for s in result["skipped"].values()]
    return "\n".join(lines)


def first_error(log: str) -> str:
    """The error of the log's first failed record (what stopped every candidate), or a pointer to the log."""
    return next((rec["error"] for rec in read_records(log) if rec.get("error")), f"see {log}")
