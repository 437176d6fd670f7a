"""CPU studies for issue 25 (attention kernel, decode step): run on their own, not by
`make bench` (bench/run_all.py lists bench/*.py only)."""
