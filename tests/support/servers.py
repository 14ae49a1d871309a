"""Servers started by a test: a free port on 127.0.0.1, a bounded wait until healthy, a bounded stop."""

from __future__ import annotations

from pathlib import Path





def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (servers in tests bind there only)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, log: Path, timeout_s: float = 300) -> None:
    """Poll `url` until it answers 200, for at most timeout_s; fails with the log's tail if the
    server process exits first or the time runs out."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{url} not healthy in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(1)


def stop_server(proc, timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
