"""Build the registered model class and fill its weights (safetensors, .bin, GGUF or dummy)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch
from torch import nn

from tokenmill.config.configs import ModelConfig
from tokenmill.dtypes import parse_dtype
from tokenmill import envs
from tokenmill.distributed.parallel_state import get_tensor_model_parallel_world_size
from tokenmill.kernels.cpu import elementwise as cpu_elementwise
from tokenmill.kernels.cpu import gguf_matmul
from tokenmill.model_loader import gguf_quantized
from tokenmill.layers.cpu_weights import pack_cpu_linear_weights
from tokenmill.model_loader.dummy import initialize_dummy_weights
from tokenmill.model_loader.quantized import (
    describe_quantization,
    dequantize_layers,
    format_bytes,
    quantize_layers,
    weight_bytes,
)
from tokenmill.model_loader.weight_utils import (
    pt_weights_iterator,
    safetensors_files,
    safetensors_tensor_names,
    safetensors_weights_iterator,
)
from tokenmill.models.registry import resolve_model_cls

logger = logging.getLogger(__name__)



def to_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`torch.float16` or its name ("float16", "bfloat16", "float32") -> torch dtype.

    Raises:
        ValueError: an unknown name.
    """
    return parse_dtype(dtype)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def iterate_weights(model_config: ModelConfig, device: torch.device | str,
                    keep_gguf_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the model's checkpoint in the chosen load format.

    Safetensors are read straight onto `device`; GGUF and .bin tensors come
    on the CPU (the parameters' weight loaders move and cast them).
    `keep_gguf_blocks`: GGUF tensors also carry their raw blocks (`gguf_quantized`).

    Raises:
        ValueError: the folder has no weights in the requested format.
    """
    fmt = model_config.load_format
    if model_config.gguf_file is not None and fmt in ("auto", "gguf"):
        from tokenmill.model_loader.gguf_loader import gguf_weights_iterator

        return gguf_weights_iterator(model_config.gguf_file, model_config.hf_config, keep_blocks=keep_gguf_blocks)
    if fmt == "gguf":
        raise ValueError(f"--load-format gguf needs a .gguf file, but {model_config.model_path} is not one.")
    folder = model_config.model_path
    files = safetensors_files(folder) if fmt in ("auto", "safetensors") else []
    if files:
        return safetensors_weights_iterator(files, device)
    if fmt == "safetensors":
        raise ValueError(f"{folder} has no *.safetensors files (pass --load-format auto or pt for .bin weights).")
    return pt_weights_iterator(folder)


def _keep_gguf_quantized(model_config: ModelConfig, device: torch.device | str) -> bool:
    """A GGUF on the CPU at tensor-parallel size 1 with the C kernels built, unless TOKENMILL_CPU_GGUF_KERNELS=0."""
    if model_config.gguf_file is None or model_config.load_format not in ("auto", "gguf"):
        return False
    if torch.device(device).type != "cpu" or get_tensor_model_parallel_world_size() != 1 or not envs.cpu_gguf_kernels():
        return False
    if gguf_matmul.load() is None:
        logger.info("GGUF weights are dequantized at load: the CPU C kernels are unavailable.")
        return False
    return True


def checkpoint_tensor_names(model_config: ModelConfig) -> list[str]:
    """Names of the checkpoint's tensors as `iterate_weights` yields them (safetensors: headers only)."""
    files = safetensors_files(model_config.model_path) if model_config.load_format in ("auto", "safetensors") else []
    if files:
        return safetensors_tensor_names(files)
    return [name for name, _ in pt_weights_iterator(model_config.model_path)]


def _quantized_weights(model_config: ModelConfig, model: nn.Module,
                       device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """Quantize the layers the checkpoint quantizes, then its tensors converted to tokenmill's layout."""
    from tokenmill.quantization import convert_weights, quantized_modules

    cfg = model_config.quantization
    if cfg.checkpoint_format == "quantize-at-load":  # --quantization fp8: the layers quantize the 16-bit tensors
        with torch.device(device):
            quantize_layers(model, cfg, None)
        return iterate_weights(model_config, device)
    modules = quantized_modules(cfg, checkpoint_tensor_names(model_config))
    with torch.device(device):
        quantize_layers(model, cfg, modules)
    return convert_weights(cfg, iterate_weights(model_config, device), modules)


def get_model(model_config: ModelConfig, device: torch.device | str, dtype: str | torch.dtype) -> nn.Module:
    """The model of `model_config` on `device` in `dtype`, weights loaded, in eval mode.

    Parameters are allocated directly on `device` under `dtype` (no CPU
    copy of the full model), then each checkpoint tensor is copied in.

    With `model_config.quantization` (int4/int8 and FP8 checkpoints) the layers the
    checkpoint quantizes are made quantized layers before any tensor is read
    (`model_loader/quantized.py`), the tensors are converted to tokenmill's
    layout as they stream in (`quantization.convert_weights`), and on the
    CPU the loaded layers are dequantized into `dtype`. `--quantization fp8` on
    a 16-bit checkpoint makes every linear layer and expert FP8 and quantizes the
    tensors as they load (`layers/fp8_params.py`). Dummy weights with a
    quantization config quantize every linear layer and expert with valid
    random tensors (GPU speed runs without a checkpoint).

    Raises:
        ValueError: unsupported architecture, missing or mismatched weights,
            a bad quantized checkpoint (naming the tensor or module); the
            partly filled model is dropped, nothing half-loaded is returned.
    """
    model_cls, _ = resolve_model_cls(getattr(model_config.hf_config, "architectures", None))
    torch_dtype = to_torch_dtype(dtype)
    qcfg = model_config.quantization
    start = time.perf_counter()
    with torch.device(device), _default_dtype(torch_dtype):
        model = model_cls(model_config.hf_config)
        if qcfg is not None and model_config.load_format == "dummy":
            quantize_layers(model, qcfg, None)
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model, seed=model_config.seed)
    else:
        keep_blocks = _keep_gguf_quantized(model_config, device)
        if keep_blocks:
            gguf_quantized.capture(model)
        with _default_dtype(torch_dtype), torch.no_grad():
            weights = (iterate_weights(model_config, device, keep_gguf_blocks=keep_blocks) if qcfg is None
                       else _quantized_weights(model_config, model, device))
            loaded = model.load_weights(weights)
        if keep_blocks:
            gguf_quantized.finalize(model)
        # An FP8 weight_scale arrives with its weight (the converter requires both; a 16-bit weight's loader writes it).
        missing = sorted({n for n, p in model.named_parameters() if not getattr(p, "loaded_with_weight", False)}
                         - set(loaded))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"The checkpoint at {model_config.model_path} lacks weights for: {shown}.")
    total, quantized = weight_bytes(model)
    quant_note = "" if qcfg is None else f", {format_bytes(quantized)} of it {describe_quantization(qcfg)}"
    logger.info("Loaded %s (%s, %s) in %.1f s: weights %s%s", model_config.architecture or model_cls.__name__,
                torch_dtype, device, time.perf_counter() - start, format_bytes(total), quant_note)
    if torch.device(device).type == "cpu":
        if qcfg is not None:
            count = dequantize_layers(model)  # the CPU runs dense layers (oneDNN packing below included)
            logger.info("Dequantized %d %s layers into %s for the CPU: weights now %s", count,
                        "fp8" if qcfg.is_fp8 else f"int{qcfg.bits}", torch_dtype, format_bytes(weight_bytes(model)[0]))
        pack_cpu_linear_weights(model)  # bfloat16: oneDNN's layout once, not per call
        cpu_elementwise.load()  # build (once per machine) or load the CPU C kernels now, not at the first request
    return model.eval()
