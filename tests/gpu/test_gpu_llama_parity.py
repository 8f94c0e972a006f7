"""LlamaForCausalLM on CUDA through the whole engine vs transformers, in bfloat16 and float16.

A random Llama (4 layers, hidden 512, 8 query / 4 kv heads (GQA), head_dim 64
or 128, vocab 1024) is saved as safetensors and loaded by
`LLM(model=folder, skip_tokenizer_init=True, ...)`. Eight token-id prompts of
1..700 tokens run together with max_num_batched_tokens=128: steps mix whole
prompts with chunks of the long ones, and prompts cross 16-token blocks.

- Prompt logits: a forward hook on the runner's model records the logits of
  every prompt position as the real steps compute them (scheduler, input
  batch, paged KV cache, attention backend), compared with transformers in
  float64 (the reference; its softmax and RMSNorm run in float32, ~1e-7
  relative, far below the tolerances) and in the same dtype.
- Greedy: `LLM.generate`, 32 tokens per prompt, CUDA graphs allowed, against
  transformers' greedy `generate` in the same dtype (near-tie rule of
  tests/test_llm_parity.py), and every generated token re-scored by
  transformers in float64 given our own prefix (teacher forcing).

Each case runs with TRITON_ATTN and TORCH_SDPA, and under the cc-7.0
simulation (TOKENMILL_FORCE_CC70=1), where float16 is the dtype and
bfloat16 must be refused. Only the offline path is imported (no server
packages).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.attention.forward_context import get_forward_context
from tokenmill.config import EngineArgs

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

DEVICE = "cuda"
BLOCK_SIZE = 16
# Inside one block, exactly one, one past, two, several, and 700 (six steps at 128 tokens per step).
PROMPT_LENS = [1, 7, 16, 17, 32, 49, 100, 700]
MAX_BATCHED_TOKENS = 128
NUM_TOKENS = 32
HEAD_DIMS = (64, 128)
BACKENDS = ("TRITON_ATTN", "TORCH_SDPA")
# (dtype, cc-7.0 simulation)
MODES = [("bfloat16", False), ("float16", False), ("float16", True)]
MODE_IDS = ["bf16", "fp16", "cc70-fp16"]

# Tolerances from the unit roundoff u of the dtype: bfloat16 keeps 8 significand bits
# (u = 2^-8 = 3.9e-3), float16 11 (u = 2^-11 = 4.9e-4). Every layer rounds its activations
# to the dtype, so a correct implementation's logits differ from exact (float64) ones by a
# few u relative to max|logit|; on this model (CPU, tokenmill and transformers alike)
# 3-8 u in bfloat16 and 4-9 u in float16, growing with prompt length. So:
#   (a) max|ours - ref64| <= REL_TOL * max|ref64| with REL_TOL = 16 u (about 2x margin);
#   (b) max|ours - ref64| <= 2 * max|hf - ref64| + 4 u * max|ref64|: no worse than transformers
#       at the same precision (a bug that costs a few bits, e.g. K/V rounded twice, fails here).
# Greedy steps follow from (a): with every logit within e = REL_TOL * M (M = max|logit|) of
# exact, our pick's exact logit is within 2e of the exact best, our log-prob within 2e of the
# exact one, and ours and transformers' picks can differ only where transformers' own top-2
# gap is <= 4e (both off by e, in opposite directions, on both tokens).
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
REL_TOL = {dtype: 16 * u for dtype, u in UNIT_ROUNDOFF.items()}
INIT_STD = 0.05  # weights' std: logits of |x| <= ~6, top-2 gaps ~0.25 typical


def _llama_config(head_dim: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=head_dim, max_position_embeddings=2048, rms_norm_eps=1e-5,
        initializer_range=INIT_STD, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )


def _prompts(vocab_size: int) -> list[list[int]]:
    """Random prompts of PROMPT_LENS in which no two prompts hold the same token at the same position,
    so a step's chunk (its position and first token) names its prompt."""
    g = torch.Generator().manual_seed(1)
    columns = torch.stack([torch.randperm(vocab_size, generator=g)[: len(PROMPT_LENS)]
                           for _ in range(max(PROMPT_LENS))], dim=1)  # [num_prompts, max_len]
    return [columns[i, :n].tolist() for i, n in enumerate(PROMPT_LENS)]


