"""compressed-tensors FP8 weights (llm-compressor's FP8, FP8_DYNAMIC, FP8_BLOCK and FP8 W8A16 schemes): config parsing.

The tensors are those of the `fp8` layout (`quantization/fp8.py`, which converts them): `weight`
float8_e4m3fn [N, K], `weight_scale` [1] (strategy tensor), [N, 1] (channel) or [ceil(N/Bn), ceil(K/Bk)]
(block, `block_structure: [Bn, Bk]`), and `input_scale` [1] for static activations. The format is
`float-quantized` when activations are quantized too, and `naive-quantized` for weight-only FP8
(compressed-tensors' `FloatQuantizationCompressor` only claims schemes with input activations).

Activation schemes read (`input_activations`):

    null                                            W8A16: weight-only
    dynamic: true,  strategy: token                 W8A8, per-token scales computed per call
    dynamic: true,  strategy: group, group_size Bk  W8A8 with block weights, per 1 x Bk group (DeepSeek-V3)
    dynamic: false, strategy: tensor                W8A8, the stored per-tensor input_scale
"""

from __future__ import annotations

from tokenmill.quantization.compressed_tensors import _GROUP_FIELDS, _WEIGHT_FIELDS
from tokenmill.quantization.config import QuantizationConfig, check_fields, require


def parse_float_groups(groups: dict, fmt: str, ignore: tuple[str, ...], source: str) -> QuantizationConfig:
    """The FP8 scheme of a compressed-tensors config's `config_groups` (every group must use the same one).

    Args:
        groups: `config_groups` (checked non-empty by the caller).
        fmt: the top-level `format` ("float-quantized" or "naive-quantized").
        ignore: the `ignore` list (module names and "re:" patterns).
        source: the config's file, for messages.

    Raises:
        ValueError: naming the key that is unknown or unsupported (e.g. int weights, asymmetric FP8,
            dynamic per-tensor activations, a block size whose Bk is not a multiple of 16).
    """
    schemes = {}
    for gname, group in groups.items():
        where = f"config_groups.{gname}."
        require(isinstance(group, dict), source, where[:-1], group, "a scheme object")
        check_fields(group, source, _GROUP_FIELDS, where)
        require(group.get("format") in (None, fmt, "float-quantized", "naive-quantized"), source, where + "format",
                group.get("format"), "float-quantized or naive-quantized")
        targets = group.get("targets")
        require(isinstance(targets, list) and all(t == "Linear" or (isinstance(t, str) and t.startswith("re:"))
                                                  for t in targets), source, where + "targets", targets,
                "Linear layers (or re: patterns over them)")
        require(group.get("output_activations") is None, source, where + "output_activations",
                group.get("output_activations"), "output activations are not quantized")
        strategy, block = _parse_weights(group.get("weights"), source, where + "weights.")
        act = _parse_activations(group.get("input_activations"), block, source, where + "input_activations.")
        schemes[gname] = (strategy, block, act)
    first = next(iter(schemes.values()))
    for gname, scheme in schemes.items():
        require(scheme == first, source, f"config_groups.{gname}", groups[gname],
                "every config group must use the same FP8 scheme")
    strategy, block, act = first
    return QuantizationConfig(method="compressed-tensors", bits=8, group_size=-1, has_zeros=False, act_order=False,
                              checkpoint_format="float-quantized", ignore=ignore, source=source, weight_type="float",
                              weight_strategy=strategy, weight_block_size=block, activation_scheme=act)


def _fp8_args(args: dict, source: str, where: str) -> None:
    require(args.get("num_bits", 8) == 8, source, where + "num_bits", args.get("num_bits"), "8-bit floats")
    require(args.get("type") == "float", source, where + "type", args.get("type"),
            "float (FP8); int weights are read from pack-quantized checkpoints")
    require(args.get("symmetric", True) is True, source, where + "symmetric", args.get("symmetric"),
            "FP8 is symmetric (no zero points)")
    require(args.get("actorder") in (None, False), source, where + "actorder", args.get("actorder"), "null")


def _parse_weights(w: object, source: str, where: str) -> tuple[str, tuple[int, int] | None]:
    """(strategy "tensor" | "channel" | "block", block (Bn, Bk) or None) of one group's FP8 `weights`."""
    require(isinstance(w, dict), source, where[:-1], w, "weight quantization args")
    check_fields(w, source, _WEIGHT_FIELDS, where)
    _fp8_args(w, source, where)
    require(w.get("dynamic", False) is False, source, where + "dynamic", w.get("dynamic"),
            "weights must be static (stored scales)")
    strategy = w.get("strategy")
    require(strategy in ("tensor", "channel", "block"), source, where + "strategy", strategy,
            "tensor, channel or block")
    require(w.get("group_size") is None, source, where + "group_size", w.get("group_size"),
            "FP8 weights have no group size")
    block = w.get("block_structure")
    if strategy != "block":
        require(block is None, source, where + "block_structure", block, "only with strategy block")
        return strategy, None
    require(isinstance(block, list) and len(block) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block), source, where + "block_structure",
        block, "[Bn, Bk], two positive ints")
    require(block[1] % 16 == 0, source, where + "block_structure", block,
            "Bk must be a multiple of 16 (the FP8 GEMM's K tile)")
    return strategy, (block[0], block[1])


def _parse_activations(a: object, block: tuple[int, int] | None, source: str, where: str) -> str | None:
    """"dynamic", "static" or None (weight-only) for one group's `input_activations` (module docstring's table)."""
    if a is None:
        return None
    require(isinstance(a, dict), source, where[:-1], a, "activation quantization args or null")
    check_fields(a, source, _WEIGHT_FIELDS, where)
    _fp8_args(a, source, where)
    dynamic, act_strategy = a.get("dynamic"), a.get("strategy")
    if dynamic is False:
        require(act_strategy == "tensor", source, where + "strategy", act_strategy,
                "static activations must be per-tensor")
        require(block is None, source, where + "dynamic", dynamic,
                "block-scaled weights take dynamic per-group activations")
        return "static"
    require(dynamic is True, source, where + "dynamic", dynamic, "true (per token / group) or false (static)")
    if block is None:
        require(act_strategy == "token", source, where + "strategy", act_strategy,
                "dynamic activations are quantized per token")
    else:
        require(act_strategy == "group" and a.get("group_size") == block[1], source, where + "strategy",
                f"{act_strategy} (group_size {a.get('group_size')})",
                f"block-scaled weights take dynamic per-group activations of group_size {block[1]} (the block's Bk)")
    return "dynamic"
