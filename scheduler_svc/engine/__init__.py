"""The engine: one step loop per worker (overlapped scheduling), the worker
client (the only worker.v1 proto conversion), routing, handover, adding and
draining workers, output streams, and the domain errors the API layer maps to
status codes."""
