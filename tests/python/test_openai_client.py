"""The official `openai` package, unmodified, completes, chats and streams against Duet; its
greedy output equals the gRPC output for the same prompt."""

import openai
import pytest

from conftest import grpc_generate


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


PROMPT = "The three primary colors are"


def test_completion_equals_grpc(client, model, gateway, stubs):
    pb, _ = stubs
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    _, grpc_text = grpc_generate(stubs, gateway.grpc, text=PROMPT, max_tokens=24, sampling=pb.SamplingParams(temperature=0.0))
    assert done.choices[0].text == grpc_text
    assert done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.completion_tokens <= 24 and done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens


def test_completion_token_ids_and_logprobs(client, model):
    # "The capital of France is" as token ids.
    done = client.completions.create(model=model, prompt=[504, 3575, 282, 4649, 314], max_tokens=6, temperature=0, logprobs=5)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == 6 == len(lp.token_logprobs) == len(lp.top_logprobs)
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 5 and logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(logprob) and chosen in top


def test_sampling_without_a_seed_differs_and_with_one_repeats(client, model):
    story = dict(model=model, prompt="Tell me a story:", max_tokens=32, temperature=1.0)
    unseeded = {client.completions.create(**story).choices[0].text for _ in range(3)}
    assert len(unseeded) == 3, f"three unseeded samples at temperature 1 were not all different: {unseeded}"
    seeded = {client.completions.create(**story, seed=7).choices[0].text for _ in range(2)}
    assert len(seeded) == 1, f"the same seed gave different samples: {seeded}"


def test_the_seed_drawn_for_a_request_is_reported_and_reproduces_it(client, model):
    story = dict(model=model, prompt="Tell me a story:", max_tokens=32, temperature=1.0)
    raw = client.completions.with_raw_response.create(**story)
    seed = int(raw.headers["x-duet-seed"])
    again = client.completions.create(**story, seed=seed)
    assert again.choices[0].text == raw.parse().choices[0].text
    given = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, seed=11)
    assert given.headers["x-duet-seed"] == "11"


def test_streamed_completion_equals_whole(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_and_streamed_chat(client, model, gateway, stubs):
    pb, _ = stubs
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    done = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    text = done.choices[0].message.content
    assert done.choices[0].message.role == "assistant" and text
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    _, grpc_text = grpc_generate(stubs, gateway.grpc, chat=chat, max_tokens=16, sampling=pb.SamplingParams(temperature=0.0))
    assert text == grpc_text
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join((c.choices[0].delta.content or "") for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_chat_logprobs(client, model):
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_logprob_bytes_are_each_tokens_own_bytes(client, model):
    # Japanese text comes out in tokens that split characters: each token's `bytes` must be its
    # own bytes (not the replacement character's), and they must add up to the text.
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Write the Japanese word for cat."}],
                                          max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    content = done.choices[0].logprobs.content
    pieces = [bytes(c.bytes) for c in content]

    def complete_utf8(b):
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    assert any(not complete_utf8(p) for p in pieces), f"no token split a character: {pieces}"
    assert b"".join(pieces).decode("utf-8", errors="replace") == done.choices[0].message.content
    assert all(bytes(alt.bytes) != b"\xef\xbf\xbd" for c in content for alt in c.top_logprobs)


FRANCE = [504, 3575, 282, 4649, 314]  # "The capital of France is"; 4649 is " France".


def test_logit_bias_bans_and_forces_tokens_the_same_over_both_apis(client, model, gateway, stubs):
    pb, _ = stubs
    greedy_ids, _ = grpc_generate(stubs, gateway.grpc, tokens=pb.TokenIds(ids=FRANCE), max_tokens=4, sampling=pb.SamplingParams(temperature=0.0))
    first = greedy_ids[0]
    # -100 bans the greedy choice: the first token is another one.
    banned_ids, banned_text = grpc_generate(
        stubs, gateway.grpc, tokens=pb.TokenIds(ids=FRANCE), max_tokens=4, sampling=pb.SamplingParams(temperature=0.0, logit_bias={first: -100.0})
    )
    assert banned_ids[0] != first and first not in banned_ids
    done = client.completions.create(model=model, prompt=FRANCE, max_tokens=4, temperature=0, logit_bias={str(first): -100})
    assert done.choices[0].text == banned_text
    # +100 makes a token all but certain, at any temperature.
    forced = client.completions.create(model=model, prompt=FRANCE, max_tokens=3, temperature=1.0, seed=3, logit_bias={"4649": 100})
    assert forced.choices[0].text == " France" * 3


def test_frequency_and_presence_penalties_change_a_repetitive_continuation(client, model, gateway, stubs):
    pb, _ = stubs
    prompt = "1 1 1 1 1 1 1 1"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert plain.count("1") >= 6, f"the greedy continuation was expected to repeat: {plain!r}"
    for penalty in (dict(frequency_penalty=1.5), dict(presence_penalty=2.0)):
        text = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, **penalty).choices[0].text
        assert text.count("1") < plain.count("1"), f"{penalty}: {text!r} against {plain!r}"
        _, grpc_text = grpc_generate(stubs, gateway.grpc, text=prompt, max_tokens=12, sampling=pb.SamplingParams(temperature=0.0, **penalty))
        assert grpc_text == text


def test_bad_penalties_and_logit_bias_are_refused(client, model):
    for bad, word in [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(logit_bias={"99999999": 1}), "logit_bias"),
        (dict(logit_bias={"hello": 1}), "logit_bias"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="x", max_tokens=1, **bad)
        assert word in str(e.value), (bad, str(e.value))
    # Zeros are what a client sends by default: accepted.
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, presence_penalty=0, frequency_penalty=0, logit_bias={})


