"""Tokenizers: the built-in byte-level one, and the run's tokenizer as every role holds it.

The built-in tokenizer has one token per byte (256) plus two special tokens, so
every task's alphabet (and any UTF-8 text) is covered and nothing is ever
downloaded. It is a byte-level BPE with no merges, the same family as Qwen2's.

`RunTokenizer` is the run's tokenizer as the `tokenizers` library holds it
(no torch, no transformers): the broker loads it from the model folder's
`tokenizer.json` to encode prompts, check token ids and decode completions for
re-scoring; samplers and the trainer wrap the tokenizer they loaded with the
model. Its `fingerprint` is what they compare at registration, so a sampler
whose tokenizer is not the run's is refused instead of being scored as garbage.
Prompts, in the `plain` or `chat` format, are encoded here and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from echorl.config import SamplingConfig


def never_emitted(tok: Tokenizer, eos_id: int) -> tuple[int, ...]:
    """The special tokens other than eos: the decode drops them, so a completion holding one
    would be scored on other text than the loss trains on. Every backend keeps generation
    from emitting them (and the trainer's log-probs from counting them), and the broker
    refuses a completion that holds one."""
    added = tok.get_added_tokens_decoder()
    return tuple(sorted(i for i, t in added.items() if t.special and i != eos_id))


PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)  # ids 0 and 1
# Encoded into the fingerprint: spaces, digits, newlines, non-ASCII (composed and not) and
# markup all show how a tokenizer splits text.
PROBES = (
    "a b  c\n\t12 + 34 = 46, 1234567.",
    "Ünïcødé 漢字 🙂 café cafe\u0301",
    "<answer>x</answer> \\boxed{1/2} <|endoftext|>",
)


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


class TokenizerError(ValueError):
    """The run's tokenizer cannot be loaded or cannot do what the run asks of it."""


@dataclass(frozen=True)
class RunTokenizer:
    """The run's tokenizer: encode, decode, prompts in the run's format, and a fingerprint."""

    tok: Tokenizer
    eos_token: str
    chat_template: str | None = None
    bos_token: str | None = None  # what chat templates that start with {{ bos_token }} write

    @classmethod
    def builtin(cls) -> RunTokenizer:
        """The tiny model's byte tokenizer (a run with no `model.path`)."""
        return cls(byte_tokenizer(), EOS_TOKEN)

    @classmethod
    def from_folder(cls, path: str | Path) -> RunTokenizer:
        """From a Hugging Face folder: `tokenizer.json`, with eos and the chat template from
        `tokenizer_config.json` (or `chat_template.jinja`)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(
                f"{path} has no tokenizer.json (a fast tokenizer's file; slow-only tokenizers "
                "are not supported: save the tokenizer with transformers to get one)"
            )
        tok = Tokenizer.from_file(str(file))
        config = _read_json(path / "tokenizer_config.json")
        eos, bos = (_token(config.get(key)) for key in ("eos_token", "bos_token"))
        if eos is None:  # fall back on the model's config
            eos_id = _read_json(path / "config.json").get("eos_token_id")
            eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
            eos = tok.id_to_token(eos_id) if eos_id is not None else None
        if eos is None or tok.token_to_id(eos) is None:
            raise TokenizerError(f"{path}: no eos token the vocabulary knows ({eos!r})")
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: the default one
            template = {t.get("name"): t.get("template") for t in template}
        return cls(tok, eos, _default_template(template), bos)

    @classmethod
    def from_hf(cls, tokenizer: PreTrainedTokenizerBase) -> RunTokenizer:
        """Wrap a loaded transformers tokenizer (a fast one: it has a `tokenizers` backend)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerError(f"{type(tokenizer).__name__} is not a fast tokenizer")
        template = _default_template(tokenizer.chat_template)
        return cls(backend, tokenizer.eos_token, template, tokenizer.bos_token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self.tok.token_to_id(self.eos_token)

    @cached_property
    def never_emitted(self) -> tuple[int, ...]:
        return never_emitted(self.tok, self.eos_id)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of what decides every token id: the tokenizer's pipeline as `tokenizer.json`
        states it (normalizer, pre-tokenizer, model with its vocabulary and merges, decoder,
        added tokens; not the post-processor, padding and truncation, which never apply to
        the ids a run uses), how probe texts split, the eos token and the chat template.
        Equal fingerprints, equal ids and equal prompts."""
        spec = json.loads(self.tok.to_str())
        for unused in ("post_processor", "padding", "truncation"):
            spec.pop(unused, None)
        canon = {
            "tokenizer": spec,
            "probe": [self.encode(text) for text in PROBES],
            "eos": self.eos_token,
            "bos": self.bos_token,
            "chat_template": self.chat_template,
        }
        blob = json.dumps(canon, ensure_ascii=False, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, text: str | list[dict], system: str | None = None) -> str:
        """`text` as a user turn, or a dataset's chat messages, after an optional system turn
        (when they hold none), with the generation prompt, rendered by the chat template the
        way transformers renders it."""
        if not self.chat_template:
            raise TokenizerError(
                "sampling.prompt_format = chat (or a dataset of chat messages) needs a "
                "tokenizer with a chat template; this one has none (the built-in tiny model's "
                "byte tokenizer has none: use plain text prompts)"
            )
        if isinstance(text, str):
            text = [{"role": "user", "content": text}]
        messages = [{"role": "system", "content": system}] if system else []
        if any(m["role"] == "system" for m in text):
            messages = []
        messages += [{"role": m["role"], "content": m["content"]} for m in text]
        return self._compiled.render(
            messages=messages,
            add_generation_prompt=True,
            eos_token=self.eos_token,
            bos_token=self.bos_token or "",
        )

    def __getstate__(self) -> dict:
        """Pickled without caches (a compiled template is not picklable): what a verifier
        worker process receives."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_compiled", "fingerprint")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @cached_property
    def _compiled(self):
        return _compile(self.chat_template)

    def encode_prompt(self, text: str | list[dict], params: SamplingConfig) -> list[int]:
        """A problem's `query` as token ids: text in the run's `sampling.prompt_format`,
        chat messages always through the chat template."""
        if params.prompt_format == "chat" or not isinstance(text, str):
            text = self.render_chat(text, params.system_prompt)
        return self.encode(text)

    def encode_prompts(
        self, texts: list[str | list[dict]], params: SamplingConfig
    ) -> list[list[int]]:
        return [self.encode_prompt(t, params) for t in texts]


def _token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _default_template(template) -> str | None:
    """The chat template to use: the only one, or the one named "default" of several."""
    if isinstance(template, dict):
        return template.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _compile(template: str):
    """A chat template compiled in a sandbox with the helpers transformers gives templates."""
    from datetime import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizerError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
