"""The built-in models' chat template: the trainer renders its prompts through a model's template, so a single user
message must come out as exactly the prompt the model was pretrained on (with role labels, arith-tiny saw prompts it
never learned, and the demo scored 0.000 before and after RL)."""

from rollout_farm.services.extensions.tasks import ArithTask
from rollout_farm.services.models import byte_tokenizer
from rollout_farm.trainer.sync.rollouts import render_prompt


def test_a_user_message_renders_to_the_pretraining_prompt():
    tok = byte_tokenizer()
    for problem in ArithTask().heldout(5):
        assert render_prompt(tok, problem) == problem.prompt


def test_several_messages_render_one_per_line():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: 2+2\nA:"}]
    assert byte_tokenizer().apply_chat_template(messages, tokenize=False) == "be brief\nQ: 2+2\nA:"
