"""Observability: Prometheus metrics fed by engine hooks and read at scrape time,
the /metrics endpoint, the Stats RPC's figures and the live view. It reads the
engine; only the composition root imports it."""
