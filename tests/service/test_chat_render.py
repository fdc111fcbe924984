"""The ingress renders chat templates itself (rollout_farm/services/chat/renderer.py), with the tokenizer an engine
replica hands it once: its render equals the render with the tokenizer the replica builds from its model (built here
the same way) for the models the service tests run, the tiny Llama with a role template (the session app) and the
built-in byte tokenizer's template (a user engine, the bench app). The comparison can tell a wrong tokenizer: the
other app's tokenizer renders differently (negative control). A chat request's prompt is the replica tokenizer's
render, token for token."""

import asyncio
import functools

import httpx
import pytest

from rollout_farm.services.chat.renderer import ChatRenderer
from rollout_farm.services.chat.template import render
from rollout_farm.services.models import byte_tokenizer
from rollout_farm.services.replica.handle import Replicas

MESSAGES = [
    [{"role": "user", "content": "Q: 2+2"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo ✓ 12+30"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c\nd"}],
    [{"role": "user", "content": ""}],
]
APPS = {"service": "farm", "bench_service": "bench"}  # fixture -> its Serve app


def replicas(app: str) -> Replicas:
    from ray import serve

    return Replicas(serve.get_deployment_handle("engine", app_name=app))


def replica_tokenizer(app: str, tiny_model):
    """The tokenizer app's engine builds from its model, built here: the tiny Llama's folder (the torch engine), the
    byte tokenizer (the bench engine without a model folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model) if app == "farm" else byte_tokenizer()


def renders(ingress_app: str, replica_app: str, tiny_model) -> tuple[list, list]:
    """(the renders of an ingress that took its tokenizer from ingress_app's replicas, replica_app's tokenizer's)."""

    async def ingress():
        chat = ChatRenderer(functools.partial(replicas(ingress_app).read, "chat_tokenizer"))
        return [await chat.render(m) for m in MESSAGES]

    reference = replica_tokenizer(replica_app, tiny_model)
    return asyncio.run(ingress()), [render(reference, m) for m in MESSAGES]


@pytest.mark.parametrize("fixture", APPS)
def test_the_ingress_renders_as_the_replica_does(request, fixture, tiny_model):
    request.getfixturevalue(fixture)
    ours, theirs = renders(APPS[fixture], APPS[fixture], tiny_model)
    assert ours == theirs and all(isinstance(t, str) for t in theirs)


def test_a_tokenizer_of_another_model_renders_differently(service, bench_service, tiny_model):
    """Negative control: the comparison above tells the two models' templates apart."""
    ours, theirs = renders("bench", "farm", tiny_model)
    assert ours != theirs
    assert theirs[0] == "user: Q: 2+2\nassistant:" and ours[0] == "Q: 2+2"


def test_a_chat_prompt_is_the_replica_render_token_for_token(service):
    from ray import serve

    handle = serve.get_deployment_handle("engine", app_name="farm")
    tok = handle.chat_tokenizer.remote().result()
    for messages in MESSAGES[:3]:
        body = {"messages": messages, "max_completion_tokens": 4, "temperature": 0}
        r = httpx.post(f"{service}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        text = render(tok, messages)
        assert r.json()["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False).input_ids)
