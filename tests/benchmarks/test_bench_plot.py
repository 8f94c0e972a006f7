"""`bench plot` draws a PNG from serve result files."""

from __future__ import annotations

import json

import pytest

from tokenmill.benchmarks.cli import main
from tokenmill.benchmarks.plot import load_results, series


def _result(path, label: str | None, conc: int | None, tput: float, **extra) -> str:
    r = {"backend": "openai", "max_concurrency": conc, "num_prompts": 64, "output_throughput": tput,
         "median_ttft_ms": 10.0 * (conc or 64), "median_tpot_ms": 5.0, **extra}
    if label:
        r["label"] = label
    path.write_text(json.dumps(r))
    return str(path)


def test_plot_writes_png(tmp_path):
    files = [_result(tmp_path / f"a{c}.json", "tokenmill", c, 100.0 * c) for c in (1, 4, 2, 16)]
    files.append(_result(tmp_path / "b1.json", "vllm", 1, 90.0))
    out = tmp_path / "plots" / "p.png"
    assert main(["plot", *files, "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_series_groups_by_label_then_backend_and_sorts_by_concurrency(tmp_path):
    files = [_result(tmp_path / "x.json", "tm", 8, 1.0), _result(tmp_path / "y.json", "tm", 2, 2.0),
             _result(tmp_path / "z.json", None, None, 3.0)]
    lines = series(load_results(files))
    assert sorted(lines) == ["openai", "tm"]
    assert [x for x, _ in lines["tm"]] == [2.0, 8.0]
    assert [x for x, _ in lines["openai"]] == [64.0]  # no limit: all num_prompts in flight


def test_plot_reads_appended_json_lines_and_rejects_missing_files(tmp_path):
    p = tmp_path / "appended.json"
    p.write_text(json.dumps({"label": "a", "max_concurrency": 1, "output_throughput": 1.0}) + "\n"
                 + json.dumps({"label": "a", "max_concurrency": 2, "output_throughput": 2.0}))
    assert len(load_results([str(p)])) == 2
    with pytest.raises(ValueError, match="does not exist"):
        load_results([str(tmp_path / "missing.json")])
