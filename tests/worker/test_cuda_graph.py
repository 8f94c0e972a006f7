"""CUDA-graph bookkeeping that runs anywhere: capture sizes, padding lookup, padding rows.

The capture/replay itself needs a GPU: tests/gpu/test_cuda_graphs.py. The attention kernel under a mixed
graph's metadata: tests/kernels/test_triton_paged_attention.py.
"""

from __future__ import annotations

import torch

from tokenmill.worker.cuda_graph import (
    MIXED_MAX_TOKENS,
    CUDAGraphRunner,
    capture_sizes,
    mixed_capture_sizes,
    padded_size,
)


def test_capture_sizes_follow_the_issue():
    assert capture_sizes(256, 8192) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(1024, 16384)[-1] == 512  # capped at 512
    assert capture_sizes(40, 8192) == [1, 2, 4, 8, 16, 32, 40]  # the cap itself is captured
    assert capture_sizes(3, 8192) == [1, 2, 3]
    assert capture_sizes(256, 24) == [1, 2, 4, 8, 16, 24]  # a step cannot exceed the token budget


def test_padded_size_is_smallest_capture_at_least_n():
    sizes = capture_sizes(64, 8192)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 8, 9, 17, 64)] == [1, 4, 8, 8, 16, 32, 64]
    assert padded_size(sizes, 65) is None


def _buffers(n_tok: int, n_req: int) -> dict[str, torch.Tensor]:
    """Persistent step buffers with recognisable stale contents (tokens and requests)."""
    return {
        "input_ids": torch.arange(n_tok, dtype=torch.int64) + 100,
        "positions": torch.arange(n_tok, dtype=torch.int64) + 7,
        "slot_mapping": torch.arange(n_tok, dtype=torch.int64) + 50,
        "query_start_loc": torch.arange(n_req + 1, dtype=torch.int32) * 3,
        "seq_lens": torch.full((n_req,), 9, dtype=torch.int32),
    }


def test_pad_decode_inputs_makes_harmless_padding_rows():
    n_buf = 16
    bufs = _buffers(n_buf, n_buf)
    before = {k: v.clone() for k, v in bufs.items()}
    runner = CUDAGraphRunner(lambda i, p: i, bufs, torch.zeros(n_buf, 4, dtype=torch.int32), [], None,
                             capture_sizes(n_buf, 64), max_model_len=64)
    runner.pad_decode_inputs(3, 8)
    # Rows [0, 3) (the live decodes) and everything past the padded size are untouched.
    for k in bufs:
        assert torch.equal(bufs[k][:3], before[k][:3]), k
    assert torch.equal(bufs["slot_mapping"][8:], before["slot_mapping"][8:])
    # Padding rows write nothing to the KV cache and attend to one slot.
    assert bufs["slot_mapping"][3:8].tolist() == [-1] * 5
    assert bufs["seq_lens"][3:8].tolist() == [1] * 5
    # Live rows keep their query_start_loc (0..3 prefix); padding requests get one token each.
    assert bufs["query_start_loc"][:4].tolist() == [0, 3, 6, 9]
    assert bufs["query_start_loc"][4:9].tolist() == [4, 5, 6, 7, 8]
    assert bufs["input_ids"][3:8].tolist() == [0] * 5 and bufs["positions"][3:8].tolist() == [0] * 5
    md = runner.metadata(8)
    assert (md.num_reqs, md.max_query_len, md.max_seq_len, md.slot_mapping.shape[0]) == (8, 1, 64, 8)


def test_mixed_capture_sizes():
    assert mixed_capture_sizes(16384)[-1] == MIXED_MAX_TOKENS == 2048  # capped
    assert mixed_capture_sizes(300) == [16, 32, 64, 96, 128, 192, 256, 300]  # the token budget itself is captured
    assert mixed_capture_sizes(8) == [8]
    assert mixed_capture_sizes(16384, enabled=False) == []
    sizes = mixed_capture_sizes(16384)
    # A padded step computes at most 1.5x the tokens it has above 64, 1.25x above 256.
    assert all(padded_size(sizes, n) <= max(64, n * 1.5) for n in range(1, 2049))
    assert all(padded_size(sizes, n) <= n * 1.25 for n in range(257, 2049))
    assert padded_size(sizes, 2049) is None  # eager above the cap


def _mixed_runner(n_tok: int, n_req: int):
    bufs = _buffers(n_tok, n_req)
    runner = CUDAGraphRunner(lambda i, p: i, bufs, torch.zeros(n_req, 4, dtype=torch.int32), [], None,
                             capture_sizes(n_req, n_tok), max_model_len=64, mixed_sizes=mixed_capture_sizes(n_tok))
    return runner, bufs


