"""lm-evaluation-harness, unmodified, evaluates the served model: its `local-completions` model
finds Duet's tokenizer endpoints (no Hugging Face tokenizer for a GGUF model) and scores a
multiple-choice task from the prompts' log-probabilities (`echo` with `logprobs`), four prompts
a request."""

import json
import os
import subprocess
import sys
import urllib.request

QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Berlin", " Madrid"], 0),
    ("The capital of Germany is", [" Rome", " Berlin", " Paris", " Vienna"], 1),
    ("The capital of Italy is", [" Madrid", " Lisbon", " Rome", " Athens"], 2),
    ("The capital of Spain is", [" Oslo", " Madrid", " Dublin", " Prague"], 1),
    ("The capital of Japan is", [" Seoul", " Beijing", " Bangkok", " Tokyo"], 3),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " banana", " Tuesday"], 0),
]


def test_the_harness_scores_a_multiple_choice_task(gateway, tmp_path):
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "capitals.yaml").write_text(
        "task: duet_capitals\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    with urllib.request.urlopen(f"{gateway.base_url}/v1/models") as r:
        model = json.loads(r.read())["data"][0]["id"]
    out = tmp_path / "out"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions",
         "--model_args", f"base_url={gateway.base_url}/v1/completions,model={model},num_concurrent=1",
         "--tasks", "duet_capitals", "--include_path", str(tmp_path), "--output_path", str(out),
         # Several prompts a request (a completion's batch of prompts).
         "--batch_size", "4"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "Using remote tokenizer" in log, "the harness did not find Duet's tokenizer endpoints:\n" + log[-4000:]
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1, list(out.rglob("*"))
    acc = results[0]["results"]["duet_capitals"]["acc,none"]
    # SmolLM2 knows these (greedy scoring: the same every run).
    assert acc == 1.0, results[0]["results"]
