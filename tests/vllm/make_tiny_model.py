"""Build a tiny, randomly initialised Llama model that vLLM (CPU) and transformers load offline.

Usage: python tests/vllm/make_tiny_model.py OUT_DIR [--seed N] [--hidden H --layers L]

The model (by default 2 layers, hidden 128, 4 heads, 2 KV heads, vocab 2048, 2048 positions; ``--hidden``
and ``--layers`` make a larger one, e.g. for prefill times in the tens of milliseconds) is saved with
``save_pretrained`` as safetensors, next to a byte-level BPE tokenizer trained here with ``tokenizers``
on generated text and a chat template, so that ``HF_HUB_OFFLINE=1`` loading needs no network.
The output is deterministic for a given seed (same bytes on every run). Needs torch, transformers
and tokenizers: run it with the vLLM venv's python (``.venv-vllm/bin/python``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

VOCAB_SIZE = 2048
MAX_POSITIONS = 2048
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _corpus(seed: int, n_lines: int = 20_000) -> list[str]:
    """Pseudo-random English-like text: enough distinct pieces for BPE to fill the vocabulary."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [26 - i for i in range(len(letters))]
    words = ["".join(rng.choices(letters, weights=weights, k=rng.randint(1, 9))) for _ in range(6000)]
    punct = [".", ",", "!", "?", ":", ";", ""]
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 24)
        body = " ".join(rng.choice(words) for _ in range(n))
        lines.append(body.capitalize() + rng.choice(punct) + f" {rng.randint(0, 9999)}")
    return lines


def _build_tokenizer(out_dir: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer vocab is {tok.get_vocab_size()}, expected {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _build_model(out_dir: Path, seed: int, hidden: int, layers: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=SPECIAL_TOKENS.index("<|pad|>"),
        bos_token_id=SPECIAL_TOKENS.index("<|bos|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|eos|>"),
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    """Build the model and tokenizer into OUT_DIR; print where and how long it took."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (a multiple of 4 heads x 32)")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out_dir: Path = args.out_dir
    if args.hidden <= 0 or args.hidden % 128 or args.layers <= 0:
        parser.error(f"--hidden {args.hidden} --layers {args.layers}: need a multiple of 128 and at least 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(out_dir, args.seed)
    _build_model(out_dir, args.seed, args.hidden, args.layers)
    print(f"tiny model in {out_dir} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
