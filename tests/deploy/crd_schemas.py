"""JSON Schemas for the custom resources tokenmill ships, written from their documented fields.

`kubernetes-validate` has the core API's schemas only, so the ScaledObject
(KEDA, keda.sh/v1alpha1: https://keda.sh/docs/latest/reference/scaledobject-spec/
and the Prometheus scaler page) and the ServiceMonitor (Prometheus Operator,
monitoring.coreos.com/v1: its API reference) are checked against these: every
field tokenmill sets is listed with its documented type, and any other field
is rejected (`additionalProperties: false`), so a typo fails the test. The
prometheus-adapter rule follows its config reference (docs/config.md).
"""

from __future__ import annotations

_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _LABELS,
                            "annotations": _LABELS}, "additionalProperties": False}
# Prometheus Operator's Duration pattern.
_DURATION = {"type": "string",
             "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}


def _strict(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or [], "additionalProperties": False}


SCALED_OBJECT = _strict({
    "apiVersion": {"const": "keda.sh/v1alpha1"},
    "kind": {"const": "ScaledObject"},
    "metadata": _METADATA,
    "spec": _strict({
        # Without apiVersion/kind the target is a Deployment (apps/v1).
        "scaleTargetRef": _strict({"name": {"type": "string"}, "apiVersion": {"type": "string"},
                                   "kind": {"type": "string"}, "envSourceContainerName": {"type": "string"}},
                                  ["name"]),
        "pollingInterval": _INT32,
        "cooldownPeriod": _INT32,
        "minReplicaCount": _INT32,
        "maxReplicaCount": _INT32,
        "triggers": {"type": "array", "minItems": 1, "items": _strict({
            "type": {"const": "prometheus"},
            "name": {"type": "string"},
            # Trigger metadata values are strings in the CRD (numbers must be quoted).
            "metadata": _strict({
                "serverAddress": {"type": "string", "pattern": "^https?://"},
                "query": {"type": "string", "minLength": 1},
                "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                "activationThreshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                "namespace": {"type": "string"},
                "ignoreNullValues": {"type": "string", "enum": ["true", "false"]},
            }, ["serverAddress", "query", "threshold"]),
        }, ["type", "metadata"])},
    }, ["scaleTargetRef", "triggers"]),
}, ["apiVersion", "kind", "metadata", "spec"])

SERVICE_MONITOR = _strict({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "ServiceMonitor"},
    "metadata": _METADATA,
    "spec": _strict({
        "jobLabel": {"type": "string"},
        "selector": _strict({"matchLabels": _LABELS}, ["matchLabels"]),
        "namespaceSelector": {"type": "object"},
        "endpoints": {"type": "array", "minItems": 1, "items": _strict({
            "port": {"type": "string"},
            "path": {"type": "string", "pattern": "^/"},
            "interval": _DURATION,
            "scrapeTimeout": _DURATION,
            "scheme": {"enum": ["http", "https"]},
        }, ["port"])},
    }, ["selector", "endpoints"]),
}, ["apiVersion", "kind", "metadata", "spec"])

ADAPTER_RULES = _strict({"rules": {"type": "array", "minItems": 1, "items": _strict({
    "seriesQuery": {"type": "string"},
    "seriesFilters": {"type": "array"},
    "resources": _strict({"overrides": {"type": "object", "additionalProperties": _strict(
        {"resource": {"type": "string"}, "group": {"type": "string"}}, ["resource"])},
        "template": {"type": "string"}}),
    "name": _strict({"matches": {"type": "string"}, "as": {"type": "string"}}, ["matches"]),
    "metricsQuery": {"type": "string"},
}, ["seriesQuery", "resources", "metricsQuery"])}}, ["rules"])

BY_KIND = {"ScaledObject": SCALED_OBJECT, "ServiceMonitor": SERVICE_MONITOR}
