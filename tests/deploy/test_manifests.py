"""deploy/kubernetes and deploy/helm/tokenmill validate against the Kubernetes schemas.

Core kinds go through `kubernetes-validate` (strict: unknown fields fail);
ScaledObject, ServiceMonitor and the prometheus-adapter rule through the
schemas in crd_schemas.py. The Helm chart is rendered for each autoscaling
mode by Helm itself and by helm_subset.py. Neither Debian nor PyPI packages a
`helm` binary, but PyPI's helm-python-sdk bundles Helm v4's Go SDK as a C
library: its `Chart.render` is what `helm template` runs and its `lint` is
`helm lint`, offline. helm_subset.py renders the same objects without it.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from crd_schemas import ADAPTER_RULES, BY_KIND
from helm_subset import chart_values, render, render_chart

from optional_deps import require

kubernetes_validate = require("kubernetes_validate", "kubernetes-validate")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
CHART = REPO / "deploy" / "helm" / "tokenmill"
K8S_VERSION = "1.30.0"


def _validate(doc: dict) -> None:
    if doc["kind"] in BY_KIND:
        jsonschema.validate(doc, BY_KIND[doc["kind"]])
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _plain() -> dict[str, dict]:
    """relative path -> its one document."""
    out = {}
    for path in sorted(K8S.rglob("*.yaml")):
        (doc,) = _docs(path.read_text())
        out[str(path.relative_to(K8S))] = doc
    return out


def _render_chart(**overrides: str) -> list[dict]:
    """The chart rendered with values.yaml + overrides (keyword a__b = value path a.b), values schema-checked."""
    sets = {key.replace("__", "."): value for key, value in overrides.items()}
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    jsonschema.validate(chart_values(CHART, sets), schema)
    return _docs(render_chart(CHART, sets))


def _container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_every_plain_manifest_validates():
    docs = _plain()
    assert set(docs) == {"deployment.yaml", "service.yaml", "pvc.yaml", "secret.yaml", "servicemonitor.yaml",
                         "autoscaling/keda/scaledobject.yaml", "autoscaling/hpa/hpa.yaml",
                         "autoscaling/hpa/prometheus-adapter-rules.yaml"}
    for name, doc in docs.items():
        _validate(doc)
    rules = yaml.safe_load(docs["autoscaling/hpa/prometheus-adapter-rules.yaml"]["data"]["config.yaml"])
    jsonschema.validate(rules, ADAPTER_RULES)
    (rule,) = rules["rules"]
    hpa_metric = docs["autoscaling/hpa/hpa.yaml"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert rule["name"]["as"] == hpa_metric == "tokenmill_num_requests_waiting"
    assert re.fullmatch(rule["name"]["matches"], "tokenmill:num_requests_waiting")


def test_the_validators_reject_mistakes():
    docs = _plain()
    bad = copy.deepcopy(docs["deployment.yaml"])
    _container(bad)["livenesProbe"] = _container(bad).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    bad_so = copy.deepcopy(docs["autoscaling/keda/scaledobject.yaml"])
    bad_so["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA wants a string
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad_so)
    bad_sm = copy.deepcopy(docs["servicemonitor.yaml"])
    bad_sm["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad_sm)


def test_probes_drain_and_volumes_of_the_deployment():
    c = _container(_plain()["deployment.yaml"])
    pod = _plain()["deployment.yaml"]["spec"]["template"]["spec"]
    assert c["startupProbe"]["httpGet"]["path"] == c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    # The grace period covers the preStop sleep plus the server's drain (--shutdown-timeout).
    drain = next(float(a.split("=")[1]) for a in c["args"] if a.startswith("--shutdown-timeout="))
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert "persistentVolumeClaim" in volumes["cache"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/data", "/dev/shm"}
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env["TOKENMILL_API_KEY"]["key"] == "api-key" and env["HF_TOKEN"]["key"] == "hf-token"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("mode, kinds", [("keda", {"ScaledObject"}), ("hpa", {"HorizontalPodAutoscaler", "ConfigMap"}),
                                         ("none", set())])
def test_helm_chart_renders_valid_objects_with_one_autoscaler(mode, kinds):
    docs = _render_chart(autoscaling__mode=mode)
    for doc in docs:
        _validate(doc)
        if doc["kind"] == "ConfigMap":  # the prometheus-adapter rule
            jsonschema.validate(yaml.safe_load(doc["data"]["config.yaml"]), ADAPTER_RULES)
    by_kind = {d["kind"] for d in docs}
    assert by_kind - {"Deployment", "Service", "Secret", "PersistentVolumeClaim", "ServiceMonitor"} == kinds
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    # An autoscaler owns the replica count; a fixed one would fight it on every `helm upgrade`.
    assert ("replicas" in deployment["spec"]) == (mode == "none")


def test_helm_chart_matches_the_plain_manifests():
    rendered = {d["kind"]: d for d in _render_chart()}
    plain = {d["kind"]: d for d in _plain().values()}
    rc, pc = _container(rendered["Deployment"]), _container(plain["Deployment"])
    for key in ("args", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "ports", "resources"):
        assert rc[key] == pc[key], key
    assert (rendered["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            == plain["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
    assert rendered["ScaledObject"]["spec"]["triggers"] == plain["ScaledObject"]["spec"]["triggers"]
    assert rendered["ServiceMonitor"]["spec"]["endpoints"] == plain["ServiceMonitor"]["spec"]["endpoints"]
    hpa_mode = {d["kind"]: d for d in _render_chart(autoscaling__mode="hpa")}
    assert hpa_mode["HorizontalPodAutoscaler"]["spec"]["metrics"] == plain["HorizontalPodAutoscaler"]["spec"]["metrics"]
    # The adapter rule, its PromQL taken from values.yaml, is the plain one.
    assert (yaml.safe_load(hpa_mode["ConfigMap"]["data"]["config.yaml"])
            == yaml.safe_load(plain["ConfigMap"]["data"]["config.yaml"]))


def test_helm_values_refuse_an_unknown_autoscaling_mode():
    with pytest.raises(jsonschema.ValidationError):
        _render_chart(autoscaling__mode="both")


def test_subset_renderer_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="unsupported"):
        render('{{ include "x" . }}', {})
    with pytest.raises(ValueError, match="values do not have"):
        render("{{ .Values.missing }}", {})
    assert render("a:{{- if eq .Values.m \"x\" }} 1{{ else }} 2{{ end }}", {"m": "x"}) == "a: 1"
    assert render("a:\n  {{- .Values.m }} {{ .Values.m -}}\n b", {"m": "x"}) == "a:x xb"
    with pytest.raises(ValueError, match="unsupported"):
        render("{{-.Values.m }}", {"m": "x"})  # Go needs the space after the trim marker


@pytest.fixture(scope="module")
def helm():
    """helm_python: Helm v4's Go SDK (libhelm_c) from PyPI's helm-python-sdk."""
    return require("helm_python", "helm-python-sdk")


def _helm_template(helm, **values) -> list[dict]:
    """`helm template tokenmill deploy/helm/tokenmill` with `values` over values.yaml, by Helm's own engine."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="tokenmill", namespace="default", is_install=True)
    return [d for _, text in sorted(manifests.items()) for d in _docs(text)]


