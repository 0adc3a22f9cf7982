"""Prompt formats: the task's text as is, or inside the tokenizer's chat template.

`plain` is for the tiny model and base checkpoints; `chat` wraps the text as a
user turn (after an optional system turn) with the generation prompt, for
instruction-tuned checkpoints. The sampler, the trainer and the warm-up all
encode prompts here, so they agree on every token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from echorl.config import SamplingConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], params: SamplingConfig
) -> list[list[int]]:
    if params.prompt_format == "plain":
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "sampling.prompt_format = chat needs a tokenizer with a chat template; this one "
            "has none (the built-in tiny model's byte tokenizer has none: use plain)"
        )
    system = [{"role": "system", "content": params.system_prompt}] if params.system_prompt else []
    rendered = [
        tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in texts
    ]
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
