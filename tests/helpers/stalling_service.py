"""A service that never becomes ready: it starts a child (`sleep SECONDS`, the stand-in
for a kernel build or a tensor-parallel rank) and waits; SIGTERM ends it (the default
action) but not its child. `python -m tests.helpers.stalling_service SECONDS --host H
--port P --ready-file F`, as tools.processes starts a service."""

from __future__ import annotations

import subprocess
import sys
import time

if __name__ == "__main__":
    subprocess.Popen(["sleep", sys.argv[1]])
    time.sleep(3600)