@pytest.mark.parametrize("mode, kinds", [("keda", {"ScaledObject"}), ("hpa", {"HorizontalPodAutoscaler", "ConfigMap"}),
                                         ("none", set())])
def test_helm_template_renders_valid_objects_equal_to_the_subset_renderer(helm, mode, kinds):
    docs = _helm_template(helm, autoscaling={"mode": mode})
    for doc in docs:
        _validate(doc)
    assert {d["kind"] for d in docs} - {"Deployment", "Service", "Secret", "PersistentVolumeClaim",
                                        "ServiceMonitor"} == kinds
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert ("replicas" in deployment["spec"]) == (mode == "none")
    # helm_subset.py, used where the wheel is missing, renders exactly what Helm renders.
    by_kind = {d["kind"]: d for d in docs}
    assert by_kind == {d["kind"]: d for d in _render_chart(autoscaling__mode=mode)}
    assert len(by_kind) == len(docs)


def test_helm_lint_strict_finds_nothing_above_info(helm):
    report = helm.lint(str(CHART), strict=True, kube_version="v1.30.0")
    assert report["total_charts_linted"] == 1 and report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


def test_helm_refuses_an_unknown_autoscaling_mode_by_the_values_schema(helm):
    with pytest.raises(helm.HelmValuesError, match="autoscaling/mode"):
        _helm_template(helm, autoscaling={"mode": "both"})
    with pytest.raises(helm.HelmValuesError, match="seriesQuery"):
        _helm_template(helm, autoscaling={"hpa": {"seriesQuery": ""}})
