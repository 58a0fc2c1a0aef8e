"""Run every analytics job over one window of the observation log, then write the report.

``sigil-push analytics`` calls ``run_all``; ``spark-submit analytics/run.py --input LOG
--output DIR`` does the same on any cluster. All jobs share one SparkSession and one parse of
the log (cached), which is most of the cost.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):
    # spark-submit runs this file as a script: make the `analytics` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.sql import DataFrame

from analytics import canary, delivery, dropped_events, relay_latency, report
from analytics.duration import DEFAULT_GRACE_MS
from analytics.hadoop import HadoopFS
from analytics.jobs import EXIT_OK, EXIT_USAGE, argument_parser, run_job
from analytics.observations import Observations, load_observations
from analytics.preflight import InputError, check_arguments
from analytics.progress import progress, step
from analytics.session import DEFAULT_MASTER, analytics_session

JOBS = (canary.JOB, relay_latency.JOB, dropped_events.JOB, delivery.JOB)
REPORT_NAME = "report.html"


@dataclass(frozen=True)
class RunSummary:
    """What a run read and wrote: for the CLI's closing line and for tests."""

    files_read: int
    records_read: int
    corrupt_lines: int
    records_in_window: int
    rows: dict[str, int] = field(default_factory=dict)


def _iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=UTC)
    spec = "seconds" if ms % 1000 == 0 else "milliseconds"
    return moment.isoformat(timespec=spec).replace("+00:00", "Z")


def _facts(obs: Observations) -> list[tuple[str, str]]:
    return [
        ("window", f"{_iso(obs.start_ms)} to {_iso(obs.end_ms)}"),
        ("log files read", str(obs.files_read)),
        ("lines read", str(obs.records_read)),
        ("corrupt lines", str(obs.corrupt_lines)),
        ("records in window", str(obs.records_in_window)),
        ("grace", f"{obs.grace_ms / 1000:g} s"),
    ]


def run_all(
    input_path: str,
    output_path: str,
    master: str | None = DEFAULT_MASTER,
    since: datetime | None = None,
    until: datetime | None = None,
    grace_ms: int = DEFAULT_GRACE_MS,
) -> RunSummary:
    """Run all jobs on ``[since, until)`` of the log at ``input_path`` into ``output_path``.

    ``grace_ms`` (``--grace``) is how late a relay may deliver an event and not have missed it.

    ``master`` None leaves the choice to spark-submit; an active SparkSession is reused.
    Raises ``InputError`` for an unusable input path or window.
    """
    check_arguments(input_path, since, until)  # before a JVM starts
    rows: dict[str, int] = {}
    with analytics_session(master) as spark:
        with step("reading observations"):
            obs = load_observations(spark, input_path, since, until, grace_ms)
        progress(
            f"{obs.files_read} files, {obs.records_read} lines, {obs.corrupt_lines} corrupt, "
            f"{obs.records_in_window} records in the window"
        )
        results: dict[str, DataFrame] = {}
        try:
            for job in JOBS:
                job_results, job_rows = run_job(job, obs, output_path)
                results.update(job_results)
                rows.update(job_rows)
            with step("report"):
                page = report.render(_facts(obs), results)
                fs = HadoopFS(spark)
                fs.write_bytes(fs.child(output_path, REPORT_NAME), page.encode("utf-8"))
        finally:
            for df in results.values():
                df.unpersist()
            obs.release()
    return RunSummary(
        files_read=obs.files_read,
        records_read=obs.records_read,
        corrupt_lines=obs.corrupt_lines,
        records_in_window=obs.records_in_window,
        rows=rows,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``spark-submit analytics/run.py --input LOG --output DIR [--master URL] [--since ISO]
    [--until ISO]``; returns the exit code (0 success, 2 bad usage)."""
    args = argument_parser("analytics/run.py", __doc__ or "").parse_args(argv)
    try:
        summary = run_all(
            args.input, args.output, args.master, args.since, args.until, args.grace
        )
    except InputError as error:
        print(f"analytics: {error}", file=sys.stderr)
        return EXIT_USAGE
    progress(f"wrote {sum(summary.rows.values())} rows and {REPORT_NAME} to {args.output}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
