"""Environments and tools for multi-turn rollouts (the edge: they run user code).

Two ways to give a trajectory its tools, both accepted unchanged:

- **TRL's ``environment_factory``**: a callable returning an object with
  ``reset(**kwargs) -> str | None``; its public methods are the tools; an optional
  ``get_reward()`` makes it the reward source. :class:`EnvironmentSession` wraps one such
  object per trajectory. An object may also define ``step(text) -> (observation, reward,
  done)``: then ``step`` is not a tool but the environment's answer to a model output
  that calls no tool.
- **plain tool functions**: :class:`Tool` (a name, the function, and how a second run
  is avoided).

Durability rule for a tool: it is **idempotent** (running it again has the same effect:
mark it with :func:`idempotent`) or it provides a **status check by idempotency key**
(``status(key) -> result | None``, None: the call did not run; the tool then receives
``idempotency_key=`` as a keyword argument, so it can remember the call). A tool that is
neither is never run a second time: after a crash between its request and its result,
the call is recorded as failed (``not_rerun``) instead.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rolloutlog.eventstore.errors import RolloutlogError

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """Text to token ids and back. Token ids are the source of truth: text enters a
    context once, through :meth:`encode`; a model's output is only decoded (to parse its
    tool calls), never re-encoded."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""
        ...


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call parsed from a model's output text."""

    name: str
    arguments: dict[str, Any]


