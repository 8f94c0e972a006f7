"""A production server, end to end: every sampling field, logprob shapes, auth, /metrics, load and disconnects.

Uses the session's `prod_server` (conftest.py: API key, --max-model-len 256,
--max-num-seqs 64, --max-logprobs 20) with the real `openai` client (the SIGTERM
test ends test_vllm_openai_entrypoint.py's server). Generations are a few tokens long:
the suite runs on 2 CPU cores.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import pytest
from optional_deps import require
from server_harness import API_KEY, PROD_MAX_MODEL_LEN, PROD_MAX_NUM_SEQS, http, no_keepalive

openai = require("openai")
prom_parser = require("prometheus_client.parser", "prometheus-client")

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(prod_server):
    return openai.OpenAI(base_url=f"{prod_server.base}/v1", api_key=API_KEY,
                         http_client=no_keepalive(), max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.model_loader.tokenizer import load_tokenizer
    from tokenmill.model_loader.source import bundled_gguf_path

    return load_tokenizer(bundled_gguf_path())


def metrics(server) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client's parser: (sample name, sorted labels) -> value."""
    status, raw, headers = http("GET", f"{server.base}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    out = {}
    for family in prom_parser.text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(values: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in values.items() if n == name and set(labels.items()) <= set(ls))


# ---------------------------------------------------------------- sampling fields


def test_stop_token_ids_end_the_output_at_that_token(client, model, tokenizer):
    prompt = "The capital of France is"
    base = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    tokens = base.choices[0].logprobs.tokens
    assert len(tokens) == 6
    # A generated token (not the first) whose text is one token id, at its first occurrence.
    k = next(i for i in range(1, 6) if len(tokenizer.encode(tokens[i])) == 1 and tokens[i] not in tokens[:i])
    stop_id = tokenizer.encode(tokens[k])[0]
    res = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    choice = res.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop_id
    assert res.usage.completion_tokens == k + 1  # the stop token is generated, then nothing more
    assert choice.text == "".join(tokens[:k])  # and its text is not shown


def test_n_three_gives_three_choices_streamed_with_indices(client, model):
    kw = {"model": model, "prompt": "My favourite animal is", "max_tokens": 4, "n": 3, "seed": 5,
          "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in full.choices}
    assert len(set(streamed.values())) > 1  # seed + i per child: the samples differ


def test_seed_gives_the_same_text_alone_and_in_a_busy_batch(client, model):
    kw = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 1234,
          "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**kw).choices[0].text

    def noise(i: int) -> None:
        client.completions.create(model=model, prompt=f"Noise {i}: the weather", max_tokens=8, temperature=1.0,
                                  extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=noise, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    busy = client.completions.create(**kw).choices[0].text
    for t in threads:
        t.join()
    assert busy == alone


def test_completion_logprobs_have_openais_shape_and_sane_values(client, model):
    res = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == res.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4  # the top 3, plus the sampled token when it is not among them
        assert tok_lp <= 0 and all(v <= 0 for v in top.values())
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-4  # probabilities of distinct tokens
        assert tok_lp == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely token
        assert top[tok] == pytest.approx(tok_lp, abs=1e-6)


def test_chat_logprobs_have_openais_shape_and_sane_values(client, model):
    res = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=5)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 5
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-4
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)
        assert entry.bytes == list(entry.token.encode())
    no_top = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=2, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)
    plain = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_returns_the_prompt_and_a_list_of_prompts_gives_a_choice_each(client, model):
    prompts = ["The sky is", "Water is"]
    res = client.completions.create(model=model, prompt=prompts, max_tokens=3, n=2, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in res.choices) == [0, 1, 2, 3]
    for c in res.choices:
        assert c.text.startswith(prompts[c.index // 2]) and len(c.text) > len(prompts[c.index // 2])
    assert res.usage.completion_tokens == 4 * 3


def test_max_tokens_omitted_or_null_is_the_rest_of_the_context_and_zero_is_400(prod_server, model):
    prompt = [1000] * (PROD_MAX_MODEL_LEN - 5)  # leaves 5 tokens of context
    for extra in ({}, {"max_tokens": None}):
        status, raw, _ = http("POST", f"{prod_server.base}/v1/completions",
                              {"model": model, "prompt": prompt, "ignore_eos": True, **extra}, AUTH)
        body = json.loads(raw)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    for bad in (0, -1):
        status, raw, _ = http("POST", f"{prod_server.base}/v1/completions",
                              {"model": model, "prompt": "Hi", "max_tokens": bad}, AUTH)
        assert status == 400 and "max_tokens" in json.loads(raw)["error"]["message"]


def test_max_completion_tokens_and_vllm_extras_change_the_output(client, model):
    res = client.chat.completions.create(model=model, messages=CAPITAL, max_completion_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == 3 and res.choices[0].finish_reason == "length"
    greedy = client.completions.create(model=model, prompt="Paris is a", max_tokens=6, temperature=0).choices[0].text
    top1 = client.completions.create(model=model, prompt="Paris is a", max_tokens=6, temperature=1.5, seed=3,
                                     extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy  # top_k=1 leaves only the argmax
    loop = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    repeated = client.completions.create(model=model, prompt=loop, max_tokens=4, temperature=0).choices[0].text
    penalized = client.completions.create(model=model, prompt=loop, max_tokens=4, temperature=0,
                                          extra_body={"repetition_penalty": 5.0}).choices[0].text
    assert repeated.startswith(" 3") and penalized != repeated  # the penalty breaks the loop
    min_tok = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say OK."}],
                                             max_tokens=12, temperature=0, extra_body={"min_tokens": 10})
    assert min_tok.usage.completion_tokens >= 10
    stop = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                     stop=["Paris"], extra_body={"include_stop_str_in_output": True})
    assert stop.choices[0].text.endswith("Paris") and stop.choices[0].finish_reason == "stop"


def test_neutral_values_behave_exactly_like_absent_fields(client, model):
    base = {"model": model, "prompt": "A list of fruits:", "max_tokens": 8, "temperature": 0.9, "seed": 77}
    absent = client.completions.create(**base)
    neutral = client.completions.create(
        **base, presence_penalty=0, frequency_penalty=0, top_p=1.0, n=1, stop=[], logit_bias={}, echo=False,
        extra_body={"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [],
                    "ignore_eos": False, "include_stop_str_in_output": False, "skip_special_tokens": True})
    assert neutral.choices[0].text == absent.choices[0].text
    assert neutral.usage == absent.usage
    zero_k = client.completions.create(**base, extra_body={"top_k": 0})
    assert zero_k.choices[0].text == absent.choices[0].text


def test_max_logprobs_bounds_both_endpoints(client, model):
    client.completions.create(model=model, prompt="Hi", max_tokens=1, logprobs=20)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="Hi", max_tokens=1, logprobs=21)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=1, logprobs=True, top_logprobs=21)


