"""Calculator environment: random arithmetic with a `calculate` tool and a verifiable answer."""

from envs.calculator.env import CalculatorEnv, CalculatorTask, EfficientAnswer, ExactAnswer, make_task

__all__ = ["CalculatorEnv", "CalculatorTask", "EfficientAnswer", "ExactAnswer", "make_task"]
