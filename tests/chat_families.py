"""Model families' real chat templates and tokenizers for tests, without weights or a model hub
(tests/data/chat_templates: the official templates as llama.cpp's models/templates carries them, MIT). The vocabulary
is a byte-level BPE trained here with the family's added tokens: the template is the real one, its special tokens are
single tokens, and the sampled ids may differ from the canonical encoding of their text, as a real model's do.

`FAMILIES` is the one family table of the tests (tests/unit/test_chat_families.py, the replay corpus
tests/replay_corpus.py); `qwen3_tokenizer()` builds Qwen3's; `sampled` writes a turn as a model samples it; `episode`
runs the turns as a session builds them.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from rollout_farm.services.chat import delta as chat_delta
from rollout_farm.services.chat.tool_formats import TOOL_FORMATS, Hermes
from rollout_farm.services.episodes.chat_turns import assistant_message, opens_thinking, parsed_turn
from rollout_farm.services.episodes.segments import Segment

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
DESCRIBED = [{"type": "function", "function": {**TOOLS[0]["function"], "description": "Evaluates an expression."}}]
# Qwen3's added tokens from id 151643 on, in order (its tokenizer_config.json); the six tags are not special.
ADDED = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
    "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> "
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> "
    "<tool_response> </tool_response> <think> </think>"
).split()
LEAD = "Let me check.\n"  # text a Qwen turn may write before its calls
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


def qwen3_tokenizer(template: str = "qwen3.jinja"):
    """Qwen3's tokenizer: its added tokens (the six tags not special) on a BPE trained on the turns below."""
    corpus = [*REPLIES, "<tool_response>\n1776\n</tool_response> system user assistant Use tools. What is"]
    return family_tokenizer(template, ADDED, TAGS, corpus, eos="<|im_end|>", pad="<|endoftext|>")


def qwen25_tokenizer():
    """Qwen2.5's template (tests/unit/test_session_tokens.py: hermes calls, results in one user turn) on Qwen3's
    tokenizer."""
    from tests.unit.test_session_tokens import QWEN25

    tok = qwen3_tokenizer()
    tok.chat_template = QWEN25
    return tok


