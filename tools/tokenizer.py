"""Stage 2: a byte-level BPE tokenizer (HF `tokenizers`), saved in Hugging Face layout.

Special tokens come first: `<|endoftext|>` (id 0: end of sequence, separates files) and
`<|MASK|>` (id 1: DFLASH's mask token). Pre-tokenizer, decoder and post-processor are byte-level,
like the demo model's (launch/demo.py), so `speculant.executor.build.load_tokenizer` reads it
and `transformers.AutoTokenizer` loads it as a PreTrainedTokenizerFast.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE of `vocab_size` tokens (specials and the 256 byte symbols included)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def special_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """(eos_id, mask_id)."""
    return tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(MASK_TOKEN)


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, context: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    specials = {
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
