"""verifiers end to end against the farm: one multi-turn rollout of a verifiers 0.4.0 task, through its training client
(token ids to POST /inference/v1/generate, rendered by `renderers`) and its evaluation client (chat, streamed, to
/v1/chat/completions, and to a farm session's), with verifiers' own agent, interception server and rubric
(tests/verifiers_driver.py).

verifiers pins openai<3 and mcp==2.0.0, which the project's venv cannot hold, so it runs in a venv of its own, built
from tests/data/verifiers.lock once and cached in FARM_CACHE/venvs (keyed by the lock's digest, reused by every test
session); a cold build takes about a minute. The samples are checked against the farm's own: each of the training
trace's token paths, sent to POST /v1/rollouts with the same seed, gives the same ids and logprobs."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollout_farm.services.models import CACHE
from tests.conftest import TOKEN

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "tests" / "data" / "verifiers.lock"
DRIVER = ROOT / "tests" / "verifiers_driver.py"
SEED = 5
MAX_TOKENS = 8  # the driver's sampling.max_tokens
USER_TURNS = ["and 2+2?", "thanks"]  # after the task's own prompt: three turns


def pip_install(python: Path) -> None:
    command = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--disable-pip-version-check"]
    command += ["-c", str(LOCK), f"verifiers=={verifiers_version()}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        error = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1][-500:]
    except subprocess.TimeoutExpired:
        error = "timed out after 600 s"
    if error is None:
        return
    reason = f"could not install verifiers from {LOCK.name} (`{' '.join(command[2:])}`): {error}"
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"{reason}. CI is set, so this fails rather than skips: CI must reach PyPI")
    pytest.skip(reason)


def verifiers_version() -> str:
    (version,) = re.findall(r"^verifiers==(\S+)$", LOCK.read_text(), re.M)
    return version


@pytest.fixture(scope="module")
def verifiers_python() -> Path:
    """The cached venv's python: built in a folder of its own, then renamed into place, so a build cut short is never
    taken for a finished one."""
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()[:12]
    home = CACHE / "venvs" / f"verifiers-{verifiers_version()}-{digest}"
    if not (home / "bin" / "python").exists():
        building = home.with_name(f".{home.name}-{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(building)], check=True, timeout=60)
        pip_install(building / "bin" / "python")
        try:
            building.rename(home)
        except OSError:  # another session finished first
            shutil.rmtree(building, ignore_errors=True)
    return home / "bin" / "python"


@pytest.fixture(scope="module")
def traces(service, tiny_model, verifiers_python, tmp_path_factory) -> dict:
    """The driver's three traces (train, eval, session) of the same task, seed and user turns, and the session's own
    record of its turns."""
    model = httpx.get(f"{service}/v1/models", timeout=30).json()["data"][0]["id"]
    session = httpx.post(f"{service}/v1/sessions", json={}, timeout=30).json()["base_url"]
    home = tmp_path_factory.mktemp("verifiers-home")  # verifiers' caches and runtime folders, not the user's
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "FARM_API_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    # -I: neither the checkout nor PYTHONPATH on sys.path, so only the venv's packages are importable
    command = [str(verifiers_python), "-I", str(DRIVER), service, model, str(tiny_model), str(SEED), session]
    done = subprocess.run([*command, *USER_TURNS], capture_output=True, text=True, timeout=300, env=env, cwd=home)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout) | {"trajectory": httpx.get(f"{session}/trajectory", timeout=30).json()}


def farm_sample(service: str, prompt: list[int], seed: int) -> dict:
    """The farm's own sample of `prompt` with the sampling the training client sent (renderers adds the tokenizer's
    EOS as stop_token_ids)."""
    params = {"temperature": 1.0, "max_new_tokens": MAX_TOKENS, "seed": seed, "stop_token_ids": [1]}
    body = {"prompts": [{"token_ids": prompt}], "sampling_params": params}
    r = httpx.post(f"{service}/v1/rollouts", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["groups"][0]["samples"][0]


def rubric(trace: dict) -> None:
    """The task's rewards, computed by verifiers from the last reply, as the driver's rubric defines them."""
    last = trace["replies"][-1]
    assert trace["rewards"] == {
        "says_the_answer": {"score": float("7" in last), "weight": 1.0},
        "reply_length": {"score": len(last) / 100, "weight": 0.5},
    }
    assert trace["reward"] == pytest.approx(float("7" in last) + 0.5 * len(last) / 100)


def turns(trace: dict) -> None:
    assert trace["ok"] and trace["errors"] == [] and trace["stop_condition"] == "user_closed"
    assert trace["num_turns"] == len(trace["calls"]) == len(trace["replies"]) == 1 + len(USER_TURNS)
    for call in trace["calls"]:  # a random model: every turn runs to max_tokens
        assert call["finish_reason"] == "length" and call["usage"]["completion_tokens"] == MAX_TOKENS


def same_as_the_farms(service: str, ids: list[int], sampled: list[bool], logprobs: list[float]) -> None:
    """Each sampled run of tokens is the farm's own sample of the tokens before it, with the same seed."""
    starts = [i for i, s in enumerate(sampled) if s and (i == 0 or not sampled[i - 1])]
    assert starts and all(sampled[i : i + MAX_TOKENS] == [True] * MAX_TOKENS for i in starts)
    assert sum(sampled) == MAX_TOKENS * len(starts)
    for i in starts:
        own = farm_sample(service, ids[:i], SEED)
        assert own["token_ids"] == ids[i : i + MAX_TOKENS], f"the run at {i}"
        assert own["logprobs"] == pytest.approx(logprobs[i : i + MAX_TOKENS], abs=1e-5)


