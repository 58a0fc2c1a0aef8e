"""Telemetry helpers at the bottom of the import graph, importing nothing of the package: the
memory gauges, the batch histogram, tracebacks without messages and the redaction of keys in
relay URLs and relay text. Any layer may import them."""
