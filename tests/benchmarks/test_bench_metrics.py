"""Metrics math on synthetic timings: TTFT, TPOT, ITL, E2EL, percentiles, goodput, token counts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tokenmill.benchmarks.datasets import SampleRequest
from tokenmill.benchmarks.metrics import (
    RequestFuncOutput,
    calculate_metrics,
    chunk_token_counts,
    format_summary,
    metrics_to_dict,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    peak_concurrency,
    peak_output_rate,
)


def _out(ttft: float, latency: float, n_out: int, itl: list[float] | None = None, **kw) -> RequestFuncOutput:
    return RequestFuncOutput(success=True, ttft=ttft, latency=latency, output_tokens=n_out,
                             itl=itl or [], num_chunks=n_out, **kw)


def _four_requests():
    # TTFTs 100..400 ms; each request's decode part is 1 s over 10 gaps -> TPOT 100 ms for all.
    outs = [_out(t, t + 1.0, 11, [0.1] * 10) for t in (0.1, 0.2, 0.3, 0.4)]
    outs.append(RequestFuncOutput(success=False, error="HTTP 500"))
    reqs = [SampleRequest("p", 7, 11) for _ in outs]
    return reqs, outs


def test_latency_stats_and_throughput():
    reqs, outs = _four_requests()
    m = calculate_metrics(reqs, outs, duration_s=2.0, tokenizer=None, percentiles=[50, 95, 99])
    assert (m.completed, m.failed) == (4, 1)
    assert m.total_input == 4 * 7 and m.total_output == 4 * 11
    assert m.request_throughput == pytest.approx(2.0)
    assert m.output_throughput == pytest.approx(22.0)
    assert m.total_token_throughput == pytest.approx(36.0)
    ttft = m.stats["ttft"]
    assert ttft.mean == pytest.approx(250.0) and ttft.median == pytest.approx(250.0)
    # linear interpolation between 300 and 400 ms at rank 0.95 * 3 = 2.85
    assert dict(ttft.percentiles)[95] == pytest.approx(385.0)
    assert m.stats["tpot"].mean == pytest.approx(100.0)
    assert m.stats["itl"].median == pytest.approx(100.0)
    assert m.stats["e2el"].mean == pytest.approx(1250.0)
    assert m.input_lens == [7, 7, 7, 7, 0] and m.output_lens[-1] == 0


def test_tpot_skips_single_token_outputs_and_itl_is_pooled():
    reqs = [SampleRequest("p", 3, 5), SampleRequest("p", 3, 1)]
    outs = [_out(0.05, 0.45, 5, [0.1, 0.1, 0.1, 0.1]), _out(0.5, 0.5, 1)]
    m = calculate_metrics(reqs, outs, 1.0, None, [50])
    assert m.stats["tpot"].mean == pytest.approx(100.0)  # (450 - 50) / (5 - 1); the 1-token request has none
    assert m.stats["itl"].mean == pytest.approx(100.0)
    assert m.stats["ttft"].mean == pytest.approx(275.0)


def test_goodput_counts_requests_meeting_every_slo():
    reqs, outs = _four_requests()
    m = calculate_metrics(reqs, outs, 2.0, None, [99], parse_goodput(["ttft:250"]))
    assert m.request_goodput == pytest.approx(1.0)  # 100 and 200 ms qualify -> 2 requests / 2 s
    m = calculate_metrics(reqs, outs, 2.0, None, [99], parse_goodput(["ttft:250", "e2el:1150"]))
    assert m.request_goodput == pytest.approx(0.5)  # only the 100 ms one ends by 1150 ms
    m = calculate_metrics(reqs, outs, 2.0, None, [99], parse_goodput(["tpot:99"]))
    assert m.request_goodput == 0.0
    assert calculate_metrics(reqs, outs, 2.0, None, [99]).request_goodput is None


def test_token_count_sources(word_tokenizer):
    req = SampleRequest("w1 w2 w3", 3, 4)
    # server usage wins for output; tokenizer count for input when a tokenizer is given
    out = RequestFuncOutput(success=True, ttft=0.1, latency=0.2, generated_text="w1 w2", num_chunks=2,
                            prompt_tokens=9, output_tokens=4)
    assert calculate_metrics([req], [out], 1.0, word_tokenizer, [50]).total_input == 3
    assert calculate_metrics([req], [out], 1.0, None, [50]).total_input == 9
    assert calculate_metrics([req], [out], 1.0, None, [50]).total_output == 4
    out.output_tokens = 0  # no usage: tokenizer count of the text, else the chunk count
    assert calculate_metrics([req], [out], 1.0, word_tokenizer, [50]).total_output == 2
    out.num_chunks = 5
    assert calculate_metrics([req], [out], 1.0, None, [50]).total_output == 5


def test_result_keys_and_summary_table():
    reqs, outs = _four_requests()
    m = calculate_metrics(reqs, outs, 2.0, None, [50, 99.9], {"ttft": 300.0})
    d = metrics_to_dict(m, ["ttft", "tpot"])
    for key in ("completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms", "std_tpot_ms", "p99.9_tpot_ms"):
        assert key in d, key
    assert "mean_itl_ms" not in d
    table = format_summary(m, 2.0, ["ttft", "tpot"], max_concurrency=4)
    assert "Serving Benchmark Result" in table and "Request goodput (req/s):" in table
    assert "P99.9 TTFT (ms):" in table and "Maximum request concurrency:" in table
    assert "Inter-token Latency" not in table


@pytest.mark.parametrize("bad", [["ttft=5"], ["foo:5"], ["ttft:x"], ["tpot:-1"]])
def test_parse_goodput_rejects(bad):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(bad)


def test_parse_lists():
    assert parse_percentiles("50, 95,99.9") == [50.0, 95.0, 99.9]
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError):
        parse_percentiles("101")
    with pytest.raises(ValueError):
        parse_metric_names("ttft,latency")


def test_peaks():
    a = _out(0.1, 0.5, 5, [0.1] * 4, start_time=10.0)  # chunks at 0.1 .. 0.5 s -> 5 in the first second
    b = _out(0.9, 2.5, 3, [0.2, 1.4], start_time=10.2)  # chunks at 1.1, 1.3, 2.7 s
    c = _out(0.2, 1.0, 2, [0.1], start_time=10.5)  # in flight [10.5, 11.5)
    failed = RequestFuncOutput(success=False, start_time=10.0, latency=5.0)
    # windows [0, 1) and [1, 2.7] (the partial last window merged into the one before): 5 / 1, 3 / 1.7
    assert peak_output_rate([a, b, failed]) == 5.0
    assert peak_output_rate([a, b], bucket_s=2.0) == pytest.approx(8 / 2.7)  # shorter than 2 windows: one
    assert peak_output_rate([a], bucket_s=2.0) == pytest.approx(5 / 0.5)  # a run shorter than one window
    # a [10.0, 10.5), b [10.2, 12.7), c [10.5, 11.5): a ends as c starts -> at most 2 at once
    assert peak_concurrency([a, b, c, failed]) == 2
    m = calculate_metrics([SampleRequest("p", 1, 5)] * 3, [a, b, c], 2.0, None, [50])
    d = metrics_to_dict(m, ["ttft"])
    assert d["max_concurrent_requests"] == 2
    assert d["max_output_tokens_per_s"] == 7.0  # c adds chunks at 0.7 and 0.8 s to the first second


def _chunks(itl: list[float], ttft: float, output_tokens: int, **kw) -> RequestFuncOutput:
    """A successful request with len(itl) + 1 content chunks that reports `output_tokens` in its usage."""
    return RequestFuncOutput(success=True, ttft=ttft, latency=ttft + sum(itl), itl=itl, num_chunks=len(itl) + 1,
                             output_tokens=output_tokens, **kw)


def test_chunk_token_count_sources(word_tokenizer):
    # what the chunks say (per-chunk usage, token ids or logprobs, recorded by send_request) wins
    assert chunk_token_counts(_chunks([0.1, 0.1], 0.1, 8, chunk_tokens=[4, 3, 1])).tolist() == [4, 3, 1]
    # chunks that say nothing: the tokenizer counts their text; the chunk that says keeps its count
    said_some = _chunks([0.1, 0.1], 0.1, 0, chunk_tokens=[-1, 5, -1], chunk_texts=["w1 w2 w3", "w4", "w5 w6"])
    assert chunk_token_counts(said_some, tokenizer=word_tokenizer).tolist() == [3, 5, 2]
    assert chunk_token_counts(said_some).tolist() == [1, 5, 1]  # no tokenizer: one token each
    # the counts add up to the request's output length: 7 tokens over 3 silent chunks -> 7/3 each
    assert chunk_token_counts(_chunks([0.1, 0.1], 0.1, 7)).tolist() == pytest.approx([7 / 3] * 3)
    assert chunk_token_counts(said_some, 20, word_tokenizer).tolist() == pytest.approx([6, 10, 4])
    # nothing known at all: one token per chunk (vLLM's rule)
    assert chunk_token_counts(_chunks([0.1, 0.1], 0.1, 0)).tolist() == [1, 1, 1]


def test_peak_counts_tokens_per_chunk(word_tokenizer):
    """A synthetic trace where chunks carry several tokens: one token per chunk put the peak below the mean."""
    # a: chunks at 0.2, 0.4, 0.6, 2.5 s whose token ids number 1, 4, 4, 1 (no usage in the stream)
    a = _chunks([0.2, 0.2, 1.9], ttft=0.2, output_tokens=0, chunk_tokens=[1, 4, 4, 1],
                chunk_texts=["w1", "w2 w3 w4 w5", "w6 w7 w8 w9", "w10"],
                generated_text="w1 w2 w3 w4 w5 w6 w7 w8 w9 w10")
    # b: chunks at 0.5, 1.5, 2.6, 3.0 s that say nothing; their texts hold 3, 1, 2, 1 tokens
    b = _chunks([1.0, 1.1, 0.4], ttft=0.5, output_tokens=0, chunk_tokens=[-1] * 4,
                chunk_texts=["w1 w2 w3", "w4", "w5 w6", "w7"], generated_text="w1 w2 w3 w4 w5 w6 w7")
    reqs = [SampleRequest("p", 1, 10), SampleRequest("p", 1, 7)]
    m = calculate_metrics(reqs, [a, b], 3.0, word_tokenizer, [50])
    assert m.total_output == 17 and m.output_throughput == pytest.approx(17 / 3)
    # [0, 1) s: 1 + 4 + 4 from a, 3 from b = 12; [1, 2): 1; [2, 3]: 1 + 2 + 1 = 4
    assert m.max_output_tokens_per_s == pytest.approx(12.0)
    # one token per chunk would say 4 in [0, 1) s: below the mean of 5.67
    blind = [dataclasses.replace(o, chunk_tokens=[], chunk_texts=[]) for o in (a, b)]
    assert peak_output_rate(blind) == pytest.approx(4.0)
    assert m.max_output_tokens_per_s >= m.output_throughput


@pytest.mark.parametrize("seed", range(20))
def test_peak_is_never_below_the_mean(seed):
    """Random traces with multi-token chunks and runs of any length: peak >= mean output throughput."""
    rng = np.random.default_rng(seed)
    outs, reqs = [], []
    for _ in range(int(rng.integers(1, 12))):
        n = int(rng.integers(1, 20))
        carried = rng.integers(1, 6, size=n).tolist()
        outs.append(_chunks(rng.exponential(0.3, size=n - 1).tolist(), ttft=float(rng.uniform(0.01, 2.0)),
                            output_tokens=sum(carried), chunk_tokens=carried, start_time=float(rng.uniform(0, 3))))
        reqs.append(SampleRequest("p", 1, sum(carried)))
    t0 = min(o.start_time for o in outs)
    duration = max(o.start_time + o.latency for o in outs) - t0  # the benchmark lasts at least this long
    m = calculate_metrics(reqs, outs, duration, None, [50])
    assert m.max_output_tokens_per_s >= m.output_throughput * (1 - 1e-9)
