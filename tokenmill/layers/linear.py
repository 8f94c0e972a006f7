"""Linear layers, Megatron-LM style, ready for tensor parallelism.

Each layer holds only its rank's shard of the weight, `[out, in]` as
`torch.nn.functional.linear` wants, and attaches a `weight_loader` to its
parameters that copies the rank's slice of a full checkpoint tensor:

    ColumnParallelLinear   splits the output dim: W = [W_0; W_1; ...] (rows)
    RowParallelLinear      splits the input dim:  W = [W_0, W_1, ...] (cols),
                           partial outputs are summed with an all-reduce
    MergedColumnParallelLinear  several column layers fused (gate_up_proj)
    QKVParallelLinear      q, k, v fused; heads split across ranks

The split of a transformer MLP / attention block is Column -> Row, so only
one all-reduce per block is needed (Shoeybi et al. 2019, "Megatron-LM").
Parameters are created with `torch.empty` under the caller's default device
and dtype (the loader builds the model inside `with torch.device(...)`).
Each parameter also carries `full_shape`, the shape of the unsharded tensor
its `weight_loader(param, full)` accepts (fused layers: the parts stacked),
so the dummy loader can draw the same full weights at any tensor-parallel size.

int4/int8 checkpoints: `LinearBase.quantize(scheme)` (called by the loader's
walk, `model_loader/quantization.py`, before loading) replaces `weight` by
`qweight`, `scales`, `qzeros`, `g_idx` (`layers/quant_params.py`); the same
weight loaders shard them. CUDA runs `kernels.quant_linear`; on the CPU the
loader calls `dequantize()` after loading, and the layer is dense again.
`quantize(Fp8Scheme)` makes an FP8 layer instead (`layers/fp8_params.py`:
float8_e4m3fn `weight`, per-row `weight_scale`, static `input_scale`), run by
`kernels.fp8_linear` (W8A8 or weight-only per device), dequantized on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tokenmill import kernels
from tokenmill.distributed.partition import divide_evenly, head_partition
from tokenmill.layers.fp8_params import Fp8Scheme, fp8_weight, load_input_scale, make_fp8_params, quantizing_loader
from tokenmill.layers.gguf_weights import GGUFWeight
from tokenmill.layers.quant_params import (
    QUANT_KINDS,
    InputShard,
    QuantScheme,
    load_replicated_g_idx,
    make_quant_params,
    narrow_input,
    needs_synthetic_g_idx,
    quant_tensors,
    scale_dtype,
    synthetic_g_idx,
)


def _divide(numerator: int, denominator: int, what: str) -> int:
    return divide_evenly(numerator, denominator, what)


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"Checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape {tuple(param.shape)}.")
    param.data.copy_(loaded)


def _is_g_idx(param: torch.Tensor) -> bool:
    return getattr(param, "quant_kind", None) == "g_idx"


def _is_input_scale(param: torch.Tensor) -> bool:
    return getattr(param, "quant_kind", None) == "input_scale"


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into `param`, casting dtype and device.

    Raises:
        ValueError: the shapes differ.
    """
    _copy_checked(param, loaded_weight)