def test_pad_mixed_inputs_makes_empty_requests_and_padding_tokens():
    runner, bufs = _mixed_runner(n_tok=64, n_req=6)
    bufs["query_start_loc"][:4] = torch.tensor([0, 7, 8, 11], dtype=torch.int32)  # 3 requests, 11 tokens
    before = {k: v.clone() for k, v in bufs.items()}
    runner.pad_mixed_inputs(3, 11, 16)
    for k in ("input_ids", "positions", "slot_mapping"):
        assert torch.equal(bufs[k][:11], before[k][:11]) and torch.equal(bufs[k][16:], before[k][16:]), k
    assert bufs["slot_mapping"][11:16].tolist() == [-1] * 5  # padding writes nothing to the KV cache
    assert bufs["input_ids"][11:16].tolist() == [0] * 5 and bufs["positions"][11:16].tolist() == [0] * 5
    # Requests [3, 6) are empty: they start and end where the live tokens end; nothing to attend to.
    assert bufs["query_start_loc"].tolist() == [0, 7, 8, 11, 11, 11, 11]
    assert bufs["seq_lens"].tolist() == [9, 9, 9, 0, 0, 0]
    md = runner.metadata_mixed(16)
    assert (md.num_reqs, md.max_query_len, md.num_actual_tokens) == (6, 16, 16)
    assert md.query_start_loc.shape[0] == 7 and md.block_table.shape[0] == 6 and md.slot_mapping.shape[0] == 16
    # A graph of fewer tokens than block-table rows is captured for one request per token.
    small = _mixed_runner(n_tok=64, n_req=40)[0]
    assert small.mixed_reqs(16) == 16 and small.mixed_reqs(64) == 40 and small.metadata_mixed(16).num_reqs == 16
    # With a sliding-window KV group (gpt-oss) its metadata is the graph's with the group's table rows and slots.
    assert runner.metadata_swa(md) is None
    bufs["slot_mapping_swa"] = torch.arange(64, dtype=torch.int64)
    runner.block_table_swa = torch.ones(6, 4, dtype=torch.int32)
    runner.pad_mixed_inputs(3, 11, 16)
    assert bufs["slot_mapping_swa"][11:16].tolist() == [-1] * 5
    for graph_md in (runner.metadata_mixed(16), runner.metadata(4)):
        swa = runner.metadata_swa(graph_md)
        assert swa.block_table.data_ptr() == runner.block_table_swa.data_ptr()
        assert swa.block_table.shape[0] == graph_md.num_reqs and swa.slot_mapping.shape[0] == graph_md.num_actual_tokens
        assert (swa.num_reqs, swa.max_query_len, swa.query_start_loc.shape) == (
            graph_md.num_reqs, graph_md.max_query_len, graph_md.query_start_loc.shape)



def test_long_decode_graphs_for_small_batches(monkeypatch):
    """Past LONG_DECODE_SEQ small decode batches split their KV more, so they get a second graph (captured for
    max_model_len) and a step with a longer sequence replays it; shorter steps keep the first."""
    from tokenmill.kernels.triton import attention_config

    monkeypatch.setattr(attention_config, "_num_sms", lambda index: 132)  # an H200
    n_buf = 512
    runner = CUDAGraphRunner(lambda i, p: i, _buffers(n_buf, n_buf), torch.zeros(n_buf, 4, dtype=torch.int32),
                             [torch.empty(2, 1, 16, 8, 128)], None, capture_sizes(n_buf, 16384),
                             max_model_len=131072)
    cuda = torch.device("cuda", 0)  # choose_num_splits only splits on CUDA
    runner._splits = lambda device, *a: attention_config.choose_num_splits(cuda, *a)
    assert runner.long_sizes() == [1, 2, 4, 8, 16, 32, 48, 64]  # 8 kv heads: 80 requests fill 4 programs an SM
    assert runner.metadata(8).max_seq_len == attention_config.LONG_DECODE_SEQ
    assert runner.metadata(8, long=True).max_seq_len == 131072

    replayed = []

    class FakeGraph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            replayed.append(self.name)

    for size in (1, 2, 4):
        runner.graphs[size], runner.outputs[size] = FakeGraph(f"short{size}"), torch.zeros(size, 3)
    runner.long_graphs[2], runner.long_outputs[2] = FakeGraph("long2"), torch.ones(2, 3)
    assert runner.replay(2, max_seq_len=16384).sum() == 0 and replayed[-1] == "short2"
    assert (runner.num_replays, runner.num_long_replays) == (1, 0)
    assert runner.replay(2, max_seq_len=16385).sum() == 2 * 3 and replayed[-1] == "long2"
    assert (runner.num_replays, runner.num_long_replays) == (2, 1)
    runner.replay(4, max_seq_len=100000)  # no long graph of that size: the short one (any split count is correct)
    assert replayed[-1] == "short4"
    assert (runner.num_replays, runner.num_long_replays) == (3, 1)
    short = CUDAGraphRunner(lambda i, p: i, _buffers(n_buf, n_buf), torch.zeros(n_buf, 4, dtype=torch.int32),
                            [torch.empty(2, 1, 16, 8, 128)], None, capture_sizes(n_buf, 16384), max_model_len=8192)
    short._splits = runner._splits
    assert short.long_sizes() == [] and short.metadata(8).max_seq_len == 8192


