"""--gpu-memory-utilization on CUDA: the KV cache gets what the fraction leaves, and a
max_model_len it cannot hold fails at start-up naming the largest one that fits.

Model: a dummy-weight Llama (config.json only) whose KV cache costs 8 KiB per
token in bfloat16 (2 x 4 layers x 4 kv heads x head_dim 128 x 2 bytes; a
16-token block is 128 KiB). "Used" is what the device holds before the engine
starts (CUDA context, earlier tests' tensors, other processes): total - free
after `empty_cache`. The fractions are chosen from it, so the tests do not
depend on what ran before them on the GPU.
"""

from __future__ import annotations

import gc
import logging
import math
import re

import pytest
import torch
from transformers import LlamaConfig

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

GiB, MiB = 2**30, 2**20
BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = 2 * 4 * 4 * 128 * 2


def _model_dir(tmp_path, max_position_embeddings: int) -> str:
    LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                max_position_embeddings=max_position_embeddings, architectures=["LlamaForCausalLM"],
                ).save_pretrained(tmp_path)
    return str(tmp_path)


def _used_and_total() -> tuple[int, int]:
    """(bytes in use on the device, total bytes), after dropping torch's cached blocks."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free, total


def _fraction(needed: int, total: int, digits: int) -> float:
    """The smallest fraction with `digits` decimals that covers `needed` bytes (skips when the GPU is too full)."""
    util = math.ceil(needed / total * 10**digits) / 10**digits
    if util > 0.95:
        pytest.skip(f"the GPU already holds too much memory ({needed / GiB:.1f} GiB needed of {total / GiB:.1f})")
    return util


def _start(folder: str, **kw) -> LLM:
    return LLM(model=folder, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
               block_size=BLOCK_SIZE, seed=0, **kw)


def test_kv_cache_takes_what_the_utilization_leaves(tmp_path, caplog):
    folder = _model_dir(tmp_path, 4096)
    used, total = _used_and_total()
    util = _fraction(used + 8 * GiB, total, 2)  # leaves ~8 GiB for weights, activations and the KV cache
    caplog.set_level(logging.INFO, logger="tokenmill")
    llm = _start(folder, gpu_memory_utilization=util, max_model_len=4096, max_num_seqs=64,
                 max_num_batched_tokens=4096)
    try:
        num_blocks = llm.llm_engine.engine_config.cache_config.num_gpu_blocks
        assert num_blocks > 0
        assert re.search(rf"KV cache: {num_blocks} blocks\b", caplog.text), caplog.text
        kv_caches = llm.llm_engine.engine_core.executor.worker.model_runner.kv_caches
        kv_bytes = sum(t.numel() * t.element_size() for t in kv_caches)
        assert kv_bytes == num_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN
        # util * total - used is what the fraction leaves; weights (~10 MiB), a 4096-token step's
        # activations, CUDA graphs and cuBLAS workspaces come out of it (well under 2 GiB here).
        budget = util * total - used
        what = (f"KV cache {kv_bytes / GiB:.2f} GiB; util {util} x total {total / GiB:.1f} GiB - used "
                f"{used / GiB:.2f} GiB = {budget / GiB:.2f} GiB")
        assert budget - 2 * GiB <= kv_bytes <= budget + 64 * MiB, what
        out = llm.generate([{"prompt_token_ids": list(range(1, 40))}],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        in_use, _ = _used_and_total()
        assert in_use <= util * total + 1 * GiB, f"{in_use / GiB:.2f} GiB in use after start-up; {what}"
    finally:
        llm.llm_engine.shutdown()


def test_too_long_max_model_len_names_the_largest_that_fits(tmp_path):
    max_len = 1 << 18  # needs 2 GiB of KV cache
    folder = _model_dir(tmp_path, max_len)
    used, total = _used_and_total()
    util = _fraction(used + 1 * GiB, total, 3)  # at most ~1.1 GiB for everything: < 150k tokens of KV
    kw = {"gpu_memory_utilization": util, "max_num_seqs": 4, "max_num_batched_tokens": 2048}
    with pytest.raises(ValueError) as info:
        _start(folder, max_model_len=max_len, **kw)
    msg = str(info.value)
    del info  # its traceback holds the half-built engine
    m = re.search(r"--max-model-len (\d+)", msg)
    assert m, msg
    fits = int(m.group(1))
    assert 0 < fits < max_len and fits % BLOCK_SIZE == 0, msg
    assert fits * KV_BYTES_PER_TOKEN <= util * total - used + 64 * MiB, msg
    m = re.search(r"raise --gpu-memory-utilization \(now ([0-9.]+)\)", msg)
    assert m and float(m.group(1)) == pytest.approx(util), msg
    assert "--kv-cache-memory-bytes" not in msg, msg  # that flag is the CPU's advice

    used_after, _ = _used_and_total()
    assert used_after - used < 256 * MiB, f"the failed start-up left {(used_after - used) / MiB:.0f} MiB in use"
    llm = _start(folder, max_model_len=fits, **kw)  # the message's promise: this length fits
    try:
        assert llm.llm_engine.engine_config.cache_config.num_gpu_blocks * BLOCK_SIZE >= fits
    finally:
        llm.llm_engine.shutdown()
