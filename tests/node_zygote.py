"""A fork server for crash tests: imports peerloom once, then forks one `peerloom node` process per command.

A node started this way is a real OS process (its own pid, its own file descriptors, killed with a real
SIGKILL) that skips the seconds of Python imports a fresh interpreter pays, so a crash test can kill and
restart a node many times in a short run. Protocol on stdin/stdout, one line each::

    start <config path>   -> <pid>
    kill                  -> killed <pid>        (SIGKILL the running node and reap it)
    quit
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from peerloom.node import run_node
from tests.node_cluster import numpy_digits

numpy_digits(0, 1)  # warm the dataset and sklearn imports before forking


def main() -> None:
    child: int | None = None
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "start":
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                log = os.open(Path(arg).parent / "node.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                try:
                    run_node(Path(arg))
                finally:
                    os._exit(0)
            child = pid
            print(pid, flush=True)
        elif command == "kill" and child is not None:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            print(f"killed {child}", flush=True)
            child = None
        elif command == "quit":
            if child is not None:
                os.kill(child, signal.SIGTERM)
                os.waitpid(child, 0)
            return


if __name__ == "__main__":
    main()
