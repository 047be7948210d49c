"""A demo pod: an HTTP server on ADDR:PORT that answers with its pod name (stdlib only)."""

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME, ADDR, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"{NAME}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


ThreadingHTTPServer((ADDR, PORT), Handler).serve_forever()
