"""A session's tokens: sampled ids appended verbatim, only new messages rendered, forks on rewrites.

The tokenizer is a tiny byte-level BPE trained here, with Qwen2.5's chat template (hermes tool calls, tool results
in a user turn): real merges, so a model's sampled ids can differ from the canonical encoding of the same text.
"""

import json

import pytest

from rollout_farm.services.chat import delta as chat_delta
from rollout_farm.services.chat.tool_formats import Hermes
from rollout_farm.services.episodes.segments import Segment

QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags'
    '<|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        'Let me compute 37*48 with the calculator.\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "37*48"}}\n</tool_call>',
        "<tool_response>\n1776\n</tool_response> The answer is 1776. What is 12 times 31? system user assistant",
    ] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    t = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    t.chat_template = QWEN25
    return t


def sampled(tok, text: str, canonical: bool) -> list[int]:
    """A turn as a model may sample it, ending with <|im_end|>: canonical ids, or the same text one character at a
    time (a valid tokenization the canonical encoder would never produce)."""
    ids = tok.encode(text, add_special_tokens=False) if canonical else []
    if not canonical:
        for ch in text:
            ids += tok.encode(ch, add_special_tokens=False)
    return ids + [tok.convert_tokens_to_ids("<|im_end|>")]


def episode(tok, canonical: bool) -> tuple[Segment, list[dict], list[list[int]]]:
    """Three turns of a calculator episode, as a session builds them: (segment, messages, each turn's prompt ids)."""
    seg, fmt = Segment("s0"), Hermes()
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 37*48?"}]
    first = chat_delta.opening(tok, messages, TOOLS)
    seg.add_context(first.messages, messages)
    seg.add_context(first.prompt, [])
    prompts, replies = (
        [],
        [
            'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>',
            "The answer is 1776. What is 12 times 31?",
        ],
    )
    for turn, text in enumerate(replies):
        prompts.append(list(seg.token_ids))
        ids = sampled(tok, text, canonical)
        parsed = fmt.parse(text, turn)
        message = {"role": "assistant", "content": parsed.content, "tool_calls": [c.openai() for c in parsed.calls]}
        seg.add_sampled(ids, [-0.5] * len(ids), [-0.4] * len(ids), [turn] * len(ids), "stop", message, parsed.calls)
        new = [{"role": "tool", "tool_call_id": "call_0_0", "content": "1776"}] if parsed.calls else []
        new = new or [{"role": "user", "content": "372"}]
        seg.add_context(chat_delta.close(tok, ids, TOOLS), [])
        d = chat_delta.delta(tok, new, TOOLS)
        seg.add_context(d.messages, new)
        seg.add_context(d.prompt, [])
        messages = seg.messages
    prompts.append(list(seg.token_ids))
    return seg, messages, prompts


