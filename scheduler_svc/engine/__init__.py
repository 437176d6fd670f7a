"""The engine: one step loop per worker (core.py, overlapped scheduling), the
worker client (the only worker.v1 proto conversion), the fleet of workers
(fleet.py: connect, add, drain), the requests flowing through it (flow.py:
submit, route, hand over), output streams, and the domain errors the API layer
maps to status codes."""
