"""Operating the bridge: outside the request path.

- :mod:`bridge_ops.front`: nginx's configuration for a front over several replicas
  (``rest-bridge front-config``), filled in from ``nginx.conf.template``.
- :mod:`bridge_ops.cluster`: N replicas and nginx on one machine (``rest-bridge cluster``).
- :mod:`bridge_ops.codex_diff`: what changed in the app-server protocol between two
  codex releases, and which scenario files and cassettes use it (``rest-bridge codex-diff``).

They may import :mod:`bridge`; nothing on its request path imports them (only its CLI
does, to run their commands).
"""
