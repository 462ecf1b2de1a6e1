"""Tool calls and structured output for a chat model that knows neither (sans-IO).

The model sees its tools in a system message and is asked to answer a call
as ``<tool_call>`` followed by ``{"name": ..., "arguments": {...}}``, the
Hermes convention most small instruct models were tuned on. What it may
write is then constrained by a llama.cpp grammar built with llama-cpp-python's
JSON-schema converter, so a call is always valid JSON for its function's
``parameters``:

- a named function or ``"required"``: the call marker is already in the
  prompt (the answer's first words), and the grammar admits only a call
  object for that function (or for any of the tools);
- ``"auto"``: the grammar admits either the marker and a call object, or
  text (or, with ``response_format``, the requested JSON) that does not
  start with ``<``; the first character decides which;
- ``response_format`` ``json_object`` / ``json_schema`` without a call:
  the grammar of that schema.

``ToolCallScanner`` turns the text the model writes into OpenAI's stream
shape as it arrives: content pieces, or one tool call whose first delta has
the id and name and whose next deltas are fragments of ``arguments``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from hedgerow.errors import InvalidRequest

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
# Text that does not start with "<" (so it can't be mistaken for a call).
_ANY_TEXT = r'[^<] [^\x00]*'
# A call object's head: its name (the call starts there), then the arguments' key.
_CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_SPACE_CHARS = " \t\r\n"
_TAIL_CHARS = "}" + _SPACE_CHARS


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call; ``parameters`` is its JSON Schema as JSON text."""

    name: str
    description: str
    parameters: str

    def schema(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.parameters) if self.parameters else {}
        return parsed or NO_ARGUMENTS


def forced(mode: str | None) -> bool:
    """A call must be made: a named function or ``"required"``."""
    return mode is not None and mode != "auto"


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             "arguments": tool.schema()},
            "required": ["name", "arguments"], "additionalProperties": False}


def callable_tools(tools: tuple[ToolSpec, ...], mode: str) -> tuple[ToolSpec, ...]:
    if mode.startswith("function:"):
        return tuple(t for t in tools if t.name == mode.removeprefix("function:"))
    return tools


def known_call(tools: tuple[ToolSpec, ...], mode: str | None) -> ToolSpec | None:
    """The function a forced call must be to, when there is only one: its name
    then goes in the prompt and the model writes only the arguments."""
    if not forced(mode):
        return None
    assert mode is not None
    chosen = callable_tools(tools, mode)
    return chosen[0] if len(chosen) == 1 else None


def call_prefill(tools: tuple[ToolSpec, ...], mode: str | None) -> str:
    """What the answer starts with, written into the prompt."""
    if not forced(mode):
        return ""
    known = known_call(tools, mode)
    if known is None:
        return CALL_OPEN
    return CALL_OPEN + '{"name": ' + json.dumps(known.name) + ', "arguments": '


def first_token_grammar() -> str:
    """``"auto"``'s first step: a call's marker, or text that cannot begin one."""
    return f'root ::= "<tool_call>\\n" | {_ANY_TEXT}'


def grammar_for(tools: tuple[ToolSpec, ...], mode: str | None,
                response_schema: str | None) -> str | None:
    """The GBNF grammar constraining the answer, or None for free text."""
    converter = _converter()
    try:
        if mode is None:
            if response_schema is None:
                return None
            _visit(converter, json.loads(response_schema), "", "response_format")
            return str(converter.format_grammar())
        known = known_call(tools, mode)
        if known is not None:
            _visit(converter, known.schema(), "", "tools")
            return str(converter.format_grammar())
        chosen = callable_tools(tools, mode)
        schemas = [call_schema(t) for t in chosen]
        calls = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        if forced(mode):
            _visit(converter, calls, "", "tools")
            return str(converter.format_grammar())
        _visit(converter, calls, "call", "tools")
        text = _ANY_TEXT
        if response_schema is not None:
            _visit(converter, json.loads(response_schema), "answer", "response_format")
            text = "answer"
        rules = str(converter.format_grammar())
        return f'root ::= "<tool_call>\\n" call | {text}\n{rules}'
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"a schema is not JSON: {error}", code="invalid_value") from None


def _converter() -> Any:
    # llama-cpp-python's converter (untyped): the one behind LlamaGrammar.from_json_schema,
    # used directly so that a call's rules and a text rule can share one grammar.
    # Imported here: the simulated worker and the gateway use this module's types
    # and parsing without llama-cpp-python installed (the `worker` extra).
    from llama_cpp import llama_grammar

    return llama_grammar.SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                         raw_pattern=False)  # type: ignore[no-untyped-call]


def _visit(converter: Any, schema: dict[str, Any], name: str, param: str) -> None:
    # The converter raises plain exceptions on what it cannot express.
    try:
        resolved = converter.resolve_refs(schema, "request")
        converter.visit(resolved, name)
    except (ValueError, KeyError, TypeError, AssertionError, NotImplementedError) as error:
        raise InvalidRequest(f"{param}: this JSON Schema cannot be turned into a grammar: "
                             f"{error}", param=param, code="invalid_value") from None