class _References:
    """Checkpoint folders and transformers outputs, built on first use and cached for the module.

    Args:
        root: a folder for the checkpoints (one per head_dim).
    """

    def __init__(self, root) -> None:
        self.root = root
        self.prompts = _prompts(1024)
        self._folders: dict[int, str] = {}
        self._logits: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._greedy: dict[tuple[int, str], list[tuple[list[int], list[torch.Tensor]]]] = {}
        self._exact: dict[int, LlamaForCausalLM] = {}  # float64 models kept for re-scoring

    def folder(self, head_dim: int) -> str:
        """A saved random Llama (float32 safetensors); norms perturbed so their loading matters."""
        if head_dim not in self._folders:
            torch.manual_seed(head_dim)
            model = LlamaForCausalLM(_llama_config(head_dim)).eval()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.add_(0.1 * torch.randn_like(p))
            folder = self.root / f"llama_hd{head_dim}"
            model.save_pretrained(folder, safe_serialization=True)
            assert (folder / "model.safetensors").exists()
            self._folders[head_dim] = str(folder)
        return self._folders[head_dim]

    def hf_model(self, head_dim: int, dtype: str) -> LlamaForCausalLM:
        """transformers' model from the same files; float64 uses eager attention (exact reference)."""
        kw = {"attn_implementation": "eager"} if dtype == "float64" else {}
        model = LlamaForCausalLM.from_pretrained(self.folder(head_dim), dtype=getattr(torch, dtype),
                                                 local_files_only=True, **kw)
        return model.to(DEVICE).eval()

    @torch.no_grad()
    def logits(self, head_dim: int, dtype: str) -> list[torch.Tensor]:
        """Per prompt: logits [len, vocab] on the CPU, float64 (dtype float64) or float32."""
        key = (head_dim, dtype)
        if key not in self._logits:
            model = self.hf_model(head_dim, dtype)
            out = [model(torch.tensor([p], device=DEVICE)).logits[0].cpu() for p in self.prompts]
            self._logits[key] = [x.double() if dtype == "float64" else x.float() for x in out]
            del model
            torch.cuda.empty_cache()
        return self._logits[key]

    @torch.no_grad()
    def greedy(self, head_dim: int, dtype: str) -> list[tuple[list[int], list[torch.Tensor]]]:
        """Per prompt: transformers' greedy `generate` (NUM_TOKENS, no EOS) -> (token ids, each step's logits)."""
        key = (head_dim, dtype)
        if key not in self._greedy:
            model = self.hf_model(head_dim, dtype)
            refs = []
            for p in self.prompts:
                ids = torch.tensor([p], device=DEVICE)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NUM_TOKENS, output_logits=True, return_dict_in_generate=True,
                                     pad_token_id=0)
                tokens = out.sequences[0, len(p):].tolist()
                assert len(tokens) == NUM_TOKENS, "transformers stopped early (an EOS in the config?)"
                refs.append((tokens, [x[0].float().cpu() for x in out.logits]))
            self._greedy[key] = refs
            del model
            torch.cuda.empty_cache()
        return self._greedy[key]

    @torch.no_grad()
    def rescore(self, head_dim: int, prompt: list[int], generated: list[int]) -> torch.Tensor:
        """float64 logits [len(generated), vocab] that transformers gives each generated token's step,
        given the prompt and the tokens generated before it (teacher forcing)."""
        if head_dim not in self._exact:
            self._exact[head_dim] = self.hf_model(head_dim, "float64")
        ids = torch.tensor([prompt + generated[:-1]], device=DEVICE)
        return self._exact[head_dim](ids).logits[0, len(prompt) - 1:].double().cpu()


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> _References:
    return _References(tmp_path_factory.mktemp("gpu_llama"))


