"""Waiting on a real run in the end-to-end tests: a condition, checked while the launcher lives."""
import subprocess
import time


def wait_for(condition, what: str, proc: subprocess.Popen, timeout_s: float = 300, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)
