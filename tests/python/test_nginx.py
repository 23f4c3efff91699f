"""The reference multi-node deployment, deploy/nginx/duet.conf, tested as written: nginx
(Debian's package) in front of two Duet nodes on 127.0.0.2 and 127.0.0.3, driven through
both APIs. Sessions stay on the node that holds their KV (consistent hashing on the session
key); stateless requests are spread round-robin; a node drained with SIGTERM and stopped
loses no stateless request, and its sessions, now routed to the other node, say where
they were."""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from conftest import ROOT, Gateway

SESSION = "x-session-id"


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_listening(port, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


class Nginx:
    """nginx running deploy/nginx/duet.conf with the nodes' and its own addresses filled in."""

    def __init__(self, nodes):
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(binary):
            raise RuntimeError("nginx is missing: install Debian's nginx-light (scripts/test.sh does)")
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="duet-nginx-"))
        os.chmod(self.dir, 0o755)
        self.http_port, self.grpc_port = free_port(), free_port()
        conf = (ROOT / "deploy" / "nginx" / "duet.conf").read_text()
        swaps = {
            "127.0.0.2:8000": nodes[0].http, "127.0.0.3:8000": nodes[1].http,
            "127.0.0.2:50051": nodes[0].grpc, "127.0.0.3:50051": nodes[1].grpc,
            "127.0.0.1:8080": f"127.0.0.1:{self.http_port}", "127.0.0.1:50050": f"127.0.0.1:{self.grpc_port}",
            "/var/log/nginx/": f"{self.dir}/",
        }
        for old, new in swaps.items():
            assert old in conf, f"deploy/nginx/duet.conf no longer has {old}: update this test with it"
            conf = conf.replace(old, new)
        (self.dir / "duet.conf").write_text(conf)
        temp = " ".join(f"{k}_temp_path {self.dir}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (self.dir / "nginx.conf").write_text(
            f"daemon off;\nworker_processes 1;\npid {self.dir}/nginx.pid;\nerror_log {self.dir}/error.log info;\n"
            f"events {{ worker_connections 512; }}\nhttp {{ {temp}\n include {self.dir}/duet.conf; }}\n")
        check = subprocess.run([binary, "-t", "-p", str(self.dir), "-e", str(self.dir / "error.log"),
                                "-c", str(self.dir / "nginx.conf")], capture_output=True, text=True)
        assert check.returncode == 0, f"nginx -t refused the configuration:\n{check.stderr}"
        self.proc = subprocess.Popen([binary, "-p", str(self.dir), "-e", str(self.dir / "error.log"),
                                      "-c", str(self.dir / "nginx.conf")])
        wait_listening(self.http_port)
        wait_listening(self.grpc_port)

    def upstreams(self, log):
        """(session key, upstream address list) of each request nginx logged in `log`."""
        out = []
        for line in (self.dir / log).read_text().splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            out.append((fields["session"], fields["upstream"]))
        return out

    def stop(self):
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def chat(base, messages, session=None, max_tokens=4):
    """(status, x-session-id header, body) of a chat completion."""
    headers = {"content-type": "application/json", **({SESSION: session} if session else {})}
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers.get(SESSION), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get(SESSION), json.loads(e.read())


def grpc_turn(stubs, addr, text, key=None, session_id=None):
    """(session id, cached tokens, generated text) of one gRPC turn."""
    pb, pb_grpc = stubs
    metadata = [(SESSION, key or session_id)] if (key or session_id) else None
    req = pb.GenerateRequest(text=text, max_tokens=4, sampling=pb.SamplingParams(temperature=0))
    if session_id:
        req.session_id = session_id
    elif key:
        req.create_session = True
    with grpc.insecure_channel(addr) as channel:
        sid, cached, out = "", 0, ""
        for msg in pb_grpc.InferenceStub(channel).Generate(req, metadata=metadata, timeout=120):
            kind = msg.WhichOneof("event")
            if kind == "prompt":
                sid, cached = msg.prompt.session_id, msg.prompt.cached_tokens
            elif kind == "token":
                out += msg.token.text
        return sid, cached, out


