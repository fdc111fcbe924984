"""Episodes run in the farm (POST /v1/episodes): for each prompt a group of n episodes, run concurrently, each a
session driven by an environment plug-in (rollout_farm/services/episodes/environments.py).

An episode: open a session (the environment's tool format), reset the environment, then turn by turn: a chat turn
on the session with the environment's tools (tokens in, tokens out: only the observation's messages are rendered,
the sampled ids kept verbatim), the environment's step on the turn, its observation appended, until the environment
says done or a limit ends it. Its stop_reason says which: done, max_turns, max_tokens (the sampled tokens of the
episode), context_overflow (no room left in the model's context), env_error (the environment raised; the message is
kept, the rest of the group goes on). A reset or step slower than tool_timeout_s gets an error observation instead.
The farm's own errors (a replica lost, a weight version not reached) fail the request, as for a rollout; a turn the
engines refuse for lack of room (429) waits and tries again, since a group's episodes all run at once.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import tenacity
from pydantic import ValidationError

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.tool_formats import TOOL_FORMATS, ToolCall
from rollout_farm.services.episodes import calculator, mcp_env, openenv_remote  # noqa: F401  (the built-in environments)
from rollout_farm.services.episodes.allowed_hosts import NOTHING, AllowedHosts, NotAllowed, use_allowed_hosts
from rollout_farm.services.episodes.chat_turns import ContextFull
from rollout_farm.services.episodes.environments import ENVIRONMENTS, AssistantTurn, Environment, Step
from rollout_farm.services.episodes.sessions import Sessions
from rollout_farm.services.errors import Invalid, Overloaded, as_service_error
from rollout_farm.services.observability import metrics
from rollout_farm.services.protocol import episodes as E
from rollout_farm.services.protocol import sessions as S
from rollout_farm.services.protocol.episode_groups import as_group
from rollout_farm.services.tenants.registry import ANYONE, Principal

ContextLength = Callable[[], Awaitable[int | None]]
EPISODE_STRIDE = 1_000_003  # seed offset between the episodes of a seeded request (turns step by 1)
OVERLOAD_WAIT_S = 2.0  # the longest wait between two tries of a turn the engines refused for lack of room
OVERLOAD_PATIENCE_S = 600.0  # then the episode's request fails with the 429


class EnvironmentFailed(Exception):
    """The environment raised or answered wrongly: the episode ends with env_error."""


class Episodes:
    def __init__(
        self,
        sessions: Sessions,
        context_length: ContextLength,
        plugins: list[str],
        allowed: AllowedHosts = NOTHING,
        mcp_servers: dict | None = None,
    ):
        self.sessions, self.context_length, self.plugins, self.allowed = sessions, context_length, plugins, allowed
        # what the deployment configured for environments: the context env.params are validated in (mcp_env.py)
        self.configured = {"mcp_servers": mcp_servers or {}}

    async def environment(self, spec: E.EnvSpec, field: str = "env") -> tuple[type[Environment], object]:
        """The environment class and its checked params; 422 naming env.name or env.params.<field>, or the URL field
        of a remote environment whose host FARM_ENV_ALLOWED_HOSTS does not list (rollout_farm/services/episodes/
        allowed_hosts.py)."""
        try:
            kind = ENVIRONMENTS.get(spec.name, self.plugins)
        except KeyError as e:
            raise Invalid([{"field": f"{field}.name", "message": str(e).strip("'\"")}]) from None
        try:
            params = kind.Params.model_validate(spec.params, context=self.configured)
        except ValidationError as e:
            where = [f"{field}.params." + ".".join(map(str, x["loc"])) for x in e.errors()]
            raise Invalid([{"field": w, "message": x["msg"]} for w, x in zip(where, e.errors())]) from None
        if kind.tool_format not in ["auto", *TOOL_FORMATS.names()]:
            problem = f"its tool format {kind.tool_format!r} is not registered"
            raise Invalid([{"field": f"{field}.name", "message": problem}])
        for name, url in kind.remote_urls(params).items():
            try:
                await self.allowed.resolve(url)
            except NotAllowed as e:
                raise Invalid([{"field": f"{field}.params.{name}", "message": str(e)}]) from None
        return kind, params

    async def run(self, req: E.EpisodeRequest, who: Principal = ANYONE) -> E.EpisodeResponse:
        """The groups of the request; its episodes' sessions are `who`'s tenant's (another tenant's token gets a 404
        on them; the admin's and anyone's: no owner, as before tenants)."""
        groups = [g async for g in self.groups(req, who=who)]
        return E.EpisodeResponse(groups=sorted(groups, key=lambda g: g.prompt_index))

    async def generate_for_queue(self, req: E.EpisodeRequest, owner: str | None = None) -> list[P.Group]:
        """An episode source's groups, as rollout groups (rollout_farm/services/protocol/episode_groups.py); their
        sessions are the source's owner's."""
        groups = [as_group(g, req.sampling_params) for g in (await self.run(req, Principal(tenant=owner))).groups]
        return [g for g in groups if g is not None]

    async def stream(self, req: E.EpisodeRequest, who: Principal = ANYONE) -> AsyncIterator[str]:
        """NDJSON lines; the request is checked before the first line, so a bad one is still a plain 422."""
        resolved = await self.environment(req.env)

        async def lines() -> AsyncIterator[str]:
            sent = 0
            try:
                async for group in self.groups(req, resolved, who):
                    sent += 1
                    yield group.model_dump_json() + "\n"
                yield E.EpisodeStreamEnd(groups=sent).model_dump_json() + "\n"
            except Exception as e:
                error = as_service_error(e)
                yield E.EpisodeStreamEnd(groups=sent, error=error.message, status=error.status).model_dump_json() + "\n"

        return lines()

    async def groups(
        self, req: E.EpisodeRequest, resolved=None, who: Principal = ANYONE
    ) -> AsyncIterator[E.EpisodeGroup]:
        """The groups as they finish (`resolved`: the environment and its params, when checked already)."""
        kind, params = resolved or await self.environment(req.env)
        context = await self.context_length()
        groups = (self.group(req, kind, params, i, p, context, who) for i, p in enumerate(req.prompts))
        tasks = [asyncio.create_task(g) for g in groups]
        try:
            for done in asyncio.as_completed(tasks):
                yield await done
        finally:
            for t in tasks:
                t.cancel()

    async def group(
        self, req, kind, params, index: int, prompt: P.Prompt, context: int | None, who: Principal = ANYONE
    ) -> E.EpisodeGroup:
        group_id = f"{uuid.uuid4().hex[:12]}:{index}"  # the sessions of one group share it
        numbers = range(index * req.n, (index + 1) * req.n)
        runs = [self.episode(req, kind, params, prompt, group_id, context, number, who) for number in numbers]
        episodes = await asyncio.gather(*runs)
        rewards = [e.reward for e in episodes]
        std = statistics.pstdev(rewards)
        return E.EpisodeGroup(
            prompt_index=index,
            episodes=episodes,
            reward_mean=statistics.fmean(rewards),
            reward_std=std,
            zero_variance=std < 1e-6,
        )

    async def episode(
        self,
        req: E.EpisodeRequest,
        kind,
        params,
        prompt: P.Prompt,
        group_id: str,
        context: int | None,
        number: int,
        who: Principal = ANYONE,
    ) -> E.EpisodeOut:
        """Episode `number` of the request (its seed, with a seeded request: each episode and turn draws apart), in a
        session owned by `who`'s tenant."""
        use_allowed_hosts(self.allowed)  # where its environment may connect (this task's context)
        opened = await self.sessions.open(
            S.SessionCreate(
                sampling_params=req.sampling_params,
                sampler=req.sampler,
                group_id=group_id,
                min_weight_version=req.min_weight_version,
                adapter=req.adapter,
                tool_format=kind.tool_format,
                ttl_s=req.ttl_s,
            ),
            base_url="",
            who=who,
        )
        sid = opened.session_id
        run = EpisodeRun(self.sessions, req, kind, sid, context)
        run.seed = None if req.sampling_params.seed is None else (req.sampling_params.seed + EPISODE_STRIDE * number)
        try:
            run.env = kind(params)
        except Exception as e:
            run.stop_reason, run.error = "env_error", f"init: {type(e).__name__}: {e}"
        if run.env is not None:
            try:
                await run.play(prompt)
            finally:
                try:
                    await asyncio.wait_for(run.env.close(), req.tool_timeout_s)
                except Exception as e:  # a close that fails does not undo the episode
                    run.error = run.error or f"close: {type(e).__name__}: {e}"
        metrics.EPISODES.labels(run.stop_reason).inc()
        await self.sessions.reward(sid, S.SessionReward(reward=sum(run.rewards)), base_url="")
        await self.sessions.close(sid, base_url="")
        trajectory = await self.sessions.trajectory(sid)
        versions = [v for seg in trajectory.segments for v in seg.token_versions if v >= 0]
        return E.EpisodeOut(
            session_id=sid,
            segments=trajectory.segments,
            reward=sum(run.rewards),
            turn_rewards=run.rewards,
            turns=len(run.rewards),
            tool_calls=run.tool_calls,
            malformed_tool_calls=run.malformed,
            stop_reason=run.stop_reason,
            error=run.error,
            weight_version=min(versions, default=-1),
        )


