import math

import pytest
from pydantic import ValidationError

from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import (
    BadRequest,
    Completion,
    Forbidden,
    JobState,
    NotFound,
    ProtocolError,
    SamplerInfo,
    ScoredGroup,
    TooLarge,
    Unauthorized,
    Unprocessable,
    WeightVersion,
)

PROMPT = [40, 41, 42]
JOB = JobState(group_size=2, prompt_ids=PROMPT)
FINGERPRINT = RunTokenizer.builtin().fingerprint


def completion(ids=(5, 6, 1), lps=(-0.5, -1.0, -0.01), finished=True):
    return {"token_ids": list(ids), "logprobs": list(lps), "finished": finished}


def group(**over):
    body = {
        "job_id": 3,
        "version": 2,
        "prompt_ids": PROMPT,
        "completions": [completion(), completion()],
        "rewards": [1.0, 0.0],
    }
    return body | over


def test_a_good_group_round_trips_through_json():
    g = ScoredGroup.model_validate(group())
    assert ScoredGroup.model_validate_json(g.model_dump_json()) == g
    assert g.tokens == 6
    assert g.rewards == [1.0, 0.0]
    assert g.completions[0].mask == [1, 1, 1]  # single turn: every token is the model's
    g.check_against(JOB, vocab_size=258, latest_version=2)


@pytest.mark.parametrize(
    "body,reason",
    [
        (group(completions=[completion(lps=(-0.5, math.nan, -1.0))], rewards=[0.0]), "finite"),
        (group(completions=[completion(lps=(-0.5, math.inf, -1.0))], rewards=[0.0]), "finite"),
        (group(completions=[completion(lps=(-0.5, 0.3, -1.0))], rewards=[0.0]), "<= 0"),
        (group(completions=[completion(ids=(5, 6))], rewards=[0.0]), "2 token ids but 3 log-probs"),
        (
            group(completions=[completion(ids=(5, -6, 1))], rewards=[0.0]),
            "greater than or equal to 0",
        ),
        (group(completions=[completion(ids=(5, 2**63, 1))], rewards=[0.0]), "less than or equal"),
        (group(completions=[completion(ids=(), lps=())], rewards=[0.0]), "at least 1"),
        (group(completions=[]), "at least 1"),
        (group(prompt_ids=[]), "at least 1"),
        (group(prompt_ids=[5, -1]), "greater than or equal to 0"),
        (group(version=-1), "greater than or equal to 0"),
        (group(job_id="three"), "valid integer"),
        (group(rewards=[1.0]), "1 rewards for 2 completions"),
        (group(rewards=[1.0, math.nan]), "finite"),
        (group(rewards=[1.0, math.inf]), "finite"),
        (group(extra="x"), "Extra inputs"),
        (group(completions=[completion()] * 1025, rewards=[0.0] * 1025), "at most 1024"),
    ],
)
def test_malformed_groups_are_refused_with_a_reason(body, reason):
    with pytest.raises(ValidationError, match=reason):
        ScoredGroup.model_validate(body)


def test_rewards_are_required():
    body = group()
    del body["rewards"]
    with pytest.raises(ValidationError, match="rewards"):
        ScoredGroup.model_validate(body)


@pytest.mark.parametrize(
    "job,vocab_size,latest,error,reason",
    [
        (JOB, 6, 2, Unprocessable, "token id 6 is outside the vocabulary"),
        (JobState(group_size=4, prompt_ids=PROMPT), 258, 2, ProtocolError, "G = 4, got 2"),
        (JOB, 258, 1, ProtocolError, "newer than the latest published"),
        (JobState(group_size=2, prompt_ids=[40, 41]), 258, 2, ProtocolError, "not the job's"),
    ],
)
def test_state_dependent_rules(job, vocab_size, latest, error, reason):
    g = ScoredGroup.model_validate(group())
    with pytest.raises(error, match=reason) as caught:
        g.check_against(job, vocab_size=vocab_size, latest_version=latest)
    assert type(caught.value) is error


def test_check_against_refuses_prompt_ids_that_are_not_the_jobs():
    """A sampler generates from the ids the lease carried; anything else is a state conflict
    (409, the ProtocolError itself), however close it is to the job's prompt."""
    for other in ([40, 41, 43], [40, 41], [40, 41, 42, 42], [42, 41, 40]):
        g = ScoredGroup.model_validate(group(prompt_ids=other))
        with pytest.raises(ProtocolError, match="prompt_ids are not the job's prompt") as caught:
            g.check_against(JOB, vocab_size=258, latest_version=2)
        assert type(caught.value) is ProtocolError and caught.value.status == 409
    ScoredGroup.model_validate(group(prompt_ids=list(PROMPT))).check_against(
        JOB, vocab_size=258, latest_version=2
    )


def test_check_against_refuses_a_token_outside_the_vocabulary_as_unprocessable():
    g = ScoredGroup.model_validate(group(completions=[completion(), completion(ids=(5, 258, 1))]))
    with pytest.raises(Unprocessable, match=r"completions\[1\]: token id 258 .*size 258") as caught:
        g.check_against(JOB, vocab_size=258, latest_version=2)
    assert caught.value.status == 422 and isinstance(caught.value, ProtocolError)
    g.check_against(JOB, vocab_size=259, latest_version=2)  # 258 is in a vocabulary of 259


def test_the_error_tree_maps_to_http_statuses():
    statuses = {
        ProtocolError: 409,
        BadRequest: 400,
        NotFound: 404,
        Unprocessable: 422,
        TooLarge: 413,
        Unauthorized: 401,
        Forbidden: 403,
    }
    for error, status in statuses.items():
        assert issubclass(error, ProtocolError) and issubclass(error, ValueError)
        assert error.status == status


def sampler_info(**over):
    return {"name": "s1", "tokenizer": FINGERPRINT, "task": "add"} | over


@pytest.mark.parametrize("name", ["../etc", "a/b", ".hidden", "", "x" * 65, "sp ace"])
def test_names_that_could_escape_a_path_are_refused(name):
    SamplerInfo(**sampler_info())
    with pytest.raises(ValidationError):
        SamplerInfo(**sampler_info(name=name))


@pytest.mark.parametrize(
    "over",
    [
        {"tokenizer": None},
        {"tokenizer": "abc"},
        {"tokenizer": FINGERPRINT.upper()},
        {"tokenizer": FINGERPRINT + "0"},
        {"task": None},
        {"task": ""},
    ],
)
def test_samplers_must_name_their_tokenizer_fingerprint_and_task(over):
    body = {k: v for k, v in (sampler_info() | over).items() if v is not None}
    with pytest.raises(ValidationError):
        SamplerInfo(**body)


def test_weight_versions_need_a_real_sha256():
    WeightVersion(version=0, sha256="a" * 64, size_bytes=10)
    with pytest.raises(ValidationError):
        WeightVersion(version=0, sha256="A" * 64, size_bytes=10)
    with pytest.raises(ValidationError):
        Completion(token_ids=[1], logprobs=[-0.1], finished=True, extra=1)
