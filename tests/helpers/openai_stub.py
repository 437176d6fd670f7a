"""An OpenAI-compatible HTTP server that streams a fixed pace of tokens, for the bench
harness's tests (bench/harness/openai_servers.py): /v1/models, and /v1/completions
streamed as SSE, the first token after FIRST_S, each next one GAP_S later, then a usage
chunk. `python -m tests.helpers.openai_stub PORT`."""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "stub-model"
FIRST_S, GAP_S = 0.15, 0.03


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _json(self, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "stub"}]})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = int(request["max_tokens"])
        base = {"id": "c", "object": "text_completion", "created": 0, "model": MODEL}
        if not request.get("stream"):
            choice = {"index": 0, "text": "x" * tokens, "finish_reason": "length", "logprobs": None}
            self._json({**base, "choices": [choice]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        time.sleep(FIRST_S)
        for i in range(tokens):
            if i:
                time.sleep(GAP_S)
            choice = {"index": 0, "text": "x", "finish_reason": None, "logprobs": None}
            self.wfile.write(f"data: {json.dumps({**base, 'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
        self.wfile.write(f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
