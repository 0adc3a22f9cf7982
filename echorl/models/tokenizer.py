"""The built-in byte-level tokenizer, built locally with the `tokenizers` library.

One token per byte (256) plus two special tokens, so every task's alphabet (and
any UTF-8 text) is covered and nothing is ever downloaded. It is a byte-level
BPE with no merges, the same family as Qwen2's tokenizer, so that
`AutoTokenizer.from_pretrained` on a saved Qwen2 model folder (which picks
Qwen2's byte-level tokenizer class) reads it back with identical ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)  # ids 0 and 1


def byte_tokenizer() -> Tokenizer:
    """The raw `tokenizers` object (no transformers import): ids 0 = pad, 1 = eos, then bytes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == 256, f"byte alphabet has {len(alphabet)} symbols, expected 256"
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, so spaces are bytes like any other.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """The byte tokenizer wrapped for transformers, with pad/eos set and left padding."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer(),
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
    )
