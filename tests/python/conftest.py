"""Fixtures of the Python tests: a real `duet-gateway serve` (spawning the real workers) on
free ports, with and without an API key, and gRPC stubs generated from proto/ at test time."""

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = os.environ.get("DUET_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def gateway_binary() -> pathlib.Path:
    for profile in ("debug", "release"):
        path = ROOT / "target" / profile / "duet-gateway"
        if path.exists():
            return path
    raise RuntimeError("target/debug/duet-gateway is missing: run `cargo build --workspace` (scripts/test.sh does)")


class Gateway:
    """A running gateway: `grpc` and `http` are host:port addresses."""

    def __init__(self, extra_args=(), env=None, kv_bytes="64M", host="127.0.0.1"):
        self.instance = f"py{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"duet-{self.instance}-", suffix=".log", delete=False)
        args = [
            str(gateway_binary()), "serve", "--model", MODEL, "--instance", self.instance,
            "--listen", f"{host}:0", "--http-listen", f"{host}:0", "--kv-bytes", kv_bytes,
            "--cpu-workers", "1", *extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **(env or {})})
        self.grpc = self.http = None
        deadline = time.time() + 180
        while self.grpc is None:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the gateway exited before listening; log:\n{self.log_tail()}")
            if line.startswith("duet-gateway http listening on "):
                self.http = line.split()[-1]
            elif line.startswith("duet-gateway listening on "):
                self.grpc = line.split()[-1]
            if time.time() > deadline:
                raise RuntimeError("the gateway did not come up in 180 s")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://{self.http}"

    def log_tail(self) -> str:
        return pathlib.Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        assert code == 0, f"the gateway exited with {code}; log:\n{self.log_tail()}"


@pytest.fixture(scope="session")
def gateway():
    gw = Gateway()
    yield gw
    gw.stop()


API_KEY = "test-key-0123456789"


@pytest.fixture(scope="session")
def keyed_gateway():
    gw = Gateway(["--api-key", API_KEY])
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def stubs():
    """(inference_pb2, inference_pb2_grpc) generated from proto/ with grpc_tools.protoc."""
    from grpc_tools import protoc
    import grpc_tools

    out = tempfile.mkdtemp(prefix="duet-stubs-")
    include = str(pathlib.Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(ROOT / "proto" / "duet" / "v1" / "inference.proto")])
    assert rc == 0, "protoc failed on proto/duet/v1/inference.proto"
    sys.path.insert(0, out)
    from duet.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402

    return inference_pb2, inference_pb2_grpc


def grpc_generate(stubs, addr, metadata=None, **request):
    """Greedy text and token ids of a Generate stream over grpcio."""
    import grpc

    pb, pb_grpc = stubs
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.InferenceStub(channel)
        text, ids = "", []
        for msg in stub.Generate(pb.GenerateRequest(**request), metadata=metadata):
            kind = msg.WhichOneof("event")
            if kind == "token":
                ids.append(msg.token.id)
                text += msg.token.text
            elif kind == "finished":
                text += msg.finished.text
        return ids, text
