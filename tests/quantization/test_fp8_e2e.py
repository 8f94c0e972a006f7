"""FP8 checkpoints (and `--quantization fp8`) through tokenmill on CPU vs transformers on the same quantization.

Tiny random Llama and Qwen3-MoE models are written in each FP8 layout (`fp8_checkpoints.py`: the fp8 block
layout with weight_scale_inv, per-tensor with static input_scale, compressed-tensors FP8_DYNAMIC and W8A16)
and loaded two ways:

- as the CPU serves them: dequantized at load into float32. The reference is transformers on the weights the
  format's own dequantization gives (compressed-tensors' `decompress`; the published formula for the fp8
  layout). Both sides form weight * scale in float32 once: logits agree to float32 summation order
  (DEQUANT_TOL).
- with the FP8 layers kept (the CPU dequantization turned off), so the layers run `kernels.fp8_linear`'s
  reference with the checkpoint's activation quantization, as a cc >= 8.9 GPU does (per token, per 1 x 128
  group for blocks, or the static input_scale). The reference adds the same activation quantization to
  transformers' linear layers (`activation_hooks`); experts run weight-only on both sides. The two models'
  activations differ by float32 rounding, which can move a value across an e4m3 rounding boundary now and
  then: W8A8_TOL (1e-3; measured <= 1.3e-5, and 0.12-0.21 without the reference's activation quantization).

The engine's greedy tokens must equal the reference's up to near-ties (tests/models/family_utils.py's rule).
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_parity import batch_prefill_logits, compare_greedy, hf_greedy, hf_logits
from fp8_checkpoints import activation_hooks, reference_fp8_state_dict, write_fp8_checkpoint
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.kernels.fp8 import quantize_fp8_per_row
from tokenmill.model_loader import get_model
from tokenmill.model_loader import loader as loader_mod

CASES = [("llama", "fp8-block"), ("llama", "fp8-tensor-static"), ("llama", "ct-fp8-dynamic"),
         ("llama", "ct-fp8-w8a16"), ("qwen3_moe", "fp8-block"), ("qwen3_moe", "ct-fp8-dynamic"),
         ("qwen3_moe", "fp8-tensor-static")]
PROMPT_LENS = (29, 5, 17)
MAX_TOKENS = 12
DEQUANT_TOL = 1e-5
# Measured: <= 1.3e-5 (one e4m3 rounding flipped by float32 noise), against 0.12-0.21 when the reference leaves
# the activations unquantized.
W8A8_TOL = 1e-3


@pytest.fixture(scope="module")
def dense_models(tiny_llama_dir, tiny_qwen3_moe_dir) -> dict[str, str]:
    return {"llama": tiny_llama_dir, "qwen3_moe": tiny_qwen3_moe_dir}


def _hf_from_state(dense_dir: str, state: dict[str, torch.Tensor], folder: str):
    from transformers import AutoModelForCausalLM

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(dense_dir, "config.json")) as f, open(os.path.join(folder, "config.json"), "w") as g:
        g.write(f.read())
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory, dense_models):
    """(kind, layout) -> (FP8 folder, transformers model on its reference weights), built once per module."""
    cache = {}

    def get(kind: str, layout: str):
        if (kind, layout) not in cache:
            folder = write_fp8_checkpoint(dense_models[kind], str(tmp_path_factory.mktemp(f"{kind}_{layout}")), layout)
            hf = _hf_from_state(dense_models[kind], reference_fp8_state_dict(folder),
                                str(tmp_path_factory.mktemp(f"{kind}_{layout}_ref")))
            cache[kind, layout] = folder, hf
        return cache[kind, layout]

    return get


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _load(folder: str, keep_fp8: bool, monkeypatch, **kw):
    cfg = EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True, **kw).create_engine_config()
    if keep_fp8:
        monkeypatch.setattr(loader_mod, "dequantize_layers", lambda model: 0)
    return cfg, get_model(cfg.model_config, "cpu", "float32")


def _max_rel_err(model, hf) -> float:
    errs = []
    for prompt, ours in zip(_prompts(), batch_prefill_logits(model, _prompts())):
        ref = hf_logits(hf, prompt)
        errs.append(((ours - ref).abs().max() / ref.abs().max()).item())
    return max(errs)


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_logits_dequantized_and_w8a8(fp8_models, monkeypatch, kind, layout):
    folder, hf = fp8_models(kind, layout)
    cfg, model = _load(folder, False, monkeypatch)
    assert cfg.model_config.quantization.is_fp8
    assert not any(getattr(m, "quant", None) for m in model.modules())  # dense after the CPU dequantization
    assert _max_rel_err(model, hf) <= DEQUANT_TOL, f"{kind} {layout} dequantized"
    _, model = _load(folder, True, monkeypatch)
    fp8_layers = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    assert fp8_layers and all(m.w13_weight.dtype == torch.float8_e4m3fn if hasattr(m, "w13_weight")
                              else m.weight.dtype == torch.float8_e4m3fn for m in fp8_layers)
    handles = activation_hooks(hf, folder)
    try:
        err = _max_rel_err(model, hf)
    finally:
        for h in handles:
            h.remove()
    assert err <= W8A8_TOL, f"{kind} {layout} W8A8: rel err {err:.2e}"


@pytest.mark.parametrize(("kind", "layout"), [("llama", "fp8-block"), ("qwen3_moe", "ct-fp8-dynamic")])
def test_engine_greedy_matches_the_reference(fp8_models, kind, layout):
    folder, hf = fp8_models(kind, layout)
    _greedy_check(LLM(model=folder, dtype="float32", skip_tokenizer_init=True, block_size=4,
                      num_gpu_blocks_override=64, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
                      seed=0), hf, f"{kind} {layout}")


def _greedy_check(llm, hf, what: str) -> None:
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(2)], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    compared = 0
    for prompt, out in zip(_prompts(2), outs):
        ref, ref_logits = hf_greedy(hf, prompt, MAX_TOKENS)
        ok, n, msg = compare_greedy(list(out.outputs[0].token_ids), ref, ref_logits)
        assert ok, f"{what}, prompt of {len(prompt)} tokens: {msg}"
        compared += n
    assert compared >= 0.75 * MAX_TOKENS * len(PROMPT_LENS), f"{what}: only {compared} tokens compared"


def _per_channel_reference(dense_dir: str) -> dict[str, torch.Tensor]:
    """`--quantization fp8`'s weights: every linear projection (experts included) per output row, over all of K."""
    from checkpoints import read_state_dict

    out = {}
    for name, t in read_state_dict(dense_dir).items():
        quantized = name.endswith(("_proj.weight", ".experts.gate_up_proj", ".experts.down_proj")) and t.dim() >= 2
        if quantized:
            q, s = quantize_fp8_per_row(t.float())
            t = q.float() * s
        out[name] = t
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_quantization_fp8_at_load(dense_models, tmp_path, monkeypatch, caplog, kind):
    """--quantization fp8 on a 16-bit checkpoint: per-channel FP8 weights (a quarter of float32's bytes, reported
    at start-up), dynamic per-token activations; logits vs transformers on the same per-channel weights."""
    dense = dense_models[kind]
    hf = _hf_from_state(dense, _per_channel_reference(dense), str(tmp_path / "ref"))
    with caplog.at_level("INFO", logger="tokenmill.model_loader.loader"):
        cfg, model = _load(dense, False, monkeypatch, quantization="fp8")
    assert cfg.model_config.quantization.checkpoint_format == "quantize-at-load"
    assert "fp8 e4m3 channel W8A8 dynamic, quantized at load" in caplog.text
    assert _max_rel_err(model, hf) <= DEQUANT_TOL
    _, model = _load(dense, True, monkeypatch, quantization="fp8")
    linear = model.model.layers[0].self_attn.qkv_proj
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale.shape == (linear.weight.shape[0],)
    if kind == "llama":
        hooks = [m.register_forward_pre_hook(lambda mod, args: (_per_token(args[0]),))
                 for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith("_proj")]
        try:
            assert _max_rel_err(model, hf) <= W8A8_TOL
        finally:
            for h in hooks:
                h.remove()
        monkeypatch.undo()  # the engine serves as the CPU does: dequantized at load
        _greedy_check(LLM(model=dense, quantization="fp8", dtype="float32", skip_tokenizer_init=True, block_size=4,
                          num_gpu_blocks_override=64, max_num_seqs=4, max_model_len=64, seed=0), hf, "fp8 at load")


def _per_token(x: torch.Tensor) -> torch.Tensor:
    from fp8_checkpoints import fake_quantize_activations

    return fake_quantize_activations(x, None, None)
