"""Session turns with a model family's real chat template: Qwen3 (tests/data/chat_templates/qwen3.jinja, the official
template of Qwen/Qwen3-0.6B, Apache-2.0, as llama.cpp's models/templates carries it, MIT).

Qwen3's template renders an assistant turn with its reasoning (`<think>...</think>`) while it is the last one, and
without it once another message follows: the history renders differently after every turn. Before, every turn after
the first was refused (422, "no exact token continuation"). The vocabulary is a byte-level BPE trained here with
Qwen3's added tokens at their ids (Qwen's own vocabulary file is not in a package this machine can install): the
template is the real one, its special tokens are single tokens, and the model's sampled ids may differ from the
canonical encoding of their text, as a real model's do.
"""

import json
from pathlib import Path

import pytest

from rollout_farm.services.chat import delta as chat_delta
from rollout_farm.services.chat.template import for_template
from rollout_farm.services.chat.tool_formats import Hermes
from rollout_farm.services.episodes.segments import Segment, reshaped, shared_messages

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
# Qwen3's added tokens from id 151643 on, in order (its tokenizer_config.json); the six tags are not special.
ADDED = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
    "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> "
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> "
    "<tool_response> </tool_response> <think> </think>"
).split()
TAGS = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

# Five turns: a call, an answer, two calls in one turn (their results sent as two tool messages), an answer, a goodbye.
REPLIES = [
    '<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
    '{"expression": "37*48"}}\n</tool_call>',
    "<think>\nGot 1776.\n</think>\n\nThe answer is 1776.",
    '<think>\nTwo questions: two calls.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
    '{"expression": "12*31"}}\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": '
    '{"expression": "2+2"}}\n</tool_call>',
    "<think>\nBoth came back.\n</think>\n\n372 and 4.",
    "<think>\nDone.\n</think>\n\nBye.",
]
FOLLOWING = [
    [{"role": "tool", "tool_call_id": "call_0_0", "content": "1776"}],
    [{"role": "user", "content": "And 12*31 and 2+2?"}],
    [
        {"role": "tool", "tool_call_id": "call_2_0", "content": "372"},
        {"role": "tool", "tool_call_id": "call_2_1", "content": "4"},
    ],
    [{"role": "user", "content": "Thanks."}],
]


@pytest.fixture(scope="module")
def qwen3():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [*REPLIES, "<tool_response>\n1776\n</tool_response> system user assistant Use tools. What is"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED if t in TAGS])
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED if t not in TAGS])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    return tok


def sampled(tok, text: str) -> list[int]:
    """The turn as a model samples it: one character at a time (valid ids the canonical encoder never produces),
    each tag as its own token, then <|im_end|>."""
    ids, rest = [], text
    while rest:
        tag = next((t for t in TAGS if rest.startswith(t)), None)
        piece, rest = (tag, rest[len(tag) :]) if tag else (rest[0], rest[1:])
        ids += tok.encode(piece, add_special_tokens=False)
    return ids + [tok.convert_tokens_to_ids("<|im_end|>")]


def episode(tok, replies=REPLIES, following=FOLLOWING) -> tuple[Segment, list[list[int]]]:
    """The turns as a session builds them: (segment, each turn's prompt ids)."""
    seg, fmt = Segment("s0"), Hermes()
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 37*48?"}]
    first = chat_delta.opening(tok, messages, TOOLS)
    seg.add_context(first.messages, messages)
    seg.add_context(first.prompt, [])
    prompts = []
    for turn, text in enumerate(replies):
        prompts.append(list(seg.token_ids))
        ids = sampled(tok, text)
        parsed = fmt.parse(text, turn)
        message = {"role": "assistant", "content": parsed.content, "tool_calls": [c.openai() for c in parsed.calls]}
        seg.add_sampled(ids, [-0.5] * len(ids), [-0.4] * len(ids), [turn] * len(ids), "stop", message, parsed.calls)
        if turn == len(following):
            break
        new = following[turn]
        close, rendered, prompt, _ = chat_delta.turn(tok, seg.token_ids[-64:], True, new, TOOLS, False, "")
        seg.add_context(close, [])
        seg.add_context(rendered, new)
        seg.add_context(prompt, [])
    return seg, prompts


