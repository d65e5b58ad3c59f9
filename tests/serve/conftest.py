"""`nq serve` as a real process on 127.0.0.1 (any free port) over the tiny model, NumPy backend.

`server` is started once for the whole folder (tests that need other flags start their own
with the `start` fixture); its log goes to a file, which tests may read.  Teardown sends SIGTERM
and expects a clean exit.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]


class Server:
    def __init__(self, proc, url, log: Path):
        self.proc, self.url, self.log_path = proc, url, log

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGTERM, timeout=15) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_server(model, log: Path, *flags) -> Server:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("NQ_API_KEY", None)
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "nq", "serve", "-m", str(model),
                                 "--backend", "numpy", "--port", "0", *flags],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.time() + 60
    while time.time() < deadline:
        m = re.search(r"serving \S+ at (http://\S+)", log.read_text())
        if m:
            break
        if proc.poll() is not None:
            raise RuntimeError(f"nq serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError(f"nq serve did not start:\n{log.read_text()}")
    url = m.group(1)
    httpx.get(url + "/health", timeout=10).raise_for_status()
    return Server(proc, url, log)


@pytest.fixture(scope="session")
def start():
    """start(model, log_path, *flags) -> Server: another server, for other flags."""
    return start_server


@pytest.fixture(scope="session")
def server(tiny_nanoqwen, tmp_path_factory):
    s = start_server(tiny_nanoqwen, tmp_path_factory.mktemp("serve") / "server.log",
                     "-c", "4096", "--queue", "8", "--cache-slots", "2")
    yield s
    assert s.stop() == 0, s.log()
    assert "server stopped" in s.log()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def oai(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def metric(http):
    """metric(name): one unlabelled sample from /metrics."""
    def read(name: str) -> float:
        text = http.get("/metrics").text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics:\n{text}"
        return float(m.group(1))
    return read