@pytest.fixture(scope="module")
def cluster():
    nodes = [Gateway(["--node-name", name, "--gpu-threads", "1", "--drain-grace-secs", "1"], host=host)
             for name, host in (("a", "127.0.0.2"), ("b", "127.0.0.3"))]
    lb = Nginx(nodes)
    yield nodes, lb
    lb.stop()
    for n in nodes:
        if n.proc.poll() is None:
            n.stop()


def test_sessions_stay_on_their_node_and_a_drained_node_loses_no_stateless_request(cluster, stubs):
    (a, b), lb = cluster
    http, grpc_addr = f"http://127.0.0.1:{lb.http_port}", f"127.0.0.1:{lb.grpc_port}"

    # HTTP sessions: the first turn names the session key@node; the next turns, sent with
    # that id, reach the same node and reuse its KV.
    first = [{"role": "user", "content": "Name a colour."}]
    http_sessions = {}
    for i in range(12):
        status, sid, body = chat(http, first, session=f"chat-{i}")
        assert status == 200, body
        assert sid.startswith(f"chat-{i}@"), sid
        http_sessions[sid] = first + [body["choices"][0]["message"]]
    for sid, conversation in http_sessions.items():
        conversation.append({"role": "user", "content": "And another?"})
        status, again, body = chat(http, conversation, session=sid)
        assert status == 200 and again == sid, body
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 10, f"{sid}: the second turn found its KV on its node ({body['usage']})"
    nodes = {sid.split("@")[1] for sid in http_sessions}
    assert nodes == {"a", "b"}, f"12 session keys hash onto both nodes, got {nodes}"

    # gRPC sessions: created with the key in metadata, continued by id.
    grpc_sessions = []
    for i in range(12):
        sid, _, _ = grpc_turn(stubs, grpc_addr, "Once upon a time", key=f"story-{i}")
        assert sid.startswith(f"story-{i}@"), sid
        grpc_sessions.append(sid)
    for sid in grpc_sessions:
        again, cached, _ = grpc_turn(stubs, grpc_addr, " there was", session_id=sid)
        assert again == sid and cached > 3, f"{sid}: continued on its node with its KV ({cached} cached)"

    # Stateless requests go round-robin over both nodes.
    for _ in range(6):
        assert chat(http, first)[0] == 200
    stateless = [up for key, up in lb.upstreams("duet-http.log") if key == "-" or not key]
    assert {a.http, b.http} <= set(stateless), stateless

    # Node a drains and stops while stateless requests keep coming through both APIs.
    errors, done, stop = [], [0], threading.Event()

    def stateless_traffic(kind):
        while not stop.is_set():
            try:
                if kind == "http":
                    status, _, body = chat(http, first, max_tokens=3)
                    if status != 200:
                        errors.append(f"HTTP {status}: {body}")
                else:
                    grpc_turn(stubs, grpc_addr, "Hello")
                done[0] += 1
            except Exception as e:  # noqa: BLE001 - every failure is a lost request
                errors.append(f"{kind}: {e!r}")

    clients = [threading.Thread(target=stateless_traffic, args=(k,)) for k in ("http", "http", "grpc", "grpc")]
    for t in clients:
        t.start()
    time.sleep(2)
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=60) == 0, a.log_tail()
    before = done[0]
    time.sleep(3)
    stop.set()
    for t in clients:
        t.join(timeout=120)
    assert not errors, f"stateless requests lost while node a drained: {errors[:5]}"
    assert done[0] > before + 4, "requests went on through node b"

    # Node a's sessions now reach node b, which says where they were; b's go on.
    for sid, conversation in http_sessions.items():
        status, _, body = chat(http, conversation, session=sid)
        if sid.endswith("@a"):
            assert status == 421 and body["error"]["code"] == "session_elsewhere", body
            assert 'held by node "a"' in body["error"]["message"], body
        else:
            assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 10, body
    for sid in grpc_sessions:
        if sid.endswith("@a"):
            with pytest.raises(grpc.RpcError) as e:
                grpc_turn(stubs, grpc_addr, " and", session_id=sid)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
            assert 'held by node "a"' in e.value.details(), e.value.details()
        else:
            assert grpc_turn(stubs, grpc_addr, " and", session_id=sid)[1] > 3
