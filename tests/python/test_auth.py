"""With an API key set, HTTP /v1 requests and gRPC Inference calls without it are refused
(401 / UNAUTHENTICATED); with it they are served. Health stays open for probes."""

import urllib.error
import urllib.request

import grpc
import openai
import pytest

from conftest import API_KEY, grpc_generate


def status(url, key=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_http_requires_the_key(keyed_gateway):
    base = keyed_gateway.base_url
    assert status(f"{base}/v1/models") == 401
    assert status(f"{base}/v1/models", "wrong-key") == 401
    assert status(f"{base}/v1/models", API_KEY) == 200
    assert status(f"{base}/health") == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong-key", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_grpc_requires_the_key(keyed_gateway, stubs):
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(stubs, keyed_gateway.grpc, text="Hi", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ids, _ = grpc_generate(stubs, keyed_gateway.grpc, metadata=[("authorization", f"Bearer {API_KEY}")], text="Hi", max_tokens=2)
    assert len(ids) == 2
