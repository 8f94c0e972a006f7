"""gpt-oss vs transformers' GptOssForCausalLM on tiny random configs (CPU).

One tiny config (4 layers, sliding / full alternating, window 6 against
prompts of 5-50 tokens, 8 experts top-2, YaRN, GQA), its weights rounded so
that a bf16 checkpoint and an MXFP4 checkpoint (experts as `*_blocks` /
`*_scales` in the released layout, written by `kernels.mxfp4.quantize_mxfp4`)
hold exactly the same function as the float32 transformers reference.
Checks, for both checkpoints:
- float32: logits of a mixed-length paged prefill batch within 1e-4
  (relative to the largest logit) of HF's; bfloat16 by distribution (see the test);
- 24 greedy tokens through `tokenmill.LLM` with chunked prefill and
  preemption forced equal HF's (float32: near ties of 1e-3 allowed;
  bfloat16: scored by HF along our tokens, see the test).
Plus the pieces on their own (YaRN, MXFP4 decode), bad input at load, and
float16 overflow of the residual stream.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers
from family_utils import batch_prefill_logits, compare_greedy, hf_greedy, hf_logits, hf_teacher_forced
from safetensors.torch import save_file
from torch_threads import one_torch_thread

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tokenmill.layers.rotary import compute_inv_freq, rope_attention_factor
from tokenmill.model_loader import get_model
from tokenmill.models.gpt_oss import GptOssForCausalLM

VOCAB = 160
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 150000.0}
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
              max_position_embeddings=256, initializer_range=0.15, rope_parameters=YARN,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
MXFP4_CONFIG = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}
# Experts scaled up so that the +-7 clamps of the SwiGLU are reached.
EXPERT_SCALE = 4.0
PROMPT_LENS = [37, 5, 23, 50]
MAX_TOKENS = 24
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def _expert_linear(hf_param: torch.Tensor) -> torch.Tensor:
    return hf_param.detach().transpose(1, 2)  # HF [E, in, out] -> nn.Linear [E, out, in]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(HF float32 model, bf16 checkpoint folder, MXFP4 checkpoint folder), one function in all three."""
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(0.3 * torch.randn_like(p))  # non-trivial norms, biases and sinks
        for layer in hf.model.layers:
            for proj in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, proj)
                w = dequantize_mxfp4(*quantize_mxfp4(_expert_linear(p) * EXPERT_SCALE), torch.float32)  # MXFP4-exact
                p.copy_(w.transpose(1, 2))
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # bf16-exact
    bf16_dir = str(tmp_path_factory.mktemp("gptoss-bf16"))
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(bf16_dir)  # a copy: .to() would round inv_freq too
    mx_dir = str(tmp_path_factory.mktemp("gptoss-mxfp4"))
    tensors = {}
    for name, t in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(_expert_linear(t))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(mx_dir, "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["quantization_config"] = MXFP4_CONFIG
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(mx_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return hf, {"bf16": bf16_dir, "mxfp4": mx_dir}


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("ckpt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_logits_match_transformers(checkpoints, ckpt, dtype):
    """float32: every position within 1e-4. bfloat16: a rounding that swaps two experts' router ranks moves
    a position's logits by a jump, in transformers' own bf16 run as in ours (up to ~0.7 of the largest logit
    on this tiny model), so the check is on the distribution: median within 3e-2 and at most 10% of
    positions past 5e-2."""
    hf, folders = checkpoints
    cfg = EngineArgs(model=folders[ckpt], device="cpu", dtype=dtype).create_engine_config()
    assert cfg.model_config.architecture == "GptOssForCausalLM"
    model = get_model(cfg.model_config, "cpu", dtype)
    prompts = _prompts(1)
    errs = []
    for prompt, ours in zip(prompts, batch_prefill_logits(model, prompts)):
        ref = hf_logits(hf, prompt)
        errs.append((ours - ref).abs().max(dim=-1).values / ref.abs().max())
    err = torch.cat(errs)
    if dtype == "float32":
        assert err.max() <= 1e-4, f"{ckpt}: rel err {err.max():.2e}"
    else:
        assert err.median() <= 3e-2 and (err > 5e-2).float().mean() <= 0.10, \
            f"{ckpt}: median {err.median():.2e}, {(err > 5e-2).float().mean():.0%} of positions past 5e-2"


@pytest.mark.parametrize("ckpt,dtype", [("bf16", "float32"), ("mxfp4", "float32"), ("mxfp4", "bfloat16")])
def test_engine_greedy_matches_transformers(checkpoints, ckpt, dtype):
    """float32: HF's greedy tokens up to near ties (1e-3). bfloat16 (see the prefill test on rank swaps):
    scored by transformers in float32 along our own tokens (teacher-forced), at least 85% must be HF's
    choice and at most 10% more than 5% of the step's logit range below it."""
    hf, folders = checkpoints
    prompts = _prompts(2)
    # 4 prompts need up to 4 * ceil(74 / 4) = 76 blocks together; 32 blocks force preemptions.
    llm = LLM(model=folders[ckpt], dtype=dtype, skip_tokenizer_init=True, block_size=4,
              num_gpu_blocks_override=32, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=96, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.engine_config.cache_config.sliding_window_group == 6  # two KV groups
    stats = llm.llm_engine.get_stats()
    assert stats.num_chunked_prefill_steps > 0
    assert stats.num_preemptions > 0
    ours = [list(out.outputs[0].token_ids) for out in outs]
    if dtype == "bfloat16":
        same = far = 0
        for toks, (ref, ref_logits) in zip(ours, hf_teacher_forced(hf, prompts, ours)):
            for a, b, logits in zip(toks, ref, ref_logits):
                same += a == b
                far += float(logits[b] - logits[a]) > 0.05 * float(logits.max() - logits.min())
        total = MAX_TOKENS * len(prompts)
        assert same >= 0.85 * total and far <= 0.10 * total, f"{same} of {total} HF's choice, {far} far from it"
        return
    compared = 0
    for prompt, toks in zip(prompts, ours):
        ref, ref_logits = hf_greedy(hf, prompt, MAX_TOKENS)
        ok, n, msg = compare_greedy(toks, ref, ref_logits)
        assert ok, f"{ckpt} {dtype}, prompt of {len(prompt)} tokens: {msg}"
        compared += n
    assert compared >= 0.75 * MAX_TOKENS * len(prompts), f"only {compared} tokens compared"


# ---- the pieces -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_matches_transformers(truncate):
    """gpt-oss-20b's published rope parameters (truncate false), and the default truncation."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
              "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    config = transformers.GptOssConfig(head_dim=64, hidden_size=2880, num_attention_heads=64,
                                       max_position_embeddings=131072, rope_parameters=params)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    torch.testing.assert_close(compute_inv_freq(64, params), inv_freq, rtol=0, atol=0)
    assert rope_attention_factor(params) == pytest.approx(factor, rel=1e-12)
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1, rel=1e-6)


def test_mxfp4_decode_known_values_and_transformers_layout():
    # byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0) second; 0xF7: 6.0 then -6.0
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0], blocks[0, 1] = 0x21, 0xF7
    out = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8), torch.float32)  # scale 2^1
    assert out.shape == (32,)
    assert out[:4].tolist() == [1.0, 2.0, 12.0, -12.0] and torch.all(out[4:] == 0)
    # transformers' own decoder (integrations/mxfp4.py) on random bytes: same values, HF's transposed layout
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (2, 6, 3), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out]
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=0)


def test_mxfp4_quantize_round_trip():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 64, generator=g)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 2, 16) and scales.shape == (4, 2) and blocks.dtype == scales.dtype == torch.uint8
    deq = dequantize_mxfp4(blocks, scales, torch.float32)
    # Scale s = 2^(floor(log2 amax) - 2): |w| / s < 8, rounded (steps of 2 above 4) or clipped to 6, so the
    # error is below 2 s; the block's largest value is off by less than 1/3 of itself.
    amax = w.view(4, 2, 32).abs().amax(-1, keepdim=True)
    s = 2 ** (torch.floor(torch.log2(amax)) - 2)
    assert torch.all((deq - w).view(4, 2, 32).abs() < 2 * s)
    torch.testing.assert_close(dequantize_mxfp4(*quantize_mxfp4(deq), torch.float32), deq, rtol=0, atol=0)


# ---- bad input: one sentence at load ------------------------------------------------------------------------------


def _tiny_model(**overrides):
    config = transformers.GptOssConfig(**{**CONFIG, **overrides})
    with torch.device("cpu"):
        return GptOssForCausalLM(config)


def test_unknown_layer_type_is_refused():
    config = transformers.GptOssConfig(**CONFIG)
    config.layer_types = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"unknown layer_types \['chunked_attention'\]"):
        GptOssForCausalLM(config)
    config.layer_types = ["full_attention"]
    with pytest.raises(ValueError, match="1 layer_types entries for 4 layers"):
        GptOssForCausalLM(config)


def test_mxfp4_shapes_that_disagree_with_the_config_are_refused():
    model = _tiny_model()
    blocks, scales = quantize_mxfp4(torch.randn(8, 128, 64))  # gate_up [E, 2I, H]
    name = "model.layers.0.mlp.experts.gate_up_proj"
    model.load_weights([(name + "_blocks", blocks), (name + "_scales", scales)])  # the right shapes load
    with pytest.raises(ValueError, match="MXFP4 tensors of model.layers.0.mlp.experts.gate_up_proj"):
        model.load_weights([(name + "_blocks", blocks[:, :64]), (name + "_scales", scales[:, :64])])
    with pytest.raises(ValueError, match="but the config implies blocks"):
        model.load_weights([(name + "_blocks", blocks), (name + "_scales", scales[..., :1])])
    with pytest.raises(ValueError, match="has no matching _scales tensor"):
        model.load_weights([(name + "_blocks", blocks)])


def test_sinks_of_the_wrong_size_are_refused():
    model = _tiny_model()
    with pytest.raises(ValueError, match="config has 4 attention heads"):
        model.load_weights([("model.layers.0.self_attn.sinks", torch.zeros(8))])


def test_other_quantization_methods_are_refused():
    with pytest.raises(ValueError, match="quantized with 'awq' are not supported"):
        _tiny_model(quantization_config={"quant_method": "awq"})


# ---- float16: the residual stream in float32 ---------------------------------------------------------------------


def test_float16_residual_overflow_stays_finite(checkpoints):
    """Late layers' expert down biases scaled so the residual stream passes 1e5 (float16 max: 65504): with
    the float32 residual, float16 logits stay finite and close to float32's; carried in float16 they would
    turn inf/NaN (checked by switching the float32 residual off)."""
    _, folders = checkpoints
    models = {}
    for dtype in ("float32", "float16"):
        cfg = EngineArgs(model=folders["bf16"], device="cpu", dtype=dtype).create_engine_config()
        models[dtype] = model = get_model(cfg.model_config, "cpu", dtype)
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.experts.w2_bias[:, :8] = 6.0e4  # each layer's output still fits float16
    assert all(layer.fp32_residual for layer in models["float16"].model.layers)
    assert not any(layer.fp32_residual for layer in models["float32"].model.layers)
    seen = []  # the final norm's (normed, residual + last output): the whole residual stream
    hook = models["float16"].model.norm.register_forward_hook(lambda m, a, out: seen.append(out[1]))
    prompts = _prompts(3)[:2]
    ref = batch_prefill_logits(models["float32"], prompts)
    got = batch_prefill_logits(models["float16"], prompts)
    hook.remove()
    assert seen[0].dtype == torch.float32 and seen[0].abs().max() > 1e5
    for r, o in zip(ref, got):
        assert torch.isfinite(o).all()
        assert ((o - r).abs().max() / r.abs().max()).item() <= 2e-2
    for layer in models["float16"].model.layers:
        layer.fp32_residual = False
    assert not all(torch.isfinite(o).all() for o in batch_prefill_logits(models["float16"], prompts))


# ---- the published configs (benchmarks/configs) and dummy weights ----------------------------------------------

CONFIGS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")


@pytest.mark.parametrize("name,billions", [("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83)])
def test_published_configs_build_with_the_published_sizes(name, billions):
    with open(os.path.join(CONFIGS_DIR, f"{name}.json")) as f:
        config = transformers.AutoConfig.for_model(**json.load(f))
    with torch.device("meta"):
        model = GptOssForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert total / 1e9 == pytest.approx(billions, abs=0.01)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows[0::2] == [128] * (len(windows) // 2) and windows[1::2] == [None] * (len(windows) // 2)
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_cache.shape == (131072, 32)


@pytest.mark.parametrize("packed", [False, True])
def test_dummy_weights_load_with_the_mxfp4_config(tmp_path, monkeypatch, packed):
    """`--load-format dummy` on a shrunken copy of gpt-oss-20b's config.json (quantization_config kept), with
    the experts dequantized (CPU) or packed (the GPU layout, forced here): dummy MXFP4 bytes and scales."""
    from tokenmill.models import gpt_oss

    monkeypatch.setattr(gpt_oss, "keep_mxfp4_packed", lambda config: packed)
    with open(os.path.join(CONFIGS_DIR, "gpt-oss-20b.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=64, num_hidden_layers=2, layer_types=config["layer_types"][:2],
                  num_local_experts=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                  max_position_embeddings=512, eos_token_id=None, pad_token_id=None)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
              max_model_len=128, block_size=4, num_gpu_blocks_override=64, seed=0)
    out = llm.generate([{"prompt_token_ids": list(range(20))}],
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    if packed:
        experts = llm.llm_engine.engine_core.executor.worker.model_runner.model.model.layers[0].mlp.experts
        assert experts.w13_scales.eq(119).all() and experts.w13_blocks.float().std() > 50  # random bytes


def test_packed_mxfp4_experts_match_dequantized_at_load(checkpoints, monkeypatch):
    """The GPU layout (experts kept packed, decoded per layer) forced on the CPU: same logits as the experts
    dequantized at load, with a quarter of the bytes held (plus a scale byte per 32 values)."""
    from tokenmill.layers.fused_moe.mxfp4 import Mxfp4FusedMoE
    from tokenmill.models import gpt_oss

    _, folders = checkpoints
    cfg = EngineArgs(model=folders["mxfp4"], device="cpu", dtype="float32").create_engine_config()
    dense = get_model(cfg.model_config, "cpu", "float32")
    monkeypatch.setattr(gpt_oss, "keep_mxfp4_packed", lambda config: True)
    packed = get_model(cfg.model_config, "cpu", "float32")
    experts = packed.model.layers[0].mlp.experts
    assert isinstance(experts, Mxfp4FusedMoE) and experts.w13_blocks.dtype == torch.uint8
    w13, w2 = experts.expert_weights()
    torch.testing.assert_close(w13, dense.model.layers[0].mlp.experts.w13_weight, rtol=0, atol=0)
    torch.testing.assert_close(w2, dense.model.layers[0].mlp.experts.w2_weight, rtol=0, atol=0)
    prompts = _prompts(4)[:2]
    for a, b in zip(batch_prefill_logits(packed, prompts), batch_prefill_logits(dense, prompts)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_two_kv_groups_match_one_group(checkpoints, caplog):
    """The sliding-window KV group (blocks freed as the window moves, layers paired on shared tensors) gives
    the same greedy tokens as full-length KV on every layer (--disable-hybrid-kv-cache-manager), logs its
    capacity, and returns every block; with prefix caching on in both, a second round of the same prompts
    hits the cache (two groups: full blocks plus the window before them) and gives the same tokens again."""
    import logging

    _, folders = checkpoints
    prompts = _prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for disable in (False, True):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            llm = LLM(model=folders["bf16"], dtype="float32", skip_tokenizer_init=True, block_size=4,
                      num_gpu_blocks_override=400, max_num_batched_tokens=16, max_model_len=96, seed=0,
                      disable_hybrid_kv_cache_manager=disable)
        cache = llm.llm_engine.engine_config.cache_config
        assert cache.sliding_window_group == (None if disable else 6)
        assert cache.enable_prefix_caching
        if not disable:
            assert "sliding-window layers (window 6 tokens)" in caplog.text
        kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
        rounds = []
        for _ in range(2):
            hits_before = kv.prefix_cache_hits
            rounds.append([list(o.outputs[0].token_ids) for o in
                           llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
            assert kv.num_free_blocks == 400 and not kv.req_to_blocks and not kv.swa_tables
        # Second round (400 blocks: nothing evicted): every prompt hits all its full blocks but the one
        # holding its last token.
        assert kv.prefix_cache_hits - hits_before == sum((len(p) - 1) // 4 * 4 for p in prompts)
        assert rounds[0] == rounds[1]
        outs[disable] = rounds[0]
    assert outs[False] == outs[True]


@pytest.mark.slow  # two worker processes on gloo
def test_tensor_parallel_2_matches_transformers(checkpoints):
    """tp=2: each rank holds 2 of the 4 heads' sinks, half of every expert, and adds the down bias only on
    rank 0 (the all-reduce sums the ranks); greedy tokens equal transformers' up to near ties."""
    hf, folders = checkpoints
    prompts = _prompts(6)[:2]
    llm = LLM(model=folders["bf16"], dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
              max_model_len=96, kv_cache_memory_bytes="8M", seed=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, prompt, 12)
        ok, n, msg = compare_greedy(list(out.outputs[0].token_ids), ref, ref_logits)
        assert ok and n >= 6, f"prompt of {len(prompt)} tokens: {msg}"
