#!/usr/bin/env python3
"""Writes hf_params.json beside this file: what transformers builds for each config protrain-models
ships or tests, so the Rust tests can hold the builders against it without Python.

For every preset (models/src/presets/*.json), every test config (models/tests/configs/*.json) and
every real config (models/tests/real-configs/*.json), the model is built with
`AutoModelForCausalLM.from_config` on the `meta` device (no memory, no weights) and the script
records:

* ``parameters``: ``sum(p.numel() for p in model.parameters())`` (tied tensors once);
* ``tied``: ``{"lm_head.weight": <embedding name>}`` when the head shares the embedding;
* ``params``: ``[[name, shape], ...]`` in ``model.named_parameters()`` order, for models under
  10M parameters (the big ones run the same builder code with other sizes).

Run from the repository root:

    pip install torch transformers
    python models/tests/data/make_hf_params.py

Produced with python 3.11.7, torch 2.15.0, transformers 5.25.0 (recorded in the output).
"""

import glob
import json
import os
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.dirname(os.path.dirname(HERE))
SOURCES = {
    "preset": os.path.join(MODELS, "src", "presets"),
    "test": os.path.join(MODELS, "tests", "configs"),
    "real": os.path.join(MODELS, "tests", "real-configs"),
}


def describe(path):
    with open(path) as f:
        config = AutoConfig.for_model(**json.load(f))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = [[name, list(p.shape)] for name, p in model.named_parameters()]
    count = sum(p.numel() for p in model.parameters())
    tied = {}
    embedding = model.get_input_embeddings().weight
    if model.lm_head.weight is embedding:
        tied["lm_head.weight"] = next(n for n, p in model.named_parameters() if p is embedding)
    entry = {"parameters": count, "tied": tied}
    if count < 10_000_000:
        entry["params"] = params
    return entry


def main():
    out = {"versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                        "transformers": transformers.__version__}}
    for kind, folder in SOURCES.items():
        for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
            name = os.path.basename(path)[: -len(".json")]
            out[f"{kind}/{name}"] = describe(path)
            print(f"{kind}/{name}: {out[f'{kind}/{name}']['parameters']}")
    with open(os.path.join(HERE, "hf_params.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
