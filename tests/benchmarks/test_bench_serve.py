"""The serve client against a fake streaming OpenAI server on 127.0.0.1."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenmill.benchmarks import serve
from tokenmill.benchmarks.cli import main


def _write_prompts(path, prompts: list[tuple[str, int]]) -> str:
    path.write_text("\n".join(json.dumps({"prompt": p, "output_tokens": n}) for p, n in prompts))
    return str(path)


def test_serve_counts_timings_failures_and_result_file(fake_server, tmp_path, capsys):
    data = _write_prompts(tmp_path / "p.jsonl", [("a b c", 4), ("d e", 3), ("FAIL now", 4), ("f g h i", 5),
                                                 ("STREAMERR x", 6), ("j", 2)])
    rc = main(["serve", "--base-url", fake_server.url, "--model", "fake", "--dataset-name", "custom",
               "--dataset-path", data, "--num-prompts", "6", "--max-concurrency", "2", "--ignore-eos",
               "--goodput", "ttft:10000", "--save-result", "--result-dir", str(tmp_path / "res"),
               "--result-filename", "r.json", "--disable-tqdm", "--label", "fake-run"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Failed requests:" in printed
    r = json.loads((tmp_path / "res" / "r.json").read_text())
    assert r["completed"] == 4 and r["failed"] == 2
    assert r["total_output_tokens"] == 4 + 3 + 5 + 2  # from the server's usage chunk
    assert r["total_input_tokens"] == 3 + 2 + 4 + 1  # no tokenizer: the server's prompt_tokens
    assert r["max_concurrency"] == 2 and r["request_rate"] == "inf" and r["label"] == "fake-run"
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert "HTTP 500" in r["errors"][2] and "engine died" in r["errors"][4]
    # ITL gaps: one per chunk after the first; TTFT covers the server's first-chunk delay
    assert [len(x) for x in r["itls"]] == [3, 2, 0, 4, 0, 1]
    ok = [0, 1, 3, 5]
    assert all(r["ttfts"][i] >= fake_server.first_delay_s * 0.9 for i in ok)
    assert r["median_itl_ms"] >= fake_server.gap_s * 1000 * 0.9
    # TPOT = (e2el - ttft) / (n - 1) lies between the server's gap and the whole decode time
    assert fake_server.gap_s * 1000 * 0.9 <= r["mean_tpot_ms"] <= r["mean_e2el_ms"]
    for key in ("mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms", "p95_ttft_ms", "p99_ttft_ms", "p99_tpot_ms",
                "p99_itl_ms", "p99_e2el_ms", "request_throughput", "output_throughput", "total_token_throughput",
                "duration", "input_lens", "output_lens"):
        assert key in r, key
    body = fake_server.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True,
                                                                  "continuous_usage_stats": True}
    assert body["ignore_eos"] is True and body["model"] == "fake" and body["temperature"] == 0.0


def test_serve_chat_backend_random_dataset_and_model_discovery(fake_server, tmp_path):
    out = tmp_path / "chat.json"
    rc = main(["serve", "--backend", "openai-chat", "--base-url", fake_server.url + "/v1",
               "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "3",
               "--num-prompts", "5", "--request-rate", "200", "--burstiness", "2", "--disable-tqdm",
               "--result-filename", str(out), "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "90"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 5 and r["failed"] == 0 and r["total_output_tokens"] == 15
    assert r["model_id"] == "fake-model"  # read from /v1/models
    assert "p90_ttft_ms" in r and "mean_tpot_ms" not in r
    # the role-only first chunk does not count: 3 content chunks -> 2 gaps
    assert all(len(x) == 2 for x in r["itls"])
    body = fake_server.bodies[-1]
    assert body["messages"][0]["role"] == "user" and len(body["messages"][0]["content"].split()) == 8
    assert "ignore_eos" not in body


def test_model_discovery_sends_the_api_key_and_reports_http_errors(fake_server, monkeypatch):
    import asyncio

    from tokenmill.benchmarks.serve import fetch_first_model

    fake_server.api_key = "secret"
    url = fake_server.url + "/v1/models"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"HTTP 401 \(set OPENAI_API_KEY.*Invalid API key"):
        asyncio.run(fetch_first_model(url))
    monkeypatch.setenv("OPENAI_API_KEY", "secret")
    assert asyncio.run(fetch_first_model(url)) == "fake-model"


def test_serve_reports_a_dead_server_as_one_error_line(tmp_path, capsys):
    rc = main(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2",
               "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm"])
    assert rc == 1
    assert "first test request" in capsys.readouterr().err


def test_bad_flags_give_exit_status_2(capsys):
    assert main(["serve", "--backend", "tgi"]) == 2
    assert main(["serve", "--goodput", "ttft=3", "--model", "m", "--num-prompts", "1"]) == 1
    assert "--goodput" in capsys.readouterr().err


def test_build_url():
    assert serve.build_url(None, "localhost", 8001, "/v1/completions") == "http://localhost:8001/v1/completions"
    assert serve.build_url("http://h:11434/v1/", "x", 1, "/v1/chat/completions") == \
        "http://h:11434/v1/chat/completions"
    assert serve.build_url("http://h:8000", "x", 1, "/v1/completions") == "http://h:8000/v1/completions"


def test_arrival_times_mean_gap_and_burstiness():
    rng = np.random.default_rng(0)
    t = serve.arrival_times(4000, 10.0, 1.0, rng)
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    cv_bursty = np.diff(serve.arrival_times(4000, 10.0, 0.25, rng)).std() / 0.1
    cv_even = np.diff(serve.arrival_times(4000, 10.0, 4.0, rng)).std() / 0.1
    # gamma CV = 1 / sqrt(shape): 2 for shape 0.25, 0.5 for shape 4
    assert cv_bursty > 1.5 and cv_even < 0.8
    assert not serve.arrival_times(5, float("inf"), 1.0, rng).any()
    with pytest.raises(ValueError, match="request-rate"):
        serve.arrival_times(5, 0.0, 1.0, rng)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("prompt, said", [("PAIRS of tokens", [2, 2, 1]), ("PAIRS TOKENIDS", [2, 2, 1]),
                                          ("PAIRS NOUSAGE", [-1, -1, -1])])
def test_send_request_counts_tokens_per_chunk(fake_server, chat, prompt, said):
    """Multi-token chunks: per-chunk usage, else the chunk's token ids, give each chunk's token count;
    a chunk that says neither is marked -1 and keeps its text for the tokenizer."""
    import asyncio

    import aiohttp

    async def one() -> serve.RequestFuncOutput:
        body = serve.build_payload(prompt, 5, "fake", chat, {})
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with aiohttp.ClientSession() as session:
            return await serve.send_request(session, fake_server.url + path, body, chat)

    out = asyncio.run(one())
    assert out.success and out.num_chunks == 3 and out.output_tokens == 5
    assert out.chunk_tokens == said
    assert out.chunk_texts == ["tok tok ", "tok tok ", "tok "]


def test_a_server_closing_kept_alive_connections_loses_no_request():
    """A server that answers one request per connection and then closes it, without saying so (no
    `Connection: close`), some time later: a client reusing the connection would see it drop
    (ServerDisconnectedError, as llama-server's did under load); every request must succeed."""
    import asyncio

    chunk = 'data: {"choices": [{"text": "tok "}]}\n\ndata: [DONE]\n\n'
    answer = ("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
              f"Content-Length: {len(chunk)}\r\n\r\n{chunk}").encode()
    served = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(answer)
        await writer.drain()
        served.append(1)
        await asyncio.sleep(0.3)  # a reused connection's next request arrives meanwhile and is never read
        writer.close()

    async def run() -> list[serve.RequestFuncOutput]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        payloads = [serve.build_payload("p", 1, "fake", False, {}) for _ in range(6)]
        async with server:
            outputs, _ = await serve.benchmark(f"http://127.0.0.1:{port}/v1/completions", payloads, False,
                                               float("inf"), 1.0, 1, disable_tqdm=True)
        return outputs

    outputs = asyncio.run(run())
    assert [o.error for o in outputs if not o.success] == []
    assert len(served) == 7  # the check request and the six
