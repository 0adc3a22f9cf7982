"""The verifier reads exactly the tokens the loss trains on: `RunTokenizer.decode` drops
nothing but a final eos (which only ends a completion). A special token inside an answer
was dropped by the decode, so the answer scored while the loss trained the token unseen."""

from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion
from echorl.rollout.scoring import score_group
from echorl.tasks import get_task

CODEC = RunTokenizer.builtin()
PAD, EOS = 0, CODEC.eos_id


def completion(ids: list[int]) -> Completion:
    return Completion(token_ids=ids, logprobs=[-0.1] * len(ids), finished=ids[-1] == EOS)


def test_a_special_token_inside_an_answer_is_read_as_text_and_a_final_eos_only_ends_it():
    task = get_task("add")
    problem = task.problem(7)
    answer = CODEC.encode(problem.answer)
    assert CODEC.decode([*answer, EOS]) == problem.answer
    assert CODEC.decode([answer[0], PAD, *answer[1:], EOS]) == (
        problem.answer[0] + "<|pad|>" + problem.answer[1:]
    )
    rewards = score_group(
        task,
        problem,
        [completion([*answer, EOS]), completion([answer[0], PAD, *answer[1:], EOS])],
        CODEC,
    )
    assert rewards == [1.0, 0.0]
