"""The bench engine (no model, a fixed latency per decode step) batches concurrent calls: every call waiting when a
step begins gets a token from it, so K calls of m tokens take about m steps, not K x m (read from its counters)."""

import threading
import time

import pytest

from rollout_farm.services.engine.bench_engine import BenchEngine
from rollout_farm.services.protocol import SamplingParams


def test_concurrent_calls_share_the_bench_engines_steps():
    engine = BenchEngine(token_latency_s=0.002)
    K, m, out = 8, 20, []
    engine.pause()
    threads = [
        threading.Thread(
            target=lambda i=i: out.append(engine.generate([[1, 2]] * (1 + i % 2), SamplingParams(max_new_tokens=m)))
        )
        for i in range(K)
    ]
    for t in threads:
        t.start()
    engine.resume()
    for t in threads:
        t.join(60)
    assert sorted(len(o.token_ids) for call in out for o in call) == [m] * (K + K // 2)
    stats = engine.stats.snapshot()
    assert stats["batch_calls"]["max"] == K and stats["batch_rows"]["max"] == K + K // 2
    assert stats["decode_steps"] < 2 * m  # shared: K calls alone would take K x m steps
    assert engine.generated_tokens == (K + K // 2) * m and not engine.busy


def test_a_cancelled_call_leaves_and_the_others_go_on():
    engine = BenchEngine(token_latency_s=0.002)
    cancel, out = threading.Event(), {}
    long = SamplingParams(max_new_tokens=400)
    a = threading.Thread(target=lambda: out.setdefault("a", engine.generate([[1]], long, cancel)))
    b = threading.Thread(target=lambda: out.setdefault("b", engine.generate([[1]], SamplingParams(max_new_tokens=50))))
    a.start(), b.start()
    b.join(60)
    cancel.set()
    a.join(60)
    assert out["b"][0].finish_reason == "length" and len(out["b"][0].token_ids) == 50
    assert out["a"][0].finish_reason == "abort" and 0 < len(out["a"][0].token_ids) < 400


@pytest.mark.parametrize("policy", ["partial", "finish", "abort"])
def test_a_commit_mid_call_gives_each_token_the_version_the_policy_says(policy):
    """A call is 20 tokens in when version 1 is committed: "partial" goes on on version 1 (its tokens switch
    versions once, in order), "finish" stays on version 0 to the end, "abort" ends it (the replica reruns it). A
    call made after the commit is on version 1 throughout."""
    engine = BenchEngine(token_latency_s=0.002)
    out = {}
    long = SamplingParams(max_new_tokens=200)
    t = threading.Thread(target=lambda: out.setdefault("old", engine.generate([[1]], long)))
    t.start()
    while engine.stats.snapshot()["decode_steps"] < 20:
        time.sleep(0.001)
    engine.stage_weights({}, 1)
    engine.commit_weights(1, policy)
    after = engine.generate([[1]], SamplingParams(max_new_tokens=5))[0]
    t.join(60)
    (o,) = out["old"]
    assert after.weight_version == 1 and after.token_versions == [1] * 5
    versions = o.token_versions
    assert o.weight_version == 0 and versions[0] == 0 and len(versions) == len(o.token_ids)
    if policy == "partial":
        assert o.finish_reason == "length" and versions == sorted(versions) and set(versions) == {0, 1}
    elif policy == "finish":
        assert o.finish_reason == "length" and set(versions) == {0}
    else:
        assert o.finish_reason == "abort" and set(versions) == {0} and len(versions) < 200
