"""The tokenizer over HTTP in vLLM's shape, as lm-evaluation-harness's `local-completions`
probes and then uses it (`lm_eval.utils.check_remote_tokenizer_support`, `RemoteTokenizer`):
so a model known only by its GGUF file can be evaluated without a Hugging Face tokenizer."""

import json
import urllib.error
import urllib.request



def call(base, path, body=None):
    """(status, JSON body) of a GET (no body) or POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}{path}", data=data, headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_harness_finds_and_uses_the_remote_tokenizer(gateway, stubs):
    base = gateway.base_url
    # The probe: /tokenizer_info with an eos_token, and /tokenize of "test".
    code, info = call(base, "/tokenizer_info")
    assert code == 200 and info["eos_token"] and info["model_max_length"] > 0
    assert "{%" in info["chat_template"], "the GGUF's chat template, for the harness's apply_chat_template"
    code, out = call(base, "/tokenize", {"prompt": "test", "add_special_tokens": False})
    assert code == 200 and isinstance(out["tokens"], list) and out["count"] == len(out["tokens"]) > 0
    # Encoding is the server's own (the same ids as gRPC's Tokenize), decoding round-trips.
    text = "The capital of France is Paris."
    _, out = call(base, "/tokenize", {"prompt": text, "add_special_tokens": False})
    pb, pb_grpc = stubs
    import grpc

    with grpc.insecure_channel(gateway.grpc) as ch:
        want = pb_grpc.InferenceStub(ch).Tokenize(pb.TokenizeRequest(text=text, add_special=False)).ids
    assert out["tokens"] == list(want)
    code, back = call(base, "/detokenize", {"tokens": out["tokens"]})
    assert code == 200 and back["prompt"] == text
    # The eos token's text encodes to one token (the harness reads eos_token_id so).
    _, eos = call(base, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert len(eos["tokens"]) == 1
    # Chat messages through the template: the tokens a chat completion of them prefills.
    messages = [{"role": "user", "content": "Hi"}]
    _, chat = call(base, "/tokenize", {"messages": messages})
    _, done = call(base, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat["count"] == done["usage"]["prompt_tokens"]


def test_bad_tokenizer_requests_get_clear_errors(gateway):
    base = gateway.base_url
    for path, body, word in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, ""),
        ("/detokenize", {"tokens": [99999999]}, ""),
        ("/detokenize", {"tokens": "abc"}, ""),
    ]:
        code, err = call(base, path, body)
        assert code == 400, (path, body, code, err)
        assert word in json.dumps(err), (path, body, err)
