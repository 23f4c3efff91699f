"""Structured output and tool calls with off-the-shelf clients (`openai`, `langchain-openai`):
JSON schemas, any JSON object and vLLM's guided_regex / guided_grammar extensions always give
text that parses and matches, at temperature 1 too; tool calls always come back as calls of
the named functions with arguments valid under their schemas (tool_choice required, named,
auto), whole or streamed, over several turns; bad grammars and tool choices get a 400."""

import concurrent.futures
import json
import os
import re

import jsonschema
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def ask(client, model, **kw):
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    return client.chat.completions.create(model=model, messages=messages, **{"max_tokens": 120, **kw})


def check_person(p):
    assert set(p) == {"name", "age", "languages"}, p
    assert isinstance(p["name"], str) and len(p["name"]) <= 20
    assert isinstance(p["age"], int) and 0 <= p["age"] <= 150
    assert all(lang in ("en", "fr", "de") for lang in p["languages"]) and len(p["languages"]) <= 3


def test_json_schema_output_always_parses_and_matches(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(4):
        done = ask(client, model, response_format=fmt, temperature=1.0, seed=seed)
        assert done.choices[0].finish_reason == "stop", done
        check_person(json.loads(done.choices[0].message.content))


def test_json_object_and_streaming(client, model):
    # Any JSON object: every output is one as far as it goes; those that end are whole.
    finished = 0
    for seed in range(4):
        done = ask(client, model, response_format={"type": "json_object"}, temperature=1.0, seed=seed)
        text = done.choices[0].message.content
        assert text.lstrip().startswith("{"), text
        if done.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
    assert finished >= 1, "no JSON object finished within max_tokens"
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chunks = list(ask(client, model, response_format=fmt, temperature=0.7, seed=3, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check_person(json.loads(text))


def test_guided_regex_and_grammar_extensions(client, model):
    done = client.completions.create(model=model, prompt="A date:", max_tokens=20, temperature=1.0, seed=1,
                                     extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", done.choices[0].text), done.choices[0].text
    done = client.completions.create(model=model, prompt="Is the sky blue?", max_tokens=5, temperature=1.0,
                                     extra_body={"guided_grammar": 'start: "yes" | "no"'})
    assert done.choices[0].text in ("yes", "no")


def test_bad_grammars_and_tools_get_400(client, model):
    with pytest.raises(openai.BadRequestError, match="structured output"):
        ask(client, model, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    with pytest.raises(openai.BadRequestError, match="structured output"):
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"guided_regex": "(unclosed"})
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        ask(client, model, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        ask(client, model, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})


def test_edge_inputs_get_a_400_or_an_answer_and_leave_other_requests_alone(client, model):
    # A long request runs beside them: none of the inputs below may fail it.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(client.completions.create, model=model, prompt="Count: 1, 2, 3,", max_tokens=60,
                             temperature=0)
        # A regular expression that compiles but matches no text.
        for empty in ["[a&&b]", "ab[a&&b]"]:
            with pytest.raises(openai.BadRequestError, match="matches no text"):
                client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"guided_regex": empty})
        # A temperature whose inverse overflows, and a repetition penalty that would make a
        # logit infinite: valid, so answered (the first is greedy), and within the grammar.
        done = client.completions.create(model=model, prompt="Some JSON:", max_tokens=24, temperature=1e-40,
                                         extra_body={"response_format": {"type": "json_object"}})
        assert done.choices[0].text.startswith("{"), done.choices[0].text
        if done.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(done.choices[0].text), dict)
        done = client.completions.create(model=model, prompt='{"a": {"a": {"a":', max_tokens=8, temperature=1, seed=1,
                                         extra_body={"repetition_penalty": 1e-39, "response_format": {"type": "json_object"}})
        assert done.choices[0].text and done.choices[0].finish_reason in ("stop", "length")
        # A stop string over the limit.
        with pytest.raises(openai.BadRequestError, match="stop string"):
            client.completions.create(model=model, prompt="x", max_tokens=4, stop=[" " * 5000])
        assert beside.result().choices[0].finish_reason in ("stop", "length")


def test_langchain_structured_output(gateway, model):
    pytest.importorskip("langchain_openai", reason="langchain-openai is in tests/python/requirements.txt")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=150)

    llm = ChatOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", model=model, max_tokens=200, temperature=0.8, seed=1)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe a person.")
    assert isinstance(person, Person) and 0 <= person.age <= 150


def check_weather_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit") and len(args["city"]) <= 30


def test_tool_calls_required_named_and_auto(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(3):
        done = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                              max_tokens=600, temperature=1.0, seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            json.loads(call.function.arguments)
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                          max_tokens=600, temperature=0)
    assert done.choices[0].finish_reason == "tool_calls"
    for call in done.choices[0].message.tool_calls:
        check_weather_call(call)
    # auto: a call or an answer, either way well-formed.
    done = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=600, temperature=0)
    msg = done.choices[0].message
    assert (msg.tool_calls and done.choices[0].finish_reason == "tool_calls") or (msg.content and not msg.tool_calls), msg


def test_streamed_tool_calls_and_a_second_turn(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice=named,
                                                 max_tokens=600, temperature=0, stream=True))
    calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    check_weather_call(calls[0])
    # The call and its result go back into the conversation; the model then answers.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].id, "type": "function",
                                                                "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees, sunny"},
    ]
    done = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0)
    assert done.choices[0].message.content and not done.choices[0].message.tool_calls


def test_langchain_bind_tools(gateway, model):
    pytest.importorskip("langchain_openai", reason="langchain-openai is in tests/python/requirements.txt")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", model=model, max_tokens=100, temperature=0)
    msg = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather" and isinstance(msg.tool_calls[0]["args"]["city"], str)


def test_fifty_seeded_runs_each_always_validate(client, model):
    """Schema, required and named requests: 50 seeded runs each at temperature 1, sent 16 at a
    time, every one parses and validates (jsonschema). max_tokens leaves room for the longest
    reply the schemas allow (strings of at most 30 characters, at most 4 calls)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def schema_run(seed):
        done = ask(client, model, response_format=fmt, temperature=1.0, seed=seed, max_tokens=600)
        jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)

    def tools_run(seed, choice):
        done = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                                              max_tokens=600, temperature=1.0, seed=seed)
        assert done.choices[0].finish_reason == "tool_calls", done
        for call in done.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    named = {"type": "function", "function": {"name": "get_time"}}
    runs = [lambda s=s: schema_run(s) for s in range(50)]
    runs += [lambda s=s: tools_run(s, "required") for s in range(50)]
    runs += [lambda s=s: tools_run(s, named) for s in range(50)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(r) for r in runs]:
            f.result()


def test_litellm_tools_and_json_schema(gateway, model):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm", reason="litellm is in tests/python/requirements.txt")
    common = dict(model=f"openai/{model}", api_base=f"{gateway.base_url}/v1", api_key="unused", max_tokens=150, temperature=0)
    done = litellm.completion(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
                              tool_choice="required", **common)
    call = done.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    done = litellm.completion(messages=[{"role": "user", "content": "Describe a person as JSON."}],
                              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, **common)
    jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)
