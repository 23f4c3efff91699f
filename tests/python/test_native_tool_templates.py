"""Tool calls in the model's own format: the gateway started with a real model family's chat
template (`--chat-template`: Qwen 2.5's Hermes `<tool_call>`, Llama 3.1's JSON, Mistral Nemo's
`[TOOL_CALLS]`) puts the tools into the prompt through that template and reads the model's calls
back in that format; required and named calls are constrained to it, so even SmolLM2 (which
knows none of them) returns calls that validate, whole and streamed, and the call and its result
go back through the template on the next turn (Mistral's refuses ids that are not 9 letters and
digits: the gateway makes such ids for it)."""

import json
import pathlib

import jsonschema
import openai
import pytest

from conftest import Gateway
from test_structured_output import TIME, WEATHER

TEMPLATES = pathlib.Path(__file__).resolve().parents[2] / "testdata" / "templates"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module", params=["Qwen-Qwen2.5-7B-Instruct.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                        "mistralai-Mistral-Nemo-Instruct-2407.jinja"])
def family(request):
    gw = Gateway(extra_args=["--chat-template", str(TEMPLATES / request.param)])
    client = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="unused", max_retries=0)
    yield request.param, client, client.models.list().data[0].id
    gw.stop()


def check_calls(choice):
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_calls_validate(family):
    name, client, model = family
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(4):
        done = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                              max_tokens=400, temperature=1.0, seed=seed)
        check_calls(done.choices[0])
    named = {"type": "function", "function": {"name": "get_time"}}
    done = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                          max_tokens=400, temperature=0, logprobs=True)
    check_calls(done.choices[0])
    # The tokens show the model wrote the call in its family's format.
    raw = "".join(t.token for t in done.choices[0].logprobs.content)
    opening = {"Qwen": "<tool_call>\n{", "meta": '{"name": "get_time"', "mist": '[TOOL_CALLS][{"name": "get_time"'}[name[:4]]
    assert "".join(raw.split()).startswith("".join(opening.split())), raw
    assert [c.function.name for c in done.choices[0].message.tool_calls] == ["get_time"] * len(done.choices[0].message.tool_calls)
    if name.startswith("meta-llama"):
        assert len(done.choices[0].message.tool_calls) == 1, "Llama 3.1 takes one call per turn"


def test_streamed_call_and_its_result_go_back_through_the_template(family):
    name, client, model = family
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice=named,
                                                 max_tokens=400, temperature=0, stream=True))
    calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls", chunks
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_weather"])
    if name.startswith("mistralai"):
        assert len(calls[0].id) == 9 and calls[0].id.isalnum(), calls[0].id
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].id, "type": "function",
                                                                "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees, sunny"},
    ]
    done = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=30, temperature=0)
    msg = done.choices[0].message
    # auto: the model is free; either way the reply is well-formed.
    assert (msg.tool_calls and done.choices[0].finish_reason == "tool_calls") or (msg.content is not None and not msg.tool_calls), msg


def test_a_template_that_refuses_the_conversation_is_a_400(family):
    name, client, model = family
    if not name.startswith("mistralai"):
        pytest.skip("only Mistral's template checks the roles' order")
    with pytest.raises(openai.BadRequestError, match="alternate"):
        client.chat.completions.create(model=model, messages=[{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
                                       max_tokens=5)
