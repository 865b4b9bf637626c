"""An HTTP proxy in front of an S3 endpoint (moto's server, `s3_server.S3Server`) that can drop
request headers, for the tests: dropping `If-None-Match` makes a real object store that ignores
conditional writes (every PUT overwrites), as some S3-compatible stores do. It also keeps the
headers of every request it forwarded, so a test can see what a client sent. `refuse_reads(n)`
makes it answer the next n ranged GETs (reads of an object's bytes) with 503 SlowDown, as a
throttling or failing store does, without forwarding them.

    with S3Proxy(s3.endpoint, drop=("If-None-Match",)) as proxy:
        environment["AWS_ENDPOINT_URL"] = proxy.endpoint

It runs in the test process (a thread per connection) on 127.0.0.1, port 0.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse
from collections.abc import Iterable

#: Hop-by-hop headers: about one connection, never forwarded.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class S3Proxy:
    """Forwards every request to `upstream`, without the headers named in `drop`.

    Args:
        upstream: The S3 endpoint, e.g. "http://127.0.0.1:5000".
        drop: Request header names to remove (case-insensitive).
    """

    def __init__(self, upstream: str, *, drop: Iterable[str] = ()) -> None:
        target = urllib.parse.urlsplit(upstream)
        self.drop = {name.lower() for name in drop}
        #: (method, path, headers as received) of every request, in arrival order.
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        #: How many requests had a dropped header.
        self.dropped = 0
        #: Ranged GETs still to answer with 503 (see `refuse_reads`), and how many were.
        self._to_refuse = 0
        self.refused = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
                pass

            def _forward(self) -> None:
                received = {k: v for k, v in self.headers.items()}
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, received))
                    if any(k.lower() in proxy.drop for k in received):
                        proxy.dropped += 1
                    refuse = self.command == "GET" and "range" in {k.lower() for k in received} and proxy._to_refuse > 0
                    if refuse:
                        proxy._to_refuse -= 1
                        proxy.refused += 1
                body = self._body()
                if refuse:
                    error = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>'
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                headers = {k: v for k, v in received.items() if k.lower() not in proxy.drop | _HOP_BY_HOP}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                connection = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    connection.request(self.command, self.path, body=body, headers=headers)
                    answer = connection.getresponse()
                    data = answer.read()
                    self.send_response(answer.status, answer.reason)
                    for name, value in answer.getheaders():
                        if name.lower() not in _HOP_BY_HOP | {"content-length"}:
                            self.send_header(name, value)
                    length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length if length is not None else str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    connection.close()

            def _body(self) -> bytes | None:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = self.headers.get("Content-Length")
                return self.rfile.read(int(length)) if length is not None else None

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)
        self._thread.start()

    def refuse_reads(self, count: int) -> None:
        """Answers the next `count` ranged GETs with 503 SlowDown instead of forwarding them."""
        with self._lock:
            self._to_refuse = count

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> S3Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
