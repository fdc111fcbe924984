"""The built-in calculator environment: a task prompt, a `calculator` tool the model may call, and the task's reward on
the final answer (the turn that calls no tool).

For the embedded arithmetic model it uses the plain tool format (`call calculator {"expression": "37*48"}`); the
tool's answer is the observation `= 1776`. Expressions are read with `ast`, never `eval`: numbers, + - * / // % **
and parentheses, with bounded sizes, so a model cannot make the farm compute forever.
"""

from __future__ import annotations

import ast
import json
import operator

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.tool_formats import ToolCall
from rollout_farm.services.episodes.environments import ENVIRONMENTS, AssistantTurn, Environment, Step
from rollout_farm.services.extensions.rewards import REWARDS

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3456*78"}},
            "required": ["expression"],
        },
    },
}
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
MAX_EXPRESSION = 200  # characters
MAX_MAGNITUDE = 10**30  # of any operand or result


class CalculatorError(ValueError):
    pass


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError saying why for anything else."""
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None
    return value(tree)


def value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        out = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = value(node.left), value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise CalculatorError("exponent above 64")
        try:
            out = OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    else:
        raise CalculatorError(f"{type(node).__name__} is not arithmetic")
    if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE:
        raise CalculatorError("out of range")
    return out


def shown(number: int | float) -> str:
    return str(int(number)) if float(number).is_integer() else f"{number:.6g}"


class CalculatorParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: str = Field("gsm8k", description="The reward function (REWARDS) of the final answer.")

    @field_validator("reward")
    @classmethod
    def registered(cls, name: str) -> str:
        if name not in REWARDS.names():
            raise ValueError(f"unknown reward {name!r}: {', '.join(REWARDS.names())}")
        return name


@ENVIRONMENTS.register("calculator")
class Calculator(Environment):
    """A task prompt (text, with its ground_truth) and a calculator tool; the reward is the task's on the answer."""

    Params = CalculatorParams
    tools = [CALCULATOR_TOOL]
    tool_format = "plain"

    def __init__(self, params: CalculatorParams):
        super().__init__(params)
        self.reward = REWARDS.get(params.reward)
        self.ground_truth: str | None = None

    async def reset(self, prompt: P.Prompt) -> list[dict]:
        if prompt.text is None:
            raise ValueError("the calculator environment takes text prompts (with a ground_truth)")
        self.ground_truth = prompt.ground_truth
        return [{"role": "user", "content": prompt.text}]

    async def step(self, turn: AssistantTurn) -> Step:
        if not turn.tool_calls:
            return Step(reward=self.reward(turn.text, self.ground_truth), done=True)
        return Step([{"role": "tool", "tool_call_id": c.id, "content": self.answer(c)} for c in turn.tool_calls])

    @staticmethod
    def answer(call: ToolCall) -> str:
        """The tool's answer, or an error the model can read (a wrong call is an observation, not a failure)."""
        if call.name != "calculator":
            return f"error: no tool {call.name!r}; the tool is calculator"
        expression = json.loads(call.arguments).get("expression")
        if not isinstance(expression, str):
            return 'error: give {"expression": "..."}'
        try:
            return f"= {shown(calculate(expression))}"
        except CalculatorError as e:
            return f"error: {e}"
