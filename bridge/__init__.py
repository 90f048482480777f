"""codex-rest-bridge: OpenAI Codex's ``codex app-server`` behind JSON-over-HTTP."""

__version__ = "0.1.0"

#: The environment variable holding the bearer token: `rest-bridge serve` turns auth on
#: with it, and the harness presents it to a bridge it did not start (`--codex-target`).
TOKEN_VARIABLE = "REST_ADAPTER_TOKEN"