def test_n_is_bounded_by_max_num_seqs(prod_server, model):
    ok, _, _ = http("POST", f"{prod_server.base}/v1/completions",
                    {"model": model, "prompt": "Hi", "max_tokens": 1, "n": PROD_MAX_NUM_SEQS}, AUTH)
    assert ok == 200
    status, raw, _ = http("POST", f"{prod_server.base}/v1/completions",
                          {"model": model, "prompt": "Hi", "max_tokens": 1, "n": PROD_MAX_NUM_SEQS + 1}, AUTH)
    assert status == 400 and "n must be at most" in json.loads(raw)["error"]["message"]


def test_x_request_id_is_echoed_and_names_the_response(prod_server, model):
    status, raw, headers = http("POST", f"{prod_server.base}/v1/completions",
                                {"model": model, "prompt": "Hi", "max_tokens": 1}, {**AUTH, "X-Request-Id": "lb-42"})
    assert status == 200 and headers["x-request-id"] == "lb-42" and json.loads(raw)["id"] == "cmpl-lb-42"
    _, _, headers = http("GET", f"{prod_server.base}/health")
    assert len(headers["x-request-id"]) == 32  # a fresh id when the client sent none


def test_tokenize_detokenize_and_version(prod_server, model, tokenizer):
    text = "Hello, tokenmill!"
    status, raw, _ = http("POST", f"{prod_server.base}/tokenize", {"model": model, "prompt": text}, AUTH)
    body = json.loads(raw)
    assert status == 200 and body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == PROD_MAX_MODEL_LEN
    status, raw, _ = http("POST", f"{prod_server.base}/detokenize", {"tokens": body["tokens"]}, AUTH)
    assert status == 200 and json.loads(raw)["prompt"] == tokenizer.decode(body["tokens"])
    status, raw, _ = http("POST", f"{prod_server.base}/tokenize", {"messages": CAPITAL}, AUTH)
    assert status == 200 and json.loads(raw)["count"] > len(tokenizer.encode(CAPITAL[0]["content"]))
    status, raw, _ = http("GET", f"{prod_server.base}/version")
    assert status == 200 and json.loads(raw)["version"]


# ---------------------------------------------------------------- auth

PROTECTED = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 1}),
             ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
             ("GET", "/stats", None), ("GET", "/api/tags", None),
             ("POST", "/api/chat", {"messages": CAPITAL, "options": {"num_predict": 1}, "stream": False})]
OPEN = ["/health", "/metrics", "/version", "/api/version"]


