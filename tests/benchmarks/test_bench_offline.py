"""`bench throughput` and `bench latency` through a fake `tokenmill.LLM`."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import ClassVar

import pytest

import tokenmill
from tokenmill.benchmarks.cli import main


class FakeLLM:
    """Records its construction and calls; `generate` sleeps and returns max_tokens ids per prompt."""

    instances: ClassVar[list[FakeLLM]] = []
    delay_s = 0.02

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple[list, object]] = []
        FakeLLM.instances.append(self)

    def get_tokenizer(self):
        return _Tok()

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        self.use_tqdm = use_tqdm
        time.sleep(self.delay_s)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                outputs=[SimpleNamespace(token_ids=[5] * sp.max_tokens) for _ in range(sp.n)])
                for p, sp in zip(prompts, params)]


class _Tok:
    all_special_ids: ClassVar[list[int]] = [0, 1]

    def __len__(self):
        return 20


@pytest.fixture
def fake_llm(monkeypatch):
    FakeLLM.instances = []
    monkeypatch.setattr(tokenmill, "LLM", FakeLLM, raising=False)
    return FakeLLM


def test_throughput(fake_llm, tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(["throughput", "--model", "tiny", "--input-len", "6", "--output-len", "4", "--num-prompts", "5",
               "--max-num-seqs", "3", "--output-json", str(out)])
    assert rc == 0
    llm = fake_llm.instances[0]
    assert llm.kwargs["model"] == "tiny" and llm.kwargs["max_num_seqs"] == 3  # engine flags reach LLM
    prompts, params = llm.calls[0]
    assert len(prompts) == 5 and all(len(p["prompt_token_ids"]) == 6 for p in prompts)
    assert all(2 <= t < 20 for p in prompts for t in p["prompt_token_ids"])  # no special ids, in vocab
    assert all(sp.ignore_eos and sp.max_tokens == 4 for sp in params)
    r = json.loads(out.read_text())
    assert r["num_requests"] == 5 and r["total_num_tokens"] == 5 * (6 + 4)
    assert r["elapsed_time"] >= fake_llm.delay_s
    assert r["requests_per_second"] == pytest.approx(5 / r["elapsed_time"])
    assert r["output_tokens_per_second"] == pytest.approx(20 / r["elapsed_time"])
    assert "requests/s" in capsys.readouterr().out


def test_latency(fake_llm, tmp_path, capsys):
    out = tmp_path / "l.json"
    rc = main(["latency", "--batch-size", "3", "--input-len", "5", "--output-len", "2", "--num-iters-warmup", "2",
               "--num-iters", "4", "--output-json", str(out)])
    assert rc == 0
    llm = fake_llm.instances[0]
    assert len(llm.calls) == 6 and not llm.use_tqdm  # warmup + timed, no progress bars
    prompts, params = llm.calls[-1]
    assert len(prompts) == 3 and params.max_tokens == 2 and params.ignore_eos
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 4 and min(r["latencies"]) >= fake_llm.delay_s
    assert list(r["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert r["percentiles"]["10"] <= r["percentiles"]["99"]
    assert "Avg latency:" in capsys.readouterr().out


def test_offline_rejects_bad_sizes(fake_llm, capsys):
    assert main(["latency", "--batch-size", "0"]) == 1
    assert "--batch-size" in capsys.readouterr().err
