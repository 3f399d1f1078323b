"""A metadata service on 127.0.0.1 that speaks AWS IMDSv2, GCP's metadata server and Azure's
Scheduled Events the way each does (docs/cloud.md has the sources), answering per node: the
agent names its node in its User-Agent (`ckptsup/VERSION (node NAME)`), as node/cloud_notice.py
sends it. Used by tests/test_cloud_notice_unit.py and tests/test_cloud_notice_slurm.py."""

from __future__ import annotations

import re
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

NODE = re.compile(r"\(node ([^)]+)\)")


class MetadataServer:
    """State the tests set; `requests` records (method path, headers: lower-case names) of every request."""

    def __init__(self) -> None:
        self.aws_token_status = 200
        self.aws_tokens: set[str] = set()
        self.aws_action: dict[str, Any] = {}      # node -> body (200) or (status, body); absent: 404
        self.gcp_preempted: set[str] = set()      # nodes whose preempted is TRUE
        self.gcp_body: str | None = None          # instead of TRUE/FALSE
        self.azure_names: dict[str, str] = {}     # node -> the VM's name (compute/name)
        self.azure_doc: str = '{"DocumentIncarnation": 1, "Events": []}'
        self.delay_s = 0.0
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def do_PUT(self) -> None:
                server.serve(self, "PUT")

            def do_GET(self) -> None:
                server.serve(self, "GET")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "MetadataServer":
        self.thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def count(self, prefix: str) -> int:
        with self.lock:
            return sum(1 for line, _ in self.requests if line.startswith(prefix))

    def headers(self, prefix: str) -> list[dict[str, str]]:
        with self.lock:
            return [h for line, h in self.requests if line.startswith(prefix)]

    # ---- the protocols ----------------------------------------------------------------------------
    def serve(self, h: BaseHTTPRequestHandler, method: str) -> None:
        headers = {k.lower(): v for k, v in h.headers.items()}   # names are case-insensitive
        path = urlsplit(h.path).path
        with self.lock:
            self.requests.append((f"{method} {path}", headers))
        if self.delay_s:
            time.sleep(self.delay_s)
        found = NODE.search(headers.get("user-agent", ""))
        node = found.group(1) if found else ""
        status, body, kind = self.answer(method, path, h.path, headers, node)
        data = body.encode()
        try:
            h.send_response(status)
            h.send_header("Content-Type", kind)
            h.send_header("Content-Length", str(len(data)))
            if path.startswith("/computeMetadata/"):
                h.send_header("Metadata-Flavor", "Google")
            h.end_headers()
            h.wfile.write(data)
        except OSError:
            pass   # the client gave up (a timeout test)

    def answer(self, method: str, path: str, raw: str, headers: dict[str, str], node: str) -> tuple[int, str, str]:
        text = "text/plain"
        if path == "/latest/api/token":   # IMDSv2: PUT with a TTL of 1..21600 s
            if method != "PUT":
                return 405, "", text
            ttl = headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, "", text
            if self.aws_token_status != 200:
                return self.aws_token_status, "", text
            token = secrets.token_urlsafe(24)
            with self.lock:
                self.aws_tokens.add(token)
            return 200, token, text
        if path.startswith("/latest/meta-data/"):
            with self.lock:
                known = headers.get("x-aws-ec2-metadata-token") in self.aws_tokens
            if not known:   # IMDSv2 required: no or an expired token is 401
                return 401, "", text
            if path == "/latest/meta-data/spot/instance-action":
                action = self.aws_action.get(node)
                if action is None:
                    return 404, "", "text/html"
                if isinstance(action, tuple):
                    return action[0], action[1], text
                return 200, action, text
            return 404, "", "text/html"
        if path.startswith("/computeMetadata/"):   # GCP: the header, or 403
            if headers.get("metadata-flavor") != "Google":
                return 403, "Missing Metadata-Flavor:Google header.", "text/html"
            if path == "/computeMetadata/v1/instance/preempted":
                if self.gcp_body is not None:
                    return 200, self.gcp_body, "application/text"
                return 200, "TRUE" if node in self.gcp_preempted else "FALSE", "application/text"
            return 404, "", "text/html"
        if path.startswith("/metadata/"):   # Azure IMDS: Metadata: true, or 400
            if headers.get("metadata") != "true":
                return 400, '{"error": "Bad request. Required metadata header not specified"}', "application/json"
            if "api-version=" not in raw:
                return 400, '{"error": "Bad request. api-version was not specified"}', "application/json"
            if path == "/metadata/instance/compute/name":
                name = self.azure_names.get(node)
                return (200, name, text) if name else (404, "", text)
            if path == "/metadata/scheduledevents":
                return 200, self.azure_doc, "application/json"
            return 404, "", text
        return 404, "", text
