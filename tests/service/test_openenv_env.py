"""The built-in `openenv` environment (rollout_farm/services/episodes/openenv_remote.py) against a real openenv-core
server: a counting environment served by openenv's create_app under uvicorn on 127.0.0.1, episodes run through the farm.

The model is the bench app's EchoEngine, the scripted agent model (tests/farm_plugins.py): it says the text between
the marks of the last `say:‹...›` in its prompt, so the remote environment scripts the model through its observation.
"""

import threading
import time

import httpx
import pytest
import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app

from rollout_farm.services.models import byte_tokenizer
from rollout_farm.services.net import free_port

PARAMS = {"max_new_tokens": 128, "temperature": 0.0}  # a hermes call is 72 tokens of the byte tokenizer
TOOL_CALL = '<tool_call>{"name": "act", "arguments": {"message": "step {n}"}}</tool_call>'  # hermes


class CountAction(Action):
    message: str


class CountObservation(Observation):
    text: str
    count: int


class CountEnv(Environment):
    """Counts the turns that say `step <count + 1>`; each step's reward is the count so far, so only a session that
    keeps the environment across steps earns 1, 2, 3. Done after three steps. It tells the model what to say: the
    reset's `reply` with {n} the next count. `crash` raises, `slow` takes a second."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.count, self.steps, self.reply = 0, 0, "step {n}"  # what a stateless /step starts from

    def reset(self, seed=None, episode_id=None, start: int = 0, reply: str = "step {n}"):
        self.count, self.steps, self.reply = start, 0, reply
        return self.observation(0.0)

    def step(self, action: CountAction):
        if action.message == "crash":
            raise RuntimeError("the counter crashed")
        if action.message == "slow":
            time.sleep(1.0)
        self.steps += 1
        self.count += action.message == f"step {self.count + 1}"
        return self.observation(float(self.count))

    def observation(self, reward: float) -> CountObservation:
        say = self.reply.replace("{n}", str(self.count + 1))
        return CountObservation(text=f"say:‹{say}›", count=self.count, reward=reward, done=self.steps >= 3)

    @property
    def state(self) -> State:
        return State(step_count=self.steps)


@pytest.fixture(scope="module")
def openenv_url(env_ports):
    """A real openenv-core server in a thread, on the port the bench app's FARM_ENV_ALLOWED_HOSTS lists; its URL."""
    port = env_ports["openenv"]
    app = create_app(CountEnv, CountAction, CountObservation, max_concurrent_envs=16)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the openenv server did not start"
        time.sleep(0.05)
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "healthy"}
    yield url
    server.should_exit = True
    thread.join(timeout=10)


def episodes(bench: str, params: dict, **body) -> list[dict]:
    """The episodes of one prompt against the openenv environment with `params`."""
    req = {"env": {"name": "openenv", "params": params}, "prompts": [{"text": "Count."}], "sampling_params": PARAMS}
    r = httpx.post(f"{bench}/v1/episodes", json={**req, **body}, timeout=120)
    assert r.status_code == 200, r.text
    (group,) = r.json()["groups"]
    return group["episodes"]


def test_the_remote_environment_keeps_its_state_across_turns(bench_service, openenv_url):
    eps = episodes(bench_service, {"url": openenv_url, "reset": {"start": 10}}, n=2, max_turns=5)
    for ep in eps:
        assert (ep["stop_reason"], ep["turn_rewards"], ep["error"]) == ("done", [11.0, 12.0, 13.0], None)
        (seg,) = ep["segments"]
        pieces = [  # (text, sampled): the observations are compact JSON (no field picked), the turns their script
            ('Count.\n{"text":"say:‹step 11›","count":10}', 0),
            ("step 11", 1),
            ('\n{"text":"say:‹step 12›","count":11}', 0),
            ("step 12", 1),
            ('\n{"text":"say:‹step 13›","count":12}', 0),
            ("step 13", 1),
        ]
        assert byte_tokenizer().decode(seg["token_ids"]) == "".join(text for text, _ in pieces)
        assert seg["loss_mask"] == [m for text, m in pieces for _ in text.encode()]  # the byte tokenizer: a byte each


def test_the_stateless_http_routes_lose_the_state(openenv_url):
    """The negative control: openenv's HTTP /step builds a fresh environment each call, so a second step counts
    from 0 again (reward 0 where the WebSocket session's gives 2)."""
    httpx.post(f"{openenv_url}/reset", json={}, timeout=10).raise_for_status()
    first = httpx.post(f"{openenv_url}/step", json={"action": {"message": "step 1"}}, timeout=10).json()
    second = httpx.post(f"{openenv_url}/step", json={"action": {"message": "step 2"}}, timeout=10).json()
    assert (first["reward"], second["reward"]) == (1.0, 0.0)


