"""Run by the isolated verifiers venv (tests/service/test_verifiers.py), never imported by the farm's tests: one
verifiers 0.4.0 multi-turn rollout against the farm, and its trace as JSON on stdout.

verifiers' own pieces do the work: an `Agent` (the `null` harness, its chat program in a subprocess runtime), the
interception server it puts between that program and the model, and the client the rollout names: `train` (renders the
chat with `renderers`, posts token ids to the farm's POST /inference/v1/generate) or `eval` (relays the program's
streamed chat request to the farm's /v1/chat/completions, or to a farm session's). The task's prompt opens the
exchange, the driver answers as the user for the later turns, and the task's `@vf.reward`s score the finished trace.

One substitution, outside what is tested: verifiers prepares the chat program's own environment with `uv sync
--script` (runtimes/base.py: Runtime.prepare_uv_script), a second install from PyPI on every machine. The program's
dependencies (openai, mcp==2.0.0, httpx, httpx2, tenacity, certifi) are verifiers' own, so this venv holds them
already: the driver writes the same program text and runs it with this venv's python.

    FARM_API_TOKEN=... python -I verifiers_driver.py BASE_URL MODEL TOKENIZER_FOLDER SEED SESSION_URL USER_TURN...

prints {"train": trace, "eval": trace, "session": trace}: the same task, sampling and user turns through each client.
"""

import asyncio
import hashlib
import json
import sys

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarnessConfig
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

MAX_TOKENS = 8


async def prepare_with_this_python(self, script, env=None, *, activate=True) -> list[str]:
    """SubprocessRuntime.prepare_uv_script without uv: the script in the rollout's folder, run by this venv."""
    data = script.encode() if isinstance(script, str) else script
    path = self.workdir / f"{hashlib.sha256(data).hexdigest()}.py"
    path.write_bytes(data)
    return [sys.executable, str(path)]


SubprocessRuntime.prepare_uv_script = prepare_with_this_python


class Arith(vf.TaskData):
    answer: str


class ArithTask(vf.Task[Arith]):
    """The task's rubric: two rewards of the finished trace, each a function of what the model replied."""

    @vf.reward
    async def says_the_answer(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def reply_length(self, trace: vf.Trace) -> float:
        return len(trace.last_reply) / 100


def clients(base_url: str, tokenizer: str, session_url: str) -> dict[str, vf.ClientConfig]:
    """The farm as verifiers' training client (token routes) and its evaluation client (chat), the latter stand-alone
    and on a farm session (which keeps the turns' tokens)."""
    key = {"api_key_var": "FARM_API_TOKEN"}
    return {
        # the renderer's tokenizer: the model folder's (the farm serves it as "tiny-llama", not a hub name)
        "train": vf.TrainClientConfig(base_url=f"{base_url}/v1", renderer_model_name=tokenizer, **key),
        "eval": vf.EvalClientConfig(base_url=f"{base_url}/v1", **key),
        "session": vf.EvalClientConfig(base_url=session_url, **key),
    }


async def rollout(model: str, client: vf.ClientConfig, seed: int, user_turns: list[str]) -> dict:
    """One rollout: the task's prompt opens it, each of `user_turns` is a later user turn; the trace as JSON."""
    config = vf.AgentConfig(
        model=model,
        harness=NullHarnessConfig(id="null"),
        runtime=vf.SubprocessConfig(),
        client=client,
        sampling=vf.SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed),
    )
    task = ArithTask(Arith(idx=0, prompt="Q: 3+4\nA:", answer="7"))
    async with vf.make_agent(config) as agent, agent.interaction(task) as chat:
        segments = [await chat.turn()]
        for text in user_turns:
            segments.append(await chat.turn(text))
    trace = chat.trace
    return {
        "ok": trace.ok,
        "errors": [e.model_dump() for e in trace.errors],
        "stop_condition": trace.stop_condition,
        "num_turns": trace.num_turns,
        "rewards": {name: r.model_dump() if r else None for name, r in trace.rewards.items()},
        "reward": trace.reward,
        "replies": [s.last_reply for s in segments],
        # the conversation as the last turn saw it, and each root-to-leaf path as verifiers trains on it
        "messages": [{"role": m.role, "content": m.content} for m in trace.branches[-1].messages],
        "branches": [
            {"token_ids": b.token_ids, "sampled_mask": b.sampled_mask, "logprobs": b.logprobs} for b in trace.branches
        ],
        "calls": [
            {"endpoint": c.endpoint, "finish_reason": c.finish_reason, "usage": c.usage.model_dump()}
            for c in trace.calls
        ],
    }


async def main(base_url: str, model: str, tokenizer: str, seed: int, session_url: str, user_turns: list[str]) -> dict:
    return {
        kind: await rollout(model, client, seed, user_turns)
        for kind, client in clients(base_url, tokenizer, session_url).items()
    }


if __name__ == "__main__":
    url, served, folder, seed_arg, session, *turns = sys.argv[1:]
    print(json.dumps(asyncio.run(main(url, served, folder, int(seed_arg), session, turns))))
