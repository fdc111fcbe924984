"""Session turns with a model family's real chat template: Qwen3 (tests/data/chat_templates/qwen3.jinja, the official
template of Qwen/Qwen3-0.6B, Apache-2.0, as llama.cpp's models/templates carries it, MIT).

Qwen3's template renders an assistant turn with its reasoning (`<think>...</think>`) while it is the last one, and
without it once another message follows: the history renders differently after every turn. Before, every turn after
the first was refused (422, "no exact token continuation"). The tokenizer: tests/chat_families.py.
"""

import json

import pytest

from rollout_farm.services.chat import delta as chat_delta
from rollout_farm.services.chat.template import for_template
from rollout_farm.services.chat.tool_formats import TOOL_FORMATS, detected
from rollout_farm.services.compat import anthropic, responses
from rollout_farm.services.episodes.chat_turns import completion, opens_thinking, parsed_turn, thinking_and_text
from rollout_farm.services.episodes.segments import reshaped, shared_messages
from rollout_farm.services.episodes.session_store import Session
from tests.chat_families import FAMILIES, HARMONY_SAY, TOOLS, episode, qwen3_tokenizer, sampled


@pytest.fixture(scope="module")
def qwen3():
    return qwen3_tokenizer()


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


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    f = FAMILIES[request.param]
    return f, f.tokenizer()


