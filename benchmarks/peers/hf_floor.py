"""transformers floor: offline greedy generation in static batches.

Runs in the `hf` venv (torch + transformers only, no tokenmill).  Reads the
prompts that run_peers.py wrote (the same text `bench serve` sends), groups
them in consecutive batches of `--batch-size` (the concurrency), left-pads
each batch and calls `generate(max_new_tokens=L, min_new_tokens=L)` so every
request yields exactly its requested output length (the `--ignore-eos`
equivalent).  One 2-token call on the first batch warms up first (untimed).
Writes a result JSON with `bench serve`'s key names
(output_throughput, total_token_throughput, request_throughput, ...);
latency keys are per batch: e2el of a request = the wall time of its batch.

Usage:
    python hf_floor.py --model DIR --prompts prompts.jsonl --batch-size 4 \
        --dtype float32 --label transformers-fp32 --output result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF-format model folder.")
    parser.add_argument("--prompts", required=True, help="JSONL: {prompt, prompt_len, output_len} per line.")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--label", default="transformers")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}.")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"  # decoder-only: new tokens follow the last prompt token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()

    # Warm-up outside the timing, as the servers get theirs (start-up, the
    # sanity question): one short greedy call on the first batch's shapes.
    first = tokenizer([r["prompt"] for r in rows[:args.batch_size]], return_tensors="pt", padding=True,
                      add_special_tokens=False)
    with torch.inference_mode():
        model.generate(**first, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)

    total_in = total_out = 0
    e2els: list[float] = []
    start = time.perf_counter()
    for i in range(0, len(rows), args.batch_size):
        batch = rows[i:i + args.batch_size]
        # Batches share one output length (the sweep uses a fixed length).
        out_len = max(r["output_len"] for r in batch)
        enc = tokenizer([r["prompt"] for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        dt = time.perf_counter() - t0
        new = out[:, enc["input_ids"].shape[1]:]
        total_out += int(new.numel())
        total_in += int(enc["attention_mask"].sum())
        e2els.extend([dt * 1000.0] * len(batch))
    duration = time.perf_counter() - start

    result = {
        "label": args.label, "backend": "transformers-offline", "max_concurrency": args.batch_size,
        "num_prompts": len(rows), "completed": len(rows), "duration": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(rows) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "median_e2el_ms": statistics.median(e2els), "dtype": args.dtype,
        "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
    }
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(result, f)
    print(f"{args.label} batch {args.batch_size}: {result['output_throughput']:.1f} output tok/s "
          f"({total_out} tokens in {duration:.1f} s); saved {args.output}")


if __name__ == "__main__":
    main()
