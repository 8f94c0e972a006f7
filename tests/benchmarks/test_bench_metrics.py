"""Metrics math on synthetic timings: TTFT, TPOT, ITL, E2EL, percentiles, goodput, token counts."""

from __future__ import annotations

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
    b = _out(0.9, 1.5, 3, [0.2, 0.2], start_time=10.2)  # chunks at 1.1, 1.3, 1.5 s
    c = _out(0.2, 1.0, 2, [0.1], start_time=10.5)  # in flight [10.5, 11.5)
    failed = RequestFuncOutput(success=False, start_time=10.0, latency=5.0)
    assert peak_output_rate([a, b, failed]) == 5.0
    assert peak_output_rate([a, b], bucket_s=2.0) == 4.0  # 8 chunks over [0, 2) s
    # a [10.0, 10.5), b [10.2, 11.7), c [10.5, 11.5): a ends as c starts -> at most 2 at once
    assert peak_concurrency([a, b, c, failed]) == 2
    m = calculate_metrics([SampleRequest("p", 1, 5)] * 3, [a, b, c], 2.0, None, [50])
    d = metrics_to_dict(m, ["ttft"])
    assert d["max_concurrent_requests"] == 2
    assert d["max_output_tokens_per_s"] == 7.0  # c adds chunks at 0.7 and 0.8 s to the first second


def _chunks(itl: list[float], ttft: float, output_tokens: int, **kw) -> RequestFuncOutput:
    """A successful request with len(itl) + 1 content chunks that reports `output_tokens` in its usage."""
    return RequestFuncOutput(success=True, ttft=ttft, latency=ttft + sum(itl), itl=itl, num_chunks=len(itl) + 1,
                             output_tokens=output_tokens, **kw)


def test_peak_counts_tokens_per_chunk():
    # Under load one stream chunk holds several tokens. a: chunks at 0.1, 0.2, 0.3 s carrying 4, 3, 1
    # tokens (reported per chunk); b: chunks at 0.5, 1.5 s, no per-chunk counts, usage says 6 -> 3 + 3.
    a = _chunks([0.1, 0.1], ttft=0.1, chunk_tokens=[4, 3, 1], output_tokens=8)
    b = _chunks([1.0], ttft=0.5, output_tokens=6)
    assert chunk_token_counts(a).tolist() == [4, 3, 1]
    assert chunk_token_counts(b).tolist() == [3, 3]
    assert peak_output_rate([a, b]) == 11.0  # 4 + 3 + 1 + 3 in [0, 1) s; one per chunk would say 4
    # A request's chunk counts add up to its usage: 7 tokens over 3 chunks -> [3, 2, 2].
    assert chunk_token_counts(_chunks([0.1, 0.1], ttft=0.1, output_tokens=7)).tolist() == [3, 2, 2]
    # No usage at all: one token per chunk (vLLM's rule).
    assert chunk_token_counts(_chunks([0.1, 0.1], ttft=0.1, output_tokens=0)).tolist() == [1, 1, 1]
