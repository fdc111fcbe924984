"""Model families' real chat templates and tokenizers for tests, without weights or a model hub
(tests/data/chat_templates: the official templates as llama.cpp's models/templates carries them, MIT). The vocabulary
is a byte-level BPE trained here with the family's added tokens: the template is the real one, its special tokens are
single tokens, and the sampled ids may differ from the canonical encoding of their text, as a real model's do.

`qwen3_tokenizer()` builds Qwen3's; `sampled` writes a turn as a model samples it; `episode` runs the turns as a
session builds them (tests/unit/test_chat_families.py, the replay corpus).
"""

from pathlib import Path

from rollout_farm.services.chat import delta as chat_delta
from rollout_farm.services.chat.tool_formats import Hermes
from rollout_farm.services.episodes.segments import Segment

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
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


def qwen3_tokenizer():
    """Qwen3's tokenizer: its added tokens (the six tags not special) on a BPE trained on the turns below."""
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
