"""tokenmill.envs: the one boolean parser, the vLLM aliases, bad values, read-at-call-time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill import envs


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " on "])
def test_true_spellings(monkeypatch, raw):
    monkeypatch.setenv("TOKENMILL_FORCE_CC70", raw)
    assert envs.force_cc70() is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off"])
def test_false_spellings(monkeypatch, raw):
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", raw)
    assert envs.cpu_kernels() is False


def test_unset_and_empty_mean_the_default(monkeypatch):
    monkeypatch.delenv("TOKENMILL_CPU_KERNELS", raising=False)
    monkeypatch.delenv("TOKENMILL_DISABLE_FUSED_KERNELS", raising=False)
    assert envs.cpu_kernels() is True
    assert envs.disable_fused_kernels() is False
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "")
    assert envs.cpu_kernels() is True


@pytest.mark.parametrize("raw", ["2", "enable", "y", "tru"])
def test_bad_boolean_raises_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("TOKENMILL_WORKER_STATS", raw)
    with pytest.raises(ValueError, match=rf"TOKENMILL_WORKER_STATS={raw!r}"):
        envs.worker_stats()


def test_bad_integer_raises_naming_the_variable(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_THREADS", "four")
    with pytest.raises(ValueError, match="TOKENMILL_CPU_THREADS"):
        envs.cpu_threads()
    monkeypatch.setenv("TOKENMILL_CPU_THREADS", "4")
    assert envs.cpu_threads() == 4


def test_modelscope_alias(monkeypatch):
    monkeypatch.delenv("TOKENMILL_USE_MODELSCOPE", raising=False)
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    assert envs.use_modelscope() is False
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "True")
    assert envs.use_modelscope() is True
    monkeypatch.setenv("TOKENMILL_USE_MODELSCOPE", "0")  # tokenmill's name wins
    assert envs.use_modelscope() is False


def test_bad_alias_value_names_the_alias(monkeypatch):
    monkeypatch.delenv("TOKENMILL_USE_MODELSCOPE", raising=False)
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "maybe")
    with pytest.raises(ValueError, match="VLLM_USE_MODELSCOPE='maybe'"):
        envs.use_modelscope()


def test_api_key_alias_and_precedence():
    assert envs.api_key({}) is None
    assert envs.api_key({"VLLM_API_KEY": "v"}) == "v"
    assert envs.api_key({"TOKENMILL_API_KEY": "t", "VLLM_API_KEY": "v"}) == "t"
    assert envs.api_key({"TOKENMILL_API_KEY": "", "VLLM_API_KEY": "v"}) == "v"


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    assert envs.cache_dir() == tmp_path
    monkeypatch.delenv("TOKENMILL_CACHE_DIR")
    assert envs.cache_dir() == Path.home() / ".cache" / "tokenmill"


def test_force_cc70_is_parsed_once_for_platform_and_rules(monkeypatch):
    from tokenmill.platforms import cuda

    monkeypatch.setenv("TOKENMILL_FORCE_CC70", "on")  # the old platforms/cuda.py parser ignored "on"
    assert cuda.force_cc70_requested() is True
    monkeypatch.setenv("TOKENMILL_FORCE_CC70", "bogus")
    with pytest.raises(ValueError, match="TOKENMILL_FORCE_CC70"):
        cuda.force_cc70_requested()


def test_every_documented_function_reads_at_call_time(monkeypatch):
    monkeypatch.setenv("TOKENMILL_LOGGING_LEVEL", "DEBUG")
    assert envs.logging_level() == "DEBUG"
    monkeypatch.setenv("TOKENMILL_LOGGING_LEVEL", "INFO")
    assert envs.logging_level() == "INFO"
    monkeypatch.delenv("TOKENMILL_LOGGING_LEVEL")
    assert envs.logging_level() == "WARNING"
