"""The Kubernetes planner's API calls carry the service-account token as it is *now*: bound
tokens are rotated in place by the kubelet, so one read at start would expire."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from kvrelay.deploy.planner.k8s import DeploymentScaler


def test_each_call_reads_the_rotated_token(tmp_path) -> None:
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "token").write_text("first\n")
        scaler = DeploymentScaler("ns", {"prefill": "p", "decode": "d"},
                                  api=f"http://127.0.0.1:{server.server_port}",
                                  sa_dir=str(tmp_path))
        scaler.read()
        (tmp_path / "token").write_text("rotated\n")  # the kubelet's refresh
        scaler.read()
    finally:
        server.shutdown()
    assert seen == ["Bearer first"] * 2 + ["Bearer rotated"] * 2
