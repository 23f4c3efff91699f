#!/usr/bin/env python3
"""Soak: a real `duet-gateway serve` under constant load while its workers are killed.

N concurrent clients (default 64) run for the whole duration: most send streamed OpenAI chat
completions (`openai` client), and a quarter hold multi-turn gRPC sessions (a new turn every
time the last one ends). Every `--kill-every` seconds one worker is killed with SIGKILL, the
cpu-worker and the gpu-worker in turn; the gateway's supervisor restarts it. At the end the
script reports requests, errors by kind (a stream cut by a kill is expected: its request fails
with UNAVAILABLE and the client may retry; anything else is a defect), sessions lost (target 0:
a session whose worker died goes on from the KV kept in the arenas) and the resident memory of
the gateway and its workers at the start and the end.

    python3 scripts/soak.py                       # 64 clients, 10 minutes, a kill every 2 minutes
    python3 scripts/soak.py --minutes 2 --kill-every 30 --clients 16

Needs the built binaries (`cargo build --workspace --bins`; the dev profile is optimised), the default model
(scripts/fetch-model.sh) and the Python clients of tests/python/requirements.txt.
"""

import argparse
import collections
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))


def rss_kib(pid: int) -> dict[str, int]:
    """Resident memory of a process in KiB: private (anonymous), file pages (the model) and
    shared memory (the arenas, which every process that maps them counts)."""
    out = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    try:
        for line in open(f"/proc/{pid}/status"):
            key = line.split(":")[0]
            if key in out:
                out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


def mib(rss: dict[str, int]) -> str:
    return f"private {rss.get('RssAnon', 0) / 1024:.0f} + file {rss.get('RssFile', 0) / 1024:.0f} + shared {rss.get('RssShmem', 0) / 1024:.0f} MiB"


def processes(instance: str) -> dict[str, int]:
    """pid of each duet process of this instance, by role."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        line = b" ".join(cmd).decode(errors="replace")
        if instance not in line:
            continue
        for role in ("duet-gateway", "duet-gpu-worker", "duet-cpu-worker"):
            if pathlib.Path(cmd[0].decode(errors="replace")).name == role:
                out[role] = int(pid)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every", type=float, default=120.0, help="seconds between worker kills")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv-bytes", default="1G", help="the cpu-worker's KV arena (when full, idle sessions are evicted)")
    args = ap.parse_args()

    import conftest  # the tests' Gateway launcher (free ports, ready lines, the built binaries)
    import grpc
    import openai

    gw = conftest.Gateway(kv_bytes=args.kv_bytes)
    from grpc_tools import protoc
    import grpc_tools

    out = tempfile.mkdtemp(prefix="duet-soak-stubs-")
    include = str(pathlib.Path(grpc_tools.__file__).parent / "_proto")
    protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
                 str(ROOT / "proto" / "duet" / "v1" / "inference.proto")])
    sys.path.insert(0, out)
    from duet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc  # noqa: E402

    procs = processes(gw.instance)
    rss_start = {role: rss_kib(pid) for role, pid in procs.items()}
    client = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    deadline = time.time() + args.minutes * 60
    counts = collections.Counter()
    errors = collections.Counter()
    lock = threading.Lock()

    def note(key, err=None):
        with lock:
            counts[key] += 1
            if err is not None:
                errors[err] += 1

    def chat_client(i):
        rng = random.Random(i)
        while time.time() < deadline:
            try:
                stream = client.chat.completions.create(
                    model=model, stream=True, max_tokens=args.max_tokens, temperature=1.0,
                    messages=[{"role": "user", "content": f"Tell me fact number {rng.randrange(1000)} about the sea."}])
                for _ in stream:
                    pass
                note("chat ok")
            except openai.APIStatusError as e:
                note("chat failed", f"HTTP {e.status_code}: {str(e.message)[:80]}")
            except Exception as e:  # noqa: BLE001 - a stream cut by a kill shows up here
                note("chat failed", f"{type(e).__name__}: {str(e)[:80]}")

    def session_client(i):
        channel = grpc.insecure_channel(gw.grpc)
        stub = pb_grpc.InferenceStub(channel)
        session = None
        turn = 0
        while time.time() < deadline:
            kwargs = dict(max_tokens=args.max_tokens // 2)
            text = f" Turn {turn}: and then?" if session else f"Client {i} starts a story."
            if session:
                kwargs["session_id"] = session
            else:
                kwargs["create_session"] = True
            try:
                for msg in stub.Generate(pb.GenerateRequest(text=text, **kwargs)):
                    if msg.WhichOneof("event") == "prompt" and msg.prompt.session_id:
                        session = msg.prompt.session_id
                note("session turn ok")
                turn += 1
            except grpc.RpcError as e:
                code = e.code().name
                if "evicted" in e.details():
                    # The KV cache was full: an eviction, not a loss (a bigger --kv-bytes avoids it).
                    note("session evicted", f"gRPC {code}: {e.details()[:80]}")
                    session, turn = None, 0
                elif code in ("FAILED_PRECONDITION", "NOT_FOUND"):
                    note("session lost", f"gRPC {code}: {e.details()[:80]}")
                    session, turn = None, 0
                else:
                    note("session turn failed", f"gRPC {code}: {e.details()[:80]}")
                    time.sleep(0.5)
        channel.close()

    threads = []
    n_sessions = max(1, args.clients // 4)
    for i in range(args.clients):
        target = session_client if i < n_sessions else chat_client
        t = threading.Thread(target=target, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    kills = []
    victims = ["duet-cpu-worker", "duet-gpu-worker"]
    next_kill = time.time() + args.kill_every
    while time.time() < deadline:
        time.sleep(1)
        if time.time() >= next_kill:
            role = victims[len(kills) % 2]
            pid = processes(gw.instance).get(role)
            if pid:
                os.kill(pid, signal.SIGKILL)
                kills.append((round(time.time() - (deadline - args.minutes * 60)), role))
                print(f"[{kills[-1][0]:>4} s] killed {role} ({pid})", flush=True)
            next_kill += args.kill_every
    for t in threads:
        t.join(timeout=180)
    procs = processes(gw.instance)
    rss_end = {role: rss_kib(pid) for role, pid in procs.items()}
    gw.stop()
    print(f"\nsoak: {args.clients} clients ({n_sessions} with sessions), {args.minutes} min, kills: {kills}")
    for k, v in sorted(counts.items()):
        print(f"  {k:>20}: {v}")
    for k, v in errors.most_common():
        print(f"  error x{v}: {k}")
    for role in sorted(set(rss_start) | set(rss_end)):
        print(f"  RSS {role:>16}: {mib(rss_start.get(role, {}))} at start, {mib(rss_end.get(role, {}))} at end")
    lost = counts["session lost"]
    print(f"  sessions lost: {lost} (target 0)")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
