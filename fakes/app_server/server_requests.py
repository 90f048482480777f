"""Real-shaped params for the ten server-to-client requests of app-server 0.169.0.

`item/commandExecution/requestApproval` is copied from a recorded exchange; the others
are built from the generated JSON Schema (`ServerRequest.json`) with the values a real
turn would most plausibly carry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fakes.app_server.shapes import Json, command_words, shell_command

DEFAULT_COMMAND = "echo hello"


@dataclass(frozen=True)
class RequestContext:
    """Where a server request comes from: the ids and directory it refers to."""

    thread_id: str
    turn_id: str
    item_id: str
    cwd: str
    started_ms: int

    def item(self, *, started: bool = True) -> Json:
        """The keys most requests open with: thread, turn, item (and when it started)."""
        ids: Json = {"threadId": self.thread_id, "turnId": self.turn_id, "itemId": self.item_id}
        if started:
            ids["startedAtMs"] = self.started_ms
        return ids


def command_approval_params(ctx: RequestContext, command: str, reason: str | None = None) -> Json:
    """`item/commandExecution/requestApproval` params, exactly as the real server sends them."""
    words = command_words(command)
    params: Json = {
        "kind": "command",
        **ctx.item(),
        "environmentId": "local",
        "command": shell_command(command),
        "cwd": ctx.cwd,
        "commandActions": [{"type": "unknown", "command": command}],
        "proposedExecpolicyAmendment": words,
        "availableDecisions": [
            "accept",
            {"acceptWithExecpolicyAmendment": {"execpolicy_amendment": words}},
            "cancel",
        ],
    }
    if reason is not None:
        params["reason"] = reason
    return params


def file_change_approval_params(ctx: RequestContext, reason: str | None = None) -> Json:
    """`item/fileChange/requestApproval` params (the changes travel on the item)."""
    return {
        **ctx.item(),
        "reason": reason,
        "grantRoot": None,
    }


def _permissions_params(ctx: RequestContext) -> Json:
    return {
        **ctx.item(),
        "environmentId": "local",
        "cwd": ctx.cwd,
        "reason": "Write outside the workspace",
        "permissions": {
            "fileSystem": {
                "read": None,
                "write": [ctx.cwd],
                "entries": None,
                "globScanMaxDepth": None,
            },
            "network": None,
        },
    }


def _user_input_params(ctx: RequestContext) -> Json:
    return {
        **ctx.item(started=False),
        "isBlocking": True,
        "autoResolutionMs": None,
        "questions": [
            {
                "id": "confirm",
                "header": "Confirm",
                "question": "Shall I go ahead?",
                "isOther": False,
                "isSecret": False,
                "options": [
                    {"label": "Yes", "description": "Go ahead"},
                    {"label": "No", "description": "Stop here"},
                ],
            }
        ],
    }


def _tool_call_params(ctx: RequestContext) -> Json:
    return {
        "threadId": ctx.thread_id,
        "turnId": ctx.turn_id,
        "callId": ctx.item_id,
        "namespace": None,
        "tool": "lookup",
        "arguments": {"query": "fake-codex"},
    }


def _elicitation_params(ctx: RequestContext) -> Json:
    return {
        "threadId": ctx.thread_id,
        "turnId": ctx.turn_id,
        "serverName": "fake-mcp",
        "mode": "form",
        "message": "Which name should I use?",
        "requestedSchema": {
            "type": "object",
            "properties": {"name": {"type": "string", "title": "Name"}},
            "required": ["name"],
        },
        "_meta": None,
    }


def _exec_command_params(ctx: RequestContext) -> Json:
    return {
        "conversationId": ctx.thread_id,
        "callId": ctx.item_id,
        "approvalId": None,
        "command": ["/bin/bash", "-lc", DEFAULT_COMMAND],
        "cwd": ctx.cwd,
        "reason": None,
        "parsedCmd": [{"type": "unknown", "cmd": DEFAULT_COMMAND}],
    }


def _apply_patch_params(ctx: RequestContext) -> Json:
    return {
        "conversationId": ctx.thread_id,
        "callId": ctx.item_id,
        "fileChanges": {f"{ctx.cwd}/hello.txt": {"type": "add", "content": "hello\n"}},
        "reason": None,
        "grantRoot": None,
    }


_DEFAULT_PARAMS: dict[str, Callable[[RequestContext], Json]] = {
    "item/commandExecution/requestApproval": lambda ctx: command_approval_params(
        ctx, DEFAULT_COMMAND
    ),
    "item/fileChange/requestApproval": file_change_approval_params,
    "item/tool/requestUserInput": _user_input_params,
    "mcpServer/elicitation/request": _elicitation_params,
    "item/permissions/requestApproval": _permissions_params,
    "item/tool/call": _tool_call_params,
    "account/chatgptAuthTokens/refresh": lambda ctx: {
        "reason": "unauthorized",
        "previousAccountId": None,
    },
    "attestation/generate": lambda ctx: {},
    "applyPatchApproval": _apply_patch_params,
    "execCommandApproval": _exec_command_params,
}

SERVER_REQUEST_METHODS: tuple[str, ...] = tuple(_DEFAULT_PARAMS)


def default_params(method: str, ctx: RequestContext) -> Json | None:
    """Plausible params for `method`, or None for a method that is not a server request."""
    build = _DEFAULT_PARAMS.get(method)
    return None if build is None else build(ctx)
