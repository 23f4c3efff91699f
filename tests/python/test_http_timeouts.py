"""Idle and half-sent HTTP requests do not hold sockets: with `--http-timeout-secs 2`, a
connection that sends nothing, one that stops in the middle of its request head, a keep-alive
connection left idle after a request and one whose body stalls are closed (the last with a 408 in OpenAI's error shape) within a few seconds,
while a normal request on another connection is served."""

import json
import socket
import time
import urllib.request

import pytest

from conftest import Gateway

TIMEOUT = 2


@pytest.fixture(scope="module")
def gw():
    g = Gateway(["--http-timeout-secs", str(TIMEOUT)])
    yield g
    g.stop()


def connect(gw):
    host, port = gw.http.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.settimeout(TIMEOUT * 5)
    return s


def closed_within(s, limit):
    """Seconds until the server closes `s` (reading and discarding any reply), and the reply."""
    start, reply = time.time(), b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            elapsed = time.time() - start
            assert elapsed <= limit, f"closed only after {elapsed:.1f} s"
            return elapsed, reply
        reply += chunk


def test_idle_and_half_sent_requests_are_closed(gw):
    idle = connect(gw)
    half_head = connect(gw)
    half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
    stalled_body = connect(gw)
    stalled_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    # Meanwhile the server answers others.
    models = json.load(urllib.request.urlopen(f"{gw.base_url}/v1/models", timeout=10))
    assert models["data"]
    # A keep-alive connection left idle after a request.
    kept = connect(gw)
    kept.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    for what, s in [("idle", idle), ("half-sent head", half_head), ("idle keep-alive", kept)]:
        elapsed, _ = closed_within(s, TIMEOUT * 3)
        print(f"{what}: closed after {elapsed:.1f} s")
    elapsed, reply = closed_within(stalled_body, TIMEOUT * 3)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(body[body.index(b"{"):body.rindex(b"}") + 1])["error"]["code"] == "request_timeout", reply
    print(f"stalled body: 408 and closed after {elapsed:.1f} s")
