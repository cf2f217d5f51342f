"""Environments for tool-using agents: the message-level protocol, tools, the token-level wrapper and
the registry. Importing this package only exports names; it registers and imports no environment.
See README.md ("Environments") for writing your own in about 30 lines.
"""

from envs.conformance import ConformanceError, check_environment
from envs.episode_limits import EpisodeLimits
from envs.formats import FORMATS, ToolCallFormat, detect_format, get_format
from envs.protocol import (
    Environment,
    Episode,
    Immutable,
    Message,
    ProtocolError,
    Rubric,
    StepResult,
    ToolCall,
    ToolSpec,
    default_rubric,
)
from envs.registry import BUILTINS, UnknownEnvironmentError, available, make_env, resolve
from envs.template import ChatTemplate
from envs.template_text import TemplateError
from envs.toolcalls import ParsedTurn, ToolCallError, format_tool_call, parse_tool_calls
from envs.tools import Tool, ToolEnv, execute_tool_call, render_result, tools_from_openai
from envs.wrapper import (
    EnvStepError,
    Finish,
    PromptTooLongError,
    TokenEnv,
    TurnResult,
    WrapperConfig,
)

__all__ = [
    "BUILTINS",
    "FORMATS",
    "ChatTemplate",
    "ConformanceError",
    "EnvStepError",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "Finish",
    "Immutable",
    "Message",
    "ParsedTurn",
    "PromptTooLongError",
    "ProtocolError",
    "Rubric",
    "StepResult",
    "TemplateError",
    "TokenEnv",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolCallFormat",
    "ToolEnv",
    "ToolSpec",
    "TurnResult",
    "UnknownEnvironmentError",
    "WrapperConfig",
    "available",
    "check_environment",
    "default_rubric",
    "detect_format",
    "execute_tool_call",
    "format_tool_call",
    "get_format",
    "make_env",
    "parse_tool_calls",
    "render_result",
    "resolve",
    "tools_from_openai",
]