def hf_shaped(messages: list[dict]) -> list[dict]:
    """The messages with each call's arguments as an object, as HF chat templates take them (OpenAI sends text)."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.mark.parametrize("canonical", [True, False])
def test_each_prompt_is_the_last_prompt_and_its_sampled_ids_exactly(tok, canonical):
    seg, _, prompts = episode(tok, canonical)
    for turn, (before, now) in enumerate(zip(prompts, prompts[1:])):
        t = seg.turns[turn]
        assert now[: len(before)] == before  # the previous prompt is a prefix, bit for bit
        assert now[t.start : t.end] == seg.token_ids[t.start : t.end]  # and the sampled ids follow it verbatim
    sampled_at = {i for t in seg.turns for i in range(t.start, t.end)}
    assert [i for i, m in enumerate(seg.loss_mask) if m] == sorted(sampled_at)  # 1 exactly on sampled tokens
    assert {seg.token_versions[i] for i in sampled_at} == {0, 1} and set(seg.token_versions) - {0, 1} == {-1}


def test_the_deltas_equal_rendering_the_whole_chat_when_the_model_samples_canonically(tok):
    seg, messages, _ = episode(tok, canonical=True)
    assert seg.token_ids == chat_delta.render_ids(tok, hf_shaped(messages), TOOLS, True)


def test_re_encoding_the_sampled_text_breaks_token_equality(tok):
    """Negative control: a server that re-renders the chat from text (what the field moved away from) trains on
    other tokens than the model sampled, once a sample is not the canonical encoding of its text."""
    seg, messages, _ = episode(tok, canonical=False)
    re_encoded = chat_delta.render_ids(tok, hf_shaped(messages), TOOLS, True)
    assert tok.decode(re_encoded) == tok.decode(seg.token_ids)  # the same text
    assert re_encoded != seg.token_ids  # but not the same tokens: the stored buffer is what was sampled


def test_a_rewritten_history_forks_and_a_retry_gets_the_same_turn(tok):
    seg, messages, _ = episode(tok, canonical=False)
    first_answer = messages[:2]
    assert seg.answered(first_answer) is seg.turns[0]  # a retry of turn 0
    assert seg.extended_by(messages + [{"role": "user", "content": "thanks"}])
    # the client drops the tool result and answers the call itself: the history is rewritten after turn 0
    rewritten = messages[:3] + [{"role": "user", "content": "do not use the tool"}]
    assert not seg.extended_by(rewritten)
    fork = seg.fork("s1", rewritten)
    cut = seg.turns[0].end
    assert (fork.parent, fork.parent_tokens, fork.messages) == ("s0", cut, messages[:3])
    assert fork.token_ids == seg.token_ids[:cut] and set(fork.loss_mask) == {0}  # trained in the parent, not twice
    # an edit of the first user message keeps nothing: system and user were rendered together, no exact cut
    edited = [messages[0], {"role": "user", "content": "What is 37*49?"}]
    assert seg.fork("s2", edited).parent_tokens == 0


def test_tool_call_arguments_compare_as_json_not_as_text(tok):
    seg, messages, _ = episode(tok, canonical=True)
    echoed = json.loads(json.dumps(messages))
    call = echoed[2]["tool_calls"][0]["function"]
    call["arguments"] = json.dumps(json.loads(call["arguments"]), indent=2)  # the client re-serialised it
    assert seg.extended_by(echoed + [{"role": "user", "content": "ok"}])


def test_a_template_that_is_not_append_only_is_refused(tok):
    class Rewrites:  # its render of the history changes when a message is added
        chat_template = "x"

        def apply_chat_template(self, messages, **_):
            return str(len(messages)) + "".join(m["content"] for m in messages)

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    with pytest.raises(chat_delta.NotAppendOnly, match="append"):
        chat_delta.delta(Rewrites(), [{"role": "user", "content": "hi"}], None)


def test_a_segment_round_trips_through_json_exactly(tok):
    seg, messages, _ = episode(tok, canonical=False)
    fork = seg.fork("s1", messages[:3] + [{"role": "user", "content": "again"}])
    for original in (seg, fork):
        back = Segment.from_json(original.to_json())
        assert back == original and back.turns[:1] == original.turns[:1]
    assert Segment.from_json(seg.to_json()).turns[0].tool_calls[0].openai()["function"]["name"] == "calculator"


def test_re_encoding_breaks_token_equality_on_the_embedded_tokenizer_too():
    """Negative control on the built-in byte tokenizer (one token per byte, no merges, so any valid text has one
    encoding): a model still samples ids that no text round-trips, an end-of-turn token (dropped when the text is
    decoded for the chat) and bytes that are not UTF-8 (decoded as U+FFFD). Appending ids keeps them; re-encoding
    the sampled text does not."""
    from rollout_farm.services.models import byte_tokenizer

    tok = byte_tokenizer()
    lone_continuation = tok.encode("é", add_special_tokens=False)[1:]  # its second byte, 0xA9, alone
    ids = tok.encode("1776", add_special_tokens=False) + lone_continuation + [tok.eos_token_id]
    seg = Segment("s0")
    seg.add_context(tok.encode("Q: ", add_special_tokens=False), [])
    n = len(ids)
    seg.add_sampled(ids, [-0.1] * n, [-0.1] * n, [0] * n, "stop", {"role": "assistant", "content": "x"})
    text = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" in text
    assert seg.token_ids[-n:] == ids  # appended verbatim
    assert tok.encode(text, add_special_tokens=False) != ids  # the re-encoded text is other tokens


def test_a_chat_turn_is_its_pieces_and_the_forced_opening_and_a_refused_role_is_not_append_only(tok):
    """`turn`, what a session's chat turn asks the ingress's renderer for: [close, messages, prompt, forced]; the
    template's own error (a role it refuses) comes back as NotAppendOnly with the template's text."""
    seg, _, _ = episode(tok, canonical=True)
    new = [{"role": "user", "content": "thanks"}]
    forced = Hermes().opening("calculator")
    close, messages, prompt, opened = chat_delta.turn(tok, seg.token_ids[-64:], False, new, TOOLS, False, forced)
    d = chat_delta.delta(tok, new, TOOLS)
    assert (close, messages, prompt) == ([], d.messages, d.prompt)
    assert opened == tok.encode(forced, add_special_tokens=False)

    class Refuses:
        chat_template = "x"

        def apply_chat_template(self, messages, **_):
            raise ValueError("Conversation roles must alternate")

    with pytest.raises(chat_delta.NotAppendOnly, match="roles must alternate"):
        chat_delta.turn(Refuses(), [], False, new, None, True, "")
