"""Which app-server methods callers may call through the raw call routes.

A rule is a method name (``fs/readFile``: that method and every method under
``fs/readFile/``), a prefix ending in ``/`` (``fs/``: every method under it) or ``*``
(every method). A router has two layers of rules: its preset's (the ``default`` preset
refuses :data:`HOST_METHODS`, ``trusted`` refuses nothing) and the host's
(:class:`MethodPolicy`, from ``REST_ADAPTER_ALLOW_METHODS`` and
``REST_ADAPTER_REFUSE_METHODS`` or given in Python). The most specific rule that matches
a method decides (``fs/readFile`` beats ``fs/``, which beats ``fs``; ``*`` is the least
specific rule); a method no rule matches is allowed. Between rules of the same text,
the host's beats the preset's, and the host's refuse beats its own allow. So a host that
allows ``fs/`` opens what the ``default`` preset's ``fs/`` closes, while allowing
``thread/`` leaves ``thread/shellCommand`` refused until the host names it.

Names are compared in a canonical form, so an odd spelling cannot step around a rule:
case-folded, percent-decoded, empty and ``.`` segments dropped and ``..`` segments
resolved (``FS//readFile/``, ``thread/../fs/readFile`` and ``fs%2FreadFile`` are all
``fs/readfile``). The app-server itself is sent the name as the route decoded it.

Beyond names, a preset may refuse params of methods it allows (:data:`HOST_PARAMS`, by
the ``default`` preset): a call that carries one is refused as the method would be.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from bridge.limits import ENV_PREFIX, RestLimitsEnvError

ALLOW_VARIABLE = ENV_PREFIX + "ALLOW_METHODS"
REFUSE_VARIABLE = ENV_PREFIX + "REFUSE_METHODS"
POLICY_VARIABLES = frozenset({ALLOW_VARIABLE, REFUSE_VARIABLE})

#: Every method of the app-server, as a rule.
EVERY_METHOD = "*"
#: What a rule may be spelt with (codex's method names use letters, digits, `_` and `/`);
#: no `.` or `%`, so that a rule means what it says (`..` would be every method).
_RULE = re.compile(r"^(\*|[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*/?)$")
#: What a segment may have around it that the rules ignore: whitespace, controls.
_BLANK = "".join(chr(c) for c in range(33)) + "\x7f"
#: Percent-decoding rounds before a name counts as decoded (each round shortens it).
_UNQUOTE_ROUNDS = 8

# The methods of codex app-server (every release of the tested window, bridge/codex_window.py,
# the experimental surface included) that
# reach past a thread to the host or to state every session shares. The ``default``
# preset refuses them unless the host allows them. Each rule with why.
HOST_METHODS: dict[str, str] = {
    "command/": "command/exec runs any command on the host, under a sandbox policy the "
    "caller picks (dangerFullAccess included); write/resize/terminate drive it",
    "process/": "spawns and drives host processes outside any thread (experimental)",
    "thread/shellCommand": "runs a shell command unsandboxed, with full access",
    "thread/backgroundTerminals/": "lists and kills the host processes a thread left "
    "running (experimental)",
    "thread/approveGuardianDeniedAction": "overrides the automatic reviewer's refusal of "
    "an action on the host",
    "fs/": "reads, writes, copies, removes and watches any path the app-server's user "
    "can reach (/etc/shadow as root)",
    "fuzzyFileSearch": "searches file names under any directory the caller names; "
    "its session methods too",
    "config/": "reads the host's whole configuration (MCP servers' environment and "
    "headers included), writes config.toml for every later session, reloads the MCP "
    "servers it starts",
    "modelProvider/config/write": "persists a model provider (its URL gets every later "
    "prompt and the API key)",
    "modelProvider/default/set": "switches the provider every later thread of the "
    "app-server uses by default (its URL gets their prompts; codex 0.171.0 on)",
    "skills/config/write": "persists skill configuration for every later session",
    "skills/extraRoots/set": "makes the app-server load skills from any host directory",
    "experimentalFeature/enablement/set": "switches features on for the whole app-server",
    "plugin/install": "installs a plugin (code the app-server runs) on the host",
    "plugin/uninstall": "removes an installed plugin for every session",
    "plugin/reconcile": "installs and removes plugins to match the marketplaces",
    "plugin/share/": "uploads, checks out and deletes shared plugins",
    "marketplace/": "adds, removes and upgrades plugin sources (fetched to the host)",
    "mcpServer/": "calls tools and reads resources of the host's MCP servers outside a "
    "turn and its approvals, logs them in with OAuth",
    "account/login/": "replaces the credentials the app-server uses for everyone",
    "account/logout": "removes the credentials the app-server uses for everyone",
    "account/gatewayOAuth/login": "replaces the credentials the app-server uses",
    "account/gatewayOAuth/cancel": "cancels a login another caller started",
    "account/rateLimitResetCredit/consume": "spends the account's credits",
    "account/sendAddCreditsNudgeEmail": "sends mail on the account's behalf",
    "account/bedrock/": "reads and sets up cloud credentials on the host (experimental)",
    "account/gcp/": "sets up cloud credentials on the host (experimental)",
    "accountSession/": "lists and switches the account the app-server uses (experimental)",
    "userVerification/": "enrols and deletes the account's verification (experimental)",
    "feedback/": "uploads logs and threads to OpenAI, or saves them at a host path",
    "externalAgentConfig/": "reads other agents' configuration on the host and imports it "
    "into codex's",
    "windowsSandbox/setupStart": "sets up the sandbox of the host",
    "remoteControl/": "lets remote clients control the app-server (experimental)",
    "environment/": "adds remote execution environments with their tokens (experimental)",
    "memory/": "reads and resets the memories every thread shares (experimental)",
    "rollout/": "rewrites the stored threads on disk (experimental)",
    "project/": "creates, imports, moves and deletes projects over host directories (experimental)",
    "server/diagnostics": "reports on the host and the app-server process (experimental)",
}

# Parameters of allowed methods that reach the host all the same; the ``default`` preset
# refuses a call that names one (whatever its value, null included), by method.
_CONFIG = (
    "configuration for the thread: an MCP server in it is a command the app-server runs "
    "on the host at once"
)
_PATH = "reads a thread file at any path on the host"
HOST_PARAMS: dict[str, dict[str, str]] = {
    "thread/start": {"config": _CONFIG},
    "thread/resume": {"config": _CONFIG, "path": _PATH},
    "thread/fork": {"config": _CONFIG, "path": _PATH},
}

# The other methods, which act on threads and turns or only read what a client needs,
# each by its exact name, so that a method a new codex adds is classified by someone
# (tests/bridge/test_method_policy.py checks the pinned codex's schema against both).
THREAD_METHODS: dict[str, tuple[str, ...]] = {
    "the bridge has initialized the connection already (a second one is refused)": ("initialize",),
    "starts, reads and changes threads and their turns, in the sandbox the thread runs": (
        "thread/start",
        "thread/resume",
        "thread/fork",
        "thread/archive",
        "thread/unarchive",
        "thread/delete",
        "thread/unsubscribe",
        "thread/name/set",
        "thread/goal/set",
        "thread/goal/get",
        "thread/goal/clear",
        "thread/metadata/update",
        "thread/attachment/add",
        "thread/attachment/list",
        "thread/attachmentOwner/list",
        "thread/attachment/remove",
        "thread/section/move",
        "thread/compact/start",
        "thread/revert",
        "thread/list",
        "thread/loaded/list",
        "thread/read",
        "thread/turns/list",
        "thread/items/list",
        "thread/inject_items",
        "threadSection/list",
        "threadSection/create",
        "threadSection/update",
        "threadSection/delete",
        "turn/start",
        "turn/steer",
        "turn/interrupt",
        "review/start",
    ),
    "a thread's experimental surface, within the thread": (
        "thread/sample",
        "thread/sample/cancel",
        "thread/increment_elicitation",
        "thread/decrement_elicitation",
        "thread/prediction/request",
        "thread/queue/add",
        "thread/queue/list",
        "thread/queue/update",
        "thread/queue/delete",
        "thread/queue/reorder",
        "thread/queue/start",
        "thread/settings/update",
        "thread/memoryMode/set",
        "thread/memory/read",
        "thread/search",
        "thread/search/cancel",
        "thread/search/stream",
        "thread/search/stream/cancel",
        "thread/searchOccurrences",
        "thread/readState/update",
        "thread/items/read",
        "thread/guardianReview",
        "thread/prepareApprovedPlan",
        "thread/realtime/start",
        "thread/realtime/appendAudio",
        "thread/realtime/appendText",
        "thread/realtime/appendSpeech",
        "thread/realtime/stop",
        "thread/realtime/list",
        "thread/realtime/listVoices",
        "thread/timeline/list",
        "turn/settings/update",
    ),
    "reads the catalogues a client offers (models, skills, hooks, plugins, apps)": (
        "model/list",
        "modelProvider/list",
        "modelProvider/capabilities/read",
        "skills/list",
        "hooks/list",
        "plugin/list",
        "plugin/installed",
        "plugin/read",
        "plugin/skill/read",
        "plugin/search",
        "app/read",
        "app/list",
        "app/installed",
        "experimentalFeature/list",
        "permissionProfile/list",
        "collaborationMode/list",
        "mcpServerStatus/list",
        "configRequirements/read",
        "windowsSandbox/readiness",
    ),
    "reads the account's state, changes nothing": (
        "account/read",
        "account/securitySetup/read",
        "account/rateLimits/read",
        "account/usage/read",
        "account/workspaceMessages/read",
        "account/gatewayOAuth/read",
    ),
    "codex's own test method, behind the experimental capability": ("mock/experimentalMethod",),
}


def canonical(name: str) -> str:
    """``name`` as rules compare it: decoded, case-folded, ``.``/``..``/empty segments
    resolved (``FS//read%46ile/`` → ``fs/readfile``)."""
    for _ in range(_UNQUOTE_ROUNDS):
        decoded = unquote(name)
        if decoded == name:
            break
        name = decoded
    segments: list[str] = []
    for segment in name.casefold().split("/"):
        # Codex takes no whitespace or control characters around a name; an app-server
        # that did must not find `fs/readFile ` past a rule.
        segment = segment.strip(_BLANK)
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/".join(segments)


def rule_problem(rule: str) -> str | None:
    """What is wrong with a rule as written, or None."""
    if not _RULE.match(rule):
        return "is not a method name, a prefix ending in '/' or '*'"
    return None


def _key(rule: str) -> str:
    """A rule as matched: ``""`` for every method, ``"fs/"`` for a prefix, ``"fs/readfile"``
    for a name (which also covers ``"fs/readfile/"``)."""
    if rule == EVERY_METHOD:
        return ""
    stem = canonical(rule)
    return stem + "/" if rule.endswith("/") else stem


def _keys_of(method: str) -> list[str]:
    """The rule keys that can match ``method`` (canonical), most specific first."""
    segments = method.split("/") if method else []
    keys: list[str] = []
    for end in range(len(segments), 0, -1):
        stem = "/".join(segments[:end])
        if end < len(segments):
            keys.append(stem + "/")
        keys.append(stem)
    keys.append("")
    # A name rule for a stem covers its sub-methods: `a/b` matches `a/b/c` as `a/b/` does.
    return keys


def parse_rules(raw: str, variable: str) -> frozenset[str]:
    """Comma-separated rules from ``variable``; blank items are skipped."""
    rules = [item.strip() for item in raw.split(",")]
    rules = [rule for rule in rules if rule]
    for rule in rules:
        if rule_problem(rule) is not None:
            raise RestLimitsEnvError(
                variable, raw, "comma-separated list of method names, prefixes ending in '/' or '*'"
            )
    return frozenset(rules)


@dataclass(frozen=True, slots=True)
class MethodPolicy:
    """The host's method rules, over the preset's (see the module's documentation).

    ``MethodPolicy(allow={"fs/readFile"})`` lets a ``default`` router call
    ``fs/readFile``; ``MethodPolicy(refuse={"*"}, allow={"thread/", "turn/"})`` allows
    thread and turn methods only. From the environment: ``REST_ADAPTER_ALLOW_METHODS``
    and ``REST_ADAPTER_REFUSE_METHODS``, comma-separated.
    """

    allow: frozenset[str] = frozenset()
    refuse: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for rule in (*self.allow, *self.refuse):
            if not isinstance(rule, str) or rule_problem(rule) is not None:
                raise ValueError(
                    f"method rule {rule!r} is not a method name, a prefix ending in '/' or '*'"
                )


def _rule_keys(preset_refuses: Iterable[str], host: MethodPolicy) -> dict[str, bool]:
    """Rule key → allowed: the host's allow over the preset's refuse, its refuse over both."""
    keys = {_key(rule): False for rule in preset_refuses}
    keys.update({_key(rule): True for rule in host.allow})
    keys.update({_key(rule): False for rule in host.refuse})
    return keys


class MethodRules:
    """A router's decision on each method name: its preset's refusals under the host's."""

    #: Decisions remembered, by name as sent (names are few; past this, none are added),
    #: of names up to CACHED_NAME characters: at most some 1 MB.
    CACHE_SIZE = 4096
    CACHED_NAME = 128

    def __init__(
        self,
        preset_refuses: Iterable[str],
        host: MethodPolicy,
        refused_params: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self.preset_refuses = frozenset(preset_refuses)
        self.host = host
        #: Canonical method → case-folded names of the params a call may not carry.
        self.refused_params = {
            canonical(method): frozenset(name.casefold() for name in names)
            for method, names in (refused_params or {}).items()
        }
        self._keys = _rule_keys(self.preset_refuses, host)
        self._cache: dict[str, bool] = {}
        self._params_cache: dict[str, frozenset[str]] = {}
        #: Nothing is ever refused: the routes need not ask.
        self.allows_all = all(self._keys.values())

    def allows(self, method: str) -> bool:
        decided = self._cache.get(method)
        if decided is None:
            decided = self._decide(canonical(method))
            if len(method) <= self.CACHED_NAME and len(self._cache) < self.CACHE_SIZE:
                self._cache[method] = decided
        return decided

    def refused_params_of(self, method: str, params: object) -> list[str]:
        """The params (as the caller spelt them) that this router refuses ``method`` to carry."""
        if not self.refused_params or not isinstance(params, dict):
            return []
        refused = self._params_cache.get(method)
        if refused is None:
            refused = self.refused_params.get(canonical(method), frozenset())
            if len(method) <= self.CACHED_NAME and len(self._params_cache) < self.CACHE_SIZE:
                self._params_cache[method] = refused
        if not refused:
            return []
        return sorted(k for k in params if isinstance(k, str) and k.casefold() in refused)

    def _decide(self, method: str) -> bool:
        for key in _keys_of(method):
            allowed = self._keys.get(key)
            if allowed is not None:
                return allowed
        return True

    def describe(self) -> dict[str, Any]:
        """The rules, for the OpenAPI document and the start-up banner."""
        return {
            "presetRefuses": sorted(self.preset_refuses),
            "presetRefusesParams": {m: sorted(p) for m, p in sorted(self.refused_params.items())},
            "hostAllows": sorted(self.host.allow),
            "hostRefuses": sorted(self.host.refuse),
        }
