"""A verl function tool (verl.tools.function_tool), loaded by verl's AgentLoopWorker from this file's path
(rollout.multi_turn.function_tool_path) in tests/service/test_verl_tool_agent.py."""

from verl.tools.function_tool import function_tool

from rollout_farm.services.episodes.calculator import calculate, shown


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. 37*48.
    """
    value = shown(calculate(expression))
    return f"{value} say:‹The answer is {value}.›"  # scripts the model's next turn (the bench app's EchoEngine)
