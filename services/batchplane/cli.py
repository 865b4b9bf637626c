"""The `batchplane` command.

    batchplane up -c job.yaml     start a job's data plane as local processes
    batchplane demo               write a demo dataset and train a tiny model against it
    batchplane bench NAME --json  run a benchmark (balance, token-budget, plan-latency, mixture, ledger)
    batchplane ledger show --step N | find SOURCE:INDEX | stats [--from A --to B]
                                  lineage from a job's durable ledger
"""

from __future__ import annotations

import argparse
import dataclasses
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

    ledger = commands.add_parser("ledger", help="what each step trained on, from a job's durable ledger")
    ledger_commands = ledger.add_subparsers(dest="query", required=True)
    queries = {
        "show": ledger_commands.add_parser("show", help="what each rank trained on at a step"),
        "find": ledger_commands.add_parser("find", help="which steps saw a sample"),
        "stats": ledger_commands.add_parser("stats", help="the realized mixture over a range of steps"),
    }
    queries["show"].add_argument("--step", type=int, required=True, help="the step")
    queries["find"].add_argument("sample", metavar="SOURCE:INDEX", help="a source's name and a row of it, e.g. web:123")
    queries["stats"].add_argument("--from", dest="first", type=int, default=0, help="first step (default 0)")
    queries["stats"].add_argument("--to", dest="last", type=int, default=None, help="last step, inclusive (default: the latest)")
    for query in queries.values():
        where = query.add_mutually_exclusive_group(required=True)
        where.add_argument("-c", "--config", type=pathlib.Path, help="job configuration (YAML): its run_dir's ledger")
        where.add_argument("--ledger", type=pathlib.Path, help="a ledger folder (<run_dir>/ledger)")
        query.add_argument("--json", action="store_true", help="print one JSON object")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "up":
        return _up(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "ledger":
        return _ledger(args)
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


def _ledger(args: argparse.Namespace) -> int:
    from batchplane.core.config import load_job
    from batchplane.core.storage import LocalStorage
    from batchplane.planner import lineage
    from batchplane.planner.journal import LedgerReader

    if args.config is not None:
        try:
            job = load_job(args.config)
        except ConfigError as exc:
            print(f"batchplane ledger: bad configuration {args.config}: {exc}", file=sys.stderr)
            return 2
        folder = job.resolve(job.run_dir) / "ledger"
    else:
        folder = args.ledger
    if not folder.is_dir():
        print(f"batchplane ledger: no ledger at {folder}", file=sys.stderr)
        return 2
    reader = LedgerReader(LocalStorage(folder))
    if not reader.generations:
        print(f"batchplane ledger: the ledger at {folder} is empty", file=sys.stderr)
        return 2
    sources = reader.generations[-1].sources
    if args.query == "show":
        record = reader.record(args.step)
        if record is None:
            print(f"batchplane ledger: step {args.step} is not in the ledger at {folder} (latest: {reader.last_step()})", file=sys.stderr)
            return 1
        rows = lineage.step_table(record, sources)
        result: dict = {
            "step": args.step,
            "generation": reader.owner(args.step).gen,
            "shares": dict(zip(sources, record["shares"])),
            "take": record["take"],
            "thinned": lineage.is_thinned(record),
            "microbatches": rows,
        }
        text = [f"step {args.step} (generation {result['generation']}): " + ", ".join(f"{k} {v:.3f}" for k, v in result["shares"].items())]
        if result["thinned"]:
            text.append(f"  thinned (ledger.keep_detail_steps): seqs taken per source {record['take']}; per-rank samples not kept")
        text += [f"  bucket {r['bucket']} microbatch {r['microbatch']}: {r['samples']} samples  {' '.join(r['ids'])}" for r in rows]
    elif args.query == "find":
        try:
            source, row = lineage.parse_sample(args.sample, sources)
        except ValueError as exc:
            print(f"batchplane ledger find: {exc}", file=sys.stderr)
            return 2
        seen, thinned = lineage.find(reader.records(), source, row)
        result = {"sample": args.sample, "seen": [dataclasses.asdict(s) for s in seen], "thinned_steps": len(thinned)}
        text = [f"{args.sample}: seen {len(seen)} time(s)"] + [f"  step {s.step} bucket {s.bucket} microbatch {s.microbatch} epoch {s.epoch}" for s in seen]
        if thinned:
            text.append(f"  steps {thinned[0]}..{thinned[-1]} are thinned (ledger.keep_detail_steps): {len(thinned)} steps not searched")
    else:
        result = lineage.realized_mixture(reader.records(args.first, args.last), sources)
        text = [f"steps {result['first']}..{result['last']} ({result['steps']} steps, {result['samples']} samples, {result['tokens']} tokens)"]
        text.append(f"  {'source':<16}{'target':>9}{'samples':>9}{'tokens':>9}{'drift':>10}")
        text += [
            f"  {r['source']:<16}{r['target']:>9.4f}{r['sample_share']:>9.4f}{r['token_share']:>9.4f}{r['drift']:>+10.4f}" for r in result["sources"]
        ]
    print(json.dumps(result) if args.json else "\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