@pytest.mark.parametrize("method, path, body", PROTECTED)
def test_protected_routes_refuse_missing_or_wrong_keys_and_accept_the_right_one(prod_server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {API_KEY}x"},
                    {"Authorization": API_KEY}):
        status, raw, got = http(method, f"{prod_server.base}{path}", body, headers)
        assert status == 401, (headers, raw)
        err = json.loads(raw)["error"]
        assert "API key" in (err if isinstance(err, str) else err["message"])
        assert got["www-authenticate"] == "Bearer"
    status, raw, _ = http(method, f"{prod_server.base}{path}", body, AUTH)
    assert status == 200, raw


@pytest.mark.parametrize("path", OPEN)
def test_open_routes_need_no_key(prod_server, path):
    assert http("GET", f"{prod_server.base}{path}")[0] == 200


def test_openai_client_with_a_wrong_key_gets_authentication_error(prod_server, model):
    bad = openai.OpenAI(base_url=f"{prod_server.base}/v1", api_key="nope", http_client=no_keepalive(), max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt="Hi", max_tokens=1)


# ---------------------------------------------------------------- metrics


def test_metrics_parse_and_counters_move_with_requests(prod_server, client, model):
    before = metrics(prod_server)
    res = client.completions.create(model=model, prompt="Counting: one, two,", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = metrics(prod_server)
    gen = "tokenmill:generation_tokens_total"
    assert metric(after, gen) - metric(before, gen) == 4
    prompt = "tokenmill:prompt_tokens_total"
    assert metric(after, prompt) - metric(before, prompt) == res.usage.prompt_tokens
    ok = "tokenmill:request_success_total"
    assert metric(after, ok, finished_reason="length") - metric(before, ok, finished_reason="length") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        name = f"tokenmill:{hist}_count"
        assert metric(after, name) - metric(before, name) == 1, hist
    itl = "tokenmill:inter_token_latency_seconds_count"
    assert metric(after, itl) - metric(before, itl) == 3
    queries = "tokenmill:prefix_cache_queries_total"
    assert metric(after, queries) > metric(before, queries)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_hits_total"):
        assert (f"tokenmill:{name}", (("model_name", model),)) in after, name
    # The vLLM-named copies carry the same values (--metrics-vllm-names).
    assert metric(after, "vllm:generation_tokens_total") == metric(after, gen)
    assert all(ls and dict(ls).get("model_name") == model for (n, ls) in after if n.startswith("tokenmill:"))


# ---------------------------------------------------------------- load and disconnects


def test_256_concurrent_streams_complete_then_50_disconnects_free_every_block(prod_server, model, tokenizer):
    import httpx

    max_tokens = 8
    prompts = [f"Request {i}:" for i in range(256)]  # 256 distinct prompts of a few tokens

    async def one(aclient, prompt: str) -> tuple[str, int, int, int]:
        stream = await aclient.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.7,
                                                  seed=1, stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.text
        return text, usage.prompt_tokens, usage.completion_tokens, usage.total_tokens

    async def drop(http_client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "prompt": f"Drop {i}: count slowly", "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        async with http_client.stream("POST", f"{prod_server.base}/v1/completions", json=body, headers=AUTH) as resp:
            assert resp.status_code == 200
            async for _ in resp.aiter_bytes():
                break  # first chunk, then hang up

    async def run() -> list:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        aclient = openai.AsyncOpenAI(base_url=f"{prod_server.base}/v1", api_key=API_KEY, max_retries=0, timeout=600,
                                     http_client=httpx.AsyncClient(limits=limits, timeout=600))
        results = await asyncio.gather(*(one(aclient, p) for p in prompts))
        async with httpx.AsyncClient(limits=limits, timeout=120) as http_client:
            await asyncio.gather(*(drop(http_client, i) for i in range(50)))
        return results

    before = metrics(prod_server)
    results = asyncio.run(run())
    for prompt, (text, p_tokens, c_tokens, total) in zip(prompts, results):
        assert c_tokens == max_tokens and p_tokens == len(tokenizer.encode(prompt)) and total == p_tokens + c_tokens
        assert text
    deadline = time.monotonic() + 60
    while True:
        now = metrics(prod_server)
        idle = (metric(now, "tokenmill:num_requests_running") == 0 and metric(now, "tokenmill:num_requests_waiting") == 0
                and metric(now, "tokenmill:kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert idle, {k: v for k, v in now.items() if "num_requests" in k[0] or "kv_cache" in k[0]}
    ok = "tokenmill:request_success_total"
    assert metric(now, ok, finished_reason="length") - metric(before, ok, finished_reason="length") == 256
    assert metric(now, ok, finished_reason="abort") - metric(before, ok, finished_reason="abort") == 50
    gen = "tokenmill:generation_tokens_total"
    assert metric(now, gen) - metric(before, gen) >= 256 * max_tokens + 50
    # 256 requests over 64 sequence slots: they queued instead of failing.
    assert metric(now, "tokenmill:request_queue_time_seconds_count") - \
        metric(before, "tokenmill:request_queue_time_seconds_count") == 306
