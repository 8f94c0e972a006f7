"""Serving-benchmark metrics: per-request timings in, vLLM's summary numbers out.

Definitions (as vLLM's `benchmark_serving` / `vllm bench serve`):

- TTFT: time from sending the request to the first content chunk.
- TPOT: per request, `(e2el - ttft) / (output_tokens - 1)`; requests with
  one output token have no TPOT.
- ITL: every gap between successive content chunks, pooled over requests.
- E2EL: time from sending the request to the end of the stream.
- goodput: completed requests meeting every SLO, per second of benchmark.

All per-request times are seconds; reported statistics are milliseconds.
Percentiles are NumPy's default (linear interpolation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill.benchmarks.datasets import SampleRequest

METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
METRIC_HEADERS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestFuncOutput:
    """What one streamed request measured (times in seconds, `time.perf_counter` clock)."""

    success: bool = False
    generated_text: str = ""
    ttft: float = 0.0  # send -> first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between successive content chunks
    latency: float = 0.0  # send -> end of stream
    num_chunks: int = 0  # content chunks received
    # tokens each content chunk carried, aligned with [ttft, *itl]; -1 = this chunk did not say (see
    # chunk_token_counts); empty = no chunk said
    chunk_tokens: list[int] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)  # each content chunk's text, aligned with [ttft, *itl]
    prompt_tokens: int = 0  # server usage.prompt_tokens; 0 = not reported
    output_tokens: int = 0  # server usage.completion_tokens; 0 = not reported
    error: str = ""
    start_time: float = 0.0  # perf_counter() when the request was sent


@dataclass(slots=True)
class MetricStats:
    """mean / median / std and chosen percentiles of one metric, in ms."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (percentile, value_ms)


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int  # prompt tokens of completed requests
    total_output: int  # output tokens of completed requests
    request_throughput: float  # completed / s
    request_goodput: float | None  # completed within all SLOs / s; None without --goodput
    output_throughput: float  # output tok / s
    total_token_throughput: float  # (input + output) tok / s
    stats: dict[str, MetricStats]  # metric key (ttft, tpot, itl, e2el) -> stats
    input_lens: list[int]  # per request (0 for failed ones)
    output_lens: list[int]  # per request (0 for failed ones)
    max_output_tokens_per_s: float = 0.0  # most output tokens per second in one 1 s window (peak_output_rate)
    max_concurrent_requests: int = 0  # most requests in flight at one instant


def percentile_label(p: float) -> str:
    """`99.0 -> "99"`, `99.9 -> "99.9"` (vLLM's key spelling)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_percentiles(text: str) -> list[float]:
    """Parse `--metric-percentiles` such as `"50,95,99"`.

    Raises:
        ValueError: a value is not a number in [0, 100].
    """
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--metric-percentiles must be comma-separated numbers, got {text!r}.") from e
    if not values or any(not 0 <= v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles must be numbers in [0, 100], got {text!r}.")
    return values


def parse_metric_names(text: str) -> list[str]:
    """Parse `--percentile-metrics` such as `"ttft,tpot,itl,e2el"`.

    Raises:
        ValueError: an unknown metric name.
    """
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in METRIC_NAMES]
    if bad or not names:
        raise ValueError(f"--percentile-metrics takes a comma-separated subset of {','.join(METRIC_NAMES)}; "
                         f"got {text!r}.")
    return names


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """Parse `--goodput ttft:500 tpot:50` into `{"ttft": 500.0, "tpot": 50.0}` (ms).

    Raises:
        ValueError: an item is not `KEY:VALUE`, the key is not ttft/tpot/e2el,
            or the value is not a non-negative number.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:VALUE pairs with KEY in {', '.join(GOODPUT_KEYS)} and VALUE "
                             f"in ms, e.g. 'ttft:500 tpot:50'; got {item!r}.")
        try:
            slos[key] = float(value)
        except ValueError as e:
            raise ValueError(f"--goodput value for {key} must be a number of ms, got {value!r}.") from e
        if slos[key] < 0:
            raise ValueError(f"--goodput value for {key} must be >= 0 ms, got {value!r}.")
    return slos


