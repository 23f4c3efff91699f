"""With an API key set, HTTP /v1 requests and gRPC Inference calls without it are refused
(401 / UNAUTHENTICATED); with it they are served. Health stays open for probes."""

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from conftest import API_KEY, grpc_generate


def status(url, key=None, method="GET", data=None):
    return request(url, key, method, data)[0]


def request(url, key=None, method="GET", data=None):
    """(status, JSON body or None) of one request."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, None
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, (json.loads(body) if body else None)


def test_http_requires_the_key(keyed_gateway):
    base = keyed_gateway.base_url
    assert status(f"{base}/v1/models") == 401
    assert status(f"{base}/v1/models", "wrong-key") == 401
    assert status(f"{base}/v1/models", API_KEY) == 200
    assert status(f"{base}/health") == 200
    # The tokenizer endpoints are behind the key too.
    assert status(f"{base}/tokenizer_info") == 401
    assert status(f"{base}/tokenizer_info", API_KEY) == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong-key", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_unknown_paths_wrong_methods_and_big_bodies_get_openai_errors(keyed_gateway):
    base = keyed_gateway.base_url
    # An unknown /v1 path is behind the key too: 401 without it, 404 with it.
    assert status(f"{base}/v1/no-such-thing") == 401
    code, body = request(f"{base}/v1/no-such-thing", API_KEY)
    assert code == 404 and body["error"]["code"] == "not_found", body
    # A wrong method: 405 in OpenAI's error shape.
    code, body = request(f"{base}/v1/completions", API_KEY, method="GET")
    assert code == 405 and body["error"]["type"] == "invalid_request_error", body
    assert "GET" in body["error"]["message"]
    # A body over the limit: 413, not 400.
    big = json.dumps({"model": "m", "prompt": "x" * (3 << 20)}).encode()
    code, body = request(f"{base}/v1/completions", API_KEY, method="POST", data=big)
    assert code == 413 and body["error"]["code"] == "request_too_large", body


def test_grpc_requires_the_key(keyed_gateway, stubs):
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(stubs, keyed_gateway.grpc, text="Hi", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ids, _ = grpc_generate(stubs, keyed_gateway.grpc, metadata=[("authorization", f"Bearer {API_KEY}")], text="Hi", max_tokens=2)
    assert len(ids) == 2
