"""A synthetic checkpoint whose weight matrices all differ, for OpenVINO.

vlscope's synthetic weights tile one random pool (engine/model/loading.py, fill_synthetic_), so every layer's q_proj
is the same tensor as the next one's. OpenVINO's serializer stores identical constants once: exported as it is,
the int8 language model is 328 MB instead of 1.7 GB, and a decode step reads a fraction of what the real model's
would. Each matrix is rolled by its own offset here: the same values, other tensors, every byte read again.

usage: python -m bench.peers.distinct_checkpoint SOURCE_DIR OUT_DIR   (SOURCE_DIR: a saved synthetic checkpoint)
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

source, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for file in source.iterdir():
    if file.name not in ("model.safetensors", "config.json"):
        shutil.copy(file, out / file.name)
# optimum-intel 2.2 exports with transformers <= 5.0 (4.57.6 here), which reads rope_scaling, not rope_parameters.
config = json.loads((source / "config.json").read_text())
rope = config["text_config"]["rope_parameters"]
config["text_config"]["rope_scaling"] = {"rope_type": "default", "mrope_section": rope["mrope_section"],
                                         "mrope_interleaved": True}
config["text_config"]["rope_theta"] = rope["rope_theta"]
(out / "config.json").write_text(json.dumps(config, indent=1))
tensors = {}
with safe_open(source / "model.safetensors", "pt") as weights:
    for index, name in enumerate(weights.keys()):
        tensor = weights.get_tensor(name)
        if tensor.dim() >= 2:
            flat = tensor.reshape(-1)
            tensor = torch.roll(flat, shifts=(index * 7919 + 13) % flat.numel()).reshape(tensor.shape)
        tensors[name] = tensor.contiguous()
save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