class EpisodeRun:
    """One episode's loop and what it counted."""

    def __init__(self, sessions: Sessions, req: E.EpisodeRequest, kind: type[Environment], sid: str, context):
        self.sessions, self.req, self.kind, self.sid, self.context = sessions, req, kind, sid, context
        self.env: Environment | None = None
        self.seed: int | None = None  # the first turn's; turn t draws with seed + t
        self.rewards: list[float] = []
        self.tool_calls = self.malformed = self.sampled = 0
        self.stop_reason: E.StopReason = "max_turns"
        self.error: str | None = None

    async def play(self, prompt: P.Prompt) -> None:
        try:
            messages = await self.env_call("reset", self.env.reset(prompt))
        except EnvironmentFailed as e:
            self.stop_reason, self.error = "env_error", str(e)
            return
        if not messages:  # no task to answer: nothing to sample
            self.stop_reason = "env_error"
            self.error = f"reset answered no messages within tool_timeout_s={self.req.tool_timeout_s:g}"
            return
        messages = list(messages)
        for _ in range(self.req.max_turns):
            budget = self.req.sampling_params.max_new_tokens
            if self.req.max_total_tokens is not None:
                budget = min(budget, self.req.max_total_tokens - self.sampled)
                if budget < 1:
                    self.stop_reason = "max_tokens"
                    return
            seed = None if self.seed is None else (self.seed + len(self.rewards)) % 2**63
            tools = self.env.tools or None  # an instance's own, once reset has set them (openenv's)
            chat = S.SessionChatRequest(messages=messages, tools=tools, max_completion_tokens=budget, seed=seed)
            try:
                answer = await self.sample_turn(chat)
            except ContextFull:
                self.stop_reason = "context_overflow"
                return
            turn, message = assistant_turn(answer)
            self.sampled += len(turn.token_ids)
            self.tool_calls += len(turn.tool_calls)
            self.malformed += len(turn.malformed)
            messages.append(message)
            try:
                step = await self.env_call("step", self.env.step(turn))
            except EnvironmentFailed as e:
                self.stop_reason, self.error = "env_error", str(e)
                return
            step = step or timed_out(turn, self.req.tool_timeout_s)
            self.rewards.append(float(step.reward))
            if step.done:
                self.stop_reason = "done"
                return
            if not step.observation:
                self.stop_reason, self.error = "env_error", "step answered no observation and done=False"
                return
            messages += step.observation
            if self.sampled >= (self.req.max_total_tokens or float("inf")):
                self.stop_reason = "max_tokens"
                return

    async def sample_turn(self, chat: S.SessionChatRequest) -> dict:
        """The turn, waiting out the engines' back-pressure (429): a group's episodes run at once and may fill the
        replicas, which is no reason to fail the request."""
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(Overloaded),
            wait=tenacity.wait_random_exponential(multiplier=0.1, max=OVERLOAD_WAIT_S),
            stop=tenacity.stop_after_delay(OVERLOAD_PATIENCE_S),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self.sessions.chat(self.sid, chat, self.context)

    async def env_call(self, what: str, call: Awaitable):
        """The environment's answer; None when it takes longer than tool_timeout_s; EnvironmentFailed if it
        raises."""
        start = time.monotonic()
        try:
            return await asyncio.wait_for(call, self.req.tool_timeout_s)
        except asyncio.TimeoutError:  # TimeoutError from 3.11, its own class on 3.10
            metrics.ENV_TIMEOUTS.labels(what).inc()
            return None
        except Exception as e:
            raise EnvironmentFailed(f"{what}: {type(e).__name__}: {e}") from e
        finally:
            metrics.ENV_STEP_SECONDS.labels(what).observe(time.monotonic() - start)


def assistant_turn(answer: dict) -> tuple[AssistantTurn, dict]:
    """A chat completion as the environment's AssistantTurn, and as the message the history goes on with."""
    choice = answer["choices"][0]
    message = {key: v for key, v in choice["message"].items() if v is not None}
    fns = [(c["id"], c["function"]) for c in message.get("tool_calls", [])]
    calls = [ToolCall(i, f["name"], f["arguments"]) for i, f in fns]
    farm = answer["farm"]
    turn = AssistantTurn(
        message.get("content") or "", farm["token_ids"], calls, farm["malformed_tool_calls"], choice["finish_reason"]
    )
    return turn, message


def timed_out(turn: AssistantTurn, timeout_s: float) -> Step:
    """The observation of a step that did not answer in time: an error for each call, or for the turn."""
    error = f"error: the environment did not answer within {timeout_s:g} s"
    if turn.tool_calls:
        return Step([{"role": "tool", "tool_call_id": c.id, "content": error} for c in turn.tool_calls])
    return Step([{"role": "user", "content": error}])
