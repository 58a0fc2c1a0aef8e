"""What every job shares: its command line and its run under one SparkSession."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from pyspark.sql import DataFrame

from analytics.duration import DEFAULT_GRACE_MS, parse_duration_ms
from analytics.observations import Observations, load_observations
from analytics.outputs import write_outputs
from analytics.preflight import InputError, check_arguments
from analytics.progress import progress, step
from analytics.session import analytics_session

EXIT_OK = 0
EXIT_USAGE = 2


@dataclass(frozen=True)
class Job:
    """A named computation from the observations to named result tables."""

    name: str
    description: str
    compute: Callable[[Observations], dict[str, DataFrame]]


def parse_iso(value: str) -> datetime:
    """An ISO 8601 date or date-time; without a zone it is UTC, like the log."""
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date-time: {value!r}") from None


def argument_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description.strip().splitlines()[0])
    parser.add_argument(
        "--input", required=True, help="folder (any Hadoop path) of the observation log"
    )
    parser.add_argument("--output", required=True, help="folder (any Hadoop path) for the reports")
    parser.add_argument(
        "--master", default=None, help="Spark master URL (default: spark-submit's, else local[*])"
    )
    parser.add_argument(
        "--since", type=parse_iso, default=None, help="first instant to include (ISO 8601)"
    )
    parser.add_argument(
        "--until", type=parse_iso, default=None, help="first instant to exclude (ISO 8601)"
    )
    parser.add_argument(
        "--grace",
        type=parse_duration_ms,
        default=DEFAULT_GRACE_MS,
        help="how late after its first arrival a relay may deliver an event and not have "
        "missed it (e.g. 90s, 2m; default 2m)",
    )
    return parser


def run_job(
    job: Job, obs: Observations, output: str
) -> tuple[dict[str, DataFrame], dict[str, int]]:
    """Compute one job and write its results; return them (cached, for the report) and their
    row counts."""
    with step(job.name):
        results = job.compute(obs)
        rows = write_outputs(results, output)
    progress(f"{job.name}: " + ", ".join(f"{name} {count} rows" for name, count in rows.items()))
    return results, rows


def job_main(job: Job, argv: Sequence[str] | None) -> int:
    """``main`` of a job module: run that job alone, as under ``spark-submit <job>.py``."""
    args = argument_parser(f"analytics/{job.name}.py", job.description).parse_args(argv)
    try:
        check_arguments(args.input, args.since, args.until)  # before a JVM starts
        with analytics_session(args.master) as spark:
            obs = load_observations(spark, args.input, args.since, args.until, args.grace)
            try:
                results, _ = run_job(job, obs, args.output)
                for df in results.values():
                    df.unpersist()
            finally:
                obs.release()
    except InputError as error:
        print(f"analytics: {error}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
