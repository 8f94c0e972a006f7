"""`tokenmill bench plot`: throughput and latency against max concurrency from `bench serve` results.

Reads result files (one JSON object, or JSON lines from `--append-result`),
groups them by label (the result's "label", else "backend", else the file
name) and draws three panels sharing the x axis `max_concurrency`:
output tokens/s, median TTFT (ms) and median TPOT (ms), one line per label.
A result without a concurrency limit is placed at its `num_prompts` (all of
them may be in flight). matplotlib is imported only here.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

PANELS = (
    ("output_throughput", "Output throughput (tok/s)"),
    ("median_ttft_ms", "Median TTFT (ms)"),
    ("median_tpot_ms", "Median TPOT (ms)"),
)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `bench plot` arguments to `parser`."""
    parser.add_argument("results", nargs="+", help="Result JSON files written by `bench serve --save-result`.")
    parser.add_argument("--output", "-o", default="bench_plot.png", help="PNG file to write.")
    parser.add_argument("--title", default=None)
    return parser


def load_results(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """`(file stem, result)` pairs from each file (JSON, or one JSON object per line).

    Raises:
        ValueError: a file is missing or not JSON.
    """
    results = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"Result file {path!r} does not exist.")
        text = p.read_text(encoding="utf-8")
        try:
            items = [json.loads(text)]
        except json.JSONDecodeError:
            try:
                items = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is neither a JSON object nor JSON lines: {e}.") from e
        results.extend((p.stem, r) for r in items if isinstance(r, dict))
    return results


def series(results: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """label -> [(max_concurrency, result)] sorted by concurrency."""
    lines: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    for stem, r in results:
        label = str(r.get("label") or r.get("backend") or stem)
        conc = r.get("max_concurrency")
        x = float(conc if conc is not None else r.get("num_prompts") or r.get("completed") or 0)
        lines[label].append((x, r))
    return {k: sorted(v, key=lambda item: item[0]) for k, v in lines.items()}


def plot_results(results: list[tuple[str, dict[str, Any]]], output: str, title: str | None = None) -> Path:
    """Draw the three panels to the PNG `output`; return its path.

    Raises:
        ValueError: no results, or none has the plotted metrics.
    """
    if not results:
        raise ValueError("No results to plot.")
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    drawn = 0
    for label, points in series(results).items():
        for ax, (key, _) in zip(axes, PANELS):
            xy = [(x, r[key]) for x, r in points if r.get(key) is not None]
            if xy:
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=label)
                drawn += 1
    if drawn == 0:
        plt.close(fig)
        raise ValueError("No result has output_throughput, median_ttft_ms or median_tpot_ms to plot.")
    xs = [x for points in series(results).values() for x, _ in points]
    for ax, (_, ylabel) in zip(axes, PANELS):
        if min(xs) > 0 and max(xs) / min(xs) >= 8:  # sweeps are usually 1, 2, 4, ...: even spacing
            ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if title:
        fig.suptitle(title)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out


def main(args: argparse.Namespace) -> Path:
    out = plot_results(load_results(args.results), args.output, args.title)
    print(f"Saved the plot to {out}")
    return out
