"""CPU smoke test of benchmarks/gpu/offline_bench.py: every part end to end on a tiny random Llama.

Token counts must equal what was requested; every timing must be positive. The
server-only dependencies are made unimportable, as on the GPU machine.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2}
SERVER_ONLY = ("fastapi", "uvicorn", "zmq", "msgspec", "gguf", "ray")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("offline_bench", ROOT / "benchmarks" / "gpu" / "offline_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def common(tmp_path, monkeypatch) -> list[str]:
    monkeypatch.setenv("TOKENMILL_CPU_THREADS", "1")  # two torch threads crawl on a shared 2-core box
    for name in SERVER_ONLY:
        monkeypatch.setitem(sys.modules, name, None)  # `import zmq` now raises ImportError
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_LLAMA))
    return ["--config", str(config), "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
            "--kv-cache-memory-bytes", "8M", "--warmup-prompts", "2"]


def _positive(d: dict, *keys: str) -> None:
    for k in keys:
        assert d[k] > 0, (k, d[k])


def test_offline_part(bench, common, tmp_path, capsys):
    out = tmp_path / "offline.json"
    bench.main(["--part", "offline", *common, "--num-prompts", "6", "--hf-prompts", "4", "--hf-batch-size", "2",
                "--min-len", "4", "--max-len", "12", "--json-out", str(out)])
    data = json.loads(out.read_text())
    workload = bench.make_workload(6, (4, 12), (4, 12), 512, 0)
    tm, hf = data["tokenmill"], data["hf"]
    assert tm["num_prompts"] == 6 and tm["input_tokens"] == sum(len(ids) for ids, _ in workload)
    assert tm["output_tokens"] == tm["requested_output_tokens"] == sum(n for _, n in workload)
    _positive(tm, "elapsed_s", "output_tok_s", "total_tok_s", "num_steps", "mean_batch_reqs", "startup_s")
    assert tm["engine"]["kv_tokens"] > 0 and tm["engine"]["max_num_seqs"] == 256
    sample = bench.subsample(workload, 4, 2)
    assert hf["num_prompts"] == 4 and hf["output_tokens"] == sum(n for _, n in sample)
    assert hf["generated_tokens"] >= hf["output_tokens"]  # a batch generates its longest request for every row
    _positive(hf, "elapsed_s", "output_tok_s")
    assert data["ratio"] == pytest.approx(tm["output_tok_s"] / hf["output_tok_s"])
    assert data["env"]["torch"] and "git_commit" in data["env"]
    printed = capsys.readouterr().out
    assert "| tokenmill | 6 |" in printed and "ratio tokenmill / transformers" in printed
    assert "KV cache:" in printed


def test_short_part(bench, common, tmp_path):
    out = tmp_path / "short.json"
    bench.main(["--part", "short", *common, "--num-prompts", "6", "--short-len", "8", "--hf-batch-size", "4",
                "--json-out", str(out)])
    data = json.loads(out.read_text())
    tm, hf = data["tokenmill"], data["hf"]
    assert tm["output_tokens"] == tm["requested_output_tokens"] == 6 * 8 and tm["input_tokens"] == 6 * 8
    assert hf["num_prompts"] == 6 and hf["output_tokens"] == hf["generated_tokens"] == 6 * 8
    _positive(tm, "output_tok_s", "num_steps", "mean_batch_reqs")
    _positive(hf, "output_tok_s")
    assert data["ratio"] > 0


def test_tpot_part(bench, common, tmp_path, capsys):
    out = tmp_path / "tpot.json"
    bench.main(["--part", "tpot", *common, "--tpot-input", "12", "--tpot-output", "8", "--profile-steps", "3",
                "--json-out", str(out)])
    tm = json.loads(out.read_text())["tokenmill"]
    assert tm["prompt_tokens"] == 12 and tm["output_tokens"] == tm["requested_output_tokens"] == 8
    _positive(tm, "ttft_ms", "tpot_ms", "tpot_p50_ms", "execute_model_ms")
    assert tm["execute_model_timer"] == "perf_counter" and tm["gpu_kernel_ms_per_decode_step"] is None  # no GPU
    assert "| 12 | 8 |" in capsys.readouterr().out


def test_prefill_part(bench, common, tmp_path, capsys):
    out = tmp_path / "prefill.json"
    bench.main(["--part", "prefill", *common, "--num-prompts", "3", "--prefill-len", "80", "--json-out", str(out)])
    data = json.loads(out.read_text())
    tm = data["tokenmill"]
    assert data["args"]["max_model_len"] == 81  # raised to fit the prompts (common asks for 64)
    assert tm["input_tokens"] == 3 * 80 and tm["output_tokens"] == tm["requested_output_tokens"] == 3
    assert tm["prompt_tok_s"] == pytest.approx(tm["input_tokens"] / tm["elapsed_s"])
    assert "| 3 | 80 |" in capsys.readouterr().out


def test_force_cc70_means_float16_and_no_baseline_unless_asked(bench, monkeypatch):
    monkeypatch.setenv("TOKENMILL_FORCE_CC70", "0")  # restored after the test
    args = bench.parse_args(["--part", "offline", "--force-cc70"])
    assert args.dtype == "float16" and args.hf_prompts == 0 and args.num_prompts == 1000
    import os

    assert os.environ["TOKENMILL_FORCE_CC70"] == "1"
    assert bench.parse_args(["--part", "offline", "--force-cc70", "--hf-prompts", "5"]).hf_prompts == 5
    plain = bench.parse_args(["--part", "offline"])
    assert plain.dtype == "bfloat16" and plain.hf_prompts == 200
    assert bench.parse_args(["--part", "short"]).hf_prompts == 256


def test_skip_tokenmill_runs_only_the_baseline(bench, common, tmp_path, capsys):
    out = tmp_path / "hf_only.json"
    bench.main(["--part", "short", *common, "--num-prompts", "3", "--short-len", "4", "--skip-tokenmill",
                "--json-out", str(out)])
    data = json.loads(out.read_text())
    assert "tokenmill" not in data and "ratio" not in data
    assert data["hf"]["output_tokens"] == 3 * 4
    assert "| transformers (batch 64) | 3 |" in capsys.readouterr().out


def test_override_sets_a_module_constant_and_refuses_unknown_names(bench, monkeypatch):
    from tokenmill.kernels.triton import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "SCALED_MM_FAST_ACCUM", False)
    bench.apply_overrides(["tokenmill.kernels.triton.fp8_gemm.SCALED_MM_FAST_ACCUM=True"])
    assert fp8_gemm.SCALED_MM_FAST_ACCUM is True
    with pytest.raises(ValueError, match="has no NO_SUCH_NAME"):
        bench.apply_overrides(["tokenmill.kernels.triton.fp8_gemm.NO_SUCH_NAME=1"])
    with pytest.raises(ValueError, match="MODULE.NAME=VALUE"):
        bench.apply_overrides(["SCALED_MM_FAST_ACCUM"])