def tools_prompt(tools: tuple[ToolSpec, ...]) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.schema()}})
        for t in tools)
    return ("You may call one of these functions to answer:\n<tools>\n" + listed + "\n</tools>\n"
            "To call a function, answer only with <tool_call> on its own line followed by "
            'a JSON object {"name": <function name>, "arguments": <arguments object>}.')


def render_messages(messages: tuple[dict[str, Any], ...], tools: tuple[ToolSpec, ...],
                    mode: str | None) -> list[dict[str, str]]:
    """Messages a plain chat template can render: tools described in the system
    message, calls and results written out as text."""
    rendered = [_as_text(m) for m in messages]
    if mode is None or not tools:
        return rendered
    guide = tools_prompt(callable_tools(tools, mode))
    if rendered and rendered[0]["role"] in ("system", "developer"):
        rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + guide}
    else:
        rendered.insert(0, {"role": "system", "content": guide})
    return rendered


def _as_text(message: dict[str, Any]) -> dict[str, str]:
    role = str(message.get("role", "user"))
    content = str(message.get("content") or "")
    if role == "tool":  # as a user turn: every chat template knows that role
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or []
    if calls:
        written = [f"{CALL_OPEN}{_call_text(call)}{CALL_CLOSE}" for call in calls]
        content = "\n".join(([content] if content else []) + written)
    shaped = {"role": "system" if role == "developer" else role, "content": content}
    if message.get("name"):
        shaped["name"] = str(message["name"])
    return shaped


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    arguments = str(function.get("arguments") or "{}")
    try:
        value: Any = json.loads(arguments)
    except json.JSONDecodeError:
        value = arguments  # as the client sent it
    return json.dumps({"name": function.get("name"), "arguments": value})


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class TextOut:
    text: str


@dataclass(frozen=True)
class CallStart:
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    fragment: str


ScanOut = TextOut | CallStart | CallArguments


class ToolCallScanner:
    """The model's text (as it streams) → content, or one call's start and arguments.

    ``mode``: None (all text), "auto" (the first character decides: "<" opens
    a call) or a forced mode (the text is the call object; its marker was in
    the prompt). The call object's closing brace and whitespace are held
    back until the next text shows they were inside the arguments.
    """

    def __init__(self, mode: str | None, known: str | None = None) -> None:
        """``known``: the function whose name was already written (``call_prefill``);
        the text is then its arguments alone."""
        self._state = "text" if mode is None else "head" if forced(mode) else "undecided"
        self._known = known
        if known is not None:
            self._state = "bare"
        self._buffer = ""
        self._held = ""
        self.called = False

    def feed(self, text: str) -> list[ScanOut]:
        if self._state == "text":
            return [TextOut(text)] if text else []
        if self._state == "bare":
            started: list[ScanOut] = []
            if not self.called:
                self.called = True
                started.append(CallStart(new_call_id(), self._known or ""))
            return started + self._arguments(text, _SPACE_CHARS)
        if self._state == "args":
            return self._arguments(text)
        self._buffer += text
        if self._state == "undecided":
            head = self._buffer.lstrip()
            if not head:
                return []
            if not head.startswith("<"):
                self._state, text, self._buffer = "text", self._buffer, ""
                return [TextOut(text)]
            if len(head) < len(CALL_OPEN.strip()) or not head.startswith(CALL_OPEN.strip()):
                return []  # the grammar allows only the marker from here
            self._state, self._buffer = "head", head[len(CALL_OPEN.strip()):]
        return self._head()

    def _head(self) -> list[ScanOut]:
        started: list[ScanOut] = []
        if not self.called:
            named = _CALL_NAME.match(self._buffer)
            if named is None:
                return []
            self.called = True
            started.append(CallStart(new_call_id(), named.group(1)))
            self._buffer = self._buffer[named.end():]
        key = _ARGUMENTS_KEY.match(self._buffer)
        if key is None:
            return started
        self._state = "args"
        rest, self._buffer = self._buffer[key.end():], ""
        return started + self._arguments(rest)

    def _arguments(self, text: str, tail: str = _TAIL_CHARS) -> list[ScanOut]:
        pending = self._held + text
        cut = len(pending.rstrip(tail))
        self._held = pending[cut:]
        return [CallArguments(pending[:cut])] if cut else []

    def finish(self, complete: bool) -> list[ScanOut]:
        """The rest, once the model stopped; ``complete``: it was not cut by max_tokens
        (then the held ``}`` closed the call object, not the arguments)."""
        if self._state == "bare":  # what was held is the grammar's trailing space
            started = self.feed("") if not self.called else []
            held, self._held = self._held, ""
            return started + ([CallArguments(held)] if held and not complete else [])
        if self._state != "args":
            leftover, self._buffer = self._buffer, ""
            # A call cut off before its name: what the model wrote, as text
            # (after it: the call has its name and no arguments).
            if self.called or not leftover or complete:
                return []
            return [TextOut(leftover)]
        held, self._held = self._held, ""
        if complete:
            held = held.rstrip()
            held = held[:-1].rstrip() if held.endswith("}") else held
        return [CallArguments(held)] if held else []
