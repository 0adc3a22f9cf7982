"""The built-in byte-level tokenizer, built locally with the `tokenizers` library.

One token per byte (256) plus two special tokens, so every task's alphabet (and
any UTF-8 text) is covered and nothing is ever downloaded. It is a byte-level
BPE with no merges, the same family as Qwen2's tokenizer, so that
`AutoTokenizer.from_pretrained` on a saved Qwen2 model folder (which picks
Qwen2's byte-level tokenizer class) reads it back with identical ids.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)  # ids 0 and 1


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Return the byte-level tokenizer: ids 0 = pad, 1 = eos, then the 256 byte symbols."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == 256, f"byte alphabet has {len(alphabet)} symbols, expected 256"
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, so spaces are bytes like any other.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, padding_side="left"
    )
