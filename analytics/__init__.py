"""Relay-health analytics: PySpark jobs over the bridge's observation log.

The jobs answer three operator questions: which relays are slow (``relay_latency``), which
relays silently miss DMs (``dropped_events``) and how many wakeups the push providers accept
(``delivery``). ``analytics.run.run_all`` runs them in one SparkSession and writes the CSV,
Parquet and HTML reports; each job module also runs on its own under ``spark-submit``.
"""
