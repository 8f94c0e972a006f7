"""`--kv-cache-dtype fp8*` through the engine on CPU: flag, capacity, checkpoint scales, real-model quality.

Quality (the issue's bar): on the real SmolLM2-135M, the engine's 8 parity prompts (tests/test_llm_parity.py)
x 32 positions, teacher-forced on the greedy tokens of the model-dtype (float32) cache, the fp8 (e4m3) cache
predicts the same top-1 token at >= 95% of the positions. One model load serves both caches: the worker's KV
tensors are swapped between float32 and fp8 (the backends pick their path from the cache's dtype) with a
fresh scheduler each time, so nothing else differs.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
import torch
from checkpoints import save_tiny_hf_model, write_quantized_checkpoint
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.core.scheduler import Scheduler
from tokenmill.worker.kv_cache import kv_bytes_per_block

AGREEMENT = 0.95
NUM_TOKENS = 32  # as tests/test_llm_parity.py


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.mark.parametrize("value", ["fp16", "int8", "fp8_e4m3fnuz"])
def test_bad_kv_cache_dtype_fails_before_loading(value):
    # A model path that does not exist: the dtype is checked first, so its sentence is what comes out.
    with pytest.raises(ValueError) as info:
        EngineArgs(model="/nonexistent/model", kv_cache_dtype=value).create_engine_config()
    msg = str(info.value)
    assert msg == (f"--kv-cache-dtype {value} is not supported; use one of auto, fp8, fp8_e4m3, fp8_e5m2 "
                   "(auto = the model dtype).")


def test_cli_bad_kv_cache_dtype_is_one_line(capsys):
    from tokenmill.entrypoints.cli import main

    assert main(["serve", "--kv-cache-dtype", "fp9"]) == 1
    err = capsys.readouterr().err
    assert err == ("Error: --kv-cache-dtype fp9 is not supported; use one of auto, fp8, fp8_e4m3, fp8_e5m2 "
                   "(auto = the model dtype).\n")


def test_fp8_kv_bytes_are_half_of_16_bit():
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert 2 * kv_bytes_per_block(30, 16, 3, 64, dtype) == kv_bytes_per_block(30, 16, 3, 64, torch.bfloat16)


def _tiny_llm(folder: str, caplog=None, **kw) -> LLM:
    return LLM(model=folder, skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4, seed=0, **kw)


def test_fp8_cache_holds_twice_the_tokens(tiny_llama_dir, caplog):
    blocks = {}
    for kv in ("auto", "fp8_e5m2"):
        with caplog.at_level(logging.INFO, logger="tokenmill.engine.core"):
            llm = _tiny_llm(tiny_llama_dir, dtype="bfloat16", kv_cache_memory_bytes="1M", kv_cache_dtype=kv)
        blocks[kv] = llm.llm_engine.engine_core.engine_config.cache_config.num_gpu_blocks
        assert _runner(llm).kv_caches[0].dtype == (torch.bfloat16 if kv == "auto" else torch.float8_e5m2)
        llm.llm_engine.shutdown()
    assert blocks["fp8_e5m2"] == 2 * blocks["auto"]
    assert f"KV cache: {blocks['fp8_e5m2']} blocks x 16 tokens = {blocks['fp8_e5m2'] * 16} tokens" in caplog.text
    assert "float8_e5m2); max concurrency" in caplog.text


def _with_scales(src: str, dst: str, scales: dict[str, float]) -> str:
    shutil.copytree(src, dst)
    path = f"{dst}/model.safetensors"
    state = load_file(path)
    state.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(state, path)
    return dst


def test_checkpoint_scales_set_each_layer_and_scale_the_stored_values(tiny_llama_dir, tmp_path, caplog):
    # vLLM's three spellings: self_attn.k_scale / v_scale, the older kv_scale, AutoFP8's k_proj.output_scale.
    folder = _with_scales(tiny_llama_dir, str(tmp_path / "scaled"), {
        "model.layers.0.self_attn.k_scale": 2.0**-4, "model.layers.0.self_attn.v_scale": 2.0**-3,
        "model.layers.1.self_attn.kv_scale": 2.0**-2, "model.layers.1.self_attn.q_scale": 3.0})
    prompt = [{"prompt_token_ids": [5, 17, 99, 42, 7, 64, 3, 11, 120, 33]}]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    caches = {}
    for name, path in (("plain", tiny_llama_dir), ("scaled", folder)):
        with caplog.at_level(logging.INFO, logger="tokenmill.worker.model_runner"):
            llm = _tiny_llm(path, kv_cache_memory_bytes="1M", kv_cache_dtype="fp8", enable_prefix_caching=False)
        attns = [m.self_attn.attn for m in _runner(llm).model.model.layers]
        llm.generate(prompt, params, use_tqdm=False)
        caches[name] = [c.float().abs().amax(dim=(1, 2, 3, 4)) for c in _runner(llm).kv_caches]  # [2] per layer
        if name == "scaled":
            assert [(a.k_scale, a.v_scale) for a in attns] == [(2.0**-4, 2.0**-3), (2.0**-2, 2.0**-2)]
            assert "2 of 2 attention layers scaled by the checkpoint's k_scale / v_scale" in caplog.text
        else:
            assert [(a.k_scale, a.v_scale) for a in attns] == [(1.0, 1.0), (1.0, 1.0)]
            assert "the checkpoint has no k_scale / v_scale" in caplog.text
        llm.llm_engine.shutdown()
    # A power-of-two scale shifts fp8 exponents: layer 0's stored maxima grow by exactly 1 / scale (no
    # saturation: its |K|, |V| stay below 448 * scale). Layer 1's inputs went through layer 0's fp8 attention,
    # whose plain cache rounds values below 2^-6 coarser (fp8 subnormals): equal within one fp8 step there.
    assert torch.equal(caches["scaled"][0], caches["plain"][0] * torch.tensor([16.0, 8.0]))
    torch.testing.assert_close(caches["scaled"][1], caches["plain"][1] * 4.0, rtol=0.125, atol=0)


def test_compressed_tensors_kv_cache_scheme_scales_load(tiny_llama_dir, tmp_path):
    # llm-compressor W4A16 + FP8 KV scheme: config.json's kv_cache_scheme and self_attn.k_scale / v_scale tensors.
    import json

    folder = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path / "ct"), "compressed-tensors", 4, 32)
    config = json.load(open(f"{folder}/config.json"))
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    json.dump(config, open(f"{folder}/config.json", "w"))
    path = f"{folder}/model.safetensors"
    state = load_file(path)
    state.update({f"model.layers.{i}.self_attn.{n}": torch.tensor(v) for i in range(2)
                  for n, v in (("k_scale", 0.5), ("v_scale", 0.25))})
    save_file(state, path)
    llm = _tiny_llm(folder, kv_cache_memory_bytes="1M", kv_cache_dtype="fp8")
    try:
        assert [(m.self_attn.attn.k_scale, m.self_attn.attn.v_scale) for m in _runner(llm).model.model.layers] == \
            [(0.5, 0.25), (0.5, 0.25)]
        assert len(llm.generate([{"prompt_token_ids": [5, 17, 99]}], SamplingParams(max_tokens=2),
                                use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.shutdown()


def test_bad_checkpoint_scale_is_one_sentence(tiny_llama_dir, tmp_path):
    folder = _with_scales(tiny_llama_dir, str(tmp_path / "bad"), {"model.layers.0.self_attn.k_scale": 0.0})
    with pytest.raises(ValueError, match=r"KV-cache scale 'model.layers.0.self_attn.k_scale' is 0.0; scales must "
                                         r"be finite and positive."):
        _tiny_llm(folder, kv_cache_memory_bytes="1M", kv_cache_dtype="fp8")


# ---- the real SmolLM2 -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_fp8():
    engine = LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes="64M", block_size=16, max_num_seqs=16,
                 seed=0, kv_cache_dtype="fp8")
    yield engine
    engine.llm_engine.shutdown()


def _use_kv_dtype(llm: LLM, dtype: torch.dtype) -> None:
    """Replace the worker's KV tensors (in place in their list: the forward context reads that list) with zeroed
    ones of `dtype`, and give the engine a fresh scheduler (no prefix-cache entries that point into the old ones)."""
    caches = _runner(llm).kv_caches
    caches[:] = [torch.zeros(c.shape, dtype=dtype) for c in caches]
    _fresh_scheduler(llm, caching=False)


def _fresh_scheduler(llm: LLM, caching: bool) -> Scheduler:
    """A new scheduler built as EngineCore builds it (empty prefix cache, zeroed counters)."""
    core = llm.llm_engine.engine_core
    old = core.scheduler
    cfg = dataclasses.replace(core.engine_config.cache_config, enable_prefix_caching=caching)
    core.scheduler = Scheduler(core.engine_config.scheduler_config, cfg, cfg.num_gpu_blocks)
    core.scheduler.finished_req_ids = set(old.finished_req_ids)  # still to be dropped by the worker
    return core.scheduler


@pytest.mark.slow  # the real SmolLM2 (shared load ~7 s) and 8 x 32 greedy tokens
def test_smollm2_fp8_teacher_forced_top1_agreement(smollm2_fp8):
    from test_llm_parity import PROMPT_LENGTHS, _prompts

    llm = smollm2_fp8
    prompts = _prompts(llm.get_tokenizer())
    assert [len(p) for p in prompts] == PROMPT_LENGTHS
    _use_kv_dtype(llm, torch.float32)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                           use_tqdm=False)]
    assert all(len(r) == NUM_TOKENS for r in ref)
    _use_kv_dtype(llm, torch.float8_e4m3fn)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, ref, strict=True)], forced,
                        use_tqdm=False)
    agree = total = 0
    for p, r, out in zip(prompts, ref, outs, strict=True):
        for t, token in enumerate(r):
            top1 = [tok for tok, lp in out.prompt_logprobs[len(p) + t].items() if lp.rank == 1]
            agree += top1 == [token]
            total += 1
    assert total == 8 * NUM_TOKENS
    print(f"fp8 (e4m3) KV cache, SmolLM2 teacher-forced top-1 agreement with float32: {agree}/{total}")
    assert agree / total >= AGREEMENT, f"fp8 KV top-1 agreement {agree}/{total}"


@pytest.mark.slow
def test_smollm2_fp8_prefix_cache_hit_gives_same_tokens(smollm2_fp8):
    from test_llm_parity import _prompts

    llm = smollm2_fp8
    _use_kv_dtype(llm, torch.float8_e4m3fn)  # prefix caching off: the reference
    prompts = [{"prompt_token_ids": p} for p in _prompts(llm.get_tokenizer())]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    sched = _fresh_scheduler(llm, caching=True)
    cold = llm.generate(prompts, params, use_tqdm=False)  # prompts i and i + 4 share their first blocks
    warm = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cold] == ref
    assert [o.outputs[0].token_ids for o in warm] == ref
    # Every prompt of >= 17 tokens finds its whole blocks (the last prompt token is never taken from the cache).
    assert [o.num_cached_tokens for o in warm] == [(len(p["prompt_token_ids"]) - 1) // 16 * 16 for p in prompts]
    assert sched.kv_cache_manager.prefix_cache_hits > 0
