"""A renderer for the part of Helm's template language that deploy/helm/tokenmill uses.

Neither Debian nor PyPI packages a helm binary. The tests render the chart with
Helm's own engine where PyPI's helm-python-sdk (Helm v4's Go SDK in a C
library) is installed, and check that this renderer gives the same objects; the
chart's templates keep to this subset, so it still renders them without that
wheel:

    {{ .Values.a.b }}  {{ .Release.Name }}  {{ .Release.Namespace }}  {{ .Chart.AppVersion }}
    {{ "text" }}       pipelines: x | quote, x | toYaml | nindent N, toYaml x | nindent N
    functions: quote, toYaml, nindent, indent, eq, ne, not
    {{ if COND }} ... {{ else }} ... {{ end }}   (COND: a value or a function call)
    {{- and -}} trim the whitespace before / after the action, as in Go templates

Anything else (include, range, with, define, other functions) raises
ValueError, and so does a missing value (Helm would print "<no value>"), so
the test fails instead of rendering something helm would render differently.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

# As in Go templates, a trim marker is "{{- " / " -}}" with the space: "{{-3}}" is the number -3, which
# this subset does not have, so it fails as an unsupported command.
_ACTION = re.compile(r"{{(-\s)?\s*(.*?)\s*(\s-)?}}", re.S)


def _truthy(v: Any) -> bool:
    return v not in (None, False, 0, "", [], {})


def _to_yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def _indent(n: int, s: str) -> str:
    return "\n".join(" " * n + line if line else line for line in s.split("\n"))


_FUNCS = {
    "quote": lambda v: '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"',
    "toYaml": _to_yaml,
    "nindent": lambda n, s: "\n" + _indent(int(n), s),
    "indent": lambda n, s: _indent(int(n), s),
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "not": lambda v: not _truthy(v),
}


class _Ctx:
    def __init__(self, values: dict[str, Any], release: str, namespace: str, chart: dict[str, Any]) -> None:
        self.root = {"Values": values, "Release": {"Name": release, "Namespace": namespace},
                     "Chart": {k[0].upper() + k[1:]: v for k, v in chart.items()}}

    def arg(self, token: str) -> Any:
        if token.startswith("."):
            node: Any = self.root
            for part in token[1:].split("."):
                if not isinstance(node, dict) or part not in node:
                    raise ValueError(f"the template reads {token}, which the values do not have")
                node = node[part]
            return node
        if token.isdigit():
            return int(token)
        return token  # a string literal (shlex removed its quotes)

    def pipeline(self, text: str) -> Any:
        value: Any = _NOTHING
        for command in text.split("|"):
            words = shlex.split(command)
            if not words:
                raise ValueError(f"empty command in {{{{ {text} }}}}")
            head, args = words[0], [self.arg(w) for w in words[1:]]
            if head in _FUNCS:
                if value is not _NOTHING:
                    args.append(value)
                value = _FUNCS[head](*args)
            elif value is _NOTHING and not args and (head.startswith(".") or command.strip().startswith('"')):
                value = self.arg(head)
            else:
                raise ValueError(f"unsupported template command {command.strip()!r} (helm_subset.py)")
        return value


_NOTHING = object()
_UNSUPPORTED = ("include", "range", "with", "define", "template", "tpl", "fail", "block")


def render(template: str, values: dict[str, Any], release: str = "tokenmill", namespace: str = "default",
           chart: dict[str, Any] | None = None) -> str:
    """Render one template file. Raises ValueError on anything outside the subset."""
    ctx = _Ctx(values, release, namespace, chart or {})
    # Tokens: text, or (action text); trim markers applied to the neighbouring text.
    parts: list[Any] = []
    pos = 0
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if m.group(1):
            text = text.rstrip()
        parts.append(text)
        parts.append(("action", m.group(2), bool(m.group(3))))
        pos = m.end()
    parts.append(template[pos:])
    for i, p in enumerate(parts):  # right trim: strip the next text's leading whitespace
        if isinstance(p, tuple) and p[2]:
            parts[i + 1] = parts[i + 1].lstrip()
    out, stack = [], [True]  # stack: is the current branch emitted?
    branch_taken: list[bool] = []
    for p in parts:
        if isinstance(p, str):
            if all(stack):
                out.append(p)
            continue
        action = p[1]
        if action.startswith("if "):
            cond = all(stack) and _truthy(ctx.pipeline(action[3:])) if all(stack) else False
            stack.append(cond)
            branch_taken.append(cond)
        elif action == "else":
            if len(stack) < 2:
                raise ValueError("else without if")
            stack[-1] = not branch_taken[-1]
        elif action == "end":
            if len(stack) < 2:
                raise ValueError("end without if")
            stack.pop()
            branch_taken.pop()
        elif action.startswith("else ") or action.split()[0] in _UNSUPPORTED:
            raise ValueError(f"unsupported template action {action!r} (helm_subset.py)")
        elif all(stack):
            value = ctx.pipeline(action)
            out.append("" if value is None else str(value).lower() if isinstance(value, bool) else str(value))
    if len(stack) != 1:
        raise ValueError("if without end")
    return "".join(out)


def chart_values(chart_dir: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chart's values.yaml with `overrides` applied: dotted value paths -> values (strings parsed as
    YAML scalars, like `helm --set`). Raises KeyError for a path whose parents values.yaml lacks."""
    values = yaml.safe_load((Path(chart_dir) / "values.yaml").read_text())
    for dotted, value in (overrides or {}).items():
        node = values
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = yaml.safe_load(value) if isinstance(value, str) else value
    return values


def render_chart(chart_dir: str | Path, overrides: dict[str, Any] | None = None, release: str = "tokenmill") -> str:
    """`helm template RELEASE CHART --set a.b=v ...` for this subset: every template, "---" between documents."""
    root = Path(chart_dir)
    values = chart_values(root, overrides)
    chart = yaml.safe_load((root / "Chart.yaml").read_text())
    out = []
    for template in sorted((root / "templates").glob("*.yaml")):
        text = render(template.read_text(), values, release=release, chart=chart).strip("\n")
        if text.strip():
            out.append(f"# Source: {root.name}/templates/{template.name}\n{text}\n")
    return "---\n".join(out)


def helm_template(chart_dir: str | Path, overrides: dict[str, Any] | None = None, release: str = "tokenmill") -> str:
    """The same as `render_chart`, by Helm v4's own engine (PyPI's helm-python-sdk; ImportError without it)."""
    import helm_python

    sets: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        node = sets
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value) if isinstance(value, str) else value
    with helm_python.Chart.load(str(chart_dir)) as chart:
        manifests = chart.render(sets, name=release, namespace="default", is_install=True)
    return "---\n".join(f"# Source: {path}\n{text.strip()}\n" for path, text in sorted(manifests.items())
                        if text.strip())


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    use_helm = "--helm" in args
    args = [a for a in args if a != "--helm"]
    if not args or args[0].startswith("-"):
        sys.exit("usage: python tests/deploy/helm_subset.py [--helm] CHART_DIR [--set key.path=value ...]\n"
                 "  --helm: render with Helm's own engine (pip install helm-python-sdk) instead of this subset")
    sets = dict(a.split("=", 1) for flag, a in zip(args[1::2], args[2::2]) if flag == "--set")
    sys.stdout.write((helm_template if use_helm else render_chart)(args[0], sets))