class LinearBase(nn.Module):
    """Holds `weight [output_size_per_partition, input_size_per_partition]` and optional `bias`
    (or, after `quantize`, the quantized tensors of `layers/quant_params.py` instead of `weight`)."""

    def __init__(self, input_size_per_partition: int, output_size_per_partition: int, bias: bool,
                 params_dtype: torch.dtype | None = None, full_input_size: int | None = None,
                 full_output_size: int | None = None, input_start: int = 0) -> None:
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        # This rank's rows of the input dim K (all of them except for row-parallel layers).
        self.input_shard = InputShard(input_start, input_size_per_partition,
                                      full_input_size or input_size_per_partition)
        self.quant: QuantScheme | Fp8Scheme | None = None  # set by `quantize`
        self.weight = nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        full_out = full_output_size or output_size_per_partition
        self.weight.full_shape = (full_out, full_input_size or input_size_per_partition)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size_per_partition, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.full_shape = (full_out,)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _copy_checked(param, loaded_weight)

    def quantize(self, scheme: QuantScheme | Fp8Scheme) -> None:
        """Replace `weight` by empty int4/int8 parameters (`qweight`, `scales`, [`qzeros`], [`g_idx`]) to load into,
        or with an `Fp8Scheme` by FP8 ones (`weight` float8_e4m3fn, `weight_scale`, [`input_scale`]).

        Raises:
            ValueError: this rank's input rows start inside a packed int32 word (int4/int8) or inside a K block
                of the FP8 block scales.
        """
        if isinstance(scheme, Fp8Scheme):
            self._quantize_fp8(scheme)
            return
        weight = self.weight
        self.params_dtype = weight.dtype  # what `dequantize` returns
        params = make_quant_params((), weight.shape[0], weight.full_shape[0], self.input_shard, scheme,
                                   scale_dtype(weight), weight.device)
        self.weight = None  # the parameter goes; `weight` stays an attribute (None) for code that checks it
        for kind, param in params.items():
            param.weight_loader = self.weight_loader
            self.register_parameter(kind, param)
        if needs_synthetic_g_idx(scheme, self.input_shard):
            self.register_buffer("g_idx", synthetic_g_idx(scheme, self.input_shard).to(weight.device))
        self.quant = scheme

    def _quantize_fp8(self, scheme: Fp8Scheme) -> None:
        weight = self.weight
        self.params_dtype = weight.dtype  # what `dequantize` returns
        params = make_fp8_params((), weight.shape[0], weight.full_shape[0], self.input_shard, scheme, weight.device,
                                 with_input_scale=scheme.activations == "static")
        self.weight = None
        for name, param in params.items():
            param.weight_loader = self.weight_loader
            self.register_parameter(name, param)
        self.weight.weight_loader = quantizing_loader(self.weight_loader, self.weight_scale, scheme)
        self.quant = scheme

    def fp8_weight(self):
        """This rank's FP8 weight as `kernels.fp8.Fp8Weight` (after `quantize(Fp8Scheme)`)."""
        return fp8_weight(self.weight, self.weight_scale, self.quant, getattr(self, "input_scale", None))

    def quant_tensors(self):
        """This rank's quantized weight as `kernels.quant_pack.QuantTensors` (after `quantize`)."""
        assert self.quant is not None, "not a quantized layer"
        return quant_tensors(self, "", self.quant, self.input_shard.size)

    def dequantize(self) -> None:
        """Replace the loaded quantized tensors by the dense `weight` they stand for, in the layer's dtype.

        The CPU path: afterwards the layer is a plain dense layer (oneDNN packing included).
        """
        if isinstance(self.quant, Fp8Scheme):
            weight = kernels.dequantize_fp8_weight(self.fp8_weight(), self.params_dtype)
            self._parameters.pop("weight_scale")
            self._parameters.pop("input_scale", None)
        else:
            weight = kernels.dequantize_weight(self.quant_tensors(), self.params_dtype)
        for kind in QUANT_KINDS:
            if kind in self._parameters:
                del self._parameters[kind]
            self._buffers.pop(kind, None)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quant = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] @ weight^T (+ bias) -> [..., out]; the weight may be oneDNN-packed (`cpu_weights`),
        GGUF blocks (`gguf_weights`), int4/int8 (`kernels.quant_linear` on CUDA) or FP8 (`kernels.fp8_linear`)."""
        if isinstance(self.weight, GGUFWeight):
            return self.weight.matmul(x, bias)
        if isinstance(self.quant, Fp8Scheme):  # CUDA kernels per capability; CPU: the reference (layers built by hand)
            return kernels.fp8_linear(x, self.fp8_weight(), bias, self.quant.activations is not None)
        if self.quant is not None:
            x2 = x.reshape(-1, x.shape[-1])
            if x.is_cuda:
                y = kernels.quant_linear(x2, self.quant_tensors(), bias)
            else:  # the loader dequantizes CPU layers; this serves a layer built by hand
                y = F.linear(x2, kernels.dequantize_weight(self.quant_tensors(), x.dtype), bias)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if self.weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


class ReplicatedLinear(LinearBase):
    """A full copy of the layer on every rank. forward: x [..., in] -> [..., out]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, output_size, bias, params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X W^T with W's output rows split across ranks.

    forward: x [..., input_size] -> [..., output_size / tp] (or the full
    [..., output_size] with `gather_output=True`).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        tp = get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        super().__init__(input_size, _divide(output_size, tp, "output size"), bias, params_dtype,
                         full_output_size=output_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy rows [tp_rank * shard, (tp_rank + 1) * shard) of the full `[out, in]` (or `[out]`) tensor
        (quantized: of qweight, scales and qzeros; g_idx whole)."""
        if _is_g_idx(param):
            load_replicated_g_idx(param, param.data, loaded_weight)
            return
        if _is_input_scale(param):
            load_input_scale(param, loaded_weight)
            return
        shard = param.shape[0]
        _copy_checked(param, loaded_weight.narrow(0, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with one weight, e.g. gate_up_proj = [gate; up].

    Each rank holds `[gate_r; up_r]` (its slice of every part, parts stacked),
    so an activation like SiluAndMul can split the output in half locally.
    `weight_loader(param, loaded_weight, shard_id)` loads part `shard_id`
    (an index into `output_sizes`) from its full checkpoint tensor.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, gather_output: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        tp = get_tensor_model_parallel_world_size()
        for size in output_sizes:
            _divide(size, tp, "merged output size")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if _is_g_idx(param):  # every part reads the whole input: one g_idx
            load_replicated_g_idx(param, param.data, loaded_weight)
            return
        if _is_input_scale(param):  # every part reads the whole input: one activation scale
            load_input_scale(param, loaded_weight)
            return
        if shard_id is None:  # an already-merged checkpoint tensor
            # Reorder [gate; up] (full) into this rank's [gate_r; up_r].
            parts, offset = [], 0
            for size in self.output_sizes:
                part = size // self.tp_size
                parts.append(loaded_weight.narrow(0, offset + self.tp_rank * part, part))
                offset += size
            _copy_checked(param, torch.cat(parts, dim=0))
            return
        part = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy_checked(param.data.narrow(0, offset, part), loaded_weight.narrow(0, self.tp_rank * part, part))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections with attention heads split across ranks by KV-head groups.

    Output per rank: `[q (num_heads * head_size) | k (num_kv_heads * head_size) |
    v (num_kv_heads * head_size)]`, where this rank's heads come from
    `tokenmill.distributed.partition.head_partition`: whole KV-head groups,
    possibly uneven (9 heads / 3 KV heads over 2 ranks: 6 + 3 query heads),
    or one replicated KV head per rank when tp > total_num_kv_heads.
    `weight_loader(param, loaded_weight, shard_id)` takes shard_id "q", "k"
    or "v" with that full checkpoint tensor, or None with the full fused
    `[q; k; v]` tensor (as the dummy loader builds it).

    Raises:
        ValueError: the heads cannot be split over the ranks (names sizes that work).
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = False, params_dtype: torch.dtype | None = None) -> None:
        tp = get_tensor_model_parallel_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        part = head_partition(total_num_heads, total_num_kv_heads, tp, get_tensor_model_parallel_rank())
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.partition = part
        self.num_heads = part.num_heads
        self.num_kv_heads = part.num_kv_heads
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # The output dim is not an even split, so skip ColumnParallelLinear's division.
        self.input_size = hidden_size
        self.output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        self.gather_output = False
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, params_dtype,
                            full_output_size=self.output_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None) -> None:
        if _is_g_idx(param):  # q, k and v read the whole input: one g_idx
            load_replicated_g_idx(param, param.data, loaded_weight)
            return
        if _is_input_scale(param):  # q, k and v read the whole input: one activation scale
            load_input_scale(param, loaded_weight)
            return
        p, hs = self.partition, self.head_size
        if shard_id is None:  # full fused [q; k; v]
            q_full, kv_full = self.total_num_heads * hs, self.total_num_kv_heads * hs
            q, k, v = loaded_weight.split([q_full, kv_full, kv_full], dim=0)
            for sid, part in (("q", q), ("k", k), ("v", v)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            offset, size, start = 0, self.q_size, p.q_start * hs
        elif shard_id == "k":
            offset, size, start = self.q_size, self.kv_size, p.kv_start * hs
        elif shard_id == "v":
            offset, size, start = self.q_size + self.kv_size, self.kv_size, p.kv_start * hs
        else:
            raise ValueError(f"Unknown qkv shard_id {shard_id!r}; expected 'q', 'k' or 'v'.")
        _copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Y = X W^T with W's input columns split across ranks; partial sums all-reduced.

    forward: x [..., input_size_per_partition] (already split, as a column
    layer's output) -> [..., output_size]. The bias is added once, after the reduce.

    `input_partition=(start, size)` gives an uneven split explicitly (an
    o_proj after an uneven head split takes columns [start, start + size));
    by default the input is split evenly, `input_size / tp` per rank.

    Raises:
        ValueError: input_size is not divisible by tp (without `input_partition`).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 params_dtype: torch.dtype | None = None, input_partition: tuple[int, int] | None = None) -> None:
        tp = get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.reduce_results = reduce_results
        if input_partition is None:
            shard = _divide(input_size, tp, "input size")
            input_partition = (get_tensor_model_parallel_rank() * shard, shard)
        self.input_start, size = input_partition
        super().__init__(size, output_size, bias, params_dtype, full_input_size=input_size,
                         input_start=self.input_start)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy columns [input_start, input_start + shard) of the full `[out, in]` weight; the bias whole.

        Quantized: qweight's words of those columns, the groups they use (all
        groups and the g_idx slice for act-order): `quant_params.narrow_input`.
        """
        if param is self.bias:  # not split
            _copy_checked(param, loaded_weight)
            return
        _copy_checked(param, narrow_input(param, loaded_weight, self.input_shard, self.quant))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        y = self.matmul(x, None)
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        return y if self.bias is None else y + self.bias
