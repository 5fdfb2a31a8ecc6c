"""A judge endpoint for one host's loopback: ``GET /v1/models`` lists one model, and each request is logged.

The two-host Slurm fixture runs one inside each host's network namespace, on the same 127.0.0.1 port, the way a site
runs a judge on every node (``JUDGE_ON_EVERY_NODE=1``). The log line (``models <host>``, one per request, flushed)
shows which host's judge a probe reached. Runs until SIGTERM.

    python tests/host_judge.py --port 8001 --model host-judge
"""

from __future__ import annotations

import argparse
import http.server
import json
import socket
import sys


class _Handler(http.server.BaseHTTPRequestHandler):
    model = "host-judge"

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/v1/models":
            self.send_error(404)
            return
        body = json.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        print(f"models {socket.gethostname()}", flush=True)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the one line per request above is the log."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=_Handler.model)
    args = parser.parse_args(argv)
    _Handler.model = args.model
    with http.server.ThreadingHTTPServer(("127.0.0.1", args.port), _Handler) as server:
        print(f"judge on 127.0.0.1:{args.port} ({socket.gethostname()})", flush=True)
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
