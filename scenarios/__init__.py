"""Scenario runner, pytest fixtures and stream readers for testing codex-rest-bridge hosts."""
