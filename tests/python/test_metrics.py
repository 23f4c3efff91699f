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
