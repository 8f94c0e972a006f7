"""`tokenmill bench serve`: load-test any OpenAI-compatible server with streaming requests.

Flag names, defaults, arrival process, metrics and result keys follow vLLM's
`vllm bench serve` (formerly `benchmarks/benchmark_serving.py`), so a vLLM
user's command runs unchanged against tokenmill, vLLM, llama.cpp's server or
Ollama's `/v1`. Requests go out with aiohttp; arrivals are a gamma process
with shape `burstiness` and mean gap `1 / request_rate` (burstiness 1 =
Poisson; rate inf = all at once), capped by `--max-concurrency` in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill import envs
from tokenmill.benchmarks import datasets
from tokenmill.benchmarks.metrics import (
    RequestFuncOutput,
    calculate_metrics,
    format_summary,
    metrics_to_dict,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
)

BACKENDS = ("openai", "openai-chat", "vllm")  # vllm = openai completions (vLLM's older default name)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `bench serve` flags (vLLM's spellings and defaults) to `parser`."""
    g = parser.add_argument_group("server")
    g.add_argument("--backend", default="openai", choices=BACKENDS,
                   help="openai: /v1/completions with `prompt`; openai-chat: /v1/chat/completions with `messages`.")
    g.add_argument("--base-url", default=None, help="Server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port).")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None,
                   help="API path (default /v1/completions, or /v1/chat/completions for --backend openai-chat).")
    g.add_argument("--model", default=None,
                   help="Model name sent in requests (default: the server's first /v1/models).")
    g.add_argument("--served-model-name", default=None, help="Name sent in requests when it differs from --model.")
    g.add_argument("--tokenizer", default=None,
                   help="Tokenizer folder, hub id or .gguf file for prompts and token counts (default: none; "
                        "random words, and the server's usage numbers).")
    g.add_argument("--trust-remote-code", action="store_true")
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=["random", "prefix-repetition", "custom"])
    g.add_argument("--dataset-path", default=None, help="JSONL file for --dataset-name custom: {\"prompt\": ..., "
                                                        "\"output_tokens\": ...} per line.")
    g.add_argument("--custom-output-len", type=int, default=256, help="Output tokens of custom prompts without one.")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths are drawn uniformly from [L*(1-r), L*(1+r)]; r in [0, 1).")
    g.add_argument("--random-prefix-len", type=int, default=0, help="Tokens of a prefix shared by every prompt.")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second (gamma/Poisson arrivals); inf sends them all at once.")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more even.")
    g.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    g.add_argument("--ignore-eos", action="store_true",
                   help="Send vLLM's `ignore_eos: true` so outputs reach max_tokens.")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body.")
    g = parser.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000; goodput counts requests meeting all.")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="50,95,99")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--save-result", action="store_true")
    g.add_argument("--save-detailed", action="store_true", help="Also save each request's generated text.")
    g.add_argument("--append-result", action="store_true", help="Append to the result file as one JSON line.")
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--label", default=None, help="Name of this run in results and plots (default: the backend).")
    g.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="Extra fields for the result.")
    return parser


def build_url(base_url: str | None, host: str, port: int, path: str) -> str:
    """`base_url` (or http://host:port) joined with `path`; a base ending in /v1 is not doubled."""
    base = base_url.rstrip("/") if base_url else f"http://{host}:{port}"
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + path


