"""A fork server for node processes: imports peerloom once, then forks one `peerloom node` process per request.

A node started this way is a real OS process (its own pid, its own file descriptors, its own signals; killed
with a real SIGKILL) running the real command line (`peerloom.cli.main(["node", ...])`, exit status included),
that skips the seconds of Python imports a fresh interpreter pays. `tests.node_cluster.Node.start` forks
every node from one such server per test session (`shared()`), so a crash test can kill and restart a node
many times, and every fleet test starts its nodes in a fraction of a second.

Protocol on stdin/stdout, one line each (the server replies to requests in order; `exit` lines come whenever
a child ends)::

    start {"argv": [...], "env": {...}, "cwd": "...", "log": "...", "err": "..."}   -> started <pid>
                                                                        exit <pid> <status>   (Popen's returncode)
    quit  (or end of input: SIGTERM every running child, SIGKILL what is left after 15 s, exit)

(``err`` is optional: stderr goes to that file instead of ``log``.) `run_cli` runs a one-shot command such as
`peerloom verify` the same way, as `subprocess.run(..., capture_output=True, text=True)` would.

The client side is `Zygote` (a `subprocess.Popen`-like `ForkedProcess` per child); it imports nothing heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository: `python -m tests.node_zygote` runs from here

# --- the client (the test process) ----------------------------------------------------------------------


class ZygoteError(RuntimeError):
    pass


class ForkedProcess:
    """The parts of `subprocess.Popen` the tests use, for a child of the fork server."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self._zygote._exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._zygote._changed:
            if not self._zygote._changed.wait_for(
                    lambda: self.pid in self._zygote._exits or self._zygote._gone, timeout):
                # the ignore: timeout is a float here: wait_for returned False, so it timed out
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        if self.pid not in self._zygote._exits:
            raise ZygoteError("the fork server ended before its child")
        return self._zygote._exits[self.pid]

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass  # it ended; the server reports its status

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A running fork server and the children it reported."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "tests.node_zygote"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._gone = False
        self._changed = threading.Condition()
        self._requests = threading.Lock()
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            kind, _, rest = line.strip().partition(" ")
            with self._changed:
                if kind == "started":
                    self._started.append(int(rest))
                elif kind == "exit":
                    pid, status = rest.split()
                    self._exits[int(pid)] = int(status)
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def start(self, argv: list[str], *, log: Path, env: dict[str, str] | None = None,
              cwd: str | None = None, timeout_s: float = 120.0, err: Path | None = None) -> ForkedProcess:
        """Fork `peerloom <argv>` with stdout and stderr appended to `log` (stderr to `err` where given), the
        environment `env` (default: this process's) and the working directory `cwd` (default: this
        process's)."""
        request = {"argv": argv, "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd(),
                   "log": str(log), **({"err": str(err)} if err is not None else {})}
        with self._requests:
            assert self.process.stdin is not None
            with self._changed:
                if self._gone:
                    raise ZygoteError("the fork server has ended")
                self.process.stdin.write("start " + json.dumps(request) + "\n")
                self.process.stdin.flush()
                if not self._changed.wait_for(lambda: self._started or self._gone, timeout_s):
                    raise ZygoteError("the fork server did not answer")
                if not self._started:
                    raise ZygoteError("the fork server has ended")
                pid = self._started.pop(0)
        return ForkedProcess(self, pid, ["peerloom", *argv])

    def close(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_shared: dict[tuple[tuple[str, str], ...], Zygote] = {}
_shared_lock = threading.Lock()


def shared(**env: str) -> Zygote:
    """The test session's fork server for `env` (variables its interpreter starts with, on top of this
    process's environment and PYTHONHASHSEED=0 like every node), started on first use. Start-up variables
    matter where a module reads them once at import (OMP_NUM_THREADS for OpenBLAS); PEERLOOM_ZYGOTE_PRELOAD
    names modules to import before forking (``torch``). Each child gets the environment of its `start`."""
    key = tuple(sorted(env.items()))
    with _shared_lock:
        zygote = _shared.get(key)
        if zygote is None or zygote._gone or zygote.process.poll() is not None:
            zygote = _shared[key] = Zygote(env={**os.environ, "PYTHONHASHSEED": "0", **env})
            atexit.register(zygote.close)
        return zygote


@contextlib.contextmanager
def forked_popen(**env: str) -> Iterator[None]:
    """Inside the block, `subprocess.Popen(["python", "-m", "peerloom", "node", ...], stdout=<a file>, ...)` (what
    `peerloom.experiment.Fleet.start` runs for each node) forks the node from `shared(**env)` instead, with
    the environment and the log file it was given; any other Popen runs as usual."""
    real = subprocess.Popen

    def popen(args: Any, *rest: Any, **kwargs: Any) -> Any:
        stdout = kwargs.get("stdout")
        if (not rest and isinstance(args, list) and args[:4] == [sys.executable, "-m", "peerloom", "node"]
                and hasattr(stdout, "name") and kwargs.get("stderr") == subprocess.STDOUT
                and set(kwargs) <= {"stdout", "stderr", "env", "cwd"}):
            return shared(**env).start(args[3:], log=Path(stdout.name), env=kwargs.get("env"), cwd=kwargs.get("cwd"))
        return real(args, *rest, **kwargs)

    subprocess.Popen = popen  # type: ignore[misc]  # patches the class for this process
    try:
        yield
    finally:
        subprocess.Popen = real  # type: ignore[misc]  # restores it


def cli_with_forked_nodes(argv: list[str], *, preload: str = "") -> None:
    """Run `peerloom <argv>` (`peerloom.cli.main`, exit status included) in this process, with every node
    process it starts as `peerloom.experiment.Fleet.start` does forked from a fork server instead
    (`forked_popen`, under the start-up environment `Fleet.start` gives its nodes, and `preload` imported
    before forking: ``"torch"`` for torch workloads). The command itself runs as a user runs it; its nodes are
    real processes on the real command line, without an interpreter start-up and a torch import each. As a
    process of its own, from the repository root: ``python -c "import sys; from tests.node_zygote import
    cli_with_forked_nodes as run; run(sys.argv[1:])" ARGS``."""
    from peerloom.cli import main

    with forked_popen(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                      PEERLOOM_ZYGOTE_PRELOAD=preload):
        main(argv)


def run_cli(args: list[str], *, cwd: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """What `subprocess.run([sys.executable, "-m", "peerloom", *args], capture_output=True, text=True, cwd=cwd,
    env=env, timeout=timeout)` returns, with the command forked from the session's fork server (`shared()`):
    a real process running `peerloom.cli.main(args)` with its own stdout, stderr and exit status, without the
    second or more of imports a fresh interpreter pays. Not for a test of what a fresh interpreter imports."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="peerloom-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        process = shared().start(list(map(str, args)), log=out, err=err, env=env,
                                 cwd=None if cwd is None else str(cwd))
        try:
            status = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        return subprocess.CompletedProcess([sys.executable, "-m", "peerloom", *map(str, args)], status,
                                           out.read_text() if out.exists() else "",
                                           err.read_text() if err.exists() else "")


# --- the server ------------------------------------------------------------------------------------------


def _child(request: dict[str, Any], wake: tuple[int, int]) -> None:
    """In the forked child: become `peerloom <argv>` as a fresh interpreter would run it; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in wake:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        if request.get("err"):
            err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(err, 2)
            os.close(err)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]  # a TextIOWrapper here
            sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]  # as above
        # sys.path as `python -m` builds it: the working directory first, then PYTHONPATH's entries
        sys.path[0] = os.getcwd()
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra
        from peerloom import cli

        sys.argv = [str(Path(cli.__file__).with_name("__main__.py")), *request["argv"]]
        try:
            cli.main(request["argv"])
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # what the interpreter does with an uncaught exception
            import traceback

            traceback.print_exc()
            code = 1
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at exit
        except Exception:
            pass
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _say(line: str) -> None:
    try:
        print(line, flush=True)
    except (BrokenPipeError, OSError):
        pass  # the client is gone; the children are stopped at end of input


def main() -> None:
    from peerloom import cli  # noqa: F401  (imported once, before any fork)
    from peerloom.node import run_node  # noqa: F401
    from tests.node_cluster import numpy_digits

    numpy_digits(0, 1)  # warm the workload imports and the digits split (cached, or computed) before forking
    for module in filter(None, os.environ.get("PEERLOOM_ZYGOTE_PRELOAD", "").split(",")):
        importlib.import_module(module)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stdin = sys.stdin.fileno()
    children: set[int] = set()
    pending = b""
    closing = False

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")

    while not closing:
        ready, _, _ = select.select([stdin, wake_r], [], [])
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            reap()
        if stdin not in ready:
            continue
        data = os.read(stdin, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            command, _, arg = line.decode().strip().partition(" ")
            if command == "start":
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(arg), (wake_r, wake_w))
                children.add(pid)
                _say(f"started {pid}")
            elif command == "quit":
                closing = True
                break
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 15.0
    while children and time.monotonic() < deadline:
        reap()
        time.sleep(0.05)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while children:
        pid, status = os.waitpid(-1, 0)
        children.discard(pid)
        _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    main()