def test_the_training_client_samples_the_farms_tokens(service, tiny_model, traces):
    from transformers import AutoTokenizer

    train = traces["train"]
    turns(train)
    rubric(train)
    # the renderer rendered the task's prompt with the model folder's own chat template
    opening = [{"role": "user", "content": "Q: 3+4\nA:"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rendered = tokenizer.apply_chat_template(opening, add_generation_prompt=True, return_dict=False)
    # The tiny model's random bytes do not survive a decode and re-render, so each turn re-renders the conversation
    # and starts a path of its own (verifiers' branches): one sampled completion at the end of each.
    branches = train["branches"]
    assert len(branches) == train["num_turns"]
    assert branches[0]["token_ids"][: len(rendered)] == rendered
    for branch in branches:
        ids, mask, logprobs = branch["token_ids"], branch["sampled_mask"], branch["logprobs"]
        assert mask[-MAX_TOKENS:] == [True] * MAX_TOKENS and not any(mask[:-MAX_TOKENS])
        same_as_the_farms(service, ids, mask, logprobs)
        assert all(lp == 0.0 for lp in logprobs[:-MAX_TOKENS])  # verifiers' zeros on the unsampled tokens
    # negative control: another seed samples other tokens, so the agreement above is not the prompt's alone
    prompt = branches[0]["token_ids"][:-MAX_TOKENS]
    assert farm_sample(service, prompt, SEED + 1)["token_ids"] != branches[0]["token_ids"][-MAX_TOKENS:]


def test_the_evaluation_client_chats_with_the_farm(service, traces):
    chat, train = traces["eval"], traces["train"]
    turns(chat)
    rubric(chat)
    assert all(c["endpoint"] == "/chat/completions" for c in chat["calls"])
    assert chat["branches"] == [{"token_ids": [], "sampled_mask": [], "logprobs": []}]  # chat carries no tokens
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["user", "assistant"] * chat["num_turns"]
    assert [m["content"] for m in chat["messages"][2::2]] == USER_TURNS
    # the farm renders the chat with the same template and samples with the same seed: the same replies as the
    # training client's, although one route detokenized them and the other parsed token ids
    assert chat["replies"] == train["replies"]
    # and the last turn, asked of the farm directly with the conversation the client sent, answers the same
    model = httpx.get(f"{service}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": chat["messages"][:-1], "max_tokens": MAX_TOKENS, "temperature": 1.0}
    body["seed"] = SEED
    r = httpx.post(f"{service}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip() == chat["replies"][-1]


def test_the_evaluation_client_on_a_session_leaves_one_token_exact_trajectory(service, traces):
    """The same client pointed at a farm session: the farm matches the history by messages, not by re-rendering, so the
    three turns append to one segment (where the training client's re-renders started a path per turn), with the
    sampled tokens and their logprobs."""
    chat, train, trajectory = traces["session"], traces["train"], traces["trajectory"]
    turns(chat)
    rubric(chat)
    assert chat["replies"] == traces["eval"]["replies"]
    (segment,) = trajectory["segments"]
    ids, mask, logprobs = segment["token_ids"], segment["loss_mask"], segment["logprobs"]
    assert sum(mask) == MAX_TOKENS * chat["num_turns"]
    same_as_the_farms(service, ids, [bool(m) for m in mask], logprobs)
    # the first turn's prompt is the one the training client rendered: the same tokens and logprobs
    assert ids[: len(train["branches"][0]["token_ids"])] == train["branches"][0]["token_ids"]


def test_a_bridged_turn_is_sampled(service):
    """A renderer that extends the last turn's tokens (a real family's: Qwen3, Llama 3, ...; the tiny model's
    template has none) makes verifiers' training client add `routed_experts_prompt_start` to sampling_params
    (clients/train.py, TrainClient.get_response). The farm returns no routed experts, as vLLM without
    --enable-return-routed-experts; a negative start is refused, naming the field."""
    params = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "seed": SEED, "stop_token_ids": [1], "logprobs": 1}
    body = {"token_ids": [40, 41, 42], "sampling_params": params | {"routed_experts_prompt_start": 2}}
    r = httpx.post(f"{service}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["routed_experts"] is None
    assert choice["token_ids"] == farm_sample(service, [40, 41, 42], SEED)["token_ids"]
    body["sampling_params"]["routed_experts_prompt_start"] = -1
    r = httpx.post(f"{service}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "sampling_params.routed_experts_prompt_start"