def chunk_token_counts(out: RequestFuncOutput, output_tokens: int = 0, tokenizer: Any | None = None) -> np.ndarray:
    """Tokens carried by each content chunk of one request: `[num_chunks]` float64.

    Under load one stream chunk often carries several tokens, so counting
    chunks (as vLLM's `bench serve` does) puts the peak below the mean. The
    rule, per chunk:

    1. what the chunk itself says (`send_request` records it): the rise of the
       cumulative `usage.completion_tokens` when the server reports usage per
       chunk (`stream_options.continuous_usage_stats`, which the client asks
       for), else the length of its `token_ids`, else the number of its
       logprobs entries; tokens of text-less chunks go to the next content
       chunk;
    2. otherwise the token count of the chunk's text under `tokenizer` (at
       least 1);
    3. otherwise 1.

    Then, when the request's output length is known (`output_tokens`, else
    the server's final `usage.completion_tokens`), the counts are scaled so
    that they add up to it: the peak and the mean output throughput count the
    same tokens.

    Example: 3 chunks that say nothing, no tokenizer, usage says 7 tokens ->
    `[7/3, 7/3, 7/3]`; chunk ids of lengths 4, 3, 1 -> `[4, 3, 1]`. The chunks
    are those timed by `[ttft, *itl]`, so a successful request has at least one.
    """
    n = len(out.itl) + 1
    said = np.asarray(out.chunk_tokens if len(out.chunk_tokens) == n else [-1] * n, dtype=np.float64)
    counts = np.ones(n, dtype=np.float64)
    unknown = said < 0
    if unknown.any() and tokenizer is not None and len(out.chunk_texts) == n:
        counts[unknown] = [max(1, len(tokenizer.encode(out.chunk_texts[i], add_special_tokens=False)))
                           for i in np.flatnonzero(unknown)]
    counts[~unknown] = said[~unknown]
    total = output_tokens or out.output_tokens
    if total > 0 and counts.sum() > 0:
        counts *= total / counts.sum()
    return counts


