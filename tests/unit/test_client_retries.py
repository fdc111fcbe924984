"""The client's retry policy, for FarmClient and AsyncFarmClient alike, without a server.

The answers come from an httpx.MockTransport that plays a script: a 503 or 429 with Retry-After, a 502, a read
timeout, a refused connection. This is not a mock of our service (the integration tests run against the real one):
it scripts transport-level failures that the real service cannot be made to produce on demand. The client's sleep
is replaced by a list that records each wait, so the tests are instant and can check the wait the policy chose."""

import json

import httpx
import pytest

from rollout_farm.services import protocol as P
from rollout_farm.services.client import AsyncFarmClient, FarmClient, FarmError
from rollout_farm.services.client import calls as farm_client  # CHUNK_BYTES, the upload slices

VERSION = {"version": 3, "replicas": {"r0": 3}}


GROUP = {"prompt_token_ids": [1], "samples": [], "reward_mean": 0.0, "reward_std": 0.0, "zero_variance": True}


PULLED = {"lease_id": "l", "lease_expires_s": 60.0, "current_version": 3, "items": []}


def answer(status: int, retry_after: str | None = None, **kw) -> httpx.Response:
    return httpx.Response(status, headers={"Retry-After": retry_after} if retry_after else {}, **kw)


def ndjson(*lines: dict) -> httpx.Response:
    return httpx.Response(200, content="".join(json.dumps(line) + "\n" for line in lines).encode())


class Script:
    """The transport: each request gets the next answer, or the next exception is raised (a lost connection)."""

    def __init__(self, *answers):
        self.answers, self.requests = list(answers), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture(params=["sync", "async"])
def face(request) -> str:
    return request.param


def make(face: str, *answers, **kw) -> FarmClient | AsyncFarmClient:
    """A client of either face on a Script, with retries=3, backoff_s=0.5, max_backoff_s=8 unless given;
    `.script` holds what it was sent and `.waits` the sleeps the retry policy chose."""
    cls, http = (FarmClient, httpx.Client) if face == "sync" else (AsyncFarmClient, httpx.AsyncClient)
    c = cls("http://farm", **{"retries": 3, "backoff_s": 0.5, "max_backoff_s": 8.0, **kw})
    c.script, c.waits = Script(*answers), []
    c.http = http(base_url="http://farm", transport=httpx.MockTransport(c.script))
    if face == "sync":
        c._sleep = c.waits.append
    else:

        async def sleep(seconds: float) -> None:
            c.waits.append(seconds)

        c._sleep = sleep
    return c


async def call(c, method: str, *args, **kw):
    """The method's answer from either face."""
    out = getattr(c, method)(*args, **kw)
    return await out if isinstance(c, AsyncFarmClient) else out


async def stream(c, req: P.RolloutRequest) -> list[P.GroupEvent]:
    if isinstance(c, AsyncFarmClient):
        return [e async for e in c.rollouts_stream(req)]
    return list(c.rollouts_stream(req))


async def test_retry_after_is_honoured_and_capped(face):
    c = make(face, answer(503, "2"), answer(429, "7"), answer(429, "3600"), answer(200, json=VERSION))
    assert (await call(c, "weights_version")).version == 3
    assert c.waits == [2.0, 7.0, 60.0] and len(c.script.requests) == 4  # 60 = max(max_backoff_s, 60)


async def test_without_retry_after_the_backoff_is_capped_full_jitter(face):
    c = make(face, answer(502), answer(504), answer(503, "Wed, 21 Oct 2015 07:28:00 GMT"), answer(200, json=VERSION))
    assert (await call(c, "weights_version")).version == 3
    assert len(c.waits) == 3 and all(0 <= w <= limit for w, limit in zip(c.waits, [0.5, 1.0, 2.0]))
    c = make(face, *[answer(502)] * 7, answer(200, json=VERSION), retries=7, max_backoff_s=1.0)
    assert (await call(c, "weights_version")).version == 3 and max(c.waits) <= 1.0


async def test_retries_run_out_with_the_last_error(face):
    c = make(face, *[answer(503, "1", json={"error": "busy"})] * 4)
    with pytest.raises(FarmError) as e:
        await call(c, "weights_version")
    assert e.value.status == 503 and e.value.body == {"error": "busy"} and e.value.retry_after == 1.0
    assert len(c.script.requests) == 4 and c.waits == [1.0] * 3


