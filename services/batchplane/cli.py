"""The `batchplane` command.

    batchplane up -c job.yaml     start a job's data plane as local processes
    batchplane demo               write a demo dataset and train a tiny model against it
    batchplane bench NAME --json  run a benchmark (balance, token-budget, plan-latency)
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import signal
import sys
import threading

from batchplane.core.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchplane", description="batchplane: the data plane of large-model training")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start a job's planner, loaders and constructors as local processes")
    up.add_argument("-c", "--config", type=pathlib.Path, required=True, help="job configuration (YAML)")
    up.add_argument("--run-dir", type=pathlib.Path, help="folder for logs and endpoints (default: the job's run_dir)")
    up.add_argument("--log-level", default="INFO")

    demo = commands.add_parser("demo", help="train a tiny model on two data-parallel ranks against a demo dataset")
    demo.add_argument("--dir", type=pathlib.Path, default=pathlib.Path(".batchplane/demo"), help="working folder")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--log-every", type=int, default=25, help="print progress every N steps")

    from batchplane.bench import BENCHMARKS

    bench = commands.add_parser("bench", help="run a benchmark and print its results (NAME --help for its flags)")
    bench.add_argument("benchmark", choices=list(BENCHMARKS), help="the benchmark")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="its flags, e.g. --json")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "up":
        return _up(args)
    if args.command == "bench":
        return _bench(args)
    from batchplane.demo.run import run_demo

    return run_demo(workdir=args.dir, steps=args.steps, log_every=args.log_every)


def _up(args: argparse.Namespace) -> int:
    from batchplane.launcher.local import LaunchError, LocalCluster

    try:
        cluster = LocalCluster(args.config, run_dir=args.run_dir, log_level=args.log_level)
    except ConfigError as exc:
        print(f"batchplane up: bad configuration {args.config}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
    except LaunchError as exc:
        print(f"batchplane up: {exc}", file=sys.stderr)
        return 1
    print(describe(cluster), flush=True)
    code = 0
    try:
        while not stop.wait(0.5):
            cluster.check_alive()
            if cluster.status().finished:
                print("batchplane up: every rank reached the end of the data; stopping", flush=True)
                break
    except LaunchError as exc:
        print(f"batchplane up: {exc}", file=sys.stderr)
        code = 1
    finally:
        print("batchplane up: stopping", flush=True)
        cluster.stop()
    return code


def describe(cluster) -> str:
    """The table of processes, addresses, metrics and logs that `up` prints."""
    job = cluster.job
    lines = [f"batchplane up: job {job.job!r} (fingerprint {job.fingerprint}), run folder {cluster.run_dir}"]
    for p in cluster.processes:
        extra = ""
        if p.name.startswith("constructor-"):
            extra = f"  ranks {list(job.constructor_ranks(int(p.name.split('-')[1])))}"
        lines.append(
            f"  {p.name:<15} {p.address:<22} metrics http://{job.network.host}:{p.metrics_port}/metrics"
            f"  log {p.log_path}{extra}"
        )
    lines.append(f"  clients: export BATCHPLANE_ENDPOINTS={cluster.endpoints_path}")
    lines.append("  Ctrl-C stops every process.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())


def _bench(args: argparse.Namespace) -> int:
    from batchplane.bench import load

    module = load(args.benchmark)
    parser = argparse.ArgumentParser(prog=f"batchplane bench {args.benchmark}", description=module.HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a table per record)")
    module.add_arguments(parser)
    args = argparse.Namespace(**{**vars(parser.parse_args(args.options)), "benchmark": args.benchmark})

    def progress(message: str) -> None:
        print(f"[{args.benchmark}] {message}", file=sys.stderr, flush=True)

    result = load(args.benchmark).run(args, progress)
    if args.json:
        print(json.dumps(result))
        return 0
    records = result.get("records", [])
    if records:
        columns = list(records[0])
        print("  ".join(columns))
        for record in records:
            print("  ".join(_cell(record.get(c)) for c in columns))
    for key, value in result.items():
        if key != "records":
            print(f"{key}: {json.dumps(value)}")
    return 0


def _cell(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)
