"""A step as plain data: its columns (input.py), their validation (validation.py),
its result (output.py) and the errors a step ends with (errors.py). The bottom
room of the worker: it imports nothing else of worker_svc, and every other
room may import it."""
