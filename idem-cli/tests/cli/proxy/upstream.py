"""The upstream behind `idem proxy` in the tests: stdlib only.

    python3 upstream.py PORT      (0: any free port)

Prints `upstream: listening on PORT` once it accepts connections. It counts
every request per (method, path, Idempotency-Key) and keeps the headers each
one arrived with; the tests read them directly (not through the proxy) at
GET /_control/seen?key=K (or ?path=P for requests without a key).

Endpoints (any method unless said):
  /pay[?delay_ms=N]      JSON: the count so far for its (method, path, key),
                         the body's sha256, the fence and attempt headers
  /echo                  the same JSON plus every header received; answers
                         with hop-by-hop headers of its own
  /cookie                as /pay, with two Set-Cookie headers and X-Custom
  /status/N              answers status N with a small JSON body
  /stream?bytes=N        a chunked body of N bytes, byte i = i % 251
  /block?id=X            answers only once POST /_control/release?id=X came
  /drop                  reads the request, closes the connection unanswered
  anything else          as /pay
"""

import hashlib
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

LOCK = threading.Lock()
COUNTS = {}  # (method, path, key) -> requests seen
SEEN = []  # every request but the control ones, in arrival order
RELEASED = {}  # block id -> threading.Event


def released(block_id):
    with LOCK:
        return RELEASED.setdefault(block_id, threading.Event())


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.handle_any()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def read_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return body
                body += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self, status, doc, extra_headers=()):
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra_headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def handle_any(self):
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        body = self.read_body()
        if url.path.startswith("/_control/"):
            return self.control(url.path, query)
        key = self.headers.get("Idempotency-Key", "")
        headers = {}
        for name, value in self.headers.items():
            headers.setdefault(name.lower(), []).append(value)
        with LOCK:
            count = COUNTS.get((self.command, url.path, key), 0) + 1
            COUNTS[(self.command, url.path, key)] = count
            SEEN.append(
                {
                    "method": self.command,
                    "path": url.path,
                    "query": url.query,
                    "key": key,
                    "headers": headers,
                    "body_sha256": hashlib.sha256(body).hexdigest(),
                    "at": time.time(),
                }
            )
        doc = {
            "key": key,
            "path": url.path,
            "count": count,
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "fence": self.headers.get("idem-fence"),
            "attempt": self.headers.get("idem-attempt"),
        }
        try:
            self.route(url.path, query, doc, headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the proxy went away

    def route(self, path, query, doc, headers):
        if path == "/echo":
            doc["headers"] = headers
            hops = [
                ("Connection", "x-secret-hop"),
                ("X-Secret-Hop", "from the upstream"),
                ("Keep-Alive", "timeout=99"),
                ("Proxy-Connection", "keep-alive"),
                ("X-Upstream-Kept", "yes"),
            ]
            return self.answer(200, doc, hops)
        if path == "/cookie":
            cookies = [
                ("Set-Cookie", "session=abc; HttpOnly"),
                ("Set-Cookie", "theme=dark"),
                ("X-Custom", "kept"),
            ]
            return self.answer(201, doc, cookies)
        if path.startswith("/status/"):
            return self.answer(int(path.split("/")[2]), doc)
        if path == "/stream":
            return self.stream(int(query.get("bytes", "0")))
        if path == "/block":
            if not released(query.get("id", "")).wait(120):
                doc["error"] = "never released"
            return self.answer(200, doc)
        if path == "/drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        time.sleep(int(query.get("delay_ms", "0")) / 1000)
        return self.answer(201, doc)

    def stream(self, total):
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        pattern = bytes(i % 251 for i in range(251)) * 300
        sent = 0
        while sent < total:
            start = sent % 251
            n = min(65536, total - sent)
            chunk = (pattern[start:] + pattern)[:n]
            self.wfile.write(b"%x\r\n%s\r\n" % (n, chunk))
            sent += n
        self.wfile.write(b"0\r\n\r\n")

    def control(self, path, query):
        if path == "/_control/release":
            released(query.get("id", "")).set()
            return self.answer(200, {"released": query.get("id", "")})
        if path == "/_control/seen":
            with LOCK:
                if "key" in query:
                    found = [r for r in SEEN if r["key"] == query["key"]]
                else:
                    found = [r for r in SEEN if r["path"] == query.get("path")]
            return self.answer(200, {"count": len(found), "requests": found})
        return self.answer(404, {"error": "unknown control path"})


def main():
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.daemon_threads = True
    print(f"upstream: listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