@pytest.fixture
def force_cc70(monkeypatch):
    """TOKENMILL_FORCE_CC70=1 for one test; the global SDPA switches it turns off are restored after."""
    flash, cudnn = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setenv("TOKENMILL_FORCE_CC70", "1")
    yield
    torch.backends.cuda.enable_flash_sdp(flash)
    torch.backends.cuda.enable_cudnn_sdp(cudnn)


def _start(folder: str, dtype: str, backend: str, **kw) -> LLM:
    return LLM(model=folder, dtype=dtype, device=DEVICE, skip_tokenizer_init=True, attention_backend=backend,
               block_size=BLOCK_SIZE, max_model_len=1024, max_num_seqs=16,
               max_num_batched_tokens=MAX_BATCHED_TOKENS, kv_cache_memory_bytes="256M", seed=0, **kw)


def _stop(llm: LLM) -> None:
    llm.llm_engine.shutdown()
    torch.cuda.empty_cache()


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _check_engine(llm: LLM, dtype: str, backend: str, cc70: bool) -> None:
    """The engine runs what the case asked for; under cc 7.0 also its limits (fp16, no flash SDPA, 1 stage)."""
    cfg = llm.llm_engine.engine_config
    runner = _runner(llm)
    assert cfg.model_config.dtype == dtype
    assert runner.attn_backend.name == backend
    assert cfg.device_config.force_cc70 == cc70
    if cc70:
        assert not torch.backends.cuda.flash_sdp_enabled()
        if backend == "TRITON_ATTN":
            assert runner.attn_backend.num_stages == 1


