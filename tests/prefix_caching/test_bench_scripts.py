"""Smoke runs of benchmarks/prefix_cache_bench.py and chunked_prefill_tpot.py on a tiny dummy Llama.

They exercise the `--config FILE --load-format dummy --skip-tokenizer-init`
path the H200 run uses, and check the JSON each script writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def tiny_config(tmp_path) -> str:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model" / "config.json")


def test_prefix_cache_bench_smoke(tiny_config, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import prefix_cache_bench

    out = tmp_path / "pc.json"
    rc = prefix_cache_bench.main(["--config", tiny_config, "--skip-tokenizer-init", "--dtype", "float32",
                                  "--max-model-len", "256", "--kv-cache-memory-bytes", "8M", "--num-requests", "4",
                                  "--system-len", "64", "--question-len", "5", "--output-len", "2",
                                  "--request-rate", "100", "--json-out", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["caching"]) for r in results] == [("sequential", True), ("poisson", True),
                                                            ("sequential", False), ("poisson", False)]
    for r in results:
        assert r["num_requests"] == 4 and len(r["ttfts_s"]) == 4 and r["mean_ttft_s"] > 0
        # 64 shared tokens = 4 blocks; requests 1..3 hit them when caching is on (the cache starts cold).
        assert r["mean_cached_tokens"] == (3 * 64 / 4 if r["caching"] else 0)


def test_chunked_prefill_tpot_smoke(tiny_config, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import chunked_prefill_tpot

    out = tmp_path / "tpot.json"
    rc = chunked_prefill_tpot.main(["--config", tiny_config, "--skip-tokenizer-init", "--dtype", "float32",
                                    "--max-model-len", "256", "--kv-cache-memory-bytes", "8M", "--num-running", "2",
                                    "--burst", "2", "--long-len", "200", "--chunk-budget", "64",
                                    "--json-out", str(out)])
    assert rc == 0
    on, off = json.loads(out.read_text())["results"]
    assert on["chunked_prefill"] and not off["chunked_prefill"]
    # 2 prompts of 200 tokens in 64-token steps (minus 2 decode tokens each step) end short several times.
    assert on["num_chunked_prefill_steps"] >= 6 and off["num_chunked_prefill_steps"] == 0
    assert on["num_itls"] > off["num_itls"] > 0