def test_every_turn_appends_its_prompt_is_the_last_one_and_the_sampled_ids_verbatim(qwen3):
    seg, prompts = episode(qwen3)
    assert len(seg.turns) == 5
    for turn, (before, now) in enumerate(zip(prompts, prompts[1:])):
        t = seg.turns[turn]
        assert now[: len(before)] == before and now[t.start : t.end] == seg.token_ids[t.start : t.end]
    sampled_at = {i for t in seg.turns for i in range(t.start, t.end)}
    assert [i for i, m in enumerate(seg.loss_mask) if m] == sorted(sampled_at)  # 1 exactly on sampled tokens


def test_the_context_between_turns_is_the_templates_with_the_reasoning_kept(qwen3):
    """The tokens between the sampled turns are the official template's rendering of the new messages: the same text
    as the template renders the whole chat with every turn's reasoning kept (its think gate opened), which is the
    trajectory the model saw. The official rendering of the whole chat drops earlier turns' reasoning."""
    seg, _ = episode(qwen3)
    kept = qwen3.chat_template.replace("{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}")
    assert kept != qwen3.chat_template
    history = for_template(seg.messages)  # the farm's messages carry the reasoning inline: the template splits it
    whole = qwen3.apply_chat_template(history, tools=TOOLS, tokenize=False, chat_template=kept)
    official = qwen3.apply_chat_template(history, tools=TOOLS, tokenize=False)
    ours = qwen3.decode(seg.token_ids)
    assert ours == whole.rstrip("\n")  # the last turn's closing newline comes with the next turn
    assert ours != official.rstrip("\n") and "I should call the tool." not in official


def test_a_template_that_changes_more_than_a_finished_turns_reasoning_is_still_refused(qwen3):
    """Negative control: a template that drops the whole previous assistant turn, not a span before its content, once
    a message follows it: no exact continuation, 422 as before."""

    class Forgets:
        chat_template = "x"

        def apply_chat_template(self, messages, **_):
            last = len(messages) - 1
            return "".join(
                f"<{m['role']}>{m['content']}</{m['role']}>"
                for i, m in enumerate(messages)
                if m["role"] != "assistant" or i == last
            )

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    with pytest.raises(chat_delta.NotAppendOnly, match="append"):
        chat_delta.delta(Forgets(), [{"role": "user", "content": "hi"}], None)


def test_a_harness_that_strips_the_reasoning_from_its_history_appends_one_that_edits_it_forks(qwen3):
    """A harness sends back the assistant turns without their <think> block (Qwen3's own template does so), or with
    the reasoning as `reasoning_content`: the same turn, appended. One that changes the reasoning or the answer
    rewrites the history: a fork."""
    seg, _ = episode(qwen3)
    stored = seg.messages
    assert "<think>" in stored[2]["content"]

    def rewritten(how) -> list[dict]:
        given = json.loads(json.dumps(stored))
        for m in given:
            if m["role"] == "assistant":
                how(m)
        return given + [{"role": "user", "content": "More?"}]

    def strip(m):
        m["content"] = m["content"].split("</think>", 1)[1].lstrip("\n")

    def moved(m):
        reasoning, content = m["content"].split("</think>", 1)
        m["reasoning_content"], m["content"] = reasoning.removeprefix("<think>").strip("\n"), content.lstrip("\n")

    def edited_reasoning(m):
        m["content"] = m["content"].replace("</think>", " Or not.\n</think>", 1)

    def edited_answer(m):
        m["content"] += " Really."

    assert seg.extended_by(rewritten(strip)) and seg.extended_by(rewritten(moved))
    assistants = sum(m["role"] == "assistant" for m in stored)
    assert reshaped(stored, rewritten(strip)) == assistants and reshaped(stored, rewritten(lambda m: None)) == 0
    assert not seg.extended_by(rewritten(edited_reasoning)) and not seg.extended_by(rewritten(edited_answer))
    assert shared_messages(stored, rewritten(edited_answer)) == 2  # forks after the first user message