async def test_a_4xx_raises_farm_error_at_once(face):
    body = {"error": "invalid request", "detail": [{"field": "n", "message": "Input should be greater than 0"}]}
    c = make(face, answer(422, json=body))
    with pytest.raises(FarmError) as e:
        await call(c, "weights_version")
    assert e.value.status == 422 and e.value.body == body and len(c.script.requests) == 1 and c.waits == []
    c = make(face, answer(400, content=b"not json"))
    with pytest.raises(FarmError) as e:
        await call(c, "queue_pull", P.PullRequest(source="s"))
    assert e.value.status == 400 and e.value.body == "not json" and len(c.script.requests) == 1


FAILURES = {
    "read-timeout": lambda: httpx.ReadTimeout("read timed out"),
    "500": lambda: answer(500),  # the front's, when the replica holding the request died
    "502": lambda: answer(502),
    "503": lambda: answer(503, "1"),
}


@pytest.mark.parametrize("failure", FAILURES.values(), ids=FAILURES.keys())
async def test_a_call_that_must_not_run_twice_is_not_retried_once_it_may_have_run(face, failure):
    c = make(face, failure(), answer(200, json=PULLED))
    with pytest.raises((httpx.ReadTimeout, FarmError)):
        await call(c, "queue_pull", P.PullRequest(source="s"))
    assert len(c.script.requests) == 1 and c.waits == []


async def test_the_fronts_404_before_it_has_routes_is_retried_and_the_services_404_is_not(face):
    """A proxy or HAProxy that has just started answers its own plain-text 404 until Serve tells it the routes
    (seen after HAProxy was killed and started again): the request never reached the service, so even a call that
    must not run twice is sent again. The service's own 404 (JSON) is an answer."""
    routeless = answer(404, content=b"Path '/v1/queue/pull' not found. Ping http://farm/-/routes for available routes.")
    c = make(face, routeless, answer(200, json=PULLED))
    assert (await call(c, "queue_pull", P.PullRequest(source="s"))).lease_id == "l" and len(c.script.requests) == 2
    c = make(face, answer(404, json={"error": "unknown queue source", "detail": []}), answer(200, json=PULLED))
    with pytest.raises(FarmError) as e:
        await call(c, "queue_pull", P.PullRequest(source="s"))
    assert e.value.status == 404 and len(c.script.requests) == 1


async def test_a_call_that_must_not_run_twice_is_retried_when_it_cannot_have_run(face):
    c = make(face, httpx.ConnectError("refused"), answer(429, "1"), answer(200, json=PULLED))
    assert (await call(c, "queue_pull", P.PullRequest(source="s"))).lease_id == "l"
    assert len(c.script.requests) == 3 and c.waits[1] == 1.0


async def test_a_rollout_is_retried_under_one_request_id(face):
    c = make(face, httpx.ReadTimeout("lost"), answer(502), answer(500), answer(200, json={"groups": [GROUP]}))
    req = P.RolloutRequest(prompts=[P.Prompt(text="hi")])
    assert len((await call(c, "rollouts", req)).groups) == 1
    ids = {json.loads(r.content)["request_id"] for r in c.script.requests}
    assert len(c.script.requests) == 4 and len(ids) == 1


async def test_an_upload_is_sent_whole_on_every_attempt(face, monkeypatch):
    monkeypatch.setattr(farm_client, "CHUNK_BYTES", 3)
    data = b"0123456789"
    pushed = {"version": 4, "tensors": 1, "bytes": 10, "seconds": 0.1}
    c = make(face, httpx.ReadTimeout("lost"), answer(503, "1"), answer(200, json=pushed))
    assert (await call(c, "push_weights", data, 4)).version == 4
    assert [r.content for r in c.script.requests] == [data] * 3
    assert all(r.headers["content-length"] == "10" and "transfer-encoding" not in r.headers for r in c.script.requests)


async def test_a_stream_is_retried_only_before_its_first_line(face):
    queues_full = {"done": True, "groups": 0, "error": "engine queues full", "status": 429}
    c = make(
        face, answer(503, "2"), ndjson(queues_full), ndjson({"index": 0, "group": GROUP}, {"done": True, "groups": 1})
    )
    events = await stream(c, P.RolloutRequest(prompts=[P.Prompt(text="hi")]))
    assert [e.index for e in events] == [0] and len(c.script.requests) == 3 and c.waits[0] == 2.0
    assert len({json.loads(r.content)["request_id"] for r in c.script.requests}) == 1
    c = make(face, ndjson({"index": 0, "group": GROUP}, queues_full), ndjson({"done": True, "groups": 0}))
    with pytest.raises(FarmError) as e:
        await stream(c, P.RolloutRequest(prompts=[P.Prompt(text="hi")] * 2))
    assert e.value.status == 429 and len(c.script.requests) == 1  # a group arrived: no second rollout
    c = make(face, ndjson({"index": 0, "group": GROUP}))
    with pytest.raises(FarmError) as e:
        await stream(c, P.RolloutRequest(prompts=[P.Prompt(text="hi")] * 2))
    assert "closed before its last line" in e.value.body["error"] and len(c.script.requests) == 1


