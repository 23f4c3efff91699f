"""The curl examples in the README (between the curl-examples markers) work as written,
against a running gateway (its address put in place of the default 127.0.0.1:8000)."""

import json
import pathlib
import subprocess

from conftest import ROOT

BEGIN, END = "<!-- curl-examples:begin -->", "<!-- curl-examples:end -->"


def readme_commands():
    text = (ROOT / "README.md").read_text()
    assert BEGIN in text and END in text, "the README lost its curl-examples markers"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        if line.startswith("```"):
            continue
        if not current and not line.startswith("curl "):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(current)
            current = ""
    return commands


def test_readme_curl_examples(gateway):
    commands = readme_commands()
    assert len(commands) >= 5, commands
    for cmd in commands:
        run = cmd.replace("127.0.0.1:8000", gateway.http)
        out = subprocess.run(["bash", "-o", "pipefail", "-c", run], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{cmd}\nexit {out.returncode}\n{out.stdout}\n{out.stderr}"
        body = out.stdout.strip()
        assert body, f"{cmd}: no output"
        if body.startswith("data: "):
            events = [l[len("data: "):] for l in body.splitlines() if l.startswith("data: ")]
            assert events[-1] == "[DONE]", f"{cmd}: the stream did not end with [DONE]"
            for e in events[:-1]:
                assert "error" not in json.loads(e), f"{cmd}: {e}"
        elif body.startswith("{"):
            assert "error" not in json.loads(body), f"{cmd}: {body}"
