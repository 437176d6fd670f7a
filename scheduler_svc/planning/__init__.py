"""What runs in each step: request validation (the one home of its rules) and
the budgeted, chunked-prefill step planner with preemption and planning ahead.
Pure Python, no I/O."""