async def test_a_stream_stopped_early_is_not_sent_again(face):
    c = make(face, ndjson({"index": 0, "group": GROUP}, {"index": 1, "group": GROUP}, {"done": True, "groups": 2}))
    events = c.rollouts_stream(P.RolloutRequest(prompts=[P.Prompt(text="hi")] * 2))
    if face == "sync":
        assert next(events).index == 0
        events.close()
    else:
        assert (await anext(events)).index == 0
        await events.aclose()
    assert len(c.script.requests) == 1 and c.waits == []


async def test_control_sends_only_pause_resume_and_abort(face):
    c = make(face, answer(200, json={"action": "pause", "replicas": []}))
    for action in ("weights", "../healthz", "bogus"):
        with pytest.raises(ValueError, match="pause, resume, abort"):
            await call(c, "control", action)
    assert c.script.requests == []
    assert (await call(c, "control", "pause")).action == "pause"
    assert c.script.requests[0].url.path == "/v1/pause"


async def test_wait_ready_polls_until_healthy_or_times_out(face):
    c = make(face, answer(503), httpx.ConnectError("refused"), answer(200, json={"status": "ok", "weight_version": 1}))
    assert (await call(c, "wait_ready", timeout_s=60)).status == "ok" and c.waits == [0.5, 0.5]
    c = make(face, answer(503))
    with pytest.raises(TimeoutError, match="not healthy after 0s"):
        await call(c, "wait_ready", timeout_s=0)


async def test_stream_lines_split_on_newlines_only(face):
    """A sample's text may hold characters that str.splitlines() (and httpx's iter_lines) treat as line breaks;
    the stream's NDJSON lines end at "\\n" alone (json.dumps leaves them raw with ensure_ascii=False)."""
    sample = {
        "token_ids": [5],
        "logprobs": [-0.1],
        "text": "a\x1eb\u2028c\x85d",
        "finish_reason": "stop",
        "weight_version": 0,
    }
    group = {**GROUP, "samples": [sample]}
    body = "".join(
        json.dumps(line, ensure_ascii=False) + "\n"
        for line in [{"index": 0, "group": group}, {"done": True, "groups": 1}]
    )
    assert len(body.splitlines()) > 2  # the negative control: a splitlines reader would cut the group's line
    c = make(face, httpx.Response(200, content=body.encode()))
    events = await stream(c, P.RolloutRequest(prompts=[P.Prompt(text="x")]))
    assert [e.group.samples[0].text for e in events] == [sample["text"]]


def test_client_retries_then_raises_on_a_dead_port():
    with FarmClient("http://127.0.0.1:9", retries=2, backoff_s=0.01) as c:
        calls, send = [], c.http.request
        c.http.request = lambda *a, **kw: calls.append(a) or send(*a, **kw)
        with pytest.raises(httpx.TransportError):
            c.weights_version()
    assert len(calls) == 3  # the first try and two retries


def cut_after(text: str, face: str) -> httpx.Response:
    """An answer whose connection drops after `text` (a read error mid-line)."""

    def chunks():
        yield text.encode()
        raise httpx.ReadError("connection lost")

    async def achunks():
        for chunk in chunks():
            yield chunk

    return httpx.Response(200, content=chunks() if face == "sync" else achunks())


async def test_a_stream_retried_after_a_line_was_cut_starts_afresh(face):
    """The retry reads its own answer from the start: the cut line's fragment is not glued onto its first line."""
    whole = json.dumps({"index": 0, "group": GROUP}) + "\n"
    c = make(face, cut_after(whole[:25], face), ndjson({"index": 0, "group": GROUP}, {"done": True, "groups": 1}))
    events = await stream(c, P.RolloutRequest(prompts=[P.Prompt(text="hi")]))
    assert [e.index for e in events] == [0] and len(c.script.requests) == 2
