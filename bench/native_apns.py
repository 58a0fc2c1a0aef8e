"""A native (C) stand-in for APNs in throughput benchmarks: nginx answering HTTP/2 over TLS.

The test suite's fake APNs (testkit/fakes/fake_apns.py) is `h2` in Python: it checks what Apple
checks, and at bench rates it costs about two thirds of what a worker spends per wakeup, on
the same 2 cores as the workers. A scaling figure measured against it mostly measures the
fake. nginx answers each POST /3/device/<token> with `200` and the request's `apns-id` echoed
(aioapns matches answers to requests by that header), at a few microseconds per request. It
checks nothing (no provider token, no topic): correctness stays with the tests' fake.

The server counts what it answered: nginx's stub_status `requests` counter, read on a
separate plain-HTTP port, so a run can check the workers' own count of APNs answers against
what the server saw.

Needs Debian's nginx (any flavour with the http_v2, ssl and stub_status modules):
`apt-get install -y nginx-light`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

INSTALL_HINT = "nginx not found: `apt-get install -y nginx-light` (or pass --apns python)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(folder: Path, port: int, status_port: int, cert: Path, key: Path) -> str:
    # one worker process: a C server answering empty 200s needs a small share of one core, and
    # a second process would only take CPU from the workers being measured
    return f"""
worker_processes 1;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    # answers as close to Apple's (`:status` and `apns-id`) as stock nginx allows: no
    # content-type; `server`, `date` and `content-length: 0` stay (HPACK-indexed after the first)
    server_tokens off;
    default_type "";
    # aioapns keeps its connections for the whole run: never close one after N requests
    keepalive_requests 1000000000;
    keepalive_timeout 3600s;
    http2_max_concurrent_streams 1000;
    server {{
        listen 127.0.0.1:{port} ssl http2;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location /3/device/ {{
            add_header apns-id $http_apns_id always;
            return 200;
        }}
    }}
    server {{
        listen 127.0.0.1:{status_port};
        location = /status {{ stub_status; }}
    }}
}}
"""


def children_of(parent: int) -> list[int]:
    """The pids whose parent is `parent` (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


class NativeApns:
    """nginx as a local APNs endpoint on a free loopback port (see the module docstring)."""

    def __init__(self, folder: Path, cert_file: Path, key_file: Path) -> None:
        binary = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None
        )
        if binary is None:
            raise SystemExit(INSTALL_HINT)
        self.folder = folder / "nginx"
        self.folder.mkdir(exist_ok=True)
        self.port, self._status_port = _free_port(), _free_port()
        config = self.folder / "nginx.conf"
        config.write_text(_config(self.folder, self.port, self._status_port, cert_file, key_file))
        self._process = subprocess.Popen(
            [binary, "-c", str(config), "-p", str(self.folder), "-e", str(self.folder / "error.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._polls = 0
        deadline = time.monotonic() + 20
        while True:
            try:
                self.answered()
                break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    log = self.folder / "error.log"
                    raise RuntimeError(
                        "nginx did not start: " + (log.read_text() if log.exists() else "")
                    ) from None
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self._process.pid

    def pids(self) -> list[int]:
        """The master and its worker process (the worker does the answering)."""
        return [self.pid, *children_of(self.pid)]

    def answered(self) -> int:
        """Requests nginx has handled on the APNs port: stub_status counts every request on
        either port, so this handle's own status reads (this one included) are taken off."""
        url = f"http://127.0.0.1:{self._status_port}/status"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        self._polls += 1
        # "Active connections: 1\nserver accepts handled requests\n 5 5 9\n..."
        requests = int(text.splitlines()[2].split()[2])
        return requests - self._polls

    def stop(self) -> None:
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            self._process.wait(10)
