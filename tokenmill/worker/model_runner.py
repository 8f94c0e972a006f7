"""ModelRunner: one device's model, KV cache and persistent batch; runs one step.

Step (`execute_model`):
    scheduler diffs -> InputBatch rows -> input_ids / positions / metadata
    -> model forward under the forward context -> logits at logits_indices
    -> Sampler -> sampled ids appended to the batch -> ModelRunnerOutput.
The only host<->device sync is one wait for the results' copy to pinned host
memory at the end. On CUDA, decode-only steps replay CUDA graphs captured
at padded batch sizes, and steps with prefill tokens up to 2048 tokens
replay mixed-step graphs (tokenmill/worker/cuda_graph.py), unless
`--enforce-eager`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill import envs
from tokenmill.attention.forward_context import set_forward_context
from tokenmill.attention.selector import get_attn_backend
from tokenmill.config.configs import EngineConfig, kv_memory_hint
from tokenmill.core.sched_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed import parallel_state as ps
from tokenmill.distributed.pp_comm import broadcast_sampled_token_ids, recv_intermediate, send_intermediate
from tokenmill.dtypes import dtype_name, is_fp8, kv_cache_dtype, parse_dtype
from tokenmill.platforms.memory import default_cpu_kv_cache_bytes
from tokenmill.sample.sampler import Sampler, SamplerOutput
from tokenmill.structured_output.bitmask import apply_grammar_bitmask, grammar_rows
from tokenmill.worker.cuda_graph import CUDAGraphRunner, capture_sizes, mixed_capture_sizes
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.kv_cache import (
    KVCacheSpec,
    allocate_kv_caches,
    check_max_model_len_fits,
    kv_cache_spec,
)
from tokenmill.worker.prompt_logprobs import PromptLogprobsCollector

logger = logging.getLogger(__name__)



class ModelRunner:
    """Args: engine_config; device: this worker's torch device; tp_size: tensor-parallel ranks."""

    def __init__(self, engine_config: EngineConfig, device: torch.device, tp_size: int = 1) -> None:
        self.config = engine_config
        self.device = device
        mc, cc, sc = engine_config.model_config, engine_config.cache_config, engine_config.scheduler_config
        self.dtype = parse_dtype(mc.dtype)
        self.max_model_len = mc.max_model_len
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        # Heads and layers of this rank come from the initialized process groups (uneven splits included).
        override = None if tp_size == ps.get_tensor_model_parallel_world_size() else tp_size
        self.window_group = cc.sliding_window_group  # two KV groups (worker/kv_cache.py) when set
        self.kv_dtype = kv_cache_dtype(cc.cache_dtype, self.dtype)  # the model dtype, or fp8
        self.spec: KVCacheSpec = kv_cache_spec(mc.hf_config, cc.block_size, self.kv_dtype, override,
                                               two_groups=self.window_group is not None)
        self.attn_backend = get_attn_backend(device.type, engine_config.device_config.attention_backend)
        self.pin_memory = device.type == "cuda"
        text_cfg = mc.hf_config.get_text_config() if hasattr(mc.hf_config, "get_text_config") else mc.hf_config
        self.vocab_size = text_cfg.vocab_size
        self.hidden_size = text_cfg.hidden_size
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: CUDAGraphRunner | None = None
        self.sampler = Sampler()
        self.prompt_logprobs = PromptLogprobsCollector(self.vocab_size)
        self._step_id = 0  # steps that sampled (async scheduling matches read-backs to launches by it)
        self.input_batch = InputBatch(
            self.max_num_reqs, self.max_model_len, self.max_num_tokens, cc.block_size, self.vocab_size,
            device, self.pin_memory, two_groups=self.window_group is not None,
        )

    # ---- set-up ------------------------------------------------------------------

    def load_model(self) -> None:
        from tokenmill.model_loader import get_model

        self.model = get_model(self.config.model_config, self.device, self.dtype)
        if is_fp8(self.kv_dtype):
            self._log_kv_scales()

    def _log_kv_scales(self) -> None:
        """One line: how many attention layers got k_scale / v_scale from the checkpoint (the rest use 1.0)."""
        from tokenmill.layers.attention import Attention

        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        scaled = sum(m.k_scale != 1.0 or m.v_scale != 1.0 for m in layers)
        if scaled:
            logger.info("fp8 KV cache (%s): %d of %d attention layers scaled by the checkpoint's k_scale / v_scale",
                        dtype_name(self.kv_dtype), scaled, len(layers))
        else:
            logger.info("fp8 KV cache (%s): the checkpoint has no k_scale / v_scale, so K and V are stored with "
                        "scale 1.0 (fine while |K|, |V| stay well inside fp8's range; values past it saturate)",
                        dtype_name(self.kv_dtype))

    def determine_num_available_blocks(self) -> int:
        """KV blocks this device can hold.

        num_gpu_blocks_override wins; on CPU kv_cache_memory_bytes (default: a
        share of the memory left after the weights, platforms/memory.py) // bytes_per_block; on CUDA kv_cache_memory_bytes if given, else
        (gpu_memory_utilization * total - peak of a dummy max-size step) // bytes_per_block.

        Raises:
            ValueError: not even one block fits.
        """
        cc = self.config.cache_config
        per_block = self.spec.bytes_per_block
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type != "cuda":
            budget = default_cpu_kv_cache_bytes(num_workers=self.config.parallel_config.world_size)
        else:
            budget = self._profile_free_cuda_memory()
        num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise ValueError(
                f"No memory is left for the KV cache ({budget / 2**30:.2f} GiB available, one block needs "
                f"{per_block / 2**20:.1f} MiB); raise --gpu-memory-utilization or --kv-cache-memory-bytes, "
                "or lower --max-num-batched-tokens."
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_free_cuda_memory(self) -> int:
        """Bytes left for the KV cache on this GPU.

        budget = gpu_memory_utilization * total
                 - peak torch memory of a dummy step of max_num_batched_tokens
                   (weights + activations + logits and sampler temporaries for max_num_seqs rows)
                 - memory outside torch's allocator (CUDA context, cuBLAS/NCCL
                   workspaces, other processes on the device)
                 - an estimate of the decode CUDA graphs' private pool
                   (the step's activations scaled to the largest captured batch).

        Quantized weights count at their int4/int8 size (they stay packed in
        GPU memory). The dummy step runs at the largest M the scheduler can
        send, so it takes the kernels' large-M path, which dequantizes one
        layer's weight into a temporary dense copy before cuBLAS
        (`kernels.quant_linear`; the quantized fused MoE runs its grouped
        kernel at every M): that temporary is part of the measured peak, and
        the KV budget leaves room for it.
        """
        assert self.model is not None, "load_model() first"
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        weights = torch.cuda.memory_allocated(dev)
        n = self.max_num_tokens
        input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        positions = torch.arange(n, device=dev) % self.max_model_len
        with set_forward_context(None, [], self.attn_backend):
            hidden = self._run_model(input_ids, positions)
        if hidden is not None:  # the last pipeline stage: logits and the sampler's [rows, vocab] temporaries
            logits = self.model.compute_logits(hidden[: self.max_num_reqs]).float()
            probs = logits.softmax(dim=-1)
            probs.div(torch.empty_like(probs).exponential_()).argmax(dim=-1)
            del logits, probs
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(dev))
        graphs = 0
        if self._use_cuda_graphs():
            largest = max([capture_sizes(self.max_num_reqs, self.max_num_tokens)[-1],
                           *mixed_capture_sizes(self.max_num_tokens, envs.mixed_cuda_graphs())[-1:]])
            graphs = int((peak - weights) * min(1.0, largest / n))
        util = self.config.cache_config.gpu_memory_utilization
        budget = int(util * total - peak - non_torch - graphs)
        logger.info(
            "Memory profile: %.2f GiB total x %.2f utilization; weights %.2f GiB, step peak %.2f GiB, "
            "outside torch %.2f GiB, CUDA graphs ~%.2f GiB -> %.2f GiB for the KV cache",
            total / 2**30, util, weights / 2**30, (peak - weights) / 2**30, non_torch / 2**30, graphs / 2**30,
            max(budget, 0) / 2**30,
        )
        return max(budget, 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` blocks per layer.

        Raises:
            ValueError: one max_model_len sequence would not fit; the message
                gives the largest max_model_len that would.
        """
        bs = self.spec.block_size
        need = -(-self.max_model_len // bs)
        check_max_model_len_fits(num_blocks, bs, self.max_model_len,
                                 kv_memory_hint(self.config.cache_config, self.device.type), self.window_group,
                                 self.max_num_tokens)
        self.kv_caches = allocate_kv_caches(self.spec, num_blocks, self.device)
        if self._use_cuda_graphs():
            swa_table = self.input_batch.block_table_swa
            self.cuda_graphs = CUDAGraphRunner(
                self._run_model, self.input_batch.device_buffers, self.input_batch.block_table.block_table,
                self.kv_caches, self.attn_backend, capture_sizes(self.max_num_reqs, self.max_num_tokens),
                self.graph_max_seq_len, block_table_swa=swa_table.block_table if swa_table is not None else None,
                mixed_sizes=mixed_capture_sizes(self.max_num_tokens, envs.mixed_cuda_graphs()),
            )
            self.cuda_graphs.capture()
        # The engine core logs the one user-facing KV-cache line; this one is per worker.
        logger.debug("KV cache: %d blocks, %d tokens, max concurrency %.2fx at max_model_len %d",
                    num_blocks, num_blocks * bs, num_blocks / need, self.max_model_len)

    def release(self) -> None:
        """Drop the model, KV cache and CUDA graphs (engine shutdown; the small batch buffers stay).

        Called before the worker is dropped, so the device memory is freed even
        while something still references this runner (the CUDA-graph runner
        holds `_run_model`, a reference cycle the garbage collector may not reach
        soon, or at all if the objects were frozen with `gc.freeze()`).
        """
        if self.cuda_graphs is not None:
            self.cuda_graphs.release()
            self.cuda_graphs = None
        self.kv_caches = []
        self.model = None

    @property
    def graph_max_seq_len(self) -> int:
        """The longest sequence a step (decode or mixed) may have to replay a CUDA graph (vLLM's
        max_seq_len_to_capture)."""
        cap = self.config.device_config.max_seq_len_to_capture
        return self.max_model_len if cap is None else min(self.max_model_len, cap)

    def _use_cuda_graphs(self) -> bool:
        """Graphs need CUDA, the TRITON_ATTN backend, one pipeline stage and no --enforce-eager."""
        if self.device.type != "cuda" or self.config.device_config.enforce_eager:
            return False
        if getattr(self.attn_backend, "name", "") != "TRITON_ATTN":
            logger.info("CUDA graphs off: the %s attention backend loops on the host",
                        getattr(self.attn_backend, "name", "?"))
            return False
        if ps.model_parallel_is_initialized() and ps.get_pp_world_size() > 1:
            logger.info("CUDA graphs off: pipeline-parallel runs are eager")
            return False
        # Tensor-parallel ranks capture too: the NCCL all-reduces are recorded in the graphs
        # (checked on 2x H200: float32 TP=2 tokens == TP=1, docs/benchmarks.md).
        return True

    # ---- one step -------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns a token for each scheduled request that reached its end."""
        return self.execute_model_async(scheduler_output).result()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step (inputs, forward, sampling, the copy of the sampled ids to the host) without waiting.

        `.result()` of the returned handle waits for the copy (the step's one
        host sync) and records the tokens in the batch. With async
        scheduling the next step is launched before that: its tokens that
        are this step's samples are read from this step's sampled ids on the
        device (`InputBatch.set_pending`).
        """
        assert self.model is not None and self.kv_caches, "load_model() and initialize_kv_cache() first"
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[]))
        batch = self.input_batch
        inputs = batch.prepare_inputs(scheduler_output.num_scheduled_tokens)
        md = inputs.attn_metadata
        hidden = None
        # A graph is captured for sequences up to graph_max_seq_len (--max-seq-len-to-capture); longer runs eagerly.
        if self.cuda_graphs is not None and md.max_seq_len <= self.graph_max_seq_len:
            if md.max_query_len == 1:
                hidden = self.cuda_graphs.replay(md.num_reqs, md.max_seq_len)
            else:
                hidden = self.cuda_graphs.replay_mixed(md.num_reqs, md.num_actual_tokens)
        if hidden is None:
            with set_forward_context(md, self.kv_caches, self.attn_backend, inputs.attn_metadata_swa):
                hidden = self._run_model(inputs.input_ids, inputs.positions)
        req_ids = [batch.req_ids[r] for r in inputs.rows.tolist()]
        index = {r: i for i, r in enumerate(req_ids)}
        prompt_lps = self._prompt_logprobs(hidden, inputs, req_ids) if self.prompt_logprobs.active else {}
        if inputs.sampling_metadata is None:
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index=index, sampled_token_ids=[[] for _ in req_ids],
                prompt_logprobs_dict=prompt_lps))
        sample_req_ids = [batch.req_ids[r] for r in inputs.sample_rows.tolist()]
        grammar = grammar_rows(scheduler_output, sample_req_ids, self.device)
        out = self._sample(hidden, inputs.logits_indices, inputs.sampling_metadata, len(inputs.sample_rows), grammar)
        self._step_id += 1
        batch.set_pending(self._step_id, inputs.sample_rows, out.sampled_token_ids)
        num_logprobs = batch.sampling.num_logprobs[inputs.sample_rows] if out.logprobs is not None else None
        handle = AsyncModelRunnerOutput(self, self._step_id, req_ids, index, sample_req_ids, out, num_logprobs)
        handle.prompt_logprobs_dict = prompt_lps
        return handle

    def _prompt_logprobs(self, hidden: torch.Tensor | None, inputs, req_ids: list[str]) -> dict[str, LogprobsLists]:
        """This step's prompt positions scored (worker/prompt_logprobs.py); the prompts completed now."""
        if hidden is None:  # not the last pipeline stage
            return {}
        assert self.model is not None
        batch = self.input_batch
        rows = inputs.rows
        prompts = [batch.token_ids[r, : batch.num_prompt_tokens[r]] for r in rows.tolist()]
        return self.prompt_logprobs.collect(self.model.compute_logits, hidden, req_ids,
                                            inputs.attn_metadata.query_start_loc_cpu,
                                            batch.num_computed_tokens[rows], prompts)

    def _read_back(self, handle: AsyncModelRunnerOutput) -> ModelRunnerOutput:
        """Wait for `handle`'s sampled ids, record them in the batch, build its ModelRunnerOutput."""
        token_ids, lp_rows = handle.wait_host()
        self.input_batch.append_sampled_ids(handle.step_id, handle.sample_req_ids, token_ids)
        index = handle.req_id_to_index
        sampled: list[list[int]] = [[] for _ in handle.req_ids]
        for rid, tok in zip(handle.sample_req_ids, token_ids):
            sampled[index[rid]] = [tok]
        logprobs = None
        if lp_rows is not None:
            logprobs = _logprobs_lists(len(handle.req_ids), index, handle.sample_req_ids, lp_rows, handle.num_logprobs)
        return ModelRunnerOutput(req_ids=handle.req_ids, req_id_to_index=index, sampled_token_ids=sampled,
                                 logprobs=logprobs, prompt_logprobs_dict=handle.prompt_logprobs_dict)

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The forward pass; a CUDA-graph replay for padded decode sizes slots in here.

        Pipeline-parallel: a non-first stage first receives the previous
        stage's hidden states; a non-last stage sends its own on and returns None.
        """
        assert self.model is not None
        if ps.get_pp_world_size() == 1:
            return self.model(input_ids, positions)
        intermediate = None
        if not ps.is_first_pp_rank():
            intermediate = recv_intermediate(input_ids.shape[0], self.hidden_size, self.dtype, self.device)
        out = self.model(input_ids, positions, intermediate)
        if ps.is_last_pp_rank():
            return out
        send_intermediate(out)
        return None

    def _sample(self, hidden: torch.Tensor | None, logits_indices: torch.Tensor, metadata, num_rows: int,
                grammar: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None) -> SamplerOutput:
        """Logits and sampling on the last stage; with several ranks every rank gets the output rank's ids.

        `grammar` (bitmask, logits rows, rows list): structured-output masks applied to the logits before sampling.
        """
        assert self.model is not None
        out = None
        if hidden is not None:
            logits = self.model.compute_logits(hidden[logits_indices])
            if grammar is not None:
                apply_grammar_bitmask(logits, *grammar)
            out = self.sampler(logits, metadata)
        if not ps.model_parallel_is_initialized():
            assert out is not None
            return out
        ids = broadcast_sampled_token_ids(None if out is None else out.sampled_token_ids, num_rows, self.device)
        if out is None or ps.get_tensor_model_parallel_rank() != 0:
            return SamplerOutput(ids)  # only the output rank's logprobs are returned
        out.sampled_token_ids = ids
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
            self.prompt_logprobs.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            batch.add_request(new)
            self.prompt_logprobs.add_request(new.req_id, new.sampling_params.prompt_logprobs,
                                             len(new.output_token_ids))
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            row = batch.req_id_to_index[req_id]
            batch.block_table.append_row(row, new_blocks)
            batch.num_computed_tokens[row] = num_computed
        if batch.block_table_swa is not None:
            for req_id, new_blocks in zip(cached.req_ids, cached.new_swa_block_ids, strict=True):
                batch.block_table_swa.append_row(batch.req_id_to_index[req_id], new_blocks)


def _logprobs_lists(n: int, index: dict[str, int], sample_req_ids: list[str], lp_rows: list[list[float]],
                    num_logprobs: np.ndarray) -> LogprobsLists:
    """Per request: [sampled, top-1..top-k] ids and logprobs, k its own `logprobs`; [] if not asked.

    lp_rows[i] (request sample_req_ids[i], num_logprobs[i] = its k, -1 when
    not asked) is float64 [ids (K+1) | logprobs (K+1) | rank] for the step's
    largest K.
    """
    ids: list[list[int]] = [[] for _ in range(n)]
    vals: list[list[float]] = [[] for _ in range(n)]
    ranks = [0] * n
    for rid, row, k in zip(sample_req_ids, lp_rows, num_logprobs.tolist()):
        if k < 0:
            continue
        width = (len(row) - 1) // 2
        i = index[rid]
        ids[i] = [int(x) for x in row[: k + 1]]
        vals[i] = row[width : width + k + 1]
        ranks[i] = int(row[-1])
    return LogprobsLists(ids, vals, ranks)


class AsyncModelRunnerOutput:
    """A launched step's output: `result()` waits for the sampled ids and returns the `ModelRunnerOutput`.

    The device->host copy of the sampled ids (with logprobs: one float64
    tensor [S, 2K+3] = [ids | logprobs | rank]) starts at construction into
    pinned memory; `result()` waits on an event recorded after it, which is
    the step's one host sync (not a stream synchronization, so the step is
    clean under `torch.cuda.set_sync_debug_mode("error")`). `result()` may
    be called more than once; the batch is updated the first time.
    """

    __slots__ = ("_done", "_host", "_output", "_runner", "has_logprobs", "num_logprobs", "prompt_logprobs_dict",
                 "req_id_to_index", "req_ids", "sample_req_ids", "step_id")

    def __init__(self, runner: ModelRunner | None, step_id: int, req_ids: list[str], req_id_to_index: dict[str, int],
                 sample_req_ids: list[str], out: SamplerOutput | None, num_logprobs: np.ndarray | None) -> None:
        self._runner = runner
        self.step_id = step_id
        self.req_ids = req_ids
        self.req_id_to_index = req_id_to_index
        self.sample_req_ids = sample_req_ids
        self.num_logprobs = num_logprobs
        # req_id -> prompt logprobs of the prompts this step completed (computed at launch).
        self.prompt_logprobs_dict: dict[str, LogprobsLists] = {}
        self._output: ModelRunnerOutput | None = None
        self._host: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None
        self.has_logprobs = out is not None and out.logprobs is not None
        if out is None:
            return
        t = out.sampled_token_ids
        if self.has_logprobs:
            t = torch.cat([out.logprob_token_ids.double(), out.logprobs.double(),
                           out.sampled_token_ranks.double()[:, None]], dim=1)
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = t

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> AsyncModelRunnerOutput:
        """A handle for a step that samples nothing (its output is known at launch)."""
        handle = cls(None, -1, output.req_ids, output.req_id_to_index, [], None, None)
        handle._output = output
        return handle

    def wait_host(self) -> tuple[list[int], list[list[float]] | None]:
        """(sampled ids in sample order, packed logprob rows or None) once the copy is done."""
        if self._done is not None:
            self._done.synchronize()
        assert self._host is not None
        if not self.has_logprobs:
            return self._host.tolist(), None
        packed = self._host.tolist()
        return [int(r[0]) for r in packed], packed  # column 0 is the sampled id

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._runner is not None
            self._output = self._runner._read_back(self)
            self._runner = self._host = self._done = None  # a kept handle must not pin the runner's memory
        return self._output
