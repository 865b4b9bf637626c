"""The `batchplane` command.

batchplane up -c job.yaml     start a job's data plane as local processes
batchplane demo               write a demo dataset and train a tiny model against it
batchplane bench NAME --json  run a benchmark (balance, token-budget, plan-latency, mixture, ledger,
                              chaos, transport, delivery, vlm)
batchplane ledger show --step N | find SOURCE:INDEX | stats [--from A --to B]
                              lineage from a job's durable ledger
batchplane profile -c job.yaml [--samples N] [--out profiles.json] [--json]
                              measure each source: state memory, decode and transform time
batchplane partition --profiles profiles.json --pod-memory 32Gi --pod-cpus 8 [--out F]
                              loader groups, actors and workers per actor, as a DataPlane
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


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every command and flag (the README's "Command line" lists them)."""
    parser = argparse.ArgumentParser(prog="batchplane", description="batchplane: the data plane of large-model training")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_package_version()}", help="print the installed version and exit"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start a job's planner, loaders and constructors as local processes")
    up.add_argument("-c", "--config", type=pathlib.Path, required=True, help="job configuration (YAML)")
    up.add_argument(
        "--run-dir",
        type=pathlib.Path,
        help="folder for logs, endpoints and the ledger unless ledger.location is set (default: the job's run_dir)",
    )
    up.add_argument("--log-level", default="INFO")
    up.add_argument(
        "--autoscale",
        type=pathlib.Path,
        metavar="DATAPLANE",
        help="scale the loader groups from Prometheus as the operator does, with the groups, costs, bounds and scaling of "
        "this DataPlane file (e.g. from `batchplane partition`); its sourceGroups must be the job's loaders.groups",
    )
    up.add_argument("--prometheus", help="Prometheus URL for --autoscale, e.g. http://127.0.0.1:9090")
    up.add_argument("--prometheus-job", help="the scrape job the planner is scraped under (default: any)")

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
        where.add_argument(
            "-c", "--config", type=pathlib.Path, help="job configuration (YAML): its ledger.location, else its run_dir's ledger"
        )
        where.add_argument("--ledger", help="a ledger folder (<run_dir>/ledger) or URL (s3://bucket/prefix)")
        query.add_argument("--json", action="store_true", help="print one JSON object")

    profile = commands.add_parser(
        "profile", help="measure each source of a job: file-access state memory, decode and transform time per sample"
    )
    profile.add_argument("-c", "--config", type=pathlib.Path, required=True, help="job configuration (YAML)")
    profile.add_argument(
        "--samples", type=_positive_int, default=256, metavar="N", help="rows profiled per source, from its first row groups (default 256)"
    )
    profile.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("profiles.json"),
        metavar="FILE",
        help="profiles file to write (default profiles.json)",
    )
    profile.add_argument("--json", action="store_true", help="also print the profiles as one JSON object (default: a table)")

    part = commands.add_parser(
        "partition",
        help="turn source profiles and pod limits into loader groups, actors and workers per actor (MegaScale-Data 5.1)",
    )
    part.add_argument("--profiles", type=pathlib.Path, required=True, metavar="FILE", help="a file written by `batchplane profile`")
    part.add_argument("--pod-memory", required=True, metavar="QUANTITY", help="memory of one loader pod, e.g. 32Gi")
    part.add_argument(
        "--pod-cpus", required=True, metavar="QUANTITY", help="CPU cores of one loader pod, e.g. 8 or 7500m; a worker takes one"
    )
    part.add_argument(
        "--max-workers-per-actor",
        type=_positive_int,
        metavar="W",
        help="W: workers per loader pod at most (default: the pod's whole cores)",
    )
    part.add_argument(
        "--max-actors-per-source", type=_positive_int, default=8, metavar="A", help="A: loader pods per source at most (default 8)"
    )
    part.add_argument("--cost-levels", type=_positive_int, default=4, metavar="G", help="cost clusters of sources at most (default 4)")
    part.add_argument(
        "--samples-per-s",
        type=float,
        metavar="RATE",
        help="target rate of mixed samples per second: size workers absolutely (default: relative to the cheapest sources)",
    )
    part.add_argument(
        "--weights",
        type=pathlib.Path,
        metavar="FILE",
        help="mixture weights: a job file (its mixture.weights) or a YAML mapping of source: weight (default: the weights in the profiles)",
    )
    part.add_argument(
        "--actor-memory", default="256Mi", metavar="QUANTITY", help="memory of a loader process before sources (default 256Mi)"
    )
    part.add_argument(
        "--buffer-memory",
        default="512Mi",
        metavar="QUANTITY",
        help="a loader's read-ahead buffer, the job's loaders.buffer_bytes (default 512Mi)",
    )
    part.add_argument(
        "--worker-memory", default="64Mi", metavar="QUANTITY", help="memory of a worker besides file-access state (default 64Mi)"
    )
    part.add_argument(
        "--memory-headroom",
        type=float,
        default=0.1,
        metavar="FRACTION",
        help="fraction of pod memory left unplanned for estimate error (default 0.1)",
    )
    part.add_argument(
        "--state-per",
        choices=["worker", "actor"],
        default="worker",
        help="who holds a copy of the file-access state (default: every worker)",
    )
    part.add_argument(
        "--one-source-per-group",
        action="store_true",
        help="a loader group per source (MegaScale-Data's default) instead of packing similar sources",
    )
    part.add_argument(
        "--format",
        choices=["dataplane", "values"],
        default="dataplane",
        help="a DataPlane resource (default) or the chart's sourceGroups values",
    )
    part.add_argument("--name", help="the DataPlane's name (default: the profiled job's)")
    part.add_argument(
        "--out", type=pathlib.Path, metavar="FILE", help="YAML file to write (default: standard output); a summary goes to standard error"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "up":
        return _up(args)
    if args.command == "profile":
        return _profile(args)
    if args.command == "partition":
        return _partition(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "ledger":
        return _ledger(args)
    from batchplane.demo.run import run_demo

    return run_demo(workdir=args.dir, steps=args.steps, log_every=args.log_every)


def _package_version() -> str:
    """The installed batchplane distribution's version, or "unknown" when it is not installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version("batchplane")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


#: Consecutive failed restarts of one process after which `batchplane up` gives up and stops.
MAX_FAILED_RESTARTS = 5


def _up(args: argparse.Namespace) -> int:
    import grpc

    from batchplane.core.process import EXIT_FENCED, set_from_signal
    from batchplane.launcher.local import LaunchError, LocalCluster

    try:
        cluster = LocalCluster(args.config, run_dir=args.run_dir, log_level=args.log_level)
        scaling = _autoscaling(args, cluster.job) if args.autoscale else None
    except ConfigError as exc:
        print(f"batchplane up: bad configuration: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        set_from_signal(stop)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
    except LaunchError as exc:
        print(f"batchplane up: {exc}", file=sys.stderr)
        return 1
    print(describe(cluster), flush=True)
    if scaling is not None:
        _start_autoscaler(cluster, args, *scaling, stop=stop)
    code = 0
    failed_restarts: dict[str, int] = {}
    try:
        while not stop.wait(0.5):
            for p in cluster.processes:  # the planner first; each rebuilds its state; the trainers keep going
                code_of = p.popen.poll()
                if code_of is None or p.leaving:
                    continue
                if p is cluster.planner and code_of == EXIT_FENCED:  # started again, it would fence the newer one
                    raise LaunchError(f"the planner was fenced: another planner took over the job's ledger; see {p.log_path}")
                print(f"batchplane up: {p.name} exited with status {code_of}; restarting it", flush=True)
                try:
                    cluster.restart(p)
                    failed_restarts.pop(p.name, None)
                except LaunchError as exc:  # e.g. it needs a part that is down too: next round
                    failed_restarts[p.name] = failed_restarts.get(p.name, 0) + 1
                    if failed_restarts[p.name] >= MAX_FAILED_RESTARTS:
                        raise
                    print(f"batchplane up: restarting {p.name} failed ({exc}); trying again", flush=True)
            try:
                finished = cluster.status().finished
            except grpc.RpcError:  # the planner went down since: restarted on the next round
                continue
            if finished:
                print("batchplane up: every rank reached the end of the data; stopping", flush=True)
                break
    except LaunchError as exc:
        print(f"batchplane up: {exc}", file=sys.stderr)
        code = 1
    finally:
        print("batchplane up: stopping", flush=True)
        cluster.stop()
    return code


def _autoscaling(args: argparse.Namespace, job):
    """(group specs by loader group, interval, declared schedule) from the --autoscale DataPlane.

    Raises:
        ConfigError: an unreadable or invalid file, no --prometheus, or source groups other than
            the job's loader groups.
    """
    import yaml

    from batchplane.operator.dataplane import SpecError, parse_dataplane

    if not args.prometheus:
        raise ConfigError("--prometheus", "is required with --autoscale", None)
    try:
        obj = yaml.safe_load(args.autoscale.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(str(args.autoscale), f"cannot read the DataPlane: {exc}", None) from exc
    if not isinstance(obj, dict):
        raise ConfigError(str(args.autoscale), "must hold a DataPlane object", obj)
    # Local processes need no namespace, owner or image; the rest is the operator's reading.
    metadata = {"name": "local", "namespace": "local", "uid": "local", **(obj.get("metadata") or {})}
    body = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    body = {**body, "loader": {"image": "local", **(body.get("loader") or {})}}
    try:
        spec = parse_dataplane({**obj, "metadata": metadata, "spec": body})
    except SpecError as exc:
        raise ConfigError(f"{args.autoscale}: {exc.field}", exc.problem, exc.value) from exc
    groups = [list(g.sources) for g in spec.groups]
    loaders = [[job.source_names[k] for k in job.loader_sources(g)] for g in range(job.loader_count)]
    if sorted(map(sorted, groups)) != sorted(map(sorted, loaders)):
        raise ConfigError("loaders.groups", f"must be the DataPlane's sourceGroups {groups} to autoscale them", loaders)
    by_index = {g: spec.group_spec(next(x for x in spec.groups if sorted(x.sources) == sorted(names))) for g, names in enumerate(loaders)}
    return by_index, spec.interval_s, spec.schedule


def _start_autoscaler(cluster, args: argparse.Namespace, specs, interval_s: float, schedule, *, stop: threading.Event) -> None:
    from batchplane.launcher.autoscale import LocalAutoscaler
    from batchplane.operator.prometheus import PrometheusReader

    autoscaler = LocalAutoscaler(cluster, PrometheusReader(args.prometheus), specs, job=args.prometheus_job, schedule=schedule)

    def report(row) -> None:
        changes = {g: f"{before}->{after}" for g, (before, after, _) in row.groups.items() if before != after}
        if changes:
            print(f"batchplane up: t={row.t:.0f}s loader replicas {changes} (weights {row.weights})", flush=True)

    threading.Thread(
        target=autoscaler.run, args=(stop,), kwargs={"interval_s": interval_s, "on_interval": report}, name="autoscale", daemon=True
    ).start()
    print(f"batchplane up: autoscaling loader groups {sorted(specs)} every {interval_s:.0f} s from {args.prometheus}", flush=True)


def describe(cluster) -> str:
    """The table of processes, addresses, metrics and logs that `up` prints."""
    job = cluster.job
    lines = [f"batchplane up: job {job.job!r} (fingerprint {job.fingerprint}), run folder {cluster.run_dir}"]
    for p in cluster.processes:
        extra = ""
        if p.name.startswith("constructor-"):
            extra = f"  ranks {list(job.constructor_ranks(int(p.name.split('-')[1])))}"
        lines.append(f"  {p.name:<15} {p.address:<22} metrics http://{job.network.host}:{p.metrics_port}/metrics  log {p.log_path}{extra}")
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
    import functools

    from batchplane.core.config import is_url, load_job
    from batchplane.core.errors import BatchplaneError
    from batchplane.core.object_storage import open_storage
    from batchplane.planner.journal import LedgerReader, ledger_location, open_ledger_storage

    if args.config is not None:
        try:
            job = load_job(args.config)
        except ConfigError as exc:
            print(f"batchplane ledger: bad configuration {args.config}: {exc}", file=sys.stderr)
            return 2
        run_dir = job.resolve(job.run_dir)
        folder = ledger_location(job, run_dir)
        open_ledger = functools.partial(open_ledger_storage, job, run_dir, check_writes=False)  # reads only: no write check
    else:
        folder = args.ledger if is_url(args.ledger) else str(pathlib.Path(args.ledger).absolute())
        open_ledger = functools.partial(open_storage, folder)
    if not is_url(folder) and not pathlib.Path(folder).is_dir():
        print(f"batchplane ledger: no ledger at {folder}", file=sys.stderr)
        return 2
    try:
        return _ledger_query(args, LedgerReader(open_ledger()), folder)
    except BatchplaneError as exc:  # an object store that cannot be reached or read
        print(f"batchplane ledger: cannot read the ledger at {folder}: {exc}", file=sys.stderr)
        return 2


def _ledger_query(args: argparse.Namespace, reader, folder: str) -> int:
    """Answers `batchplane ledger show/find/stats` from the ledger `reader` reads (at `folder`)."""
    from batchplane.planner import lineage

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
        if "window" in record:  # token budgets planned over several steps (planner.window)
            window = record["window"]
            result["window"] = {"first": window["first"], "steps": window["steps"], "leftover": bool(window.get("leftover"))}
            result["samples"] = record["samples"]
        text = [f"step {args.step} (generation {result['generation']}): " + ", ".join(f"{k} {v:.3f}" for k, v in result["shares"].items())]
        if "window" in result:
            w = result["window"]
            text.append(f"  planned in the window of steps {w['first']}..{w['first'] + w['steps'] - 1}; seqs consumed {result['samples']}")
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
        text = [f"{args.sample}: seen {len(seen)} time(s)"] + [
            f"  step {s.step} bucket {s.bucket} microbatch {s.microbatch} epoch {s.epoch}" for s in seen
        ]
        if thinned:
            text.append(f"  steps {thinned[0]}..{thinned[-1]} are thinned (ledger.keep_detail_steps): {len(thinned)} steps not searched")
        result["substitutions"] = lineage.substitutions(reader.records(), sources[source], row)
        for e in result["substitutions"]:
            bad = f"{e['source']}:{e['bad'][0]}" + (f"@{e['bad'][1]}" if e["bad"][1] else "")
            if e.get("passed_over"):
                text.append(f"  step {e['step']}: {bad} was bad ({e['reason']}); consumed while seeking a substitute")
                continue
            by = (
                "no substitute (none left within the search bound)"
                if e["by"] is None
                else f"{e['source']}:{e['by'][0]}" + (f"@{e['by'][1]}" if e["by"][1] else "")
            )
            text.append(f"  step {e['step']}: {bad} was bad ({e['reason']}); stood in for by {by}")
    else:
        result = lineage.realized_mixture(reader.records(args.first, args.last), sources)
        delivered = (
            "samples delivered not kept (thinned steps)" if result["delivered"] is None else f"{result['delivered']} samples delivered"
        )
        text = [
            f"steps {result['first']}..{result['last']} ({result['steps']} steps, {delivered}, {result['bad']} bad rows consumed, "
            f"{result['tokens']} tokens)"
        ]
        text.append(f"  {'source':<16}{'target':>9}{'samples':>9}{'tokens':>9}{'drift':>10}")
        text += [
            f"  {r['source']:<16}{r['target']:>9.4f}{r['sample_share']:>9.4f}{r['token_share']:>9.4f}{r['drift']:>+10.4f}"
            for r in result["sources"]
        ]
    print(json.dumps(result) if args.json else "\n".join(text))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


class _ProgressLine:
    """One line per source on standard error, redrawn in place on a terminal; elsewhere only
    each source's final line is written."""

    def __init__(self, stream=sys.stderr, width: int = 24) -> None:
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self._last = 0  # length of the line being redrawn

    def __call__(self, name: str, stage: str, done: int, total: int) -> None:
        if stage != "done" and not self.tty:
            return
        filled = self.width * done // max(total, 1)
        line = f"profile {name:<20} [{'#' * filled}{'.' * (self.width - filled)}] {stage:<9} {done}/{total}".ljust(self._last)
        self._last = 0 if stage == "done" else len(line)
        self.stream.write(("\r" + line if self.tty else line) + ("\n" if stage == "done" else ""))
        self.stream.flush()


def _profile(args: argparse.Namespace) -> int:
    from batchplane.core.config import load_job
    from batchplane.core.errors import SourceError
    from batchplane.loader.profile import ProfileSettings, profile_job

    try:
        job = load_job(args.config)
        result = profile_job(job, settings=ProfileSettings(samples=args.samples), progress=_ProgressLine())
    except ConfigError as exc:
        print(f"batchplane profile: bad configuration {args.config}: {exc}", file=sys.stderr)
        return 2
    except SourceError as exc:
        print(f"batchplane profile: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=1, default=str)
    try:
        args.out.write_text(text + "\n")
    except OSError as exc:
        print(f"batchplane profile: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, default=str))
        return 0
    print(
        f"job {result['job']!r}: {len(result['sources'])} sources profiled on {result['samples']} rows each "
        f"(state memory by {result['state_method']}); written to {args.out}"
    )
    print(f"  {'source':<20}{'files':>6}{'rows':>10}{'state':>12}{'read/sample':>13}{'transform':>11}{'p95':>11}{'bytes':>10}{'tokens':>8}")
    for s in result["sources"]:
        print(
            f"  {s['name']:<20}{len(s['files']):>6}{s['rows']:>10}{s['state_bytes'] / 2**20:>9.2f}MiB"
            f"{s['read_s_per_sample'] * 1e6:>11.1f}us{s['transform_s_per_sample'] * 1e6:>9.1f}us{s['transform_p95_s'] * 1e6:>9.1f}us"
            f"{s['bytes_per_sample']:>10.0f}{s['tokens_per_sample']:>8.1f}"
        )
    return 0


def _partition(args: argparse.Namespace) -> int:
    import yaml

    from batchplane.operator import partition as part

    flags = {
        "pod_memory_bytes": "--pod-memory",
        "pod_cpus": "--pod-cpus",
        "samples_per_s": "--samples-per-s",
        "actor_base_bytes": "--actor-memory",
        "buffer_bytes": "--buffer-memory",
        "worker_base_bytes": "--worker-memory",
        "memory_headroom": "--memory-headroom",
    }
    try:
        try:
            data = json.loads(args.profiles.read_text())
        except OSError as exc:
            raise ConfigError(str(args.profiles), "cannot read profiles file", exc.strerror) from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(str(args.profiles), "not a JSON file of profiles (batchplane profile writes one)", str(exc)) from exc
        profiles = part.profiles_from_mapping(data)
        settings = part.PartitionSettings(
            pod_memory_bytes=part.parse_memory(args.pod_memory, field="--pod-memory"),
            pod_cpus=part.parse_cpu(args.pod_cpus, field="--pod-cpus"),
            max_workers_per_actor=args.max_workers_per_actor,
            max_actors_per_source=args.max_actors_per_source,
            cost_levels=args.cost_levels,
            samples_per_s=args.samples_per_s,
            actor_base_bytes=part.parse_memory(args.actor_memory, field="--actor-memory", allow_zero=True),
            buffer_bytes=part.parse_memory(args.buffer_memory, field="--buffer-memory", allow_zero=True),
            worker_base_bytes=part.parse_memory(args.worker_memory, field="--worker-memory", allow_zero=True),
            memory_headroom=args.memory_headroom,
            state_per=args.state_per,
            one_source_per_group=args.one_source_per_group,
        )
        weights = _read_weights(args.weights) if args.weights is not None else None
        result = part.partition(profiles.sources, settings, weights=weights)
    except ConfigError as exc:
        field = flags.get(exc.field, exc.field)
        print(f"batchplane partition: {field}: {exc.problem}, got {exc.value!r}", file=sys.stderr)
        return 2
    except part.PartitionError as exc:
        print(f"batchplane partition: {exc}", file=sys.stderr)
        return 2
    if args.format == "values":
        document = part.to_values(result)
    else:
        document = part.to_dataplane(result, name=args.name or profiles.job, profiles=profiles)
    header = (
        f"# Written by `batchplane partition` from {args.profiles.name} (job {profiles.job!r}): "
        f"{len(result.groups)} loader groups, {result.actors} actors, {result.workers} workers; "
        f"pod {args.pod_memory} / {args.pod_cpus} CPUs.\n"
    )
    text = header + yaml.safe_dump(document, sort_keys=False)
    print(part.describe(result), file=sys.stderr)
    if args.out is None:
        print(text, end="")
        return 0
    try:
        args.out.write_text(text)
    except OSError as exc:
        print(f"batchplane partition: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def _read_weights(path: pathlib.Path) -> dict[str, float]:
    """Mixture weights from a job file (its mixture.weights, 1 for a source it does not name)
    or a YAML file holding `mixture: {weights: ...}`, `weights: ...` or `source: weight` pairs.

    Raises:
        ConfigError: unreadable, not YAML, or not a mapping of names to numbers.
    """
    import yaml

    from batchplane.core.config import load_job

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(str(path), "cannot read weights file", exc.strerror) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "not valid YAML", str(exc).replace("\n", " ")) from exc
    if isinstance(data, dict) and "sources" in data:
        job = load_job(path)
        return dict(zip(job.source_names, job.weights))
    if isinstance(data, dict) and isinstance(data.get("mixture"), dict):
        data = data["mixture"].get("weights", {})
    elif isinstance(data, dict) and "weights" in data:
        data = data["weights"]
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in data.items()
    ):
        raise ConfigError(str(path), "must map source names to weights (or be a job file)", data)
    return {k: float(v) for k, v in data.items()}


if __name__ == "__main__":
    sys.exit(main())
