"""fp8ops.export_fp8: a model converted with fp8ops.convert_to_fp8 written as an FP8 checkpoint
for serving (transformers, vLLM), its weights the FP8 casts it was trained with (docs/export.md).

weights.py reads each weight's cast as the eval forward makes it; checkpoint.py names the tensors
as transformers loads them; compressed_tensors.py and fp8.py write each format's scales and
quantization_config."""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from . import compressed_tensors, fp8
from .checkpoint import check_weight_type, collect

FORMATS = {"compressed-tensors": compressed_tensors, "fp8": fp8}


def export_fp8(model: nn.Module, out_dir, *, format: str = "compressed-tensors") -> None:
    """Write `model` (a transformers model converted with fp8ops.convert_to_fp8) to `out_dir` as
    an FP8 checkpoint: config.json (the model's config, its dtype that of the parameters, plus
    quantization_config) and model.safetensors. format: "compressed-tensors" (static per-tensor
    or 128x128-block weight scales; MXFP8's 1x32 blocks in its "mxfp8-quantized" format for a
    bfloat16 model, as float32 group scales otherwise) or "fp8" (transformers'
    FineGrainedFP8: 128x128 block scales). The FP8 weights are the casts the model's own eval
    forward uses, bit for bit (MXFP8 in format "fp8" excepted: cast again in blocks, warned);
    Linear layers left in high precision are listed as such. Nothing in the model changes: its
    caches, scales, gradients and training mode are as they were."""
    if format not in FORMATS:
        raise ValueError(f"export_fp8: unknown format {format!r}; "
                         f"choose one of {sorted(FORMATS)}")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError("export_fp8 takes a transformers model (one with a .config): "
                        f"not {type(model).__name__}")
    from safetensors.torch import save_file

    writer = FORMATS[format]
    plain, weights, ignore = collect(model)
    layout = check_weight_type(weights)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"export_fp8: the parameters have several dtypes "
                         f"({sorted(map(str, dtypes))}): cast the model to one first")
    dtype = dtypes.pop()
    tensors = dict(plain)
    tensors.update(writer.tensors(weights, dtype))
    as_dict = config.to_dict()
    as_dict["dtype"] = str(dtype).replace("torch.", "")
    as_dict.pop("torch_dtype", None)
    as_dict["quantization_config"] = writer.quantization_config(layout, ignore, dtype)
    os.makedirs(out_dir, exist_ok=True)
    # one copy each, on the host and contiguous: per-expert tensors are views of one cast and a
    # per-tensor scale fills its grid by expand, which safetensors refuses
    save_file({k: v.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
               for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(as_dict, f, indent=2, sort_keys=True)
