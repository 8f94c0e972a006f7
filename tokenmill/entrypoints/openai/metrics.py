"""Prometheus metrics for `GET /metrics`, with vLLM's metric names.

Every metric exists under the `tokenmill:` prefix; with `--metrics-vllm-names`
(or env `TOKENMILL_METRICS_VLLM_NAMES=1`) the same values are also exported
under `vllm:`, so an existing vLLM Grafana dashboard works unchanged. Names,
meanings and histogram buckets follow vLLM v1's `PrometheusStatLogger`
(vllm/v1/metrics/loggers.py); every series carries a `model_name` label.

Where the numbers come from:

    core process                               front end (AsyncLLM._on_outputs)
    SchedulerStats (gauges + cumulative   -->  gauges set; cumulative counters
      counters: preemptions, prefix cache)      become increments by difference
    EngineCoreOutput per request/step     -->  tokens, TTFT, ITL, queue time
      (+ scheduled_time on the first output)    (front-end clock for arrival,
                                                 core timestamps for tokens)
    a request finishing (core or stop     -->  request_success_total{finished_reason},
      string) or aborted by its client          e2e latency

Times are seconds (`time.time()` in both processes; they share a clock).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenmill import envs
from tokenmill.engine.messages import EngineCoreOutputs, SchedulerStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM v1's buckets (seconds).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")
# Status codes the server sends itself (errors.py, request_guard.py, auth.py, unbuilt_routes.py), created
# at 0: a counter series that first appears at 1 loses that response in rate()/increase(), so without
# this a pod's first 400 or 503 would never reach the dashboard's error panels.
HTTP_STATUSES = (200, 400, 401, 404, 408, 413, 415, 500, 501, 503)


def vllm_names_from_env() -> bool:
    """True when env TOKENMILL_METRICS_VLLM_NAMES is 1/true/yes/on."""
    return envs.metrics_vllm_names()


class _MetricSet:
    """One prefix's metrics ("tokenmill:" or "vllm:"), already bound to the model_name label."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str,
                 cache_info: dict[str, str] | None = None) -> None:
        p, labels = prefix, ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(p + name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(p + name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(p + name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the model's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use, 0 to 1.")
        self.gpu_kv_usage = gauge("gpu_cache_usage_perc", "Older name of kv_cache_usage_perc (same value).")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter(p + "request_success", "Finished requests, by finish reason.",
                          ["model_name", "finished_reason"], registry=registry)
        # Pre-create every reason so a dashboard sees zeros, not missing series.
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (arrival -> first token).",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", _ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Older name of inter_token_latency_seconds.",
                              _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival -> finish, per request.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival -> first scheduled, per request.",
                               _LATENCY_BUCKETS)
        # Exported as <prefix>http_responses_total{model_name, status="200"|"429"|...}.
        self.http_responses = Counter(p + "http_responses", "HTTP responses sent, by status code.",
                                      ["model_name", "status"], registry=registry)
        for status in HTTP_STATUSES:
            self.http_responses.labels(model_name, str(status))
        if cache_info:  # vLLM's info-style gauge: the labels carry the values, the sample is 1
            info = Gauge(p + "cache_config_info", "The engine's KV-cache settings (labels; value 1).",
                         ["model_name", *cache_info], registry=registry)
            info.labels(model_name, *cache_info.values()).set(1)
        self.model_name = model_name


def cache_config_info(cache_config: Any) -> dict[str, str]:
    """Labels of `cache_config_info` from a `CacheConfig`, with vLLM's names (block_size, cache_dtype, ...)."""
    return {"block_size": str(cache_config.block_size), "cache_dtype": str(cache_config.cache_dtype),
            "enable_prefix_caching": str(cache_config.enable_prefix_caching),
            "gpu_memory_utilization": str(cache_config.gpu_memory_utilization)}


class ServerMetrics:
    """The server's Prometheus registry and the code that feeds it.

    Args:
        model_name: the `model_name` label value (the served model name).
        vllm_names: also export every metric under `vllm:`.
        registry: a private `CollectorRegistry` (a new one if None), so two
            servers in one process never share series.
        cache_info: labels of the `cache_config_info` gauge (`cache_config_info(cache_config)`: block size,
            KV-cache dtype, ...); None = no such gauge.
    """

    def __init__(self, model_name: str, vllm_names: bool = False, registry: CollectorRegistry | None = None,
                 cache_info: dict[str, str] | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        prefixes = ["tokenmill:"] + (["vllm:"] if vllm_names else [])
        self._sets = [_MetricSet(self.registry, p, model_name, cache_info) for p in prefixes]
        self._last_stats: SchedulerStats | None = None

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    # -- feeding ---------------------------------------------------------------

    def observe_http_response(self, status: int) -> None:
        """Count one HTTP response with status code `status` (every route, /metrics included)."""
        for s in self._sets:
            s.http_responses.labels(s.model_name, str(status)).inc()

    def observe_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Set the gauges; turn the cumulative counters into increments.

        A counter that went backwards (a restarted core) counts from zero again.
        """
        last = self._last_stats
        for name, attr in (("preemptions", "num_preemptions"), ("prefix_queries", "prefix_cache_queries"),
                           ("prefix_hits", "prefix_cache_hits")):
            now = getattr(stats, attr)
            before = getattr(last, attr) if last is not None else 0
            delta = now - before if now >= before else now
            if delta > 0:
                for s in self._sets:
                    getattr(s, name).inc(delta)
        for s in self._sets:
            s.running.set(stats.num_running_reqs)
            s.waiting.set(stats.num_waiting_reqs)
            s.kv_usage.set(stats.kv_cache_usage)
            s.gpu_kv_usage.set(stats.kv_cache_usage)
        self._last_stats = stats

    def observe_core_outputs(self, outputs: EngineCoreOutputs, request_states: dict[str, Any]) -> list[Any]:
        """Token counts and latencies for one step; call before the output processor runs.

        Args:
            outputs: one step's outputs from the core.
            request_states: `OutputProcessor.request_states` (their
                `metrics` still hold the previous token times).

        Returns:
            The request states seen; pass them to `observe_processed` after
            the output processor ran, to count the ones that finished.
        """
        now = outputs.timestamp or time.time()
        pending: list[Any] = []
        sets = self._sets
        num_generated = num_prompt = 0  # counted once per step: a Counter.inc takes a lock
        for eco in outputs.outputs:
            state = request_states.get(eco.request_id)
            if state is None:  # aborted here while the core ran ahead
                continue
            m = state.metrics
            num_new = len(eco.new_token_ids)
            if num_new:
                num_generated += num_new
                if m.first_token_time is None:
                    num_prompt += len(state.prompt_token_ids)
                    ttft = max(0.0, now - m.arrival_time)
                    for s in sets:
                        s.ttft.observe(ttft)
                else:
                    itl = max(0.0, now - m.last_token_time) / num_new
                    for s in sets:
                        s.itl.observe(itl)
                        s.tpot.observe(itl)
            scheduled = eco.scheduled_time
            if scheduled is not None:
                for s in sets:
                    s.queue.observe(max(0.0, scheduled - m.arrival_time))
            pending.append(state)
        for s in sets:
            if num_generated:
                s.generation_tokens.inc(num_generated)
            if num_prompt:
                s.prompt_tokens.inc(num_prompt)
        return pending

    def observe_processed(self, pending: list[Any]) -> None:
        """Count the request states in `pending` that finished (core stop, length, or a stop string)."""
        for state in pending:
            if state.finish_reason is None:
                continue
            end = state.metrics.finished_time or time.time()
            self._finished(state.finish_reason, end - state.metrics.arrival_time)

    def observe_aborted(self, states: list[Any]) -> None:
        """Count requests the front end aborted (client gone, error) before they finished."""
        now = time.time()
        for state in states:
            self._finished("abort", now - state.metrics.arrival_time)

    def _finished(self, reason: str, e2e_s: float) -> None:
        for s in self._sets:
            counter = s.success.get(reason)
            if counter is not None:
                counter.inc()
            s.e2e.observe(max(0.0, e2e_s))