class _PromptLogits:
    """Forward hook on the runner's model: float32 logits of every prompt position from the real steps.

    Each step's request segments are matched to prompts by (first position,
    tokens); `result()` checks that every position was computed exactly once.
    """

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]]) -> None:
        self.prompts = prompts
        self.chunks: list[dict[int, torch.Tensor]] = [{} for _ in prompts]  # start position -> [n, vocab]
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, hidden) -> None:
        md = get_forward_context().attn_metadata
        if md is None:  # the memory profile's dummy step
            return
        input_ids = (args[0] if args else kwargs["input_ids"]).tolist()
        positions = (args[1] if len(args) > 1 else kwargs["positions"]).tolist()
        logits = module.compute_logits(hidden[: md.num_actual_tokens]).float()
        qsl = [int(x) for x in md.query_start_loc_cpu[: md.num_reqs + 1]]
        for s, e in itertools.pairwise(qsl):
            start = positions[s]
            assert positions[s:e] == list(range(start, start + e - s)), "a segment's positions are not consecutive"
            owners = [i for i, p in enumerate(self.prompts) if p[start:start + e - s] == input_ids[s:e]]
            assert len(owners) == 1, f"segment at position {start} of {e - s} tokens matches prompts {owners}"
            assert start not in self.chunks[owners[0]], "a prompt position was computed twice"
            self.chunks[owners[0]][start] = logits[s:e].cpu()

    def result(self) -> list[torch.Tensor]:
        """Per prompt: logits [len, vocab] float32."""
        self.handle.remove()
        out = []
        for prompt, chunks in zip(self.prompts, self.chunks):
            logits = torch.cat([chunks[k] for k in sorted(chunks)])
            assert logits.shape[0] == len(prompt), f"{logits.shape[0]} of {len(prompt)} positions computed"
            out.append(logits)
        return out


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "cc70"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prompt_logits_match_transformers(refs, request, head_dim, dtype, cc70, backend):
    if cc70:
        request.getfixturevalue("force_cc70")
    llm = _start(refs.folder(head_dim), dtype, backend, enforce_eager=True)  # eager: the hook sees every step
    try:
        _check_engine(llm, dtype, backend, cc70)
        capture = _PromptLogits(_runner(llm).model, refs.prompts)
        prompts = [{"prompt_token_ids": p} for p in refs.prompts]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        ours = capture.result()
        assert llm.llm_engine.num_chunked_prefill_steps > 0
    finally:
        _stop(llm)
    ref64, hf = refs.logits(head_dim, "float64"), refs.logits(head_dim, dtype)
    u = UNIT_ROUNDOFF[dtype]
    for i, prompt in enumerate(refs.prompts):
        err, hf_err = _rel_err(ours[i], ref64[i]), _rel_err(hf[i], ref64[i])
        what = (f"prompt {i} ({len(prompt)} tokens): max|ours - f64| / max|f64| = {err:.2e} ({err / u:.1f} u), "
                f"transformers {dtype}: {hf_err:.2e} ({hf_err / u:.1f} u)")
        assert err <= REL_TOL[dtype], what
        assert err <= 2 * hf_err + 4 * u, what


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "cc70"), MODES, ids=MODE_IDS)
def test_greedy_generate_matches_transformers(refs, request, dtype, cc70, backend):
    head_dim = 128
    if cc70:
        request.getfixturevalue("force_cc70")
    llm = _start(refs.folder(head_dim), dtype, backend)  # CUDA graphs for decode steps where the engine uses them
    try:
        _check_engine(llm, dtype, backend, cc70)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in refs.prompts], params, use_tqdm=False)
        graphs = getattr(_runner(llm), "cuda_graphs", None)
        if backend == "TRITON_ATTN" and graphs is not None:
            assert graphs.num_replays > 0
    finally:
        _stop(llm)
    tol = REL_TOL[dtype]
    for i, (prompt, out, (hf_tokens, hf_logits)) in enumerate(zip(refs.prompts, outs, refs.greedy(head_dim, dtype))):
        ours = list(out.outputs[0].token_ids)
        assert len(ours) == NUM_TOKENS
        # Against transformers' own greedy run: equal until a near tie, then the continuations may part.
        for step, (a, b) in enumerate(zip(ours, hf_tokens)):
            if a != b:
                top2 = torch.topk(hf_logits[step], 2).values
                gap, tie_tol = float(top2[0] - top2[1]), 4 * tol * float(hf_logits[step].abs().max())
                assert gap <= tie_tol, (f"prompt {i} ({len(prompt)} tokens) step {step}: ours {a} != transformers "
                                        f"{b}, its top-2 gap {gap:.3f} > {tie_tol:.3f}\nours: {ours}\nHF:   {hf_tokens}")
                break
        # Every step, given our own prefix: the pick is greedy and its logprob right, up to precision.
        exact = refs.rescore(head_dim, prompt, ours)
        exact_lp = exact.log_softmax(dim=-1)
        for step, tok in enumerate(ours):
            e = tol * float(exact[step].abs().max())
            our_lp = out.outputs[0].logprobs[step][tok].logprob
            where = f"prompt {i} ({len(prompt)} tokens) step {step} token {tok}"
            assert float(exact[step].max() - exact[step, tok]) <= 2 * e, f"{where}: not the exact best token"
            assert abs(our_lp - float(exact_lp[step, tok])) <= 2 * e, (
                f"{where}: logprob {our_lp:.4f} vs float64 {float(exact_lp[step, tok]):.4f}")


def test_cc70_refuses_bfloat16_and_picks_float16(refs, force_cc70):
    folder = refs.folder(64)
    with pytest.raises(ValueError, match=r"does not support bfloat16.*--dtype float16"):
        _start(folder, "bfloat16", "TRITON_ATTN")
    cfg = EngineArgs(model=folder, dtype="auto", device=DEVICE, skip_tokenizer_init=True).create_engine_config()
    assert cfg.model_config.dtype == "float16"
    assert cfg.device_config.force_cc70
