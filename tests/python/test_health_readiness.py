"""Readiness as balancers and orchestrators read it: a gateway answers /health with 503
"loading" (and requests with 503) while its workers start, 200 "ok" once serving, and after
SIGTERM 503 "draining" (gRPC health NOT_SERVING) for --drain-grace-secs while it still serves
requests, then closes its listeners and exits cleanly."""

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import MODEL, gateway_binary


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, body=None, timeout=10):
    """(status, JSON body) of a GET (or a POST of `body`)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def grpc_health(addr):
    with grpc.insecure_channel(addr) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_health_says_loading_then_ok_then_draining_before_the_listeners_close():
    http_port, grpc_port = free_port(), free_port()
    base, grpc_addr = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    proc = subprocess.Popen(
        [str(gateway_binary()), "serve", "--model", MODEL, "--instance", f"health{os.getpid()}",
         "--listen", grpc_addr, "--http-listen", f"127.0.0.1:{http_port}", "--kv-bytes", "64M",
         "--cpu-workers", "1", "--drain-grace-secs", "3", "--node-name", "probe-me"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        # While the workers start, the HTTP listener is already up and says so.
        seen, deadline = [], time.time() + 120
        while time.time() < deadline:
            try:
                status, body = get(f"{base}/health", timeout=2)
            except OSError:
                time.sleep(0.01)
                continue
            seen.append((status, body["status"]))
            if status == 200:
                break
            if body["status"] == "loading" and len(seen) == 1:
                code, err = get(f"{base}/v1/completions", {"prompt": "Hi", "max_tokens": 2})
                assert code == 503 and "loading" in err["error"]["message"], err
            time.sleep(0.01)
        assert seen and seen[-1] == (200, "ok"), seen
        assert (503, "loading") in seen, f"the listener answered before the workers were up: {seen}"
        assert body["node"] == "probe-me"
        assert grpc_health(grpc_addr) == health_pb2.HealthCheckResponse.SERVING

        # SIGTERM: draining at once, still serving for the grace period, then closed.
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert get(f"{base}/health") == (503, {"status": "draining", "detail": "shutting down: finishing the requests in flight", "node": "probe-me"})
        assert grpc_health(grpc_addr) == health_pb2.HealthCheckResponse.NOT_SERVING
        code, done = get(f"{base}/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert code == 200 and done["usage"]["completion_tokens"] == 2, done
        assert proc.wait(timeout=60) == 0
        try:
            get(f"{base}/health", timeout=2)
            raise AssertionError("the HTTP listener is still open after the gateway exited")
        except OSError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
