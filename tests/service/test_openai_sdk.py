"""The official openai SDK against the service: models, streaming, n, logprobs with alternatives, token-id prompts,
echo (lm-eval's loglikelihood requests), stop strings inside the engine, the context bound, and chat with content
parts, the developer role and seeds."""

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import CONTEXT, TOKEN


@pytest.fixture
def sdk(service):
    return openai.OpenAI(base_url=f"{service}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def test_models_lists_the_served_policy_with_its_weight_version(sdk, service, fresh_weights):
    (card,) = sdk.models.list().data
    assert card.id == "tiny-llama" and card.object == "model"
    assert card.meta == {"weight_version": fresh_weights, "context_length": CONTEXT}


def test_streamed_completions_join_to_the_plain_answer_and_end_with_usage(sdk):
    args = {"model": "m", "prompt": ["Q: 1+2\nA:", "hi"], "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 5}
    plain = sdk.completions.create(**args)
    chunks = list(sdk.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    reasons = {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert texts == {c.index: c.text for c in plain.choices}
    assert reasons == {c.index: c.finish_reason for c in plain.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_streamed_chat_sends_role_content_and_finish_reason(sdk):
    args = {"model": "m", "messages": [{"role": "user", "content": "Q: 2+2"}], "max_tokens": 6, "seed": 2}
    plain = sdk.chat.completions.create(**args)
    chunks = list(sdk.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def local_logprobs(model_dir, ids: list[int]) -> tuple[list[float], list[list[int]]]:
    """Each token's logprob given the ones before it, and the top-2 token ids at each position: a plain forward pass."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist(), logp.topk(2, -1).indices.tolist()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_like_a_forward_pass(sdk, tiny_model, fresh_weights, max_tokens):
    """lm-eval's loglikelihood request: token ids, echo, logprobs, max_tokens 0 or 1, greedy."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok("Q: 12+3\nA: 15").input_ids
    out = sdk.completions.create(model="m", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0)
    lp = out.choices[0].logprobs
    expected, top2 = local_logprobs(tiny_model, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    assert len(lp.tokens) == len(ids) + max_tokens and out.choices[0].text.startswith("Q: 12+3\nA: 15")
    for pos, alts in enumerate(lp.top_logprobs[1 : len(ids)]):
        assert len(alts) == 2 and all(
            any(t == tok.decode([i]) or t == tok.convert_ids_to_tokens(i) for i in top2[pos]) for t in alts
        )


def test_token_id_prompts_in_both_shapes_and_n(sdk, tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    a, b = tok("Q: 1+1\nA:").input_ids, tok("Q: 5+4\nA:").input_ids
    one = sdk.completions.create(model="m", prompt=a, max_tokens=4, n=3, temperature=1.0, seed=1)
    both = sdk.completions.create(model="m", prompt=[a, b], max_tokens=4, temperature=0)
    assert len(one.choices) == 3 and one.usage.prompt_tokens == len(a)
    assert len(both.choices) == 2 and both.usage.prompt_tokens == len(a) + len(b)
    same = sdk.completions.create(model="m", prompt="Q: 5+4\nA:", max_tokens=4, temperature=0)
    assert both.choices[1].text == same.choices[0].text  # ids and text of the same prompt answer alike


def test_completion_top_logprobs_hold_the_sampled_token_when_greedy(sdk):
    out = sdk.completions.create(model="m", prompt="Q: 3+3\nA:", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == out.choices[0].text
    for token, logprob, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(alts) == 3 and max(alts.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the top one
        if len(token) == 1 and token.isascii():  # one byte, one token: the alternative is that same text
            assert token in alts


def test_stop_strings_end_generation_inside_the_engine(sdk):
    """The stop string is cut from the text, and generation ended there: fewer tokens than the same seeded request
    without it, with finish_reason stop."""
    args = {"model": "m", "prompt": "Q: 7+8\nA:", "max_tokens": 40, "temperature": 1.0, "seed": 11}
    full = sdk.completions.create(**args).choices[0].text
    stop = next((full[i : i + 2] for i in range(2, len(full) - 2) if full[i : i + 2].isprintable()), None)
    assert stop, full
    cut = sdk.completions.create(**args, stop=[stop])
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < len(full.encode())  # byte tokens: it stopped early, not cut afterwards


def test_max_tokens_beyond_the_context_gets_422_with_both_numbers(service):
    prompt = CONTEXT - 100
    r = httpx.post(f"{service}/v1/completions", json={"prompt": [1] * prompt, "max_tokens": 101}, timeout=120)
    assert r.status_code == 422
    (detail,) = r.json()["detail"]
    assert detail["field"] == "max_tokens", detail
    assert f"{prompt} tokens + max_tokens 101 = {CONTEXT + 1} > the model's context of {CONTEXT}" in detail["message"]
    assert "at most 100" in detail["message"]
    text = httpx.post(f"{service}/v1/completions", json={"prompt": "x" * prompt, "max_tokens": 101}, timeout=120)
    assert text.status_code == 422 and f"{prompt} tokens" in text.json()["detail"][0]["message"]  # text is counted
    ok = httpx.post(
        f"{service}/v1/completions", json={"prompt": [1] * prompt, "max_tokens": 100, "stop": "\n"}, timeout=120
    )
    assert ok.status_code == 200


def test_chat_takes_content_parts_the_developer_role_and_seeds(sdk, tiny_model):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "Q: 2"}, {"type": "text", "text": "+2"}]},
    ]
    a = sdk.chat.completions.create(model="m", messages=messages, max_tokens=6, seed=9, n=2)
    b = sdk.chat.completions.create(model="m", messages=messages, max_tokens=6, seed=9, n=2)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    rendered = "system: be brief\nuser: Q: 2+2\nassistant:"  # developer is the system turn; parts join
    assert a.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(tiny_model)(rendered).input_ids)


def test_chat_top_logprobs(sdk):
    out = sdk.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Q: 1+1"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == out.choices[0].message.content
    assert all(
        len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5) for c in content
    )