def test_tool_mode_shows_the_action_schema_as_a_tool_and_steps_each_call(bench_service, openenv_url):
    params = {"url": openenv_url, "action": "tool", "observation_fields": ["text"], "reset": {"reply": TOOL_CALL}}
    (ep,) = episodes(bench_service, params, max_turns=5)
    assert (ep["stop_reason"], ep["turn_rewards"], ep["tool_calls"], ep["malformed_tool_calls"]) == (
        "done",
        [1.0, 2.0, 3.0],
        3,
        0,
    )
    text = byte_tokenizer().decode(ep["segments"][0]["token_ids"])
    assert text.startswith("Count.\nsay:‹" + TOOL_CALL.replace("{n}", "1") + "›")  # one string field: its text


def test_an_action_the_schema_refuses_is_an_observation_not_a_failure(bench_service, openenv_url):
    wrong = TOOL_CALL.replace('"message"', '"msg"')
    params = {"url": openenv_url, "action": "tool", "observation_fields": ["text"], "reset": {"reply": wrong}}
    (ep,) = episodes(bench_service, params, max_turns=2)
    assert (ep["stop_reason"], ep["turn_rewards"], ep["error"]) == ("max_turns", [0.0, 0.0], None)
    text = byte_tokenizer().decode(ep["segments"][0]["token_ids"])
    assert "error: the environment refused the action: message: Field required; msg: Extra inputs" in text


@pytest.mark.parametrize(
    "reset, error",
    [
        ({"reply": "crash"}, "step: RemoteError: openenv server {url}: step: EXECUTION_ERROR: the counter crashed"),
        ({"reply": "slow"}, "step: RemoteError: openenv server {url}: an earlier step did not answer in time"),
    ],
)
def test_a_remote_failure_ends_the_episode_with_env_error(bench_service, openenv_url, reset, error):
    """A step the server fails, and the step after one that timed out (its answer would come to the next question),
    end the episode with env_error naming the server."""
    eps = episodes(bench_service, {"url": openenv_url, "reset": reset}, n=2, tool_timeout_s=0.3)
    for ep in eps:
        assert ep["stop_reason"] == "env_error" and ep["error"].startswith(error.format(url=openenv_url)), ep["error"]


def test_a_server_that_is_down_ends_the_episodes_with_env_error_naming_it(bench_service, env_ports):
    url = f"http://127.0.0.1:{env_ports['down']}"
    for ep in episodes(bench_service, {"url": url}, n=2):
        assert ep["stop_reason"] == "env_error" and ep["turns"] == 0
        assert ep["error"].startswith(f"reset: Unreachable: openenv server {url}: GET /schema: ConnectError")


@pytest.mark.parametrize(
    "params, field",
    [
        ({"url": "ftp://127.0.0.1:1"}, "env.params.url"),
        ({}, "env.params.url"),
        ({"url": "http://127.0.0.1:1", "urll": "x"}, "env.params.urll"),
        ({"url": "http://127.0.0.1:1", "action": "voice"}, "env.params.action"),
    ],
)
def test_bad_openenv_params_are_a_422_naming_the_field(bench_service, params, field):
    body = {"env": {"name": "openenv", "params": params}, "prompts": [{"text": "x"}]}
    r = httpx.post(f"{bench_service}/v1/episodes", json=body, timeout=30)
    assert r.status_code == 422 and field in r.text, r.text


def test_the_environment_list_shows_openenv_and_its_params(bench_service):
    listed = httpx.get(f"{bench_service}/v1/environments", timeout=30).json()
    assert "WebSocket session" in listed["environments"]["openenv"]
    schema = listed["params"]["openenv"]
    assert schema["required"] == ["url"] and {"action", "message_field", "reset"} <= set(schema["properties"])
    assert "reward" in listed["params"]["calculator"]["properties"]


def test_a_server_the_allowed_hosts_do_not_list_is_a_422_naming_the_setting(bench_service, env_ports):
    """FARM_ENV_ALLOWED_HOSTS lists two ports on 127.0.0.1: another port, the same port on 127.0.0.2 and the Ray
    dashboard's on localhost are refused before any episode starts (tests/unit/test_allowed_hosts.py: never
    connected to, redirects included)."""
    for url in (
        f"http://127.0.0.1:{free_port()}",
        f"http://127.0.0.2:{env_ports['openenv']}",
        "http://localhost:8265",
    ):
        body = {"env": {"name": "openenv", "params": {"url": url}}, "prompts": [{"text": "x"}]}
        r = httpx.post(f"{bench_service}/v1/episodes", json=body, timeout=30)
        assert r.status_code == 422, r.text
        (problem,) = r.json()["detail"]
        assert problem["field"] == "env.params.url" and "is not in FARM_ENV_ALLOWED_HOSTS" in problem["message"]
