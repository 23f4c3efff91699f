"""`/metrics` parses with prometheus_client's text-format parser and its counters move as
requests are served."""

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(gateway):
    with urllib.request.urlopen(f"{gateway.base_url}/metrics") as r:
        assert r.status == 200
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def total(samples, name):
    return sum(v for (n, _), v in samples.items() if n == name)


def complete(gateway, prompt, max_tokens):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{gateway.base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def test_counters_move(gateway):
    complete(gateway, "Warm up", 2)
    before = scrape(gateway)
    done = complete(gateway, "Count to five: 1, 2,", 5)
    after = scrape(gateway)
    generated = done["usage"]["completion_tokens"]
    assert total(after, "duet_requests_total") == total(before, "duet_requests_total") + 1
    assert total(after, "duet_generated_tokens_total") == total(before, "duet_generated_tokens_total") + generated
    assert total(after, "duet_prompt_tokens_total") == total(before, "duet_prompt_tokens_total") + done["usage"]["prompt_tokens"]
    assert total(after, "duet_time_to_first_token_seconds_count") == total(before, "duet_time_to_first_token_seconds_count") + 1
    assert total(after, "duet_steps_total") > total(before, "duet_steps_total")
    # Every family the issue names is there.
    names = {n for n, _ in after}
    for want in ["duet_time_per_output_token_seconds_bucket", "duet_queue_depth", "duet_running_requests", "duet_sessions",
                 "duet_kv_blocks", "duet_step_phase_seconds_bucket", "duet_attention_gpu_fraction", "duet_attention_positions"]:
        assert want in names, f"{want} missing from /metrics"
    kv = {dict(labels)["state"]: v for (n, labels), v in after.items() if n == "duet_kv_blocks"}
    assert kv["free"] > 0 and kv["used"] == 0, kv
    phases = {dict(l)["phase"] for (n, l) in after if n == "duet_step_phase_seconds_count"}
    assert {"total", "linear", "attention", "attention_wait"} <= phases, phases


def test_a_client_that_leaves_mid_stream_frees_its_kv(gateway):
    import http.client
    import time

    before = scrape(gateway)
    host, port = gateway.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    # Two events arrive, then the client goes away mid-generation.
    seen = 0
    while seen < 2:
        if resp.fp.readline().startswith(b"data: "):
            seen += 1
    conn.sock.close()
    conn.close()
    deadline = time.time() + 30
    while True:
        after = scrape(gateway)
        cancelled = sum(v for (n, l), v in after.items() if n == "duet_requests_finished_total" and dict(l).get("reason") == "cancelled")
        before_cancelled = sum(v for (n, l), v in before.items() if n == "duet_requests_finished_total" and dict(l).get("reason") == "cancelled")
        used = sum(v for (n, l), v in after.items() if n == "duet_kv_blocks" and dict(l)["state"] == "used")
        if cancelled == before_cancelled + 1 and used == 0:
            break
        assert time.time() < deadline, f"cancelled {before_cancelled} -> {cancelled}, KV blocks used {used}"
        time.sleep(0.2)
    # The server carries on.
    assert complete(gateway, "Hello", 2)["usage"]["completion_tokens"] == 2


def test_a_repeated_prompt_is_served_from_the_prefix_cache(gateway):
    import uuid

    # A prompt of its own (the gateway is shared by the tests), long enough for whole blocks.
    prompt = f"Request {uuid.uuid4()}: " + "the quick brown fox jumps over the lazy dog; " * 30
    before = scrape(gateway)
    first = complete(gateway, prompt, 4)
    second = complete(gateway, prompt, 4)
    after = scrape(gateway)
    n = first["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert n - 64 <= cached < n, (n, cached)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert total(after, "duet_prefix_cache_queried_tokens_total") - total(before, "duet_prefix_cache_queried_tokens_total") == 2 * n
    assert total(after, "duet_prefix_cache_hit_tokens_total") - total(before, "duet_prefix_cache_hit_tokens_total") == cached
    kv = {dict(labels)["state"]: v for (n_, labels), v in after.items() if n_ == "duet_kv_blocks"}
    assert kv["cached"] > 0 and kv["used"] == 0, kv
