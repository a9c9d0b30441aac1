"""Scripts run as a user runs them, in a fresh interpreter (the benchmark tests).

Each script starts in a session of its own, so stopping it (a timeout, a test's teardown) stops
every process it started too: the ``aiayn`` commands a benchmark runs, their data workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def start(argv: list[str], *, env: dict[str, str] | None = None,
          cwd=None) -> subprocess.Popen:
    """``python3 ARGV...`` with its stdout and stderr captured as text (``finish``, ``stop``)."""
    return subprocess.Popen([sys.executable, *map(str, argv)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    """Kill a ``start``ed script and every process in its session; reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the script and everything it started have ended
        pass
    process.communicate()


def finish(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait up to ``timeout`` seconds for a ``start``ed script. Past it, the script and what it
    started are killed and ``subprocess.TimeoutExpired`` is raised."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
