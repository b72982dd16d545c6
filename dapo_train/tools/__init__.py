"""Tools the policy may call while it samples (issue 42): by name from one registry, as the rewards are.

registry.py    the registry (`register`), Tool (its JSON schema, `call` that never raises), resolve_tools
               (names or 'pkg.module:function' -> checked Tools), tool_schemas (for apply_chat_template)
calculator.py  the `calculator` tool: exact arithmetic over a parsed expression tree, every cost bounded
template.py    require_tool_template: a tokenizer's chat template must render the tools and tool turns

Rollouts do not call tools yet: no config key names them, and the engines sample one assistant turn.
"""

from dapo_train.tools import calculator  # noqa: F401  (fill TOOLS with the built-in tools)
from dapo_train.tools.calculator import calculate
from dapo_train.tools.registry import TOOLS, Tool, register, resolve_tools, tool_from_function, tool_schemas
from dapo_train.tools.template import require_tool_template

__all__ = ["TOOLS", "Tool", "calculate", "register", "require_tool_template", "resolve_tools",
           "tool_from_function", "tool_schemas"]
