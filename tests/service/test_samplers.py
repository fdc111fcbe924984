"""Sampler plug-ins against the real service: policy statistics, the five built-in samplers, composition, a user
sampler by dotted path."""

import statistics

import httpx
import pytest

from rollout_farm.services import protocol as P
from tests.conftest import TOKEN
from tests.metrics_text import by_label
from tests.service import helpers

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def report(service, **stats):
    r = httpx.post(f"{service}/v1/policy_stats", json=stats, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def rollout(service, sampler_params, n=16):
    body = {
        "prompts": [{"text": "hello"}, {"text": "Q: 3+4\nA:"}],
        "n": n,
        "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "seed": 1},  # seeded: the same samples each run
        "sampler": {"name": "kl_adaptive_temperature", "params": sampler_params},
    }
    r = httpx.post(f"{service}/v1/rollouts", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [s for g in r.json()["groups"] for s in g["samples"]]


def post(service, body, status=200):
    r = httpx.post(f"{service}/v1/rollouts", json=body, timeout=180)
    assert r.status_code == status, r.text
    return r.json()


def test_the_temperature_follows_the_reported_kl(service):
    """Seeded (rollout()'s sampling_params.seed): the distinct-sample and mean-logprob checks see the same samples on
    every run."""
    cool = {
        "base_temperature": 2.0,
        "low_temperature": 0.0,
        "kl_threshold": 0.02,
    }  # 0: greedy, so its effect is plain to see
    report(service, kl=0.001, step=1)
    hot = rollout(service, cool)
    assert {s["sampler_meta"]["temperature"] for s in hot} == {2.0} and hot[0]["sampler_meta"]["kl"] == 0.001
    report(service, kl=0.05, step=2)
    cold = rollout(service, cool)
    assert {s["sampler_meta"]["temperature"] for s in cold} == {0.0}
    # each sample records the params it was drawn with (the sampler's, not the request's temperature 1, top_p 1),
    # and its logprobs under that distribution, except when greedy
    assert all(s["sampled_with"] == {"temperature": 2.0, "top_p": 0.9, "top_k": -1, "regex": False} for s in hot)
    assert all(s["sampled_with"] == {"temperature": 0.0, "top_p": 0.9, "top_k": -1, "regex": False} for s in cold)
    assert all(s["sampling_logprobs"] is None for s in cold)
    assert all(
        len(s["sampling_logprobs"]) == len(s["logprobs"]) and s["sampling_logprobs"] != s["logprobs"] for s in hot
    )

    # the engines really sampled that way: greedy repeats one sample per prompt, T=2 almost never does,
    # and greedy picks the most likely tokens (higher raw-model logprobs)
    def distinct(samples):
        return len({tuple(s["token_ids"]) for s in samples})

    assert distinct(cold) == 2 and distinct(hot) >= 30

    def mean(samples):
        return statistics.fmean(lp for s in samples for lp in s["logprobs"])

    assert mean(cold) > mean(hot)
    text = httpx.get(f"{service}/metrics").text
    assert 'farm_sampler_temperature{sampler="kl_adaptive_temperature"} 0.0' in text and "farm_policy_kl 0.05" in text
    assert "farm_policy_step 2.0" in text
    assert report(service, reward_var=0.25) == {
        "kl": 0.05,
        "reward_var": 0.25,
        "step": 2,
    }  # fields left out keep their value


def test_the_client_reports_policy_stats(client):
    assert client.report_policy_stats(P.PolicyStats(step=7)).step == 7


def test_policy_stats_need_the_token_and_valid_fields(service):
    assert httpx.post(f"{service}/v1/policy_stats", json={"kl": 0.1}).status_code == 401
    bad = httpx.post(f"{service}/v1/policy_stats", json={"kl": -1}, headers=AUTH)
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "kl"
    assert httpx.post(f"{service}/v1/policy_stats", json={"kll": 1}, headers=AUTH).json()["detail"][0]["field"] == "kll"
    assert set(httpx.get(f"{service}/v1/policy_stats").json()) == {"kl", "reward_var", "step"}


def test_invalid_sampler_params_get_422_naming_the_field(service):
    body = {
        "prompts": [{"text": "hi"}],
        "sampler": {"name": "kl_adaptive_temperature", "params": {"base_temperature": 0.3, "low_temperature": 0.9}},
    }
    r = httpx.post(f"{service}/v1/rollouts", json=body)
    assert (
        r.status_code == 422
        and r.json()["detail"][0]["field"].startswith("sampler.params")
        and "low_temperature" in r.json()["detail"][0]["message"]
    )
    body["sampler"]["params"] = {"schedule": "cosine"}
    assert httpx.post(f"{service}/v1/rollouts", json=body).json()["detail"][0]["field"] == "sampler.params.schedule"
    assert "kl_adaptive_temperature" in httpx.get(f"{service}/v1/samplers").json()


def test_importance_resampling_generates_m_candidates_and_returns_n(service):
    body = {
        "prompts": [{"text": "hi"}, {"text": "ho"}],
        "n": 3,
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "seed": 5},
        "sampler": {"name": "importance_resampling", "params": {"candidates": 8, "beta": 2.0}},
    }
    before = sum(s["generated_tokens"] for s in httpx.get(f"{service}/readyz").json()["replicas"])
    r = httpx.post(f"{service}/v1/rollouts", json=body, timeout=120)
    assert r.status_code == 200, r.text
    after = sum(s["generated_tokens"] for s in httpx.get(f"{service}/readyz").json()["replicas"])
    assert after - before == 2 * 8 * 8  # 8 candidates of 8 tokens per prompt were generated
    for g in r.json()["groups"]:
        assert len(g["samples"]) == 3 and g["generated_tokens"] == 8 * 8 and g["candidates"] == 8
        # no reward: every candidate weighs the same, so the kept ones share one importance weight, (n/m) tau >= n/m
        weights = {s["sampler_meta"].pop("importance_weight") for s in g["samples"]}
        assert len(weights) == 1 and min(weights) >= 3 / 8
        for s in g["samples"]:
            assert s["sampler_meta"] == {"sampler": "importance_resampling", "candidates": 8, "ess": 8.0}


def test_policy_ratio_candidates_carry_their_log_ratio(service):
    body = {
        "prompts": [{"text": "hi"}],
        "n": 4,
        "sampling_params": {"max_new_tokens": 8, "seed": 3},
        "sampler": {"name": "importance_resampling", "params": {"candidates": 8, "target": "policy_ratio"}},
    }
    same = post(service, body)["groups"][0]["samples"]  # temperature 1, no top-p: q is p, every target weight is 1
    weights = [s["sampler_meta"]["importance_weight"] for s in same]
    assert all(abs(s["sampler_meta"]["log_ratio"]) < 1e-4 for s in same)
    assert max(weights) == pytest.approx(min(weights), rel=1e-3)
    body["sampling_params"]["temperature"] = 0.5
    sharp = post(service, body)["groups"][0]["samples"]
    assert (
        all(abs(s["sampler_meta"]["log_ratio"]) > 1e-3 for s in sharp)
        and len({round(s["sampler_meta"]["ess"], 6) for s in sharp}) == 1
    )
    for s in sharp:  # the log ratio is log p/q of the sample's own two kinds of logprobs
        assert s["sampled_with"] == {"temperature": 0.5, "top_p": 1.0, "top_k": -1, "regex": False}
        log_ratio = sum(s["logprobs"]) - sum(s["sampling_logprobs"])
        assert s["sampler_meta"]["log_ratio"] == pytest.approx(log_ratio, abs=1e-4)


def test_pattern_filter_returns_only_matches_and_counts_rejections(service):
    pattern = r"(?s)[^0-9]*"  # no digit anywhere: a random tiny model passes now and then
    body = {
        "prompts": [{"text": "hi"}, {"text": "ho"}],
        "n": 3,
        "sampling_params": {"max_new_tokens": 6, "seed": 1},
        "sampler": {"name": "pattern_conditional", "params": {"pattern": pattern, "max_candidates": 24}},
    }
    before = httpx.get(f"{service}/metrics").text
    groups = post(service, body)["groups"]
    import regex

    for g in groups:
        assert all(regex.fullmatch(pattern, s["text"]) for s in g["samples"]) and len(g["samples"]) <= 3
        assert (
            g["rejected"] == g["candidates"] - len(g["samples"])
            if len(g["samples"]) < 3
            else g["rejected"] <= g["candidates"] - 3
        )
        assert g["candidates"] % 3 == 0 and (
            len(g["samples"]) == 3 or g["candidates"] == 24
        )  # rounds of n until n match or the cap
    assert sum(g["rejected"] for g in groups) > 0

    def rejected(text):
        return by_label(text, "farm_sampler_rejected_total", "sampler").get("pattern_conditional", 0.0)

    assert rejected(httpx.get(f"{service}/metrics").text) - rejected(before) == sum(g["rejected"] for g in groups)


def test_constrained_pattern_masks_tokens_so_far_fewer_are_rejected(service):
    import regex

    pattern = r"[a-z ]{0,12}#### [0-9]{1,3}"
    body = {
        "prompts": [{"text": "hi"}, {"text": "ho"}],
        "n": 4,
        "sampling_params": {"max_new_tokens": 24, "seed": 2},
        "sampler": {
            "name": "pattern_conditional",
            "params": {"pattern": pattern, "mode": "constrained", "max_candidates": 8},
        },
    }
    constrained = post(service, body)["groups"]
    body["sampler"]["params"]["mode"] = "filter"
    filtered = post(service, body)["groups"]
    samples = [s for g in constrained for s in g["samples"]]
    assert len(samples) >= 6 and all(regex.fullmatch(pattern, s["text"]) for s in samples)
    assert sum(g["rejected"] for g in constrained) < sum(g["rejected"] for g in filtered)
    assert sum(len(g["samples"]) for g in filtered) < len(samples)  # a random model almost never writes that by itself


def test_an_invalid_pattern_is_a_422(service):
    body = {"prompts": [{"text": "hi"}], "sampler": {"name": "pattern_conditional", "params": {"pattern": "(unclosed"}}}
    detail = post(service, body, 422)["detail"][0]
    assert detail["field"] == "sampler.params.pattern" and "not a valid regular expression" in detail["message"]
    body = {"prompts": [{"text": "hi"}], "sampling_params": {"regex": "[z-a]"}}
    assert post(service, body, 422)["detail"][0]["field"] == "sampling_params.regex"


def tie_and_spread(k):
    """k prompts whose groups are zero-variance on float rewards (0.1 + 0.2 vs 0.3), interleaved with k informative
    ones."""
    return [{"text": f"p{i}", "ground_truth": "tie" if i % 2 == 0 else None} for i in range(2 * k)]


def group_filter_body(k: int, n: int, max_new_tokens: int, seed: int, **params) -> dict:
    """A rollout of tie_and_spread(k), n samples a prompt on float rewards, through dynamic_group_filter (`params`:
    the sampler's)."""
    return {
        "prompts": tie_and_spread(k),
        "n": n,
        "reward": "test_float_ties",
        "sampling_params": {"max_new_tokens": max_new_tokens, "seed": seed},
        "sampler": {"name": "dynamic_group_filter", **({"params": params} if params else {})},
    }


def test_group_filter_drops_zero_variance_groups_by_std_not_by_exact_floats(service):
    body = group_filter_body(5, n=4, max_new_tokens=8, seed=4)
    plain = post(service, {**body, "sampler": {"name": "plain"}})["groups"]
    assert any(
        len({s["reward"] for s in g["samples"]}) > 1 for g in plain[::2]
    )  # unequal floats that are equal rewards
    out = post(service, body)
    kept, report = out["groups"], out["filter"]
    assert [g["prompt_index"] for g in kept] == [1, 3, 5, 7, 9]
    assert all(g["reward_std"] > 1e-6 for g in kept)
    assert (
        report["zero_variance_groups"] == 5
        and report["generated_groups"] == 10
        and report["zero_variance_fraction"] == 0.5
    )
    assert (
        report["kept_tokens"]
        == sum(len(s["token_ids"]) for g in kept for s in g["samples"])
        < report["generated_tokens"]
    )
    assert report["waste_fraction"] == pytest.approx(1 - report["kept_tokens"] / report["generated_tokens"])


def settled(service) -> bool:
    """No replica generating, running or holding a rollout."""
    return not any(s["busy"] or s["rollouts_running"] or s["rollouts_waiting"] for s in helpers.replicas(service))


def test_group_filter_stops_at_the_target_and_its_abort_frees_engine_work(service):
    """Over-sample 40 prompts for 2 informative groups: once 2 are kept, the running calls are cancelled and the rest
    never start. Nothing left to chance: the cancelled calls are waited for (every replica idle), not only slept on."""
    import time

    prompts, n, t = 40, 4, 48
    body = {
        "prompts": [{"text": f"q{i}"} for i in range(prompts)],
        "n": n,
        "reward": "test_float_ties",
        "sampling_params": {"max_new_tokens": t, "ignore_eos": True, "seed": 6},
        "sampler": {"name": "dynamic_group_filter", "params": {"target_groups": 2, "prompts_per_call": 1}},
    }

    def tokens():
        return sum(s["generated_tokens"] for s in httpx.get(f"{service}/readyz").json()["replicas"])

    before = tokens()
    out = post(service, body)
    time.sleep(1.0)  # a cancelled engine call still on its way to a replica arrives (and stops at its first token)
    helpers.wait_until(lambda: settled(service), "the cancelled calls stopped")  # at their next token
    spent = tokens() - before
    report = out["filter"]
    assert len(out["groups"]) == 2 and report["kept_groups"] == 2 and report["target_reached"]
    assert report["generated_groups"] + report["cancelled_groups"] < prompts
    without_abort = prompts * n * t  # every prompt generated to the end: ignore_eos makes each sample exactly t tokens
    assert spent <= (report["generated_groups"] + report["cancelled_groups"]) * n * t and spent < without_abort / 4
    time.sleep(0.5)
    assert tokens() - before == spent and not any(s["busy"] for s in httpx.get(f"{service}/readyz").json()["replicas"])
    assert 'farm_filter_groups_total{outcome="kept"}' in httpx.get(f"{service}/metrics").text


def test_group_filter_params_are_checked_against_the_request(service):
    body = {
        "prompts": [{"text": "a"}, {"text": "b"}],
        "sampler": {"name": "dynamic_group_filter", "params": {"target_groups": 3}},
    }
    detail = post(service, body, 422)["detail"][0]
    assert detail["field"] == "sampler.params.target_groups" and "send more prompts" in detail["message"]
    body["sampler"]["params"] = {"inner": {"name": "pattern_conditional", "params": {"mode": "fast"}}}
    assert post(service, body, 422)["detail"][0]["field"] == "sampler.params.inner.params.mode"
    body["sampler"]["params"] = {"inner": {"name": "dynamic_group_filter"}}
    assert post(service, body, 422)["detail"][0]["field"] == "sampler.params.inner"


def test_pattern_filter_inside_the_group_filter(service):
    """Composition: each group is drawn by pattern_conditional, then the group filter drops zero-variance ones."""
    import regex

    inner = {"name": "pattern_conditional", "params": {"pattern": r"(?s)[^0-9]*", "max_candidates": 16}}
    body = group_filter_body(3, n=2, max_new_tokens=6, seed=8, inner=inner)
    out = post(service, body)
    for g in out["groups"]:
        assert g["reward_std"] > 1e-6 and g["prompt_index"] % 2 == 1
        assert all(regex.fullmatch(r"(?s)[^0-9]*", s["text"]) for s in g["samples"])
        assert g["samples"][0]["sampler_meta"] == {
            "sampler": "pattern_conditional",
            "mode": "filter",
            "filter": "dynamic_group_filter",
        }
    assert out["filter"]["zero_variance_groups"] >= 3


def test_a_user_sampler_by_dotted_path_works_end_to_end(service, client):
    body = {
        "prompts": [{"text": "hi"}],
        "n": 3,
        "sampling_params": {"max_new_tokens": 12, "seed": 9},
        "sampler": {"name": "tests.farm_plugins:LongestOfTwo"},
    }
    group = post(service, body)["groups"][0]
    assert group["candidates"] == 6 and len(group["samples"]) == 3
    assert all(s["sampler_meta"]["picked_by"] == "LongestOfTwo" for s in group["samples"])
    req = P.RolloutRequest.model_validate(body)
    assert len(client.rollouts(req).groups[0].samples) == 3  # and through the client
    for name in (
        "os.path:join",
        "tests.farm_plugins:float_ties",
        "tests.conftest:TOKEN",
    ):  # not listed in FARM_PLUGINS, or not a Sampler
        detail = post(service, {**body, "sampler": {"name": name}}, 422)["detail"][0]
        assert detail["field"] == "sampler.name" and (
            "FARM_PLUGINS" in detail["message"] or "not a Sampler subclass" in detail["message"]
        )


def test_a_queue_source_with_the_group_filter_delivers_only_informative_groups(service):
    import time

    auth = {"Authorization": f"Bearer {TOKEN}"}
    spec = {
        "name": "filtered",
        "prompts": tie_and_spread(3),
        "n": 4,
        "reward": "test_float_ties",
        "target_groups": 8,
        "sampling_params": {"max_new_tokens": 8},
        "sampler": {"name": "dynamic_group_filter"},
    }
    bad = httpx.post(
        f"{service}/v1/queue/sources",
        json={**spec, "sampler": {"name": "dynamic_group_filter", "params": {"target_groups": 2}}},
        headers=auth,
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "sampler.params.target_groups"
    assert httpx.post(f"{service}/v1/queue/sources", json=spec, headers=auth).status_code == 200
    try:
        deadline = time.monotonic() + 60
        while (state := next(s for s in httpx.get(f"{service}/v1/queue/sources").json() if s["name"] == "filtered"))[
            "pending_prompts"
        ] or state["generating"]:
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        items = httpx.post(
            f"{service}/v1/queue/pull", json={"source": "filtered", "max_groups": 8}, headers=auth
        ).json()["items"]
        assert sorted(i["prompt"]["text"] for i in items) == ["p1", "p3", "p5"]  # the tied prompts' groups were dropped
        assert all(i["group"]["reward_std"] > 1e-6 for i in items)
    finally:
        httpx.delete(f"{service}/v1/queue/sources/filtered", headers=auth)


def test_the_client_returns_the_filter_report(client):
    req = P.RolloutRequest(
        prompts=[P.Prompt(**p) for p in tie_and_spread(2)],
        n=4,
        reward="test_float_ties",
        sampling_params=P.SamplingParams(max_new_tokens=8, seed=11),
        sampler=P.SamplerSpec(name="dynamic_group_filter"),
    )
    out = client.rollouts(req)
    assert (
        [g.prompt_index for g in out.groups] == [1, 3]
        and out.filter.zero_variance_groups == 2
        and out.filter.target_reached is False
    )


def test_samplers_are_listed_and_unknown_names_or_params_get_422(service):
    listed = httpx.get(f"{service}/v1/samplers").json()
    assert "plain" in listed and listed["plain"]
    r = helpers.rollout(service, {**helpers.greedy([[40]]), "sampler": {"name": "nope"}})
    assert r.status_code == 422
    [d] = r.json()["detail"]
    assert d["field"] == "sampler.name" and "plain" in d["message"]
    r = helpers.rollout(service, {**helpers.greedy([[40]]), "sampler": {"name": "plain", "params": {"x": 1}}})
    assert r.status_code == 422 and [d["field"] for d in r.json()["detail"]] == ["sampler.params.x"]
    assert (
        helpers.rollout(
            service, {**helpers.greedy([[40]], max_new_tokens=2), "sampler": {"name": "plain", "params": {}}}
        ).status_code
        == 200
    )
