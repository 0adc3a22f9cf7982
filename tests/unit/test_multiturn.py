"""Multi-turn episodes: environment tokens carry no loss, per-turn versions are kept, and the
broker's replay agrees with an honest sampler, ignores a dishonest one's claims and refuses
a transcript whose observations are not the environment's."""

import time

import pytest
import torch
from fastapi.testclient import TestClient

from echorl.broker.app import create_app
from echorl.config import RunConfig, SamplingConfig
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion, JobState, ProtocolError, ScoredGroup
from echorl.rollout.generate import rollout
from echorl.rollout.hf import HFBackend
from echorl.rollout.scoring import score_group
from echorl.tasks import get_task
from echorl.trainer.sft import demonstration_batches
from echorl.trainer.update import groups_to_batch

ENV = get_task("sokoban")
PARAMS = SamplingConfig(temperature=1.0)
CODEC = RunTokenizer.builtin()
encode, decode = CODEC.encode, CODEC.decode


@pytest.fixture(scope="module")
def episodes(tiny_saved):
    from echorl.models import load_policy

    model, tok = load_policy(tiny_saved)
    problems = [ENV.problem(s) for s in (1, 2)]
    backend = HFBackend(model, tok)
    ids = backend.codec.encode_prompts([p.prompt for p in problems], PARAMS)
    groups = rollout(backend, ENV, problems, ids, 4, PARAMS, seed=0, version=3)
    return groups, tok, backend, problems


def test_episodes_interleave_turns_and_observations(episodes):
    groups, _, backend, problems = episodes
    assert [len(g.completions) for g in groups] == [4, 4]
    for g, p in zip(groups, problems):
        assert g.version == 3 and g.prompt_ids == backend.codec.encode(p.prompt)
        for c in g.completions:
            assert c.turns and c.turns[0].start == 0 and {t.version for t in c.turns} == {3}
            assert 1 <= len(c.turns) <= ENV.max_turns
            mask = c.mask
            for n, t in enumerate(c.turns[:-1]):
                after = c.token_ids[t.end : c.turns[n + 1].start]
                assert decode(after).endswith("\n>") and "#" in decode(after)  # a board
                assert all(lp == 0.0 for lp in c.logprobs[t.end : c.turns[n + 1].start])
            assert (
                sum(mask) == sum(t.end - t.start for t in c.turns) < len(c.token_ids)
                or len(c.turns) == 1
            )


def test_environment_tokens_carry_zero_loss_weight(episodes):
    groups, tok, _, _ = episodes
    # Every group informative (copies: the fixture's groups keep their rewards).
    groups = [g.model_copy(update={"rewards": [float(i) for i in range(4)]}) for g in groups]
    batch = groups_to_batch(groups, tok.pad_token_id, RunConfig())
    row = 0
    for g in groups:
        prompt = len(g.prompt_ids)
        for c in g.completions:
            assert batch.input_ids[row, :prompt].tolist() == g.prompt_ids
            cols = batch.loss_mask[row, prompt - 1 : prompt - 1 + len(c.token_ids)]
            assert cols.tolist() == [float(m) for m in c.mask]
            assert batch.loss_mask[row].sum().item() == sum(c.mask)
            # Behaviour log-probs are zero on environment tokens.
            env = torch.tensor(c.mask) == 0
            assert torch.all(
                batch.behaviour_logp[row, prompt - 1 : prompt - 1 + len(c.token_ids)][env] == 0
            )
            row += 1


def test_replay_agrees_with_an_honest_sampler_and_refuses_forged_observations(episodes):
    groups, _, _, problems = episodes
    for g, p in zip(groups, problems):
        assert score_group(ENV, p, g.completions, CODEC) == pytest.approx(g.rewards)
    c = groups[0].completions
    multi = next((x for x in c if len(x.turns) > 1), None)
    if multi is None:
        pytest.skip("every episode ended after one turn")
    ids = list(multi.token_ids)
    ids[multi.turns[0].end] = (
        encode("#")[0] if ids[multi.turns[0].end] != encode("#")[0] else encode(" ")[0]
    )
    forged = Completion.model_validate(multi.model_dump() | {"token_ids": ids})
    with pytest.raises(ProtocolError, match="not the environment's observation"):
        score_group(ENV, problems[0], [forged], CODEC)
    single = Completion(token_ids=multi.token_ids, logprobs=multi.logprobs, finished=False)
    with pytest.raises(ProtocolError, match="multi-turn; the turns are missing"):
        score_group(ENV, problems[0], [single], CODEC)


def test_an_episode_cut_for_context_room_ends_on_a_model_turn_and_replays(tiny_saved):
    """When the observation and another turn would not fit the model, the episode ends after
    the model's turn (no dangling observation), so the broker's replay accepts it."""
    from echorl.models import load_policy

    model, tok = load_policy(tiny_saved)
    backend = HFBackend(model, tok)
    problems = [ENV.problem(s) for s in (1, 2)]
    ids = backend.codec.encode_prompts([p.prompt for p in problems], PARAMS)
    # Room for the prompt and about two turns with their boards, not ten.
    model.config.max_position_embeddings = max(map(len, ids)) + 2 * 40
    groups = rollout(backend, ENV, problems, ids, 4, PARAMS, seed=0)
    cut = 0
    for g, p in zip(groups, problems):
        for c in g.completions:
            assert c.turns[-1].end == len(c.token_ids)  # ends on the model's turn
            assert len(g.prompt_ids) + len(c.token_ids) <= model.config.max_position_embeddings
            cut += len(c.turns) < ENV.max_turns and not c.finished
        assert score_group(ENV, p, g.completions, CODEC) == pytest.approx(g.rewards)
    assert cut > 0


