"""Prompt formats (plain, the tokenizer's chat template) and the separate format reward."""

import pytest

from echorl.broker.scoring import score_group
from echorl.config import SamplingConfig
from echorl.models.prompts import encode_prompts
from echorl.models.tokenizer import build_byte_tokenizer
from echorl.tasks import get_task
from echorl.tasks.base import reward

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_plain_and_chat_prompts():
    tok = build_byte_tokenizer()
    plain = encode_prompts(tok, ["12+34="], SamplingConfig())
    assert tok.decode(plain[0]) == "12+34="
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        encode_prompts(tok, ["12+34="], SamplingConfig(prompt_format="chat"))
    tok.chat_template = TEMPLATE
    chat = SamplingConfig(prompt_format="chat", system_prompt="Answer briefly.")
    (ids,) = encode_prompts(tok, ["12+34="], chat)
    assert tok.decode(ids) == "<system>Answer briefly.\n<user>12+34=\n<assistant>"


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
    from echorl.models.tokenizer import byte_tokenizer
    from echorl.protocol import Completion

    raw = byte_tokenizer()
    rg = get_task("rg:knights_knaves")
    q = rg.problem(3)
    ids = raw.encode(rg.demonstration(q), add_special_tokens=False).ids
    c = Completion(token_ids=ids, logprobs=[-0.1] * len(ids), finished=True)
    enc = lambda t: raw.encode(t, add_special_tokens=False).ids  # noqa: E731
    dec = lambda i: raw.decode(i, skip_special_tokens=True)  # noqa: E731
    assert score_group(rg, 3, [c], enc, dec) == [1.0]
    assert score_group(rg, 3, [c], enc, dec, format_reward=0.1) == [pytest.approx(1.1)]