def test_long_graph_split_count_is_eagers_at_its_own_size(monkeypatch):
    """A long graph is captured with max_seq_len = max_model_len; an eager decode step of the same number of
    requests with its longest sequence anywhere in (LONG_DECODE_SEQ, max_model_len] picks the same split count
    (max_seq_len // 256 is >= the cap of 64 there), so graph and eager run the same attention (the GPU test
    tests/gpu/test_cuda_graphs.py::test_long_context_decode_graph_matches_eager relies on it). A padded step
    (fewer requests than the graph's size) may split differently: correct too, only rounded differently."""
    from tokenmill.kernels.triton import attention_config

    monkeypatch.setattr(attention_config, "_num_sms", lambda index: 132)  # an H200
    cuda = torch.device("cuda", 0)
    long_seq = attention_config.LONG_DECODE_SEQ
    for max_model_len in (long_seq + 256, 131072):
        for kv_heads in (1, 2, 8):
            runner = CUDAGraphRunner(lambda i, p: i, _buffers(512, 512), torch.zeros(512, 4, dtype=torch.int32),
                                     [torch.empty(2, 1, 16, kv_heads, 128)], None, capture_sizes(512, 16384),
                                     max_model_len=max_model_len)
            runner._splits = lambda device, *a: attention_config.choose_num_splits(cuda, *a)
            sizes = runner.long_sizes()
            assert sizes and sizes[0] == 1
            for size in sizes:
                graph = attention_config.choose_num_splits(cuda, 1, size, kv_heads, max_model_len)
                for seq in (long_seq + 1, (long_seq + max_model_len) // 2, max_model_len):
                    assert attention_config.choose_num_splits(cuda, 1, size, kv_heads, seq) == graph, (size, seq)
    # 8 kv heads, 9 requests replay the graph of 16: 8 splits eager, 5 in the graph.
    assert attention_config.choose_num_splits(cuda, 1, 9, 8, 20000) == 8
    assert attention_config.choose_num_splits(cuda, 1, 16, 8, 131072) == 5


class _RecordingGraphs:
    """Stands in for the runner's CUDAGraphRunner: records what the runner asks to replay, replays nothing
    (None: the step then runs eagerly)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def replay(self, num_reqs: int, max_seq_len: int = 0):
        self.calls.append(("decode", num_reqs, max_seq_len))

    def replay_mixed(self, num_reqs: int, num_tokens: int):
        self.calls.append(("mixed", num_reqs, num_tokens))


def test_runner_asks_for_the_graph_of_its_step():
    """ModelRunner.execute_model: a decode step asks for the decode graph of (num_reqs, its longest sequence,
    which picks the long graph past LONG_DECODE_SEQ), a step with prefill tokens for the mixed graph of
    (num_reqs, tokens), a step past max_seq_len_to_capture for none; with no graph it runs eagerly."""
    from tiny_runner import make_tiny_runner

    from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
    from tokenmill.sampling_params import SamplingParams

    def step(new=(), cached=(), sched=None):
        c = CachedRequestData()
        for rid, nc in cached:
            c.req_ids.append(rid)
            c.new_block_ids.append([])
            c.num_computed_tokens.append(nc)
        return SchedulerOutput(list(new), c, dict(sched), sum(sched.values()), set())

    runner = make_tiny_runner()
    graphs = runner.cuda_graphs = _RecordingGraphs()
    greedy = SamplingParams(temperature=0.0)
    out = runner.execute_model(step(new=[NewRequestData("a", list(range(3, 14)), [], greedy, list(range(8)), 0),
                                         NewRequestData("b", [5, 6, 7], [], greedy, [8, 9], 0)],
                                    sched={"a": 11, "b": 3}))
    assert graphs.calls == [("mixed", 2, 14)]
    assert len(out.sampled_token_ids[0]) == 1  # the eager fallback ran
    runner.execute_model(step(cached=[("a", 11), ("b", 3)], sched={"a": 1, "b": 1}))
    assert graphs.calls[-1] == ("decode", 2, 12)  # the longest sequence: a's 11 + 1
    runner.config.device_config.max_seq_len_to_capture = 12
    runner.execute_model(step(cached=[("a", 12), ("b", 4)], sched={"a": 1, "b": 1}))  # a reaches 13 > 12
    assert len(graphs.calls) == 2
