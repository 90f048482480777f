"""codex-rest-bridge: OpenAI Codex's ``codex app-server`` behind JSON-over-HTTP."""

__version__ = "0.1.0"