def arrival_times(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times `[n]` float64 seconds from the start: first at 0, then gamma gaps.

    Gaps ~ Gamma(shape=burstiness, scale=1 / (request_rate * burstiness)), so
    their mean is 1 / request_rate for any burstiness (vLLM's arrival model).

    Raises:
        ValueError: request_rate or burstiness is not positive.
    """
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}.")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}.")
    if math.isinf(request_rate) or n == 0:
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def build_payload(prompt: str, output_len: int, model: str, chat: bool, sampling: dict[str, Any]) -> dict[str, Any]:
    """One streaming request body; usage is asked for in every chunk (the peak metric counts tokens per chunk)."""
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = output_len
    else:
        body["prompt"] = prompt
    body["max_tokens"] = output_len
    body.update(sampling)
    return body


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choices[0].get("text") or ""


def _auth_headers() -> dict[str, str]:
    """`Authorization: Bearer $OPENAI_API_KEY` when that is set (a server started with --api-key), else none."""
    api_key = envs.openai_api_key()
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _chunk_token_ids_count(chunk: dict[str, Any]) -> int | None:
    """Tokens one stream chunk says it carries: its `token_ids` (vLLM's `return_token_ids`), else its
    logprobs entries (chat `logprobs.content`, completions `logprobs.tokens`); None when it says neither."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs") or {}
    for key in ("content", "tokens"):
        if isinstance(logprobs.get(key), list):
            return len(logprobs[key])
    return None


async def send_request(session: Any, api_url: str, payload: dict[str, Any], chat: bool,
                       pbar: Any | None = None) -> RequestFuncOutput:
    """POST one streaming request and time its SSE chunks.

    A chunk counts as a token event when it carries text; the first one sets
    TTFT, each later one adds an ITL gap. `chunk_texts` keeps each such
    chunk's text and `chunk_tokens` the tokens it says it carried (per-chunk
    usage, else its token ids or logprobs; -1 when it says nothing; tokens of
    text-less chunks go to the next one): `chunk_token_counts` turns them
    into the peak metric's weights. A non-200 status, an `error`
    object in the stream, a broken connection or a stream without any text
    marks the request failed, with the reason in `error`.
    """
    import aiohttp

    out = RequestFuncOutput()
    headers = {"Content-Type": "application/json", **_auth_headers()}
    start = last = out.start_time = time.perf_counter()
    reported: int | None = None  # cumulative completion tokens, when the server reports usage per chunk
    counted = 0  # of those, tokens already given to a content chunk
    pending = 0  # tokens (by ids / logprobs) of text-less chunks since the last content chunk
    try:
        async with session.post(api_url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
            else:
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, `event:` lines
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    now = time.perf_counter()
                    if chunk.get("error"):
                        out.error = f"server error in stream: {json.dumps(chunk['error'])[:500]}"
                        break
                    usage = chunk.get("usage")
                    if usage and chunk.get("choices"):  # per-chunk (continuous) usage: cumulative counts
                        reported = int(usage.get("completion_tokens") or 0)
                    said = _chunk_token_ids_count(chunk)
                    if text := _chunk_text(chunk, chat):
                        if reported is not None:
                            out.chunk_tokens.append(reported - counted)
                            counted = reported
                        elif said is not None:
                            out.chunk_tokens.append(said + pending)
                        else:
                            out.chunk_tokens.append(-1)
                        pending = 0
                        out.chunk_texts.append(text)
                        if out.num_chunks == 0:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.num_chunks += 1
                        out.generated_text += text
                    elif said is not None:
                        pending += said
                    if usage:
                        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        out.output_tokens = int(usage.get("completion_tokens") or 0)
                out.latency = time.perf_counter() - start
                if reported is not None and out.chunk_tokens:  # tokens after the last content chunk
                    out.chunk_tokens[-1] += max(out.output_tokens - sum(out.chunk_tokens), 0)
                if not out.error and out.num_chunks == 0:
                    out.error = "the stream ended without any generated text"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError covers bad JSON / UTF-8
        out.error = f"{type(e).__name__}: {e}"
    out.success = not out.error
    if pbar is not None:
        pbar.update(1)
    return out


async def fetch_first_model(models_url: str) -> str:
    """The id of the first model listed at `models_url` (OpenAI `GET /v1/models`), sent with
    OPENAI_API_KEY as a bearer token when it is set (as the benchmark's requests are).

    Raises:
        ValueError: the server cannot be reached, answers with an error status (the status and body are in
            the message, e.g. 401 for a missing or wrong API key), or lists no model.
    """
    import aiohttp

    try:
        async with aiohttp.ClientSession() as session, session.get(models_url, headers=_auth_headers()) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                hint = " (set OPENAI_API_KEY to the server's --api-key)" if resp.status == 401 else ""
                raise ValueError(f"GET {models_url} answered HTTP {resp.status}{hint}: {body}")
            data = await resp.json(content_type=None)
        return data["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"Cannot read a model name from {models_url} ({type(e).__name__}: {e}); "
                         "pass --model.") from e


async def benchmark(api_url: str, payloads: list[dict[str, Any]], chat: bool, request_rate: float,
                    burstiness: float, max_concurrency: int | None, seed: int = 0,
                    disable_tqdm: bool = False) -> tuple[list[RequestFuncOutput], float]:
    """Send every payload on the arrival schedule; return the outputs (in order) and the duration in s.

    The first payload is sent once beforehand as a check.

    Raises:
        ValueError: the check request fails (wrong URL, model or server down).
    """
    import aiohttp
    from tqdm.asyncio import tqdm

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}.")
    times = arrival_times(len(payloads), request_rate, burstiness, np.random.default_rng(seed))
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    # One connection per request (as vLLM's earlier client, a session per request): a server may close a
    # kept-alive connection while the client is reusing it (llama.cpp's llama-server on the H200 at concurrency
    # 16-256 dropped 1/32 to 51/512 requests that way: ServerDisconnectedError), and a local TCP connect costs
    # well under a millisecond.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=10 * 1024**2) as session:
        check = await send_request(session, api_url, payloads[0], chat)
        if not check.success:
            raise ValueError(f"The first test request to {api_url} failed: {check.error}. Check --base-url, "
                             "--endpoint, --backend and --model.")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = None if disable_tqdm else tqdm(total=len(payloads))

        async def limited(payload: dict[str, Any]) -> RequestFuncOutput:
            if sem is None:
                return await send_request(session, api_url, payload, chat, pbar)
            async with sem:
                return await send_request(session, api_url, payload, chat, pbar)

        start = time.perf_counter()
        tasks = []
        for t, payload in zip(times.tolist(), payloads):
            if (delay := start + t - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(payload)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
    return list(outputs), duration


def sample_requests(args: argparse.Namespace, tokenizer: Any | None) -> list[datasets.SampleRequest]:
    """The dataset chosen by `--dataset-name`, seeded by `--seed`."""
    maker = datasets.PromptMaker(tokenizer, np.random.default_rng(args.seed))
    if args.dataset_name == "random":
        return datasets.sample_random(maker, args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, args.random_prefix_len)
    if args.dataset_name == "prefix-repetition":
        return datasets.sample_prefix_repetition(
            maker, args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len)
    if not args.dataset_path:
        raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl.")
    return datasets.sample_custom(maker, args.dataset_path, args.num_prompts, args.custom_output_len)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": args.temperature}
    for name in ("top_p", "top_k", "min_p"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body must be a JSON object: {e}.") from e
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object, e.g. '{\"top_k\": 20}'.")
        sampling.update(extra)
    return sampling


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark, print vLLM's summary table, save the result if asked; return the result dict.

    Raises:
        ValueError: a flag is invalid or the server rejects the first request.
        ModuleNotFoundError: aiohttp (the bench extra) is missing; raised before any work.
    """
    import aiohttp  # noqa: F401 - the `tokenmill` command turns its absence into the install line

    selected = parse_metric_names(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    slos = parse_goodput(args.goodput)
    metadata = {}
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE items, got {item!r}.")
        metadata[key] = value
    chat = args.backend == "openai-chat"
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    api_url = build_url(args.base_url, args.host, args.port, endpoint)
    model = args.served_model_name or args.model
    if model is None:
        model = asyncio.run(fetch_first_model(build_url(args.base_url, args.host, args.port, "/v1/models")))
    tokenizer = datasets.load_tokenizer(args.tokenizer, args.trust_remote_code) if args.tokenizer else None
    requests = sample_requests(args, tokenizer)
    sampling = _sampling(args)
    payloads = [build_payload(r.prompt, r.expected_output_len, model, chat, sampling) for r in requests]
    print(f"Benchmarking {api_url} with {len(payloads)} prompts; request rate {args.request_rate}, "
          f"burstiness {args.burstiness}, max concurrency {args.max_concurrency}.")
    outputs, duration = asyncio.run(benchmark(api_url, payloads, chat, args.request_rate, args.burstiness,
                                              args.max_concurrency, args.seed, args.disable_tqdm))
    m = calculate_metrics(requests, outputs, duration, tokenizer, percentiles, slos)
    print(format_summary(m, duration, selected, args.max_concurrency))
    errors = [o.error for o in outputs if o.error]
    if errors:
        print(f"First error of {len(errors)}: {errors[0]}", file=sys.stderr)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "label": args.label or args.backend,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "endpoint": endpoint,
        "num_prompts": len(payloads),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **metadata,
        "duration": duration,
        **metrics_to_dict(m, selected),
        "input_lens": m.input_lens,
        "output_lens": m.output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "errors": [o.error for o in outputs],
    }
    if args.save_detailed:
        result["generated_texts"] = [o.generated_text for o in outputs]
    if args.save_result or args.append_result or args.result_filename:
        save_result(result, args)
    return result


def save_result(result: dict[str, Any], args: argparse.Namespace) -> Path:
    """Write `result` as JSON (vLLM's default name: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)."""
    name = args.result_filename
    if not name:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{result['label']}-{args.request_rate}qps{conc}-{str(result['model_id']).split('/')[-1]}-" \
               f"{result['date']}.json"
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.append_result and path.is_file():
        with path.open("a", encoding="utf-8") as f:
            f.write("\n" + json.dumps(result))
    else:
        path.write_text(json.dumps(result, indent=None), encoding="utf-8")
    print(f"Saved the result to {path}")
    return path
