"""Builds a random LoRA adapter for a Llama checkpoint (e.g. the one of make_model.py) without a hub.

The adapter is written in PEFT's on-disk format, with torch and safetensors only (no peft needed):

    adapter_config.json          peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path
    adapter_model.safetensors    base_model.model.model.layers.N.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight

lora_A is (r, in_features), lora_B is (out_features, r); the update is (lora_alpha / r) * B @ A. Both
are random (PEFT initializes lora_B to zero, which would make the adapter a no-op): large enough that
two adapters give different greedy outputs and, through k_proj and v_proj, different KV for the same
tokens. Shapes come from the model's config.json. Same model config, parameters and seed give the same
files; a second build with the same inputs is a no-op (a marker file records them).

    .venv-vllm/bin/python tests/e2e/make_lora.py MODEL_DIR OUT_DIR [--seed 1 --rank 8 ...]

Runs with the `.venv-vllm` interpreter (needs torch and safetensors).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from built_dir import build_once

MARKER = "kvdepot-lora.json"
# Bump when the build changes in a way that alters the files for the same parameters.
BUILDER_VERSION = 1
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of one decoder layer."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }


def _params(model_config: dict[str, Any], seed: int, rank: int, alpha: int, std: float) -> dict[str, Any]:
    canonical = json.dumps(model_config, sort_keys=True).encode()
    return {
        "builder_version": BUILDER_VERSION,
        "model_config_sha256": hashlib.sha256(canonical).hexdigest(),
        "seed": seed,
        "rank": rank,
        "alpha": alpha,
        "std": std,
    }


def build_lora(
    model_dir: Path,
    out_dir: Path,
    *,
    seed: int = 1,
    rank: int = 8,
    alpha: int = 16,
    std: float = 0.05,
) -> Path:
    """Builds the adapter into `out_dir` unless it already holds one with the same inputs. Returns out_dir.

    Every lora_A and lora_B entry is drawn from N(0, std) with torch's generator seeded by `seed`
    (CPU, float32, then cast to the model's dtype), layer by layer, module by module, A then B.
    `out_dir` must be absent, empty, or a folder this function built before (it is replaced).
    """
    model_dir = Path(model_dir)
    model_config = json.loads((model_dir / "config.json").read_text())
    params = _params(model_config, seed, rank, alpha, std)

    def write(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file

        dtype = getattr(torch, str(model_config.get("torch_dtype") or model_config.get("dtype") or "float32"))
        shapes = _shapes(model_config)
        gen = torch.Generator().manual_seed(seed)
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(int(model_config["num_hidden_layers"])):
            for module in TARGET_MODULES:
                fan_in, fan_out = shapes[module]
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                a = torch.randn(rank, fan_in, generator=gen) * std
                b = torch.randn(fan_out, rank, generator=gen) * std
                tensors[f"{prefix}.lora_A.weight"] = a.to(dtype).contiguous()
                tensors[f"{prefix}.lora_B.weight"] = b.to(dtype).contiguous()
        adapter_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(model_dir),
            "r": rank,
            "lora_alpha": alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": list(TARGET_MODULES),
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
        }

        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")

    return build_once(out_dir, MARKER, params, "make_lora.py", write)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--std", type=float, default=0.05, help="std of every lora_A and lora_B entry")
    a = ap.parse_args(argv)
    print(build_lora(a.model_dir, a.out_dir, seed=a.seed, rank=a.rank, alpha=a.alpha, std=a.std))
    return 0


if __name__ == "__main__":
    sys.exit(main())