def test_per_turn_versions_make_the_group_as_stale_as_its_oldest_turn():
    ids = encode("right\n") + encode("#####\n>") + encode("left\n")
    turns = [{"start": 0, "end": 6, "version": 2}, {"start": 13, "end": 18, "version": 3}]
    c = {"token_ids": ids, "logprobs": [-0.1] * len(ids), "finished": False, "turns": turns}
    prompt = encode("#####\n>")
    group = {"job_id": 0, "prompt_ids": prompt, "completions": [c], "rewards": [0.0]}
    assert ScoredGroup.model_validate(group | {"version": 2}).completions[0].mask == (
        [1] * 6 + [0] * 7 + [1] * 5
    )
    with pytest.raises(ValueError, match="oldest turn was generated by 2"):
        ScoredGroup.model_validate(group | {"version": 3})
    job = JobState(group_size=1, prompt_ids=prompt)
    with pytest.raises(ProtocolError, match="version 3 is newer"):
        ScoredGroup.model_validate(group | {"version": 2}).check_against(job, 300, latest_version=2)
    ScoredGroup.model_validate(group | {"version": 2}).check_against(job, 300, latest_version=3)
    bad = c | {"turns": [{"start": 1, "end": 6, "version": 2}]}
    with pytest.raises(ValueError, match="starts with a model turn at token 0"):
        ScoredGroup.model_validate(group | {"version": 2, "completions": [bad]})


def test_the_broker_scores_by_replay_over_http(tmp_path, episodes):
    import hashlib

    _, _, backend, _ = episodes
    cfg = RunConfig.model_validate(
        {
            "task": {"name": "sokoban"},
            "train": {"group_size": 4, "batch_prompts": 4},
            "broker": {
                "data_dir": str(tmp_path),
                "insecure_no_auth": True,
                "first_lease": 1000,  # as a proven sampler: probation is test_hostile.py's
            },
        }
    )
    app = create_app(cfg)
    fingerprint = RunTokenizer.builtin().fingerprint
    assert app.state.broker.codec.fingerprint == fingerprint == backend.codec.fingerprint
    with TestClient(app) as api:
        body = b"weights"
        api.put(
            "/v1/weights/0", content=body, headers={"X-Sha256": hashlib.sha256(body).hexdigest()}
        )
        me = {"name": "s", "tokenizer": fingerprint, "task": ENV.name}
        other_tok = api.post("/v1/samplers", json=me | {"tokenizer": "0" * 64})
        assert other_tok.status_code == 409 and "not the run's" in other_tok.json()["detail"]
        other_task = api.post("/v1/samplers", json=me | {"task": "add"})
        assert other_task.status_code == 409 and "'add'" in other_task.json()["detail"]
        sid = api.post("/v1/samplers", json=me).json()["sampler_id"]
        jobs = api.post("/v1/jobs/lease", json={"sampler_id": sid, "n": 2}).json()["jobs"]
        played = [
            rollout(
                backend,
                ENV,
                [ENV.problem(j["seed"])],
                [j["prompt_ids"]],
                4,
                PARAMS,
                seed=1,
                version=0,
                job_ids=[j["job_id"]],
            )[0]
            for j in jobs
        ]
        honest = played[0].model_dump()
        honest["rewards"] = [9.0] * 4  # a dishonest claim changes nothing
        reply = api.post("/v1/rollouts", json={"sampler_id": sid, "group": honest})
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"stored": True}  # stored; scored by replay off the request
        pull = {"n": 4, "step": 0, "wait_s": 10}
        (scored,) = api.post("/v1/batches/pull", json=pull).json()["groups"]
        assert scored["rewards"] == pytest.approx(played[0].rewards)  # the sampler's own
        # A transcript of another game (observations the environment never showed) is refused
        # by the verifier, even with the other job's prompt ids: deleted, its job queued again.
        other = played[0].model_dump() | {
            "job_id": jobs[1]["job_id"],
            "prompt_ids": jobs[1]["prompt_ids"],
        }
        if jobs[0]["prompt"] != jobs[1]["prompt"] and any(
            len(c["turns"]) > 1 for c in other["completions"]
        ):
            reply = api.post("/v1/rollouts", json={"sampler_id": sid, "group": other})
            assert reply.status_code == 200
            for _ in range(100):  # the verdict is counted, then the job queued again
                status = api.get("/v1/status").json()
                if status["verifier"].get("refused") and status["jobs"].get("queued"):
                    break
                time.sleep(0.1)
            assert status["verifier"]["refused"] == 1
            assert status["jobs"].get("queued") == 1, status["jobs"]
        assert api.get("/v1/status").json()["rollouts"] == {"pulled": 1}


def test_warm_up_trains_on_the_demonstrated_actions_only(episodes):
    from echorl.config import SFTConfig

    _, tok, _, _ = episodes
    batch = next(demonstration_batches(ENV, tok, SFTConfig(batch_size=4)))
    for row in range(4):
        targets = batch.input_ids[row, 1:][batch.loss_mask[row].bool()]
        text = decode(targets.tolist())
        # Only action words and their newlines are trained on, never a board.
        assert "#" not in text and set(text.split()) <= {"up", "down", "left", "right"}
        assert text.endswith("\n")
