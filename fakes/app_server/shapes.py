"""Payloads shaped like `codex app-server` 0.169.0's: same keys, same order, same nulls.

Every shape here was copied from a recorded exchange with the real server (or, for the
server requests the probes could not trigger, built from the generated JSON Schema).
The functions only build dicts; sending them is the server's job.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from typing import Any

from bridge import codex_window
from fakes.app_server.protocol import DEFAULT_VERSION

#: The release the fake emulates by default: the project's pinned codex.
DEFAULT_VERSION_OUTPUT = f"codex-cli {DEFAULT_VERSION}"
DEFAULT_MODEL = "gpt-6.1-sol"
DEFAULT_MODEL_PROVIDER = "openai"
MODEL_CONTEXT_WINDOW = 258400

Json = dict[str, Any]

_PLATFORM_OS = {"linux": "linux", "darwin": "macos", "win32": "windows"}


def cli_version(version_output: str) -> str:
    """`0.169.0` from `codex-cli 0.169.0`: the version that userAgent and threads quote."""
    return version_output.rsplit(" ", 1)[-1]


def codex_home() -> str:
    """Where the real server would keep its state: `$CODEX_HOME` or `~/.codex`."""
    return os.environ.get("CODEX_HOME") or os.path.join(os.path.expanduser("~"), ".codex")


def initialize_result(client_info: Json, version: str) -> Json:
    """The `initialize` result.

    userAgent follows the real pattern `name/version (os; arch) terminal (name; client version)`,
    with one token more after the terminal, `fake-codex/<version>`: how a client (the
    bridge's `/v1/compatibility`) tells the fake apart, where a client that reads the
    version from the first token (the SDK) reads what it would from the real server.
    """
    name = str(client_info.get("name", ""))
    client_version = str(client_info.get("version", ""))
    uname = os.uname()
    terminal = os.environ.get("TERM", "unknown")
    user_agent = (
        f"{name}/{version} ({uname.sysname} {uname.release}; {uname.machine}) "
        f"{terminal} {codex_window.FAKE_TOKEN}{version} ({name}; {client_version})"
    )
    return {
        "userAgent": user_agent,
        "codexHome": codex_home(),
        "platformFamily": "unix" if os.name == "posix" else "windows",
        "platformOs": _PLATFORM_OS.get(sys.platform, sys.platform),
    }


def thread_object(
    *,
    thread_id: str,
    cwd: str,
    model: str,
    model_provider: str,
    version: str,
    originator: str,
    created_at: int,
) -> Json:
    """A `Thread` as `thread/start` returns it (no turns yet)."""
    stamp = time.strftime("%Y/%m/%d/rollout-%Y-%m-%dT%H-%M-%S", time.localtime(created_at))
    return {
        "id": thread_id,
        "environments": [{"environmentId": "local", "cwd": cwd, "runtimeWorkspaceRoots": [cwd]}],
        "extra": None,
        "sessionId": thread_id,
        "forkedFromId": None,
        "attachedToThreadId": None,
        "parentThreadId": None,
        "preview": "",
        "ephemeral": False,
        "section": None,
        "sectionEnteredAt": None,
        "projectId": None,
        "historyMode": "paginated",
        "modelProvider": model_provider,
        "model": model,
        "reasoningEffort": None,
        "createdAt": created_at,
        "updatedAt": created_at,
        "recencyAt": created_at,
        "status": {"type": "idle"},
        "path": f"{codex_home()}/sessions/{stamp}-{thread_id}.jsonl",
        "cwd": cwd,
        "cliVersion": version,
        "originator": originator,
        "source": "vscode",
        "canAcceptDirectInput": True,
        "threadSource": None,
        "agentNickname": None,
        "agentRole": None,
        "gitInfo": None,
        "name": None,
        "daybreakEnabled": None,
        "turns": [],
    }


_SANDBOXES: dict[str, tuple[Json, Json | None]] = {
    "read-only": (
        {"type": "readOnly", "networkAccess": False},
        {"id": ":read-only", "extends": None},
    ),
    "workspace-write": (
        {
            "type": "workspaceWrite",
            "writableRoots": [],
            "networkAccess": False,
            "excludeTmpdirEnvVar": False,
            "excludeSlashTmp": False,
        },
        None,
    ),
    "danger-full-access": ({"type": "dangerFullAccess"}, None),
}


def thread_start_result(thread: Json, params: Json) -> Json:
    """The `thread/start` result around `thread`, echoing the policy the client asked for."""
    sandbox, profile = _SANDBOXES.get(str(params.get("sandbox")), _SANDBOXES["read-only"])
    cwd = thread["cwd"]
    return {
        "thread": thread,
        "model": thread["model"],
        "modelProvider": thread["modelProvider"],
        "serviceTier": None,
        "disabledPluginIds": [],
        "cwd": cwd,
        "runtimeWorkspaceRoots": [cwd],
        "instructionSources": [],
        "approvalPolicy": params.get("approvalPolicy") or "on-request",
        "approvalsReviewer": params.get("approvalsReviewer") or "user",
        "sandbox": sandbox,
        "activePermissionProfile": profile,
        "reasoningEffort": None,
        "multiAgentMode": "explicitRequestOnly",
    }


def turn_object(
    turn_id: str,
    *,
    status: str = "inProgress",
    items: list[Json] | None = None,
    items_view: str = "notLoaded",
    error: Json | None = None,
    started_at: int | None = None,
    completed_at: int | None = None,
    duration_ms: int | None = None,
) -> Json:
    """A `Turn`; `rootTurnId` is the turn itself, as for every top-level turn."""
    return {
        "id": turn_id,
        "rootTurnId": turn_id,
        "items": items if items is not None else [],
        "itemsView": items_view,
        "status": status,
        "error": error,
        "startedAt": started_at,
        "completedAt": completed_at,
        "durationMs": duration_ms,
    }


def turn_error(message: str, codex_error_info: Any = None, details: str | None = None) -> Json:
    """A `TurnError` as the `error` notification and a failed turn carry it."""
    return {
        "message": message,
        "codexErrorInfo": codex_error_info,
        "additionalDetails": details,
        "misalignment": None,
    }


def input_preview(inputs: list[Any]) -> str:
    """A thread's `preview`: the text of its first user message."""
    return " ".join(
        str(entry.get("text", ""))
        for entry in inputs
        if isinstance(entry, dict) and entry.get("type") == "text"
    )


def remote_control_status(installation_id: str) -> Json:
    """What `remoteControl/status/changed` says right after `initialize` (it is off)."""
    return {
        "status": "disabled",
        "serverName": os.uname().nodename,  # what socket.gethostname() reads
        "installationId": installation_id,
        "environmentId": None,
    }


def user_content(inputs: list[Any]) -> list[Any]:
    """The userMessage `content` for `turn/start` input: text gains `text_elements`."""
    content: list[Any] = []
    for entry in inputs:
        if isinstance(entry, dict) and entry.get("type") == "text":
            content.append({"type": "text", "text": entry.get("text", ""), "text_elements": []})
        else:
            content.append(entry)
    return content


def user_message_item(
    item_id: str, content: list[Any], started_ms: int, completed_ms: int | None
) -> Json:
    """A `userMessage` thread item."""
    return {
        "type": "userMessage",
        "id": item_id,
        "clientId": None,
        "content": content,
        "startedAtMs": started_ms,
        "completedAtMs": completed_ms,
    }


def agent_message_item(item_id: str, text: str, started_ms: int, completed_ms: int | None) -> Json:
    """An `agentMessage` thread item; `text` is empty while it streams."""
    return {
        "type": "agentMessage",
        "moderation": None,
        "id": item_id,
        "text": text,
        "phase": None,
        "memoryCitation": None,
        "delivery": None,
        "questions": None,
        "startedAtMs": started_ms,
        "completedAtMs": completed_ms,
    }


def shell_command(command: str) -> str:
    """How the real server displays a model's `exec_command`: wrapped in a login shell."""
    return f"/bin/bash -lc {shlex.quote(command)}"


def command_words(command: str) -> list[str]:
    """The argv of `command`, as `proposedExecpolicyAmendment` lists it."""
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def command_execution_item(
    item_id: str,
    *,
    command: str,
    cwd: str,
    started_ms: int,
    status: str = "inProgress",
    output: str | None = None,
    exit_code: int | None = None,
    completed_ms: int | None = None,
    process_id: str | None = None,
) -> Json:
    """A `commandExecution` thread item for `command` (the unwrapped command line)."""
    return {
        "type": "commandExecution",
        "id": item_id,
        "pluginId": None,
        "scriptPath": None,
        "command": shell_command(command),
        "cwd": cwd,
        "processId": process_id,
        "source": "unifiedExecStartup" if status == "completed" else "agent",
        "status": status,
        "commandActions": [{"type": "unknown", "command": command}],
        "aggregatedOutput": output,
        "exitCode": exit_code,
        "durationMs": 0 if status == "completed" else None,
        "startedAtMs": started_ms,
        "completedAtMs": completed_ms,
    }


def file_change_item(item_id: str, changes: list[Json], status: str = "inProgress") -> Json:
    """A `fileChange` thread item; `changes` are `{path, kind: {type}, diff}`."""
    return {"type": "fileChange", "id": item_id, "changes": changes, "status": status}


def token_usage_breakdown(
    input_tokens: int, output_tokens: int, cached: int = 0, reasoning: int = 0
) -> Json:
    """A `TokenUsageBreakdown`."""
    return {
        "totalTokens": input_tokens + output_tokens,
        "inputTokens": input_tokens,
        "cachedInputTokens": cached,
        "cacheWriteInputTokens": 0,
        "outputTokens": output_tokens,
        "reasoningOutputTokens": reasoning,
    }


def thread_token_usage(total: Json, last: Json) -> Json:
    """A `ThreadTokenUsage`: the thread's running total and the last response's usage."""
    return {"total": total, "last": last, "modelContextWindow": MODEL_CONTEXT_WINDOW}


def add_usage(total: Json, last: Json) -> Json:
    """`total` plus `last`, field by field."""
    return {key: total[key] + last[key] for key in total}


RATE_LIMITS: Json = {
    "limitId": "codex",
    "limitName": None,
    "normalModelSlug": None,
    "primary": None,
    "secondary": None,
    "credits": None,
    "individualLimit": None,
    "spendControlReached": None,
    "planType": None,
    "rateLimitReachedType": None,
}

_EFFORTS = [
    ("low", "Fast responses with lighter reasoning"),
    ("medium", "Balances speed and reasoning depth for everyday tasks"),
    ("high", "Greater reasoning depth for complex problems"),
    ("xhigh", "Extra high reasoning depth for complex problems"),
]


def _model(model_id: str, display: str, description: str, *, default: bool) -> Json:
    return {
        "id": model_id,
        "model": model_id,
        "upgrade": None,
        "upgradeInfo": None,
        "availabilityNux": None,
        "displayName": display,
        "description": description,
        "modelSpecialty": None,
        "hidden": False,
        "supportedReasoningEfforts": [
            {"reasoningEffort": effort, "description": text} for effort, text in _EFFORTS
        ],
        "defaultReasoningEffort": "low",
        "inputModalities": ["text", "image"],
        "supportsPersonality": False,
        "multiAgentVersion": "v2",
        "additionalSpeedTiers": ["fast"],
        "serviceTiers": [
            {"id": "priority", "name": "Fast", "description": "2x speed, increased usage"}
        ],
        "defaultServiceTier": None,
        "availableAccessPrograms": None,
        "isDefault": default,
    }


def model_list_result() -> Json:
    """A `model/list` result: the head of the real bundled catalogue."""
    return {
        "data": [
            _model(
                DEFAULT_MODEL,
                "GPT-6.1-Sol",
                "Latest workhorse model for coding and everyday work.",
                default=True,
            ),
            _model(
                "gpt-6-astra",
                "GPT-6-Astra",
                "Frontier intelligence for the most demanding work.",
                default=False,
            ),
            _model(
                "gpt-6-luna",
                "GPT-6-Luna",
                "Small, fast and cheap model for simple tasks.",
                default=False,
            ),
        ],
        "nextCursor": None,
    }
