"""Operating several replicas of the bridge: outside the request path.

- :mod:`bridge_ops.front`: nginx's configuration for a front over several replicas
  (``rest-bridge front-config``), filled in from ``nginx.conf.template``.
- :mod:`bridge_ops.cluster`: N replicas and nginx on one machine (``rest-bridge cluster``).

Both import :mod:`bridge`; nothing in :mod:`bridge` imports them (its CLI dispatches to
them when their command is asked for).
"""
