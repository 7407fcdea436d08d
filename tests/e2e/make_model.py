"""Builds a small random-weight Llama checkpoint that vLLM can serve without a model hub.

The tokenizer is a byte-level BPE trained on the Python standard library's sources; the model is a
`LlamaForCausalLM` with random weights in bfloat16. Both are saved with `save_pretrained` into one
folder. Same parameters and seed give the same files; a second build with the same parameters is a
no-op (a marker file records them).

    .venv-vllm/bin/python tests/e2e/make_model.py OUT_DIR [--layers 8 --hidden 1024 ...]

Runs with the `.venv-vllm` interpreter (needs torch, transformers, tokenizers).
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path
from typing import Any

from built_dir import build_once

MARKER = "kvdepot-model.json"
# Bump when the build changes in a way that alters the files for the same parameters.
BUILDER_VERSION = 1
# The tokenizer is trained on the first this-many bytes of the sorted stdlib sources (a few seconds).
TRAIN_TEXT_BYTES = 8 << 20
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo"}
    files = [
        p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts) and p.is_file()
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _training_text() -> list[str]:
    texts: list[str] = []
    total = 0
    for path in _stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= TRAIN_TEXT_BYTES:
            break
    if total < 1 << 20:
        raise RuntimeError(f"too little training text found under {sysconfig.get_paths()['stdlib']}")
    return texts


def build_tokenizer(vocab: int) -> Any:
    """A byte-level BPE tokenizer (bos <s>, eos </s>, pad <pad>) as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Like Llama: encoding with special tokens prepends <s>.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )


def _params(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    max_pos: int,
    seed: int,
    intermediate: int | None,
) -> dict[str, Any]:
    return {
        "builder_version": BUILDER_VERSION,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "vocab": vocab,
        "max_pos": max_pos,
        "seed": seed,
        "intermediate": intermediate if intermediate is not None else 2 * hidden,
    }


def build_model(
    out_dir: Path,
    *,
    layers: int = 8,
    hidden: int = 1024,
    heads: int = 16,
    kv_heads: int = 8,
    vocab: int = 8000,
    max_pos: int = 8192,
    seed: int = 0,
    intermediate: int | None = None,
) -> Path:
    """Builds the checkpoint into `out_dir` unless it already holds one with the same parameters.

    head_dim is hidden // heads; the MLP (intermediate) size defaults to 2 * hidden, which keeps
    prefill cheap on CPU (8 layers, hidden 1024: 4096 tokens in about 7 s on one core). Returns out_dir.
    `out_dir` must be absent, empty, or a folder this function built before (it is replaced).
    """
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be a multiple of heads, and heads a multiple of kv_heads")
    params = _params(layers, hidden, heads, kv_heads, vocab, max_pos, seed, intermediate)

    def write(tmp: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = build_tokenizer(vocab)
        tokenizer.save_pretrained(tmp)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=params["intermediate"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hidden // heads,
            max_position_embeddings=max_pos,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            dtype="bfloat16",
        )
        torch.manual_seed(seed)
        with torch.no_grad():
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        model.generation_config = generation_config(tokenizer)
        model.save_pretrained(tmp)

    return build_once(out_dir, MARKER, params, "make_model.py", write)


def generation_config(tokenizer: Any) -> Any:
    """The checkpoint's generation config: the tokenizer's bos, eos and pad tokens."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--max-pos", type=int, default=8192)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP size (default 2*hidden)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = build_model(
        a.out_dir,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
        vocab=a.vocab,
        max_pos=a.max_pos,
        seed=a.seed,
        intermediate=a.intermediate,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
