"""A minimal app-server for wire-level faults: it writes exactly the bytes a test asks for.

Run as ``python wire_probe.py``; it speaks the app-server's JSON-RPC over stdio with the
standard library's json (integers of any size stay exact) and:

- answers ``initialize`` (and takes ``initialized``); with
  ``WIRE_PROBE_CLOSE_STDIN_AFTER_INITIALIZE`` set, then closes its stdin and lives on;
- ``probe/send {"lines": [TEXT, ...]}``: writes each TEXT as one raw line, then answers ``{}``;
- ``probe/closeStdout``, ``probe/closeStdin``: closes that pipe without answering, and
  lives on (until killed);
- reports every reply the client sends to one of its own requests as a notification
  ``probe/reply {"raw": LINE}``, the line exactly as it arrived.
"""

from __future__ import annotations

import json
import os
import sys
import time


def write(message: object) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def main() -> None:
    for raw in sys.stdin.buffer:
        line = raw.rstrip(b"\n")
        if not line.strip():
            continue
        message = json.loads(line)
        method = message.get("method")
        if method is None:
            write({"method": "probe/reply", "params": {"raw": line.decode()}})
        elif method == "initialize":
            write({"id": message["id"], "result": {"userAgent": "wire-probe/0"}})
            if os.environ.get("WIRE_PROBE_CLOSE_STDIN_AFTER_INITIALIZE"):
                os.close(0)
                while True:
                    time.sleep(3600)  # sync-ok: stays alive with a pipe closed, on purpose
        elif method == "probe/send":
            for text in message["params"]["lines"]:
                os.write(1, text.encode() + b"\n")
            write({"id": message["id"], "result": {}})
        elif method in ("probe/closeStdout", "probe/closeStdin"):
            os.close(1 if method == "probe/closeStdout" else 0)
            while True:
                time.sleep(3600)  # sync-ok: stays alive with a pipe closed, on purpose
        elif "id" in message:
            write({"id": message["id"], "result": {}})


if __name__ == "__main__":
    main()