#: ``<tool>NAME {json arguments}</tool>``, the default text protocol.
_TOOL_TAG = re.compile(r"<tool>\s*([A-Za-z_][A-Za-z0-9_]*)\s*(\{.*?\})?\s*</tool>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of ``text`` in the default protocol ``<tool>NAME {json}</tool>``
    (the JSON object of arguments is optional; a malformed one is passed as
    ``{"_raw": text}``, so the tool's error reaches the model instead of a silent skip)."""
    calls = []
    for match in _TOOL_TAG.finditer(text):
        raw = match.group(2)
        try:
            arguments = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            arguments = {"_raw": raw}
        calls.append(ToolCall(match.group(1), arguments if isinstance(arguments, dict) else {}))
    return calls


#: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Hermes, verl's default.
_HERMES_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of ``text`` in the Hermes protocol (verl's default tool parser,
    and the chat templates of Qwen and others): ``<tool_call>{"name": NAME,
    "arguments": {...}}</tool_call>``, the arguments an object or a JSON text. A call
    that does not parse is passed as the tool ``<unparsed>`` (so the model reads that it
    failed) instead of being skipped."""
    calls = []
    for match in _HERMES_TAG.finditer(text):
        body = match.group(1)
        try:
            data = json.loads(body)
            arguments = data.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments) if arguments.strip() else {}
            if not isinstance(data["name"], str) or not isinstance(arguments, dict):
                raise TypeError(body)
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
            calls.append(ToolCall("<unparsed>", {"_raw": body}))
            continue
        calls.append(ToolCall(data["name"], arguments))
    return calls


#: What a status check answers: the result of the call, or None when it did not run.
StatusCheck = Callable[[str], Any]


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool a trajectory may call.

    ``idempotent``: running it twice has the effect of running it once. ``status``:
    ``status(idempotency_key)`` returns the recorded result of a call that ran, or None;
    a tool with a status check is called with ``idempotency_key=`` as well.
    """

    name: str
    fn: Callable[..., Any]
    idempotent: bool = False
    status: StatusCheck | None = None

    def __call__(self, arguments: dict[str, Any], idempotency_key: str) -> Any:
        if self.status is not None:
            return self.fn(**arguments, idempotency_key=idempotency_key)
        return self.fn(**arguments)


def idempotent(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an environment method (or function) as idempotent: safe to run again."""
    fn.__rolloutlog_idempotent__ = True  # type: ignore[attr-defined]
    return fn


def with_status(status: StatusCheck) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give one environment method its status check by idempotency key (instead of the
    object's ``tool_status``); the method then receives ``idempotency_key=``."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__rolloutlog_status__ = status  # type: ignore[attr-defined]
        return fn

    return mark


def tool_of(name: str, fn: Callable[..., Any], status: StatusCheck | None = None) -> Tool:
    """A :class:`Tool` for ``fn``: idempotent if marked with :func:`idempotent`."""
    return Tool(
        name, fn, idempotent=bool(getattr(fn, "__rolloutlog_idempotent__", False)), status=status
    )


@runtime_checkable
class StepEnvironment(Protocol):
    """An environment that answers a model output with an observation, reward and done
    (``step`` may also be ``async``)."""

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        """The environment's answer to the model output ``text``."""
        ...


#: How a session runs one call of its environment (``reset``, ``step``, ``get_reward``,
#: ``close``): ``(what, call, is_async)`` to the call's result, awaited. The trajectory
#: backend's runner puts a deadline on it (``environment_timeout_s``).
EnvironmentRunner = Callable[[str, Callable[[], Any], bool], Awaitable[Any]]


class EnvironmentCallError(RolloutlogError):
    """A call of the environment raised, or did not answer by its deadline; the message
    says which call and why (for the sibling attempt's recorded failure)."""


async def run_directly(what: str, call: Callable[[], Any], is_async: bool) -> Any:
    """The default runner: no deadline (a synchronous call runs on the event loop); an
    error of the call is an :class:`EnvironmentCallError`."""
    try:
        out = call()
        return await out if inspect.isawaitable(out) else out
    except Exception as exc:
        raise EnvironmentCallError(
            f"the environment's {what} raised {type(exc).__name__}: {exc}"
        ) from exc


_NOT_TOOLS = frozenset({"reset", "get_reward", "step", "tool_status", "close"})


class EnvironmentSession:
    """One trajectory's environment: a TRL ``environment_factory`` object (or none) plus
    plain tools.

    The object's public methods are its tools (TRL's rule), except ``reset``,
    ``get_reward``, ``step``, ``tool_status`` and ``close``; ``tool_status(name, key)``,
    if defined, is the status check of every method tool (which then receives
    ``idempotency_key=``); a method may carry its own (:func:`with_status`). ``close()``,
    if defined, is called (and awaited if async) when the trajectory's attempt ends.
    ``reset``, ``step`` and ``get_reward`` may be ``async`` too. Each call of the
    environment goes through ``runner`` (the trajectory backend's puts a deadline on it);
    one that fails raises :class:`EnvironmentCallError`.
    """

    def __init__(
        self,
        env: object | None = None,
        tools: Sequence[Tool] = (),
        runner: EnvironmentRunner = run_directly,
    ) -> None:
        self.env = env
        self.runner = runner
        self.tools: dict[str, Tool] = {}
        if env is not None:
            status = getattr(env, "tool_status", None)
            for name, member in inspect.getmembers(env, callable):
                if name.startswith("_") or name in _NOT_TOOLS:
                    continue
                check = getattr(member, "__rolloutlog_status__", None)
                if check is None and status is not None:
                    check = _bind_status(status, name)
                self.tools[name] = tool_of(name, member, check)
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"tool {tool.name!r} is defined twice")
            self.tools[tool.name] = tool

    async def _call(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        is_async = inspect.iscoroutinefunction(method)
        return await self.runner(what, lambda: method(*args, **kwargs), is_async)

    async def reset(self, **kwargs: Any) -> str | None:
        """The environment's first observation (None without an environment)."""
        reset = getattr(self.env, "reset", None)
        if reset is None:
            return None
        out = await self._call("reset", reset, **kwargs)
        return None if out is None else str(out)

    @property
    def steps(self) -> bool:
        """Whether the environment answers a model output that calls no tool."""
        return isinstance(self.env, StepEnvironment)

    async def step(self, text: str, what: str = "step") -> tuple[str | None, float | None, bool]:
        """The environment's answer to ``text`` (see :class:`StepEnvironment`); ``what``
        names the call in an error (which turn's step)."""
        assert isinstance(self.env, StepEnvironment)
        out = await self._call(what, self.env.step, text)
        try:
            observation, reward, done = out
            return (
                None if observation is None else str(observation),
                None if reward is None else float(reward),
                bool(done),
            )
        except (TypeError, ValueError) as exc:
            raise EnvironmentCallError(
                f"the environment's {what} returned {out!r}, not (observation, reward, done)"
            ) from exc

    async def reward(self) -> float | None:
        """``get_reward()`` of the environment, when it has one."""
        get = getattr(self.env, "get_reward", None)
        if get is None:
            return None
        out = await self._call("get_reward", get)
        try:
            return float(out)
        except (TypeError, ValueError) as exc:
            raise EnvironmentCallError(
                f"the environment's get_reward returned {out!r}, not a number"
            ) from exc

    async def close(self) -> None:
        """The environment's ``close()``, when it has one: the attempt has ended. Its
        failure (an error, or no answer by the runner's deadline) is logged, never
        raised: the trajectory's turns are already durable."""
        close = getattr(self.env, "close", None)
        if close is None:
            return
        try:
            await self._call("close", close)
        except EnvironmentCallError as exc:
            log.warning("closing the environment %r failed: %s", self.env, exc)


def _bind_status(status: Callable[[str, str], Any], name: str) -> StatusCheck:
    return lambda key: status(name, key)


class VerlToolsEnvironment:
    """verl's tools as a TRL-shaped environment: the one adapter a verl user writes none of.

    A verl tool (``verl.tools.base_tool.BaseTool``'s shape: a ``name``, and async
    ``create(instance_id=None, **create_kwargs)`` returning the instance id or ``(id,
    response)``, ``execute(instance_id, parameters, **execute_kwargs)`` returning
    ``(response, step_reward, metrics)`` with a text or a ``ToolResponse`` (its
    ``text``), and ``release(instance_id, **release_kwargs)``) keeps one instance per
    trajectory. An object of this class is one trajectory's environment, so pass
    ``environment_factory=lambda: VerlToolsEnvironment(tools, ...)``; each tool is a
    method of it, named by the tool.

    ``reset(tools_kwargs=...)`` takes verl's per-row ``tools_kwargs`` (``{tool name:
    {"create_kwargs": ..., "execute_kwargs": ..., "release_kwargs": ...}}``, from the
    dataset's ``extra_info``), so ``reset_kwargs`` returns ``{"tools_kwargs": ...}``. A
    tool's instance is created at its first call (``create`` is async), and released
    by :meth:`close` when the attempt ends. verl tools have no status check and no
    idempotency promise of their own: ``idempotent`` names those that may run again,
    ``status`` gives others a check by idempotency key (their ``execute`` then receives
    ``idempotency_key=`` among its keyword arguments, to remember the call by); any other
    is never run twice.
    ``calc_reward`` is not called (it is async; the run's reward function scores the
    response, as verl's reward manager does).
    """

    def __init__(
        self,
        tools: Sequence[Any],
        *,
        idempotent: Sequence[str] = (),
        status: dict[str, StatusCheck] | None = None,
    ) -> None:
        self._tools = {str(t.name): t for t in tools}
        unknown = (set(idempotent) | set(status or {})) - set(self._tools)
        if unknown:
            raise ValueError(
                f"no verl tool named {sorted(unknown)!r} among {sorted(self._tools)!r}"
            )
        if len(self._tools) != len(tools):
            raise ValueError("two verl tools have the same name")
        self._kwargs: dict[str, dict[str, Any]] = {}
        self._instances: dict[str, str] = {}
        for name in self._tools:
            if name.startswith("_") or name in _NOT_TOOLS:
                raise ValueError(f"a verl tool cannot be named {name!r} here")
            method = self._method(name)
            if name in idempotent:
                method.__rolloutlog_idempotent__ = True  # type: ignore[attr-defined]
            if status and name in status:
                method = with_status(status[name])(method)
            setattr(self, name, method)

    def reset(self, tools_kwargs: dict[str, dict[str, Any]] | None = None, **_: Any) -> None:
        """A trajectory starts (again, after a restore: its instances are new)."""
        self._kwargs = dict(tools_kwargs or {})

    def _method(self, name: str) -> Callable[..., Any]:
        async def call(idempotency_key: str | None = None, **parameters: Any) -> str:
            tool = self._tools[name]
            kwargs = self._kwargs.get(name, {})
            instance = self._instances.get(name)
            if instance is None:
                created = await tool.create(None, **kwargs.get("create_kwargs", {}))
                instance = str(created[0] if isinstance(created, tuple) else created)
                self._instances[name] = instance
            extra = dict(kwargs.get("execute_kwargs", {}))
            if idempotency_key is not None:  # a tool with a status check remembers its calls
                extra["idempotency_key"] = idempotency_key
            out = await tool.execute(instance, parameters, **extra)
            response = out[0] if isinstance(out, tuple) else out
            text = getattr(response, "text", response)
            return "" if text is None else str(text)

        call.__name__ = name
        return call

    async def close(self) -> None:
        """Release this trajectory's tool instances."""
        instances, self._instances = self._instances, {}
        for name, instance in instances.items():
            kwargs = self._kwargs.get(name, {}).get("release_kwargs", {})
            await self._tools[name].release(instance, **kwargs)
