"""Front-end CPU per engine-core message: zmq.asyncio futures vs an event-loop reader callback.

A thread PUSHes `--messages` two-frame messages (300-byte payload, like one
decode step's outputs) over ipc://, `--gap-ms` apart, so each finds the
reader idle, as at concurrency 1. The asyncio loop thread receives them
either as `EngineCoreClient` did before (`futures`: await poll with a
timeout, await recv, a NOBLOCK recv that ends in zmq.Again, sleep(0)) or
as it does now (`callback`: `loop.add_reader` on the socket's fd, plain
NOBLOCK receives while `zmq.EVENTS` shows a message). Prints the loop
thread's CPU microseconds per message (`time.thread_time`).

    /work/main/.venv/bin/python benchmarks/zmq_reader_cpu.py
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time

import zmq
import zmq.asyncio


async def read_futures(sock: zmq.asyncio.Socket, n: int) -> None:
    got = 0
    while got < n:
        if not await sock.poll(500):
            continue
        msgs = [await sock.recv_multipart()]
        while len(msgs) < 16:
            try:
                msgs.append(await sock.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
        got += len(msgs)
        await asyncio.sleep(0)


async def read_callback(sock: zmq.asyncio.Socket, n: int) -> None:
    loop = asyncio.get_running_loop()
    plain = zmq.Socket.shadow(sock.underlying)
    done = loop.create_future()
    got = [0]

    def drain() -> None:
        k = 0
        while k < 16 and plain.get(zmq.EVENTS) & zmq.POLLIN:
            plain.recv_multipart(zmq.NOBLOCK)
            k += 1
        if k == 16:
            loop.call_soon(drain)
        got[0] += k
        if got[0] >= n and not done.done():
            done.set_result(None)

    loop.add_reader(plain.get(zmq.FD), drain)
    drain()
    await done
    loop.remove_reader(plain.get(zmq.FD))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=600)
    p.add_argument("--gap-ms", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    for _ in range(args.repeat):
        for name, reader in (("futures", read_futures), ("callback", read_callback)):
            print(f"{name:8s} {run(reader, args):6.1f} us of loop-thread CPU per message", flush=True)


def run(reader, args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        addr = f"ipc://{tmp}/out"
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PULL)
        sock.bind(addr)

        def send() -> None:
            sctx = zmq.Context()
            push = sctx.socket(zmq.PUSH)
            push.connect(addr)
            time.sleep(0.3)
            for _ in range(args.messages):
                push.send_multipart([b"OUTPUTS", b"x" * 300])
                time.sleep(args.gap_ms / 1000)
            push.close()
            sctx.term()

        async def go() -> float:
            t = threading.Thread(target=send)
            t.start()
            c0 = time.thread_time()
            await reader(sock, args.messages)
            cpu = time.thread_time() - c0
            t.join()
            return cpu

        cpu = asyncio.run(go())
        ctx.destroy(linger=0)
    return cpu / args.messages * 1e6


if __name__ == "__main__":
    main()
