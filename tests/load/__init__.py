"""Load tests: run by `make load`, not by `make test` (pytest collects only test_*.py).
Each module is a script that starts real services on 127.0.0.1, drives them for a
bounded count and time, prints a table and exits non-zero when an invariant fails."""
