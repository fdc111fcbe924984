"""Model folders: any local HF folder by path, or the embedded default built on first use.

The embedded default (`arith-tiny`) needs no hub: a byte-level tokenizer and a
1.1M-parameter Llama, pretrained here in about two minutes on the arithmetic task.
Its pretraining corpus writes FORMAT_MIX of the answers as `#### <n>` (the format
the reward checks) and the rest as `The answer is <n>.`, and it stops before the
arithmetic is perfect. Greedy decoding picks the majority format, so it starts at
zero reward, and RL can gain by learning the reward's format and by getting sums
right. The mix is close to even so that the sums are learnt about as well in either
format (`bench/format_probe.py`): at 0.3 the rewarded format got 8 points fewer sums
right, and RL could not switch formats without losing skill.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger("farm.models")

DEFAULT_MODEL = "arith-tiny"
FORMAT_MIX = 0.45  # share of pretraining answers written in the rewarded `#### n` format
PRETRAIN_STEPS = 400
CACHE = Path(os.environ.get("FARM_CACHE", Path.home() / ".cache" / "rollout-farm"))


# The built-in models' chat template: the messages' text, one per line, with no role labels. A single user
# message renders to exactly its text, so the trainer (which renders prompts through a model's template) sends the
# prompts the model was pretrained on, and chat works on the built-in models out of the box.
CHAT_TEMPLATE = "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ m['content'] }}{% endfor %}"


def byte_tokenizer():
    """A byte-level tokenizer (every byte one token) with pad and end-of-turn specials and CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_llama(
    out: Path,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    context: int = 512,
    tie: bool = False,
    vocab: int | None = None,
) -> Path:
    """Save a randomly initialised Llama with the byte tokenizer to `out` (for tests and benchmarks); `context` is its
    max_position_embeddings (the weights do not depend on it); `tie`: the output layer is the embedding (SmolLM2,
    Qwen2.5); `vocab`: more token ids than the tokenizer's (a real model's output layer size)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=context,
        tie_word_embeddings=tie,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def default_model_folder() -> Path:
    """Where the embedded default is built, in FARM_CACHE."""
    return CACHE / "models" / f"{DEFAULT_MODEL}-v2"  # v2: FORMAT_MIX 0.45 (v1: 0.3)


def resolve_model(name_or_path: str) -> Path:
    """A model folder for a path or a built-in name, building the default into the cache on first use."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: give a Hugging Face model folder")
        return path
    if name_or_path != DEFAULT_MODEL:
        raise FileNotFoundError(f"no model folder at {name_or_path!r}; give a path or {DEFAULT_MODEL!r}")
    out = default_model_folder()
    if not (out / "done").exists():
        build_default(out)
    return out


def pretraining_text(rng: random.Random, task) -> tuple[str, str]:
    """One (prompt, completion) pair of the default model's pretraining corpus."""
    p = task.train_batch(rng, 1)[0]
    answer = f" #### {p.answer}" if rng.random() < FORMAT_MIX else f" The answer is {p.answer}."
    return p.prompt, answer


EOS = None  # a piece that is the end-of-turn token
Piece = tuple[Optional[str], bool]  # text (EOS: the end-of-turn token), and whether the model learns it


def default_corpus(rng: random.Random, task) -> list[Piece]:
    """One example of the default model's pretraining corpus: a prompt, and its answer to learn."""
    prompt, answer = pretraining_text(rng, task)
    return [(prompt, False), (answer, True), (EOS, True)]


def build_default(out: Path, steps: int = PRETRAIN_STEPS, batch: int = 128, seed: int = 0) -> Path:
    """Pretrain the embedded default model on the arithmetic corpus and save it atomically to `out`."""
    from rollout_farm.services.extensions.tasks import ArithTask

    task = ArithTask()
    return pretrain(out, lambda rng: default_corpus(rng, task), steps, batch, seed, "the default model")


def pretrain(
    out: Path,
    corpus: Callable[[random.Random], list[Piece]],
    steps: int = PRETRAIN_STEPS,
    batch: int = 128,
    seed: int = 0,
    what: str = "a model",
) -> Path:
    """Pretrain a fresh tiny Llama (byte tokenizer) on `corpus`'s examples, learning only their pieces marked so,
    and save it atomically to `out`."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tiny_llama(tmp, hidden=128, layers=4, seed=seed)
    tok, model = AutoTokenizer.from_pretrained(tmp), AutoModelForCausalLM.from_pretrained(tmp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.1)
    rng, start = random.Random(seed), time.time()
    log.info("pretrain", extra={"model": what, "steps": steps, "out": str(out)})
    for _ in tqdm(range(steps), desc=f"pretraining {what}", unit="step"):
        ids, labels = [], []
        for pieces in (corpus(rng) for _ in range(batch)):
            x, y = [], []
            for text, learnt in pieces:
                piece = [tok.eos_token_id] if text is EOS else tok.encode(text, add_special_tokens=False)
                x += piece
                y += piece if learnt else [-100] * len(piece)
            ids.append(x)
            labels.append(y)
        width = max(map(len, ids))
        input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
        label_t = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        loss = model(input_ids=input_ids, attention_mask=(input_ids != tok.pad_token_id).long(), labels=label_t).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad()
    model.save_pretrained(tmp)
    (tmp / "done").write_text(json.dumps({"steps": steps, "final_loss": loss.item(), "seconds": time.time() - start}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
