"""What several test files share, so that no test module imports another.

* ``checkpoints``: the tiny checkpoint families and the default model's path.
* ``procs``: worker, scheduler and gateway processes (tools.processes), started
  side by side (``running``); a free port.
* ``worker_client``: worker.v1 steps described per sequence, laid out as columns and read
  back; replies' sampled columns read per sequence, logits decoded.
* ``worker_under_test``: a worker process beside the transformers model it serves.
* ``cluster``: transformers' model and greedy output as the reference; waiting for a
  scheduler to go idle.
* ``recorder``: greedy streams in background threads, and waiting for conditions.
* ``fake_worker``: a pure-Python stand-in for worker_svc over a simulated paged cache.
* ``fake_worker_server``: that fake served over worker.v1 gRPC (no torch), its steps
  slowed down on demand.
* ``aio_generate``: a serving.v1 Generate from asyncio tests, read to its end.
* ``stub_dns``: a resolver answering what the test sets (DNS discovery without DNS).
* ``fake_scheduler``: a serving.v1 scheduler faked in process, gateways in front of it, the
  OpenAI error and event-stream checks.
* ``planner_sim``: requests, a Planner stepped against the fake worker, the reference output.
* ``host_copies``: the sampling path's device-to-host copies, counted.
* ``worker_steps``: worker steps written row by row (the worker keeps them as columns),
  sampling rows as columns, a step's samples read back row by row.
* ``import_graph``: a package's import graph read from its source (test_layers; also a script).

Nothing here imports torch at module level unless it needs it: the scheduler's
no-torch test loads ``fake_worker_server`` in an interpreter that must stay torch-free.
"""
