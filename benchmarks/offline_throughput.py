"""Offline throughput: tokenmill `LLM.generate` vs transformers `generate`, same prompts, one process.

Both engines get the same `--num-prompts` token-id prompts (chat-templated
requests of 20-400 tokens, drawn from a fixed seed) and must produce exactly
`--output-len` tokens each (greedy, EOS ignored: tokenmill `ignore_eos=True`,
transformers `min_new_tokens = max_new_tokens`). Only generated tokens count;
the rate is output tokens / wall time of the generate calls (model loading
and one short warm-up run are outside the timing).

transformers runs batched `generate` with left padding in consecutive
batches of `--hf-batch-size` prompts (default 64: everything in one batch,
its fastest setting on the 2-core CPU box; see docs/benchmarks.md).

Usage (from the repo root):
    python benchmarks/offline_throughput.py                     # both, 64 x 128, float32
    python benchmarks/offline_throughput.py --skip-hf --num-prompts 16   # quick tokenmill A/B
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

# Sentences the prompts are cut from (any fixed English text would do).
_TEXT = (
    "The river town woke slowly, with bakers opening their shutters and fishermen checking nets by the quay. "
    "A printing press needs ink, paper, type and a patient hand; early printers often worked sixteen hours a day. "
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the chloroplasts of leaves. "
    "In 1969 two astronauts walked on the Moon while a third orbited above, waiting to bring them home. "
    "A good recipe for bread lists flour, water, salt and yeast, and then asks for time more than for skill. "
    "Railways changed how people thought about distance, since a journey of days became a journey of hours. "
    "The human heart beats about one hundred thousand times a day and pumps blood through vessels miles long. "
    "Chess players study openings, but most games are decided by small mistakes in the middle of the game. "
    "Volcanoes form where magma finds a path to the surface, building mountains from layers of ash and lava. "
    "A library is a quiet place where anyone can borrow a book, read a newspaper or ask a librarian for help. "
    "The violin has four strings tuned in fifths, and its sound depends on the wood, the varnish and the bow. "
    "Honeybees dance to tell each other where flowers are, turning the angle of the sun into a direction. "
)
_QUESTIONS = (
    "Summarize the text above in two sentences.",
    "What is the main topic of this passage?",
    "Write a short poem inspired by this text.",
    "List three facts mentioned above.",
    "Explain this passage to a ten-year-old.",
    "Which sentence above is the most surprising, and why?",
)


def build_prompts(tokenizer, num_prompts: int, seed: int = 0, min_len: int = 20,
                  max_len: int = 400) -> list[list[int]]:
    """`num_prompts` chat-templated token-id prompts with lengths spread over [min_len, max_len].

    Each prompt is a user turn "<a slice of _TEXT repeated> + question",
    cut so that the templated prompt has the drawn length (deterministic
    for a seed). Returns lists of token ids (the chat template adds the
    special tokens, so nothing more is added by either engine).
    """
    rng = np.random.default_rng(seed)
    body = tokenizer.encode(_TEXT * 4, add_special_tokens=False)
    targets = rng.integers(min_len, max_len + 1, num_prompts)
    prompts = []
    for i, target in enumerate(targets.tolist()):
        question = _QUESTIONS[i % len(_QUESTIONS)]
        frame = _chat_ids(tokenizer, question)
        n_body = max(0, target - len(frame) - 1)
        start = int(rng.integers(0, len(body) - n_body)) if n_body < len(body) else 0
        snippet = tokenizer.decode(body[start:start + n_body]).strip()
        ids = _chat_ids(tokenizer, f"{snippet}\n\n{question}" if snippet else question)
        prompts.append(ids[:max_len])
    return prompts


def _chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def run_tokenmill(llm, prompts: list[list[int]], output_len: int) -> tuple[int, float]:
    """(output tokens, seconds) of one `LLM.generate` over all prompts."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed


def run_hf(model, pad_id: int, prompts: list[list[int]], output_len: int, batch_size: int) -> tuple[int, float]:
    """(output tokens, seconds) of transformers' greedy `generate` in left-padded batches."""
    import torch

    total = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for row, p in enumerate(batch):  # left padding: the new tokens follow each prompt's last token
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
        total += int(out[:, width:].numel())
    return total, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128, help="Generated tokens per prompt (EOS ignored).")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="Prompts per transformers generate call.")
    parser.add_argument("--skip-hf", action="store_true", help="Only run tokenmill.")
    parser.add_argument("--skip-tokenmill", action="store_true", help="Only run transformers.")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: physical cores = os.cpu_count() here).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompt lengths and slices.")
    args = parser.parse_args()
    for name in ("num_prompts", "output_len", "hf_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1.")

    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set by an earlier parallel op
    from transformers import AutoTokenizer

    from tokenmill.model_loader.source import bundled_gguf_path

    gguf = bundled_gguf_path()
    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = build_prompts(tokenizer, args.num_prompts, args.seed)
    lens = [len(p) for p in prompts]
    print(f"prompts: {len(prompts)}, prompt tokens {sum(lens)} (min {min(lens)}, mean {np.mean(lens):.0f}, "
          f"max {max(lens)}), output {args.output_len} each, dtype {args.dtype}")
    results: dict[str, float] = {}

    if not args.skip_tokenmill:
        from tokenmill import LLM

        llm = LLM(dtype=args.dtype, seed=0)
        run_tokenmill(llm, prompts[:2], 4)  # warm-up
        n, dt = run_tokenmill(llm, prompts, args.output_len)
        results["tokenmill"] = n / dt
        print(f"tokenmill:    {n} output tokens in {dt:6.1f} s = {n / dt:7.1f} output tok/s "
              f"(load avg {_load()})")
        del llm

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=getattr(torch, args.dtype)).eval()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        run_hf(model, pad_id, prompts[:2], 4, 2)  # warm-up
        n, dt = run_hf(model, pad_id, prompts, args.output_len, args.hf_batch_size)
        results["transformers"] = n / dt
        print(f"transformers: {n} output tokens in {dt:6.1f} s = {n / dt:7.1f} output tok/s "
              f"(batch {args.hf_batch_size}, left padding; load avg {_load()})")

    import transformers

    from tokenmill.version import get_version

    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"tokenmill {get_version()}, {os.cpu_count()} CPUs")
    if len(results) == 2:
        print(f"ratio tokenmill / transformers: {results['tokenmill'] / results['transformers']:.2f}x")


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