def peak_output_rate(outputs: list[RequestFuncOutput], bucket_s: float = 1.0,
                     output_lens: list[int] | None = None, tokenizer: Any | None = None) -> float:
    """Most output tokens per second in one `bucket_s` window of the run (windows start at the first send).

    Chunk times are `start_time + ttft + cumsum(itl)`; each chunk weighs the
    tokens it carried (`chunk_token_counts`, scaled to `output_lens[i]` when
    given). The run's last window is partial: it is merged into the one
    before it (a run shorter than one window is one window of its own
    length), and each window's tokens are divided by its length. The windows
    then tile the run, so the largest rate is at least the run's average
    (all tokens / time to the last chunk), which is at least the mean output
    throughput (all tokens / benchmark duration). Differs from vLLM's "peak
    output token throughput", which counts one token per chunk in whole
    1-second buckets.

    Args:
        outputs: per-request results; failed ones are ignored.
        bucket_s: window length in seconds, > 0.
        output_lens: per request, the output tokens the mean counts (0 =
            unknown); parallel to `outputs`.
        tokenizer: counts the tokens of chunks whose count the stream did not say.
    """
    ok = [(o, (output_lens[i] if output_lens else 0)) for i, o in enumerate(outputs) if o.success]
    if not ok:
        return 0.0
    t0 = min(o.start_time for o, _ in ok)
    # [ttft, gap1, gap2] -> [ttft, ttft+gap1, ttft+gap1+gap2] seconds after the request's send
    times = np.concatenate([o.start_time - t0 + np.cumsum([o.ttft, *o.itl]) for o, _ in ok])
    weights = np.concatenate([chunk_token_counts(o, n, tokenizer) for o, n in ok])
    end = float(times.max())
    if end <= 0.0:
        return float(weights.sum() / bucket_s)
    last = int(end // bucket_s)  # index of the (partial) last window
    if last == 0:
        return float(weights.sum() / end)
    per_window = np.bincount(np.minimum((times // bucket_s).astype(np.int64), last - 1), weights=weights,
                             minlength=last)
    lengths = np.full(last, bucket_s)
    lengths[-1] = end - (last - 1) * bucket_s  # the last whole window plus the partial one
    return float((per_window / lengths).max())


def peak_concurrency(outputs: list[RequestFuncOutput]) -> int:
    """Most successful requests in flight at once ([start, start + latency) intervals)."""
    events = sorted([(o.start_time, 1) for o in outputs if o.success]
                    + [(o.start_time + o.latency, -1) for o in outputs if o.success])  # ends sort before starts
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def _stats(values_s: list[float], percentiles: list[float]) -> MetricStats:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:  # no samples (e.g. every output was one token): report zeros, as vLLM
        return MetricStats(0.0, 0.0, 0.0, [(p, 0.0) for p in percentiles])
    return MetricStats(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                       [(p, float(np.percentile(ms, p))) for p in percentiles])


def calculate_metrics(requests: list[SampleRequest], outputs: list[RequestFuncOutput], duration_s: float,
                      tokenizer: Any | None, percentiles: list[float],
                      goodput_slos: dict[str, float] | None = None) -> BenchmarkMetrics:
    """Aggregate per-request outputs into `BenchmarkMetrics`.

    Token counts: input = the dataset's tokenizer count when a tokenizer is
    given, else the server's `usage.prompt_tokens` (falling back to the
    dataset's word estimate); output = the server's `usage.completion_tokens`,
    else the tokenizer count of the generated text, else the number of
    content chunks.

    Args:
        requests / outputs: parallel lists, one entry per request.
        duration_s: wall time of the whole benchmark, > 0.
    """
    assert len(requests) == len(outputs)
    input_lens, output_lens = [0] * len(outputs), [0] * len(outputs)
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    for i, (req, out) in enumerate(zip(requests, outputs)):
        if not out.success:
            continue
        if tokenizer is not None:
            input_lens[i] = req.prompt_len
        else:
            input_lens[i] = out.prompt_tokens or req.prompt_len
        n_out = out.output_tokens
        if not n_out:
            n_out = (len(tokenizer.encode(out.generated_text, add_special_tokens=False))
                     if tokenizer is not None else out.num_chunks)
        output_lens[i] = n_out
        tpot = (out.latency - out.ttft) / (n_out - 1) if n_out > 1 else 0.0
        if n_out > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(out.ttft)
        itls.extend(out.itl)
        e2els.append(out.latency)
    completed = len(ttfts)
    total_input, total_output = sum(input_lens), sum(output_lens)
    goodput = None
    if goodput_slos:
        measured = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = np.ones(completed, dtype=bool)
        for key, slo_ms in goodput_slos.items():
            good &= np.asarray(measured[key], dtype=np.float64) * 1000.0 <= slo_ms
        goodput = int(good.sum()) / duration_s
    samples = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        stats={k: _stats(v, percentiles) for k, v in samples.items()},
        input_lens=input_lens,
        output_lens=output_lens,
        max_output_tokens_per_s=peak_output_rate(outputs, output_lens=output_lens, tokenizer=tokenizer),
        max_concurrent_requests=peak_concurrency(outputs),
    )


def metrics_to_dict(m: BenchmarkMetrics, selected: list[str]) -> dict[str, Any]:
    """vLLM's result keys: completed, ..., mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ..."""
    d: dict[str, Any] = {
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for key in selected:
        s = m.stats[key]
        d[f"mean_{key}_ms"] = s.mean
        d[f"median_{key}_ms"] = s.median
        d[f"std_{key}_ms"] = s.std
        for p, v in s.percentiles:
            d[f"p{percentile_label(p)}_{key}_ms"] = v
    return d


def format_summary(m: BenchmarkMetrics, duration_s: float, selected: list[str],
                   max_concurrency: int | None) -> str:
    """vLLM's "Serving Benchmark Result" table, as text."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", duration_s, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", m.max_concurrent_requests)
    row("Total Token throughput (tok/s):", m.total_token_throughput, ".2f")
    for key in selected:
        s, name = m.stats[key], METRIC_NAMES[key]
        lines.append("{s:{c}^{n}}".format(s=METRIC_HEADERS[key], n=50, c="-"))
        row(f"Mean {name} (ms):", s.mean, ".2f")
        row(f"Median {name} (ms):", s.median, ".2f")
        for p, v in s.percentiles:
            row(f"P{percentile_label(p)} {name} (ms):", v, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
