"""Relay-health analytics: PySpark jobs over the bridge's observation log.

The jobs answer four operator questions: does each relay deliver a probe DM right now
(``canary``), which relays are slow (``relay_latency``), which relays silently miss the DMs
sent to them (``dropped_events``) and how many wakeups the push providers accept
(``delivery``). ``analytics.run.run_all`` runs them in one SparkSession and writes the CSV,
Parquet and HTML reports; each job module also runs on its own under ``spark-submit``.

Installed with the bridge but usable only with the ``analytics`` extra (PySpark, matplotlib);
only ``analytics.duration`` may be imported without it.
"""