def test_every_family_appends_every_turn_with_the_sampled_ids_verbatim_and_its_calls_read(family):
    """Each family's real template over five turns with tool calls (parallel ones where the family makes them): every
    turn's prompt extends the last, the sampled ids stay as sampled, the loss mask is 1 exactly on them, and the calls
    are read back from the ids."""
    f, tok = family
    seg, prompts = f.episode(tok)
    assert len(seg.turns) == 5
    for turn, (before, now) in enumerate(zip(prompts, prompts[1:])):
        t = seg.turns[turn]
        assert now[: len(before)] == before and now[t.start : t.end] == seg.token_ids[t.start : t.end]
        assert seg.token_ids[t.start : t.end] == sampled(tok, f.replies[turn], f.tags, f.end)
    sampled_at = {i for t in seg.turns for i in range(t.start, t.end)}
    assert [i for i, m in enumerate(seg.loss_mask) if m] == sorted(sampled_at)
    calls = [
        [json.loads(c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        for m in seg.messages
        if m["role"] == "assistant"
    ]
    parallel = [{"expression": "12*31"}] + ([{"expression": "2+2"}] if f.tool_format != "harmony" else [])
    assert calls == [[{"expression": "37*48"}], [], parallel, [], []]
    assert all("\ue000" not in m["content"] and m["content"] is not None for m in seg.messages)


def test_auto_picks_each_familys_format_from_its_template(family):
    f, tok = family
    assert detected(tok) == f.tool_format
    assert detected(type("NoTemplate", (), {"chat_template": None})()) == "plain"
    assert detected(type("Other", (), {"chat_template": "{{ messages[0].content }}"})()) == "hermes"


def test_a_call_the_template_renders_reads_back_as_the_same_call(family):
    """The template's own rendering of an assistant turn with calls (what the model was trained to write), parsed back
    by the family's format from its token ids: the same calls. Unicode, nesting and odd values included."""
    f, tok = family
    fmt = TOOL_FORMATS.get(f.tool_format)()
    args = [{"expression": "37*48"}, {"q": 'naïve — 東京 "quoted"', "n": 3, "deep": {"a": [1, {"b": None}]}}]
    calls = [
        {"id": fmt.call_id(0, i), "type": "function", "function": {"name": "calculator", "arguments": a}}
        for i, a in enumerate(args[: 1 if f.tool_format in ("harmony", "llama3-json") else 2])
    ]
    user = [{"role": "user", "content": "Go."}]
    ready = tok.apply_chat_template(user, tools=f.tools, add_generation_prompt=True, tokenize=False)
    whole = tok.apply_chat_template(
        user + [{"role": "assistant", "content": "", "tool_calls": calls}], tools=f.tools, tokenize=False
    )
    whole, ready = tok.encode(whole, add_special_tokens=False), tok.encode(ready, add_special_tokens=False)
    shared = next(i for i, (a, b) in enumerate(zip([*whole, -1], [*ready, -2])) if a != b)  # R1 drops its <think>
    written = whole[shared:]
    got = fmt.parse_ids(written, tok, 0)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert got.malformed == []


def test_a_marker_written_as_text_opens_no_call_where_the_family_has_its_token(family):
    """Negative control: the same call written character by character, its markers as ordinary text rather than the
    family's special tokens: no call (read by id), while the text alone would read one."""
    f, tok = family
    fmt = TOOL_FORMATS.get(f.tool_format)()
    text = f.replies[0]
    as_tokens = fmt.parse_ids(sampled(tok, text, f.tags, f.end), tok, 0)
    assert len(as_tokens.calls) == 1
    if not fmt.markers or f.tool_format == "llama3-json":  # the tag is optional there: a bare JSON turn is a call
        return
    as_text = fmt.parse_ids(sampled(tok, text, (), f.end), tok, 0)
    assert as_text.calls == [] and fmt.parse(text, 0).calls == as_tokens.calls


REASONED = {  # a turn with reasoning as each family's model writes it, and the reasoning it holds
    "qwen3": ("<think>\nI know this.\n</think>\n\nThe answer is 1776.", "I know this."),
    "qwen3.5": ("I know this.\n</think>\n\nThe answer is 1776.", "I know this."),  # its prompt opened <think>
    "gpt-oss": (HARMONY_SAY.format("I know this.", "The answer is 1776."), "I know this."),
}


@pytest.mark.parametrize("name", sorted(REASONED))
def test_a_turns_reasoning_reaches_every_front_door(name):
    """The reasoning a turn holds (a <think> block, one the prompt opened, harmony's analysis channel) reaches the
    client: as `reasoning_content` where the session reads it apart (else inline, as sampled), as the Anthropic
    answer's thinking block and the Responses answer's reasoning item; the text without it."""
    f = FAMILIES[name]
    text, reasoning = REASONED[name]
    seg, _ = episode(f.tok, [text], [], f.fmt, f.tags, f.end, f.tools)
    session = Session("s", f.tool_format, {}, -1, 60.0, segments=[seg])
    message = completion(session, seg, 0, "m", None)["choices"][0]["message"]
    assert thinking_and_text(message) == (reasoning, "The answer is 1776.")
    assert message.get("reasoning_content") == (None if name == "qwen3" else reasoning)
    assert anthropic.blocks(message)[0] == {"type": "thinking", "thinking": reasoning, "signature": ""}
    assert responses.output(message, "x")[0]["content"] == [{"type": "reasoning_text", "text": reasoning}]


def test_only_a_prompt_that_opens_a_think_block_makes_the_text_before_think_end_reasoning():
    """Negative control: DeepSeek-R1's prompt closes its <think> block (thinking off: `<think>\\n</think>`), so a
    </think> the model writes after it is text; Qwen3.5's leaves it open."""
    for name, opens in [("qwen3.5", True), ("deepseek-r1", False), ("qwen3", False)]:
        f = FAMILIES[name]
        prompt = chat_delta.opening(f.tok, [{"role": "user", "content": "Hi"}], f.tools).prompt
        assert opens_thinking(f.tok, prompt) is opens, name
    parsed = parsed_turn(TOOL_FORMATS.get("hermes")(), "Hmm.\n</think>\n\nHi.", 0, "auto")
    assert (parsed.reasoning, parsed.content) == ("", "Hmm.\n</think>\n\nHi.")


@pytest.mark.parametrize(
    "name, stop, cut", [("llama3.1", "<|eom_id|>", "<|python_tag|>"), ("gpt-oss", "<|call|>", "<|message|>")]
)
def test_a_turn_that_stops_on_another_end_token_is_closed_one_cut_after_a_marker_is_not(name, stop, cut):
    """A turn that ended on one of the family's end tokens other than the template's ending needs no closing token;
    one cut short (max_tokens) right after another special token, a call's marker, still gets the template's ending
    (negative control: closing it with nothing would store a prompt the template never renders)."""
    tok = FAMILIES[name].tok
    text = tok.encode("Hi", add_special_tokens=False)
    ending = chat_delta.close(tok, text, None)
    assert len(ending) == 1
    assert chat_delta.close(tok, text + tok.convert_tokens_to_ids([stop]), None) == []
    assert chat_delta.close(tok, text + tok.convert_tokens_to_ids([cut]), None) == ending
