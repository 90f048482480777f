"""fake-codex: a scriptable stand-in for `codex app-server` (JSON-RPC over stdio).

Run it as `fake-codex app-server [--script PATH]`; the script format is documented in
`fakes/app_server/README.md` and modelled in `fakes.app_server.script`. This package
imports nothing on its own, so that starting the fake stays fast.
"""
