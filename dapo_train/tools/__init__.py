"""Tools the policy may call while it samples (issue 42): by name from one registry, as the rewards are.

registry.py    the registry (`register`), Tool (its JSON schema, `call` that never raises), resolve_tools
               (names or 'pkg.module:function' -> checked Tools), tool_schemas (for apply_chat_template)
calculator.py  the `calculator` tool: exact arithmetic over a parsed expression tree, every cost bounded
template.py    require_tool_template: a tokenizer's chat template must render the tools and tool turns
turns.py       ToolTurns: the calls of an assistant turn parsed and run, the tool turn the template renders

rollout.tools names them; the decode loop feeds a row that calls them the tool turn (rollout/tool_rows.py).
"""

from dapo_train.tools import calculator  # noqa: F401  (fill TOOLS with the built-in tools)
from dapo_train.tools.calculator import calculate
from dapo_train.tools.registry import TOOLS, Tool, register, resolve_tools, tool_from_function, tool_schemas
from dapo_train.tools.template import require_tool_template

__all__ = ["TOOLS", "Tool", "calculate", "register", "require_tool_template", "resolve_tools",
           "tool_from_function", "tool_schemas"]
