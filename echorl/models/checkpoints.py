"""Small random Hugging Face checkpoints with locally trained tokenizers.

They stand in for "any real checkpoint" in tests and examples without downloading anything:
a Qwen3, Llama or Qwen2 causal LM of about a million random parameters, with either a
byte-level BPE tokenizer trained on the project's own task texts (digits split one by one,
like Qwen and Llama 3) or a character-level one. A folder written by `save_checkpoint` loads
with `PreTrainedTokenizerFast.from_pretrained` and `AutoModelForCausalLM.from_pretrained`
like a downloaded one.

    from echorl.models.checkpoints import corpus, save_checkpoint, train_bpe_tokenizer
    save_checkpoint("runs/qwen3-bpe", "qwen3", train_bpe_tokenizer(corpus()))

The character-level tokenizer in a Qwen2 folder reproduces a transformers 5 trap:
`AutoTokenizer` builds Qwen2's byte-level tokenizer class from it, which drops spaces.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"  # also the pad token
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS_TASKS = ("add", "add3", "reverse", "countdown", "math_word", "knights_text", "sokoban_plan")
Arch = Literal["qwen3", "llama", "qwen2"]


def corpus(n: int = 20000, seed: int = 0) -> list[str]:
    """About `n` texts, prompt then demonstration, from the built-in tasks (nothing downloaded),
    shuffled with `seed`."""
    from echorl.tasks import TASKS, take

    per_task = -(-n // len(CORPUS_TASKS))
    texts = []
    for i, name in enumerate(CORPUS_TASKS):
        task = TASKS[name]
        texts += [f"{p.prompt}{task.demonstration(p)}\n" for p in take(task, per_task, seed + i)]
    random.Random(seed).shuffle(texts)
    return texts[:n]


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 2000, chat: bool = True
) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `texts`, pre-tokenized like Qwen2/3 and Llama 3:
    every digit its own token, then GPT-2's regex over bytes. Special tokens `<|endoftext|>`
    (id 0) and, with `chat`, `<|im_start|>` and `<|im_end|>` (ids 1 and 2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS if chat else SPECIAL_TOKENS[:1]),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_char_tokenizer(texts: Iterable[str]) -> Tokenizer:
    """One token per character seen in `texts` (not per byte), after the three special tokens.
    `decode(encode(s)) == s` for any text of seen characters, spaces and newlines included;
    unseen characters are dropped."""
    chars = sorted(set().union(*map(set, texts)))
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join the characters back with nothing between them
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_checkpoint(
    path: str | Path,
    arch: Arch,
    tokenizer: Tokenizer,
    *,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    mlp: int = 384,
    seed: int = 0,
    chat: bool = True,
) -> Path:
    """Write a random `arch` causal LM (safetensors, config, generation config) and `tokenizer`
    to `path`. With `chat`, eos is `<|im_end|>` and a ChatML template is set; without, eos is
    `<|endoftext|>` and there is no template. Pad is `<|endoftext|>`. The caller's torch RNG
    is left as it was."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from echorl.models.tiny import small_config

    eos = IM_END if chat else EOS_TOKEN
    for token in (EOS_TOKEN, eos):
        if tokenizer.token_to_id(token) is None:
            raise ValueError(f"the tokenizer has no {token} token, which chat={chat} needs")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,  # decode must give back the text exactly
    )
    if chat:
        hf_tok.chat_template = CHAT_TEMPLATE
    config = small_config(arch, len(hf_tok), hidden, layers, heads, kv_heads, mlp)
    config.pad_token_id, config.eos_token_id = hf_tok.pad_token_id, hf_tok.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = hf_tok.pad_token_id
    model.generation_config.eos_token_id = hf_tok.eos_token_id
    model.generation_config.bos_token_id = None
    path = Path(path)
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    return path
