"""Bad quantized checkpoints fail at conversion with a message naming the tensor and the config field."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from checkpoints import read_state_dict, write_quantized_checkpoint
from optional_deps import require

from tokenmill.quantization import convert_weights, parse_quantization_config

require("compressed_tensors", "compressed-tensors")

MODULE = "model.layers.1.mlp.down_proj"  # K = 256, N = 128


@pytest.fixture(scope="module")
def written(tiny_llama_dir, tmp_path_factory):
    """method/variant -> (raw quantization config, state dict) of checkpoints written once."""
    out = {}
    for key, args in {"gptq-sym": ("gptq", 4, 128, False, True), "gptq-asym": ("gptq", 4, 128, False, False),
                      "gptq-act": ("gptq", 4, 64, True, False), "awq": ("awq", 4, 128, False, False),
                      "ct-asym": ("compressed-tensors", 4, 128, False, False),
                      "ct-act": ("compressed-tensors", 4, 64, True, True)}.items():
        folder = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path_factory.mktemp(key)), *args)
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)["quantization_config"]
        out[key] = raw, read_state_dict(folder)
    return out


def _convert(raw: dict, state: dict):
    return dict(convert_weights(parse_quantization_config(raw), state.items()))


def _fails(raw: dict, state: dict, tensor: str, field: str):
    with pytest.raises(ValueError) as e:
        _convert(raw, state)
    msg = str(e.value)
    assert tensor in msg and field in msg, msg
    return msg


def test_good_checkpoints_convert(written):
    for raw, state in written.values():
        assert f"{MODULE}.qweight" in _convert(raw, state)


@pytest.mark.parametrize("key, dropped, field", [
    ("gptq-sym", "scales", "tensors"),
    ("gptq-asym", "qzeros", "zero points"),
    ("gptq-act", "g_idx", "desc_act"),
    ("awq", "scales", "tensors"),
    ("awq", "qzeros", "zero points"),
    ("ct-asym", "weight_scale", "tensors"),
    ("ct-asym", "weight_zero_point", "symmetric"),
    ("ct-act", "weight_g_idx", "actorder"),
    ("ct-act", "weight_shape", "tensors"),
])
def test_missing_tensor_is_named(written, key, dropped, field):
    raw, state = written[key]
    state = {k: v for k, v in state.items() if k != f"{MODULE}.{dropped}"}
    msg = _fails(raw, state, f"{MODULE}.{dropped}", field)
    assert "missing" in msg


def test_qweight_without_scales_in_a_stream_is_refused_even_when_scales_come_first_elsewhere(written):
    raw, state = written["gptq-sym"]
    state = {k: v for k, v in state.items() if k != f"{MODULE}.qweight"}
    _fails(raw, state, f"{MODULE}.qweight", "missing")


@pytest.mark.parametrize("key, change, tensor, field", [
    # 4-bit tensors read as 8-bit
    ("gptq-asym", {"bits": 8}, "scales", "bits"),
    ("gptq-sym", {"bits": 8}, "qzeros", "bits"),
    ("gptq-act", {"bits": 8}, "qweight", "bits"),
    # a group size that disagrees with the stored groups
    ("gptq-act", {"group_size": 128}, "scales", "group_size"),
    ("gptq-asym", {"group_size": 64}, "g_idx", "group_size"),
    ("awq", {"group_size": 64}, "scales", "group_size"),
    ("awq", {"group_size": -1}, "scales", "group_size"),
    # zero points / act-order flags that disagree with the tensors
    ("gptq-asym", {"sym": True}, "qzeros", "sym"),
    ("gptq-act", {"desc_act": False}, "g_idx", "desc_act"),
    ("awq", {"zero_point": False}, "qzeros", "zero_point"),
])
def test_config_that_disagrees_with_tensors_is_named(written, key, change, tensor, field):
    raw, state = written[key]
    _fails({**raw, **change}, state, f".{tensor}", field)


def _ct_with(raw: dict, **weights) -> dict:
    raw = json.loads(json.dumps(raw))
    raw["config_groups"]["group_0"]["weights"].update(weights)
    return raw


@pytest.mark.parametrize("key, weights, tensor, field", [
    ("ct-asym", {"num_bits": 8}, "weight_packed", "num_bits"),
    ("ct-asym", {"group_size": 64}, "weight_scale", "group_size"),
    ("ct-asym", {"symmetric": True}, "weight_zero_point", "symmetric"),
    ("ct-act", {"actorder": None}, "weight_g_idx", "actorder"),
])
def test_compressed_tensors_config_that_disagrees_is_named(written, key, weights, tensor, field):
    raw, state = written[key]
    _fails(_ct_with(raw, **weights), state, f".{tensor}", field)


def test_shapes_that_disagree_are_named(written):
    raw, state = written["ct-asym"]
    bad = {**state, f"{MODULE}.weight_shape": torch.tensor([128, 512])}
    _fails(raw, bad, f"{MODULE}.weight_packed", "num_bits")
    raw, state = written["gptq-asym"]
    bad = {**state, f"{MODULE}.scales": state[f"{MODULE}.scales"][:, :64]}
    _fails(raw, bad, f"{MODULE}.scales", "shape")
    bad = {**state, f"{MODULE}.qweight": state[f"{MODULE}.qweight"].to(torch.float32)}
    _fails(raw, bad, f"{MODULE}.qweight", "bits")
    raw, state = written["awq"]
    bad = {**state, f"{MODULE}.qzeros": state[f"{MODULE}.qzeros"][:, :4]}
    _fails(raw, bad, f"{MODULE}.qzeros", "group_size")
    raw, state = written["ct-act"]
    bad = {**state, f"{MODULE}.weight_g_idx": state[f"{MODULE}.weight_g_idx"] + 10}
    _fails(raw, bad, f"{MODULE}.weight_g_idx", "actorder")


def test_dense_weights_under_a_quantized_config_are_refused(written, tiny_llama_dir):
    """A "frozen" compressed-tensors export may hold dense weights with scales: no weight_packed, refused."""
    raw, state = written["ct-asym"]
    dense = read_state_dict(tiny_llama_dir)
    frozen = {k: v for k, v in state.items() if not k.startswith(MODULE)}
    frozen[f"{MODULE}.weight"] = dense[f"{MODULE}.weight"]
    frozen[f"{MODULE}.weight_scale"] = state[f"{MODULE}.weight_scale"]
    frozen[f"{MODULE}.weight_zero_point"] = state[f"{MODULE}.weight_zero_point"]
    _fails({**raw, "quantization_status": "frozen"}, frozen, f"{MODULE}.weight_packed", "missing")


def test_unpacked_int8_zero_points_are_read(written):
    """Older compressed-tensors releases stored asymmetric zero points unpacked, int8 [N, ngroups], signed."""
    from tokenmill.quantization.compressed_tensors import unpack_zero_points

    raw, state = written["ct-asym"]
    packed = state[f"{MODULE}.weight_zero_point"]
    zeros = unpack_zero_points(packed, 4, 128)
    old = {**state, f"{MODULE}.weight_zero_point": (zeros.to(torch.int16) - 8).to(torch.int8)}
    assert torch.equal(_convert(raw, old)[f"{MODULE}.qzeros"], _convert(raw, state)[f"{MODULE}.qzeros"])


def test_duplicate_tensor_is_refused(written):
    raw, state = written["gptq-sym"]
    name = f"{MODULE}.scales"
    stream = list(state.items()) + [(name, state[name])]
    with pytest.raises(ValueError, match=re.escape(name) + " appears twice"):
        dict(convert_weights(parse_quantization_config(raw), stream))


def test_tensors_convert_whatever_their_order(written):
    """Shards interleave modules: a module converts once its last required tensor arrives."""
    raw, state = written["ct-act"]
    forward = _convert(raw, state)
    backward = dict(convert_weights(parse_quantization_config(raw), reversed(list(state.items()))))
    assert forward.keys() == backward.keys()
    assert all(torch.equal(forward[k], backward[k]) for k in forward)