def test_n_choices_are_the_sequences_of_consecutive_seeds(client, model):
    story = dict(model=model, prompt="Tell me a story:", max_tokens=12, temperature=1.0)
    done = client.completions.create(**story, n=3, seed=5)
    assert [c.index for c in done.choices] == [0, 1, 2]
    alone = [client.completions.create(**story, seed=5 + i).choices[0] for i in range(3)]
    assert [c.text for c in done.choices] == [a.text for a in alone]
    assert len({c.text for c in done.choices}) > 1, "three samples at temperature 1 were all the same"
    assert done.usage.completion_tokens == sum(client.completions.create(**story, seed=5 + i).usage.completion_tokens for i in range(3))
    assert done.usage.prompt_tokens == client.completions.create(**story, seed=5).usage.prompt_tokens, "the prompt counts once"
    # Streamed, the chunks of each choice carry its index and add up to the same texts.
    texts, finished = ["", ""], [None, None]
    for chunk in client.completions.create(**story, n=2, seed=5, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            finished[c.index] = c.finish_reason or finished[c.index]
    assert texts == [c.text for c in done.choices[:2]] and all(finished)
    chat = dict(model=model, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8, temperature=1.0, seed=9)
    whole = client.chat.completions.create(**chat, n=2)
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**chat, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in whole.choices]
    for bad in (0, 17):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**story, n=bad)
        assert "n must be" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat, n=2, extra_headers={"x-session-id": "n-choices"})
    assert "session" in str(e.value)


def test_echo_with_logprobs_scores_the_prompt(client, model):
    # As lm-evaluation-harness's `local-completions` scores a continuation: echo the prompt
    # with each of its tokens' log-probability under the tokens before it.
    done = client.completions.create(model=model, prompt=FRANCE, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(FRANCE) + 3 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, "the first prompt token has no context"
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert done.choices[0].text == "".join(lp.tokens), "the prompt's text, then the completion's"
    assert lp.text_offset == sorted(lp.text_offset)
    # Each prompt position's alternatives are what a generation from the tokens before it
    # reports for its first token.
    for k in (2, 4):
        alone = client.completions.create(model=model, prompt=FRANCE[:k], max_tokens=1, temperature=0, logprobs=2)
        want = alone.choices[0].logprobs.top_logprobs[0]
        got = lp.top_logprobs[k]
        assert set(got) == set(want), (k, got, want)
        assert all(got[t] == pytest.approx(want[t], abs=1e-5) for t in want), (k, got, want)
    # lm-evaluation-harness's loglikelihood request and its reading of the answer: a batch of
    # one tokenised context + continuation, the continuation's log-probabilities summed and
    # whether each was the most likely token.
    greedy_first = client.completions.create(model=model, prompt=FRANCE, max_tokens=1, temperature=0, logprobs=1).choices[0].logprobs
    for continuation in ([4649], [4649, 314]):
        out = client.completions.create(model=model, prompt=[FRANCE + continuation], temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
        choice = out.model_dump()["choices"][0]
        ctxlen = len(FRANCE)
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert len(logprobs) == len(continuation) and all(x < 0 for x in logprobs)
        is_greedy = all(tok == max(top.values()) for tok, top in zip(logprobs, tops))
        if len(continuation) == 1:
            assert is_greedy == (greedy_first.tokens[0] == " France"), (logprobs, tops, greedy_first.tokens)
    # A text prompt comes back as sent; without logprobs only the text is echoed.
    text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True).choices[0].text
    assert text.startswith("The capital of France is") and len(text) > len("The capital of France is")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=1, echo=True, stream=True)
    assert "echo" in str(e.value)


def test_a_batch_of_prompts_answers_each_in_order(client, model):
    prompts = ["The capital of France is", "1, 2, 3,"]
    done = client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0)
    alone = [client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0) for p in prompts]
    assert [c.index for c in done.choices] == [0, 1]
    assert [c.text for c in done.choices] == [a.choices[0].text for a in alone]
    assert done.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    # With n, prompt-major: prompt p's choice i is index p * n + i, sampled with seed + index.
    sampled = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=1.0, seed=5, n=2)
    want = [client.completions.create(model=model, prompt=prompts[k // 2], max_tokens=6, temperature=1.0, seed=5 + k).choices[0].text for k in range(4)]
    assert [c.text for c in sampled.choices] == want
    # lm-evaluation-harness with batch_size > 1: tokenised prompts, echoed and scored, each
    # as it is alone.
    batch = [FRANCE, FRANCE[:3]]
    scored = client.completions.create(model=model, prompt=batch, max_tokens=1, temperature=0, logprobs=1, echo=True)
    for c, ids in zip(scored.choices, batch):
        one = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True).choices[0]
        assert c.text == one.text and c.logprobs.token_logprobs == one.logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=["x"] * 33, max_tokens=1, n=2)
    assert "at most 64" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=[], max_tokens=1)


def test_best_of_answers_the_likeliest_of_its_samples(client, model):
    story = dict(model=model, prompt="Tell me a story:", max_tokens=10, temperature=1.0)
    samples = [client.completions.create(**story, seed=5 + i, logprobs=1).choices[0] for i in range(4)]
    mean = lambda c: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)
    ranked = sorted(samples, key=mean, reverse=True)
    best = client.completions.create(**story, seed=5, best_of=4, n=2)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.choices[0].logprobs is None, "logprobs only where asked for"
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in samples), "every sample generated counts"
    for bad in (dict(best_of=1, n=2), dict(best_of=17), dict(best_of=3, stream=True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**story, **bad)
        assert "best_of" in str(e.value), (bad, str(e.value))


def test_errors_are_openai_errors(client, model):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=1, logprobs=6)
    assert "logprobs" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="word " * 9000, max_tokens=1)
    assert "context" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "robot", "content": "x"}], max_tokens=1)
