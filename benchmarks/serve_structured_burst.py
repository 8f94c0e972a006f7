"""A burst of chat requests against a running server, plain and then with JSON schemas, timed.

`--num-requests` concurrent chat completions (greedy, `--max-tokens`), first
without and then with `response_format` json_schema, every request with a
schema of its own (so every grammar is compiled). Prints the wall time of
each burst, the median and slowest request, and how many structured answers
parse as JSON. Used to compare engine-core thread counts
(`TOKENMILL_CPU_THREADS`) under grammar compiles.

    tokenmill serve MODEL --served-model-name smollm2 --port 8000 &
    python benchmarks/serve_structured_burst.py --base-url http://127.0.0.1:8000 --model smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


async def _one(client, model: str, i: int, structured: bool, max_tokens: int) -> tuple[float, str]:
    kwargs = {}
    if structured:
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"}, "n": {"type": "integer"}},
                  "required": [f"field_{i}", "n"]}
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
    t = time.perf_counter()
    r = await client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens,
                                             messages=[{"role": "user", "content": f"Give me JSON number {i}."}],
                                             **kwargs)
    return time.perf_counter() - t, r.choices[0].message.content or ""


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{args.base_url}/v1", api_key="unused")
    for structured in (False, True):
        t = time.perf_counter()
        results = await asyncio.gather(*[_one(client, args.model, i, structured, args.max_tokens)
                                         for i in range(args.num_requests)])
        wall = time.perf_counter() - t
        latencies = sorted(r[0] for r in results)
        valid = sum(_parses(r[1]) for r in results)
        print(f"{'json_schema' if structured else 'plain'}: {args.num_requests} requests in {wall:.1f} s, "
              f"median {latencies[len(latencies) // 2]:.2f} s, slowest {latencies[-1]:.2f} s, "
              f"answers that parse as JSON: {valid}")


if __name__ == "__main__":
    asyncio.run(main())
