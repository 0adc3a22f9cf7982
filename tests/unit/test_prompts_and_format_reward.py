"""Prompt formats (plain, the tokenizer's chat template) and the separate format reward."""

import pytest

from echorl.config import SamplingConfig
from echorl.models.tokenizer import RunTokenizer, TokenizerError, build_byte_tokenizer
from echorl.rollout.scoring import score_group
from echorl.tasks import get_task
from echorl.tasks.base import reward

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_plain_and_chat_prompts():
    codec = RunTokenizer.builtin()
    plain = codec.encode_prompts(["12+34=", "5+5="], SamplingConfig())
    assert [codec.decode(ids) for ids in plain] == ["12+34=", "5+5="]
    assert plain[0] == codec.encode("12+34=") == codec.encode_prompt("12+34=", SamplingConfig())
    with pytest.raises(TokenizerError, match="needs a tokenizer with a chat template"):
        codec.encode_prompts(["12+34="], SamplingConfig(prompt_format="chat"))
    assert issubclass(TokenizerError, ValueError)
    tok = build_byte_tokenizer()
    tok.chat_template = TEMPLATE
    templated = RunTokenizer.from_hf(tok)
    chat = SamplingConfig(prompt_format="chat", system_prompt="Answer briefly.")
    (ids,) = templated.encode_prompts(["12+34="], chat)
    assert templated.decode(ids) == "<system>Answer briefly.\n<user>12+34=\n<assistant>"
    # Rendered as transformers renders it, so every role sees the same prompt ids.
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "12+34="},
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert templated.render_chat("12+34=", "Answer briefly.") == rendered
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert templated.render_chat("x") == "<user>x\n<assistant>"  # no system prompt, no turn
    # The template is part of the fingerprint: a run's samplers must share it.
    assert templated.fingerprint != codec.fingerprint
    assert RunTokenizer.from_hf(build_byte_tokenizer()).fingerprint == codec.fingerprint


def test_format_reward_is_a_separate_bonus():
    task = get_task("add")
    p = task.problem(0)
    right, wrong = p.answer, str(int(p.answer) + 1)
    assert reward(task, p, right) == 1.0
    assert reward(task, p, right, format_reward=0.2) == 1.0  # no tags, no bonus
    tagged = f"<answer>{wrong}</answer>"
    assert reward(task, p, tagged, format_reward=0.2) == pytest.approx(0.2)  # format, not right
    rg = get_task("rg:knights_knaves")
    q = rg.problem(0)
    assert reward(rg, q, rg.demonstration(q), format_reward=0.2) == pytest.approx(1.2)


def test_the_broker_adds_the_format_reward_too():
    from echorl.protocol import Completion

    codec = RunTokenizer.builtin()
    rg = get_task("rg:knights_knaves")
    q = rg.problem(3)
    ids = codec.encode(rg.demonstration(q)) + [codec.eos_id]  # eos is not part of the text
    c = Completion(token_ids=ids, logprobs=[-0.1] * len(ids), finished=True)
    assert score_group(rg, q, [c], codec) == [1.0]
    assert score_group(rg, q, [c], codec, format_reward=0.1) == [pytest.approx(1.1)]


def test_chat_rendering_keeps_bos_and_takes_the_default_of_named_templates(tmp_path):
    """Templates that begin with {{ bos_token }} (Llama 3, Mistral, Gemma) render as
    transformers renders them; of several named templates the "default" one is used, the
    same from the folder and from a loaded tokenizer (equal fingerprints)."""
    from transformers import PreTrainedTokenizerFast

    from echorl.models.checkpoints import EOS_TOKEN, IM_END, corpus, train_bpe_tokenizer
    from echorl.models.loading import load_tokenizer

    hf = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe_tokenizer(corpus(1000)),
        eos_token=IM_END,
        pad_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
    )
    template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    hf.chat_template = template
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    loaded = load_tokenizer(tmp_path)
    folder, wrapped = RunTokenizer.from_folder(tmp_path), RunTokenizer.from_hf(loaded)
    messages = [{"role": "user", "content": "12+34="}]
    expected = loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert folder.render_chat("12+34=") == expected and expected.startswith(EOS_TOKEN)
    assert folder.fingerprint == wrapped.fingerprint
    loaded.chat_template = {"default": template, "tool_use": "{{ messages }}"}
    assert RunTokenizer.from_hf(loaded).chat_template == template
