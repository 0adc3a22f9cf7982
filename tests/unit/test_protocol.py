import math

import pytest
from pydantic import ValidationError

from echorl.protocol import Completion, ProtocolError, RolloutGroup, SamplerInfo, WeightVersion


def completion(ids=(5, 6, 1), lps=(-0.5, -1.0, -0.01), finished=True):
    return {"token_ids": list(ids), "logprobs": list(lps), "finished": finished}


def group(**over):
    body = {"job_id": 3, "version": 2, "completions": [completion(), completion()]}
    return body | over


def test_a_good_group_round_trips_through_json():
    g = RolloutGroup.model_validate(group(claimed_rewards=[1.0, 0.0]))
    assert RolloutGroup.model_validate_json(g.model_dump_json()) == g
    assert g.tokens == 6
    g.check_against(vocab_size=258, group_size=2, latest_version=2)


@pytest.mark.parametrize(
    "body,reason",
    [
        (group(completions=[completion(lps=(-0.5, math.nan, -1.0))]), "finite"),
        (group(completions=[completion(lps=(-0.5, math.inf, -1.0))]), "finite"),
        (group(completions=[completion(lps=(-0.5, 0.3, -1.0))]), "<= 0"),
        (group(completions=[completion(ids=(5, 6))]), "2 token ids but 3 log-probs"),
        (group(completions=[completion(ids=(5, -6, 1))]), "greater than or equal to 0"),
        (group(completions=[completion(ids=(5, 2**63, 1))]), "less than or equal to"),
        (group(completions=[completion(ids=(), lps=())]), "at least 1"),
        (group(completions=[]), "at least 1"),
        (group(version=-1), "greater than or equal to 0"),
        (group(job_id="three"), "valid integer"),
        (group(claimed_rewards=[1.0]), "1 claimed rewards for 2 completions"),
        (group(claimed_rewards=[1.0, math.nan]), "finite"),
        (group(extra="x"), "Extra inputs"),
        (group(completions=[completion()] * 1025), "at most 1024"),
    ],
)
def test_malformed_groups_are_refused_with_a_reason(body, reason):
    with pytest.raises(ValidationError, match=reason):
        RolloutGroup.model_validate(body)


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (
            {"vocab_size": 6, "group_size": 2, "latest_version": 2},
            "token id 6 is outside the vocabulary",
        ),
        ({"vocab_size": 258, "group_size": 4, "latest_version": 2}, "leased with G = 4, got 2"),
        (
            {"vocab_size": 258, "group_size": 2, "latest_version": 1},
            "newer than the latest published",
        ),
    ],
)
def test_state_dependent_rules(kwargs, reason):
    g = RolloutGroup.model_validate(group())
    with pytest.raises(ProtocolError, match=reason):
        g.check_against(**kwargs)


@pytest.mark.parametrize("name", ["../etc", "a/b", ".hidden", "", "x" * 65, "sp ace"])
def test_names_that_could_escape_a_path_are_refused(name):
    with pytest.raises(ValidationError):
        SamplerInfo(name=name)


def test_weight_versions_need_a_real_sha256():
    WeightVersion(version=0, sha256="a" * 64, size_bytes=10)
    with pytest.raises(ValidationError):
        WeightVersion(version=0, sha256="A" * 64, size_bytes=10)
    with pytest.raises(ValidationError):
        Completion(token_ids=[1], logprobs=[-0.1], finished=True, extra=1)