def family_tokenizer(template: str, added, tags, corpus, eos: str, pad: str, bos: str | None = None):
    """A family's tokenizer: its added tokens in order (`tags` not special, the rest special), each a single token,
    on a byte-level BPE trained on `corpus`, with its real chat template (tests/data/chat_templates/`template`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(corpus) * 20, trainer)
    for t in added:  # in the family's order
        (bpe.add_tokens if t in tags else bpe.add_special_tokens)(
            [AddedToken(t, special=t not in tags, normalized=False)]
        )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, pad_token=pad, bos_token=bos)
    tok.chat_template = (TEMPLATES / template).read_text()
    return tok


def sampled(tok, text: str, tags=None, end: str | None = "<|im_end|>") -> list[int]:
    """The turn as a model samples it: one character at a time (valid ids the canonical encoder never produces),
    each tag as its own token (`tags`: Qwen3's six by default; none: the text is all characters, a model writing a
    tag's text), then `end` (none: the text ends with its own end token)."""
    tags = TAGS if tags is None else tags
    ids, rest = [], text
    while rest:
        tag = next((t for t in tags if rest.startswith(t)), None)
        piece, rest = (tag, rest[len(tag) :]) if tag else (rest[0], rest[1:])
        ids += tok.encode(piece, add_special_tokens=False)
    return ids + ([tok.convert_tokens_to_ids(end)] if end else [])


def episode(
    tok, replies=REPLIES, following=FOLLOWING, fmt=None, tags=None, end="<|im_end|>", tools=TOOLS, ask="What is 37*48?"
) -> tuple[Segment, list[list[int]]]:
    """The turns as a session builds them: (segment, each turn's prompt ids). The calls and the reasoning are read
    from the sampled ids as a session reads them (chat_turns.parsed_turn, by `fmt`: hermes by default) into the
    assistant message it stores, the following messages rendered after them as a session does (none after the last
    turn given fewer)."""
    seg, fmt = Segment("s0"), fmt or Hermes()
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": ask}]
    first = chat_delta.opening(tok, messages, tools)
    seg.add_context(first.messages, messages)
    seg.add_context(first.prompt, [])
    prompts, prompt = [], first.prompt
    for turn, text in enumerate(replies):
        prompts.append(list(seg.token_ids))
        ids = sampled(tok, text, tags, end)
        parsed = parsed_turn(fmt, "", turn, "auto", ids, tok, opens_thinking(tok, prompt))
        message = assistant_message(parsed)
        seg.add_sampled(ids, [-0.5] * len(ids), [-0.4] * len(ids), [turn] * len(ids), "stop", message, parsed.calls)
        if turn == len(following):
            break
        new = following[turn]
        close, rendered, prompt, _ = chat_delta.turn(
            tok, seg.token_ids[-64:], True, new, tools, False, "", message.get("tool_calls")
        )
        seg.add_context(close, [])
        seg.add_context(rendered, new)
        seg.add_context(prompt, [])
    return seg, prompts


def calls_of(fmt, *expressions: str) -> str:
    """One turn's calls of the calculator, as `fmt` renders them (parallel calls: one after another)."""
    return fmt.render_calls([("calculator", {"expression": e}) for e in expressions])


def following_for(fmt) -> list[list[dict]]:
    """FOLLOWING with the format's call ids (Mistral's templates take 9-character ids only)."""
    return [
        [{"role": "tool", "tool_call_id": fmt.call_id(0, 0), "content": "1776"}],
        FOLLOWING[1],
        [
            {"role": "tool", "tool_call_id": fmt.call_id(2, 0), "content": "372"},
            {"role": "tool", "tool_call_id": fmt.call_id(2, 1), "content": "4"},
        ],
        FOLLOWING[3],
    ]


@dataclass(frozen=True)
class Family:
    """A model family for the tests: its tokenizer (real template, real added tokens), its tool format, five sampled
    turns (a call, an answer, two calls or one where the family makes one per turn, an answer, a goodbye), the
    messages that follow each, the token its turns end with (none: each reply ends with its own), how its turns
    carry reasoning (`think`: a leading <think> block of the content, which its template splits; `opened`: the text up
    to </think> of a <think> block the generation prompt opened, read apart as reasoning_content; `analysis`:
    harmony's analysis channel, read apart as reasoning_content; none) and the text it may write before its calls."""

    name: str
    tokenizer: Callable
    tool_format: str
    replies: list[str]
    following: list[list[dict]]
    tags: tuple[str, ...]  # the added tokens a reply's text is sampled with as single tokens
    end: str | None
    tools: list[dict] = field(default_factory=lambda: TOOLS)
    reasoning: str | None = None
    lead: str = ""

    @property
    def fmt(self):
        return TOOL_FORMATS.get(self.tool_format)()

    @property
    def parallel(self) -> bool:
        """Whether a turn may make several calls (harmony's make one per turn)."""
        return self.tool_format != "harmony"

    @cached_property
    def tok(self):
        """The family's tokenizer, built once."""
        return self.tokenizer()

    def episode(self, tok) -> tuple[Segment, list[list[int]]]:
        return episode(tok, self.replies, self.following, self.fmt, self.tags, self.end, self.tools)


def family(
    name,
    template,
    added,
    tags,
    fmt_name,
    eos,
    pad,
    bos=None,
    replies=None,
    end=None,
    following=None,
    tools=TOOLS,
    lead="Let me compute. ",
    reasoning=None,
):
    fmt = TOOL_FORMATS.get(fmt_name)()
    replies = replies or [
        lead + calls_of(fmt, "37*48"),
        "The answer is 1776.",
        calls_of(fmt, "12*31", "2+2"),
        "372 and 4.",
        "Bye.",
    ]
    corpus = [*replies, "system user assistant Use tools. What is 1776 372 calculator expression"]
    return Family(
        name,
        lambda: family_tokenizer(template, added, tags, corpus, eos=eos, pad=pad, bos=bos),
        fmt_name,
        replies,
        following or following_for(fmt),
        tuple(added),
        end if end is not None else eos,
        tools,
        reasoning,
        lead if replies is None else "",
    )


LLAMA3 = "<|begin_of_text|> <|end_of_text|> <|start_header_id|> <|end_header_id|> <|eom_id|> <|eot_id|> <|python_tag|>"
MISTRAL = (
    "<unk> <s> </s> [INST] [/INST] [AVAILABLE_TOOLS] [/AVAILABLE_TOOLS] [TOOL_RESULTS] [/TOOL_RESULTS] [TOOL_CALLS] "
    "[IMG] <pad> [IMG_BREAK] [IMG_END] [PREFIX] [MIDDLE] [SUFFIX] [SYSTEM_PROMPT] [/SYSTEM_PROMPT] [TOOL_CONTENT] "
    "[ARGS] [CALL_ID]"
)  # Tekken's control tokens; [ARGS] and [CALL_ID] from tokenizer v11 on
DEEPSEEK = (
    "<｜begin▁of▁sentence｜> <｜end▁of▁sentence｜> <｜User｜> <｜Assistant｜> <think> </think> <｜tool▁calls▁begin｜> "
    "<｜tool▁calls▁end｜> <｜tool▁call▁begin｜> <｜tool▁call▁end｜> <｜tool▁outputs▁begin｜> <｜tool▁outputs▁end｜> "
    "<｜tool▁output▁begin｜> <｜tool▁output▁end｜> <｜tool▁sep｜>"
)
HARMONY = "<|startoftext|> <|endoftext|> <|return|> <|constrain|> <|channel|> <|start|> <|end|> <|message|> <|call|>"
HARMONY_CALL = (
    "<|channel|>analysis<|message|>{}<|end|><|start|>assistant"
    + TOOL_FORMATS.get("harmony")().opening("calculator")
    + '{{"expression": "{}"}}<|call|>'
)
HARMONY_SAY = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>{}<|return|>"

FAMILIES = {
    f.name: f
    for f in [
        Family("qwen3", qwen3_tokenizer, "hermes", REPLIES, FOLLOWING, tuple(TAGS), "<|im_end|>", TOOLS, "think", LEAD),
        Family("qwen2.5", qwen25_tokenizer, "hermes", REPLIES, FOLLOWING, tuple(TAGS), "<|im_end|>", lead=LEAD),
        family(
            "qwen3-coder",
            "qwen3-coder.jinja",
            ADDED,
            TAGS,
            "qwen3-xml",
            "<|im_end|>",
            "<|endoftext|>",
            end="<|im_end|>",
        ),
        family("qwen3.5", "qwen3.5.jinja", ADDED, TAGS, "qwen3-xml", "<|im_end|>", "<|endoftext|>", reasoning="opened"),
        family(
            "llama3.1",
            "llama3.1.jinja",
            LLAMA3.split(),
            (),
            "llama3-json",
            "<|eot_id|>",
            "<|end_of_text|>",
            bos="<|begin_of_text|>",
            replies=[
                '<|python_tag|>{"name": "calculator", "parameters": {"expression": "37*48"}}',
                "The answer is 1776.",
                '{"name": "calculator", "parameters": {"expression": "12*31"}}; '
                '{"name": "calculator", "parameters": {"expression": "2+2"}}',
                "372 and 4.",
                "Bye.",
            ],
        ),
        family(
            "llama3.2",
            "llama3.2.jinja",
            LLAMA3.split(),
            (),
            "llama3-json",
            "<|eot_id|>",
            "<|end_of_text|>",
            bos="<|begin_of_text|>",
            lead="",
        ),
        family("mistral-nemo", "mistral-nemo.jinja", MISTRAL.split(), (), "mistral", "</s>", "<pad>", bos="<s>"),
        family(
            "mistral-small-3.2",
            "mistral-small-3.2.jinja",
            MISTRAL.split(),
            (),
            "mistral-v11",
            "</s>",
            "<pad>",
            bos="<s>",
        ),
        family(
            "deepseek-r1",
            "deepseek-r1.jinja",
            DEEPSEEK.split(),
            ("<think>", "</think>"),
            "deepseek-v3",
            "<｜end▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            bos="<｜begin▁of▁sentence｜>",
        ),
        family(
            "deepseek-v3.1",
            "deepseek-v3.1.jinja",
            DEEPSEEK.split(),
            ("<think>", "</think>"),
            "deepseek-v3.1",
            "<｜end▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            bos="<｜begin▁of▁sentence｜>",
        ),
        family(
            "gpt-oss",
            "gpt-oss.jinja",
            HARMONY.split(),
            (),
            "harmony",
            "<|return|>",
            "<|endoftext|>",
            bos="<|startoftext|>",
            end="",
            tools=DESCRIBED,
            reasoning="analysis",
            replies=[
                HARMONY_CALL.format("I should call the tool.", "37*48"),
                HARMONY_SAY.format("Got 1776.", "The answer is 1776."),
                HARMONY_CALL.format("First 12*31.", "12*31"),
                HARMONY_SAY.format("Got 372.", "372, and 2+2 is 4."),
                HARMONY_SAY.format("Done.", "Bye."),
            ],
            following=[
                [{"role": "tool", "tool_call_id": "call_0_0", "content": "1776"}],
                [{"role": "user", "content": "And 12*31 and 2+2?"}],
                [{"role": "tool", "tool_call_id": "call_2_0", "content": "372"}],
                [{"role": "user", "content": "Thanks."}],
            ],
        ),
    ]
}
