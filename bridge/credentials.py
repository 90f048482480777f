"""The bridge's own secrets: read once, and left nowhere a child process can read them.

Two secrets are the bridge's alone: the bearer token callers present
(``REST_ADAPTER_TOKEN``) and the token of an app-server it connects to over ``ws://``
(``REST_ADAPTER_APP_SERVER_TOKEN``). Each comes from its variable or, the convention of
container secrets, from a file named by the same variable with ``_FILE`` appended (its
trailing whitespace trimmed, as mounted secrets often end with a newline).

Once read, ``rest-bridge serve`` forgets where they came from (:func:`forget_secrets`):
the variables leave ``os.environ`` and the C library's environment, and their bytes are
overwritten in the block the kernel shows as ``/proc/<pid>/environ``, which on Linux is
the process's *original* environment and which no ``unsetenv`` changes. The process is
then made non-dumpable (:func:`make_undumpable`), so that another process of the same
user without ``CAP_SYS_PTRACE`` can open neither its ``environ`` nor its ``mem``. Every
process the bridge starts gets :func:`child_environment`, which never carries a secret
variable nor the path of a secret file, whatever the bridge's own environment holds (a
host embedding the bridge keeps its environment as it is).

What stays possible, and is the host's to prevent: a process running as root, or with
``CAP_SYS_PTRACE``, can read the bridge's memory, the secrets included; a process of the
bridge's user can open a secret file it knows the path of. Run the app-servers as
another user to close both.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
from collections.abc import Iterable, Mapping

from bridge import TOKEN_VARIABLE
from bridge.limits import APP_SERVER_TOKEN_VARIABLE, ENV_PREFIX

#: ``VARIABLE_FILE`` names a file holding what ``VARIABLE`` would.
FILE_SUFFIX = "_FILE"
#: The variables holding the bridge's secrets.
SECRET_VARIABLES = (TOKEN_VARIABLE, APP_SERVER_TOKEN_VARIABLE)
#: What no child process ever gets: the secrets and the paths of their files.
HIDDEN_VARIABLES = frozenset(
    {*SECRET_VARIABLES, *(variable + FILE_SUFFIX for variable in SECRET_VARIABLES)}
)
#: A secret file bigger than this is refused (a token is a few dozen bytes).
MAX_SECRET_FILE_BYTES = 65536


class SecretError(ValueError):
    """A secret variable or file that cannot be used; the message names the variable and
    never holds the secret."""


def read_secret_file(path: str) -> str:
    """The secret in the file at ``path``, its trailing whitespace trimmed.

    Raises :class:`SecretError` (naming the path, never the content) when the file cannot
    be read, is a FIFO (which would wait for a writer), is bigger than
    :data:`MAX_SECRET_FILE_BYTES`, is not UTF-8 or holds nothing but whitespace. For
    hosts embedding the bridge:
    ``with_bearer_auth(app, read_secret_file("/run/secrets/bridge-token"))``.
    """
    try:
        # Opened without waiting: a FIFO with no writer would hold the start for ever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SecretError(f"cannot read {path!r}: {exc.strerror or type(exc).__name__}") from None
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise SecretError(f"{path!r} is a FIFO: it would wait for a writer")
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as handle:
            data = handle.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise SecretError(f"cannot read {path!r}: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise SecretError(f"{path!r} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretError(f"{path!r} is not UTF-8 text") from None
    text = text.rstrip()
    if not text:
        raise SecretError(f"{path!r} is empty")
    return text


def read_secret(variable: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The secret ``variable`` holds, or the one in the file ``variable_FILE`` names, or
    None when neither is set.

    Raises :class:`SecretError` naming the variable when both are set, or when the file
    cannot be used (see :func:`read_secret_file`).
    """
    env = os.environ if environ is None else environ
    file_variable = variable + FILE_SUFFIX
    value = env.get(variable)
    path = env.get(file_variable)
    if path is None:
        return value
    if value is not None:
        raise SecretError(f"{variable} and {file_variable} are both set: set one of them")
    if not path:
        raise SecretError(f"{file_variable} is empty: it must name a file")
    try:
        return read_secret_file(path)
    except SecretError as exc:
        raise SecretError(f"{file_variable}: {exc}") from None


def child_environment(
    extra: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a process the bridge starts: ``environ`` (default: the
    bridge's own) and then ``extra``, without any of :data:`HIDDEN_VARIABLES`."""
    env = dict(os.environ if environ is None else environ)
    env.update(extra or {})
    for variable in HIDDEN_VARIABLES:
        env.pop(variable, None)
    return env


def reserved_variables(env: Mapping[str, str] | None) -> list[str]:
    """The names in ``env`` that are the bridge's own (``REST_ADAPTER_*``), sorted."""
    return sorted(name for name in env or {} if name.startswith(ENV_PREFIX))


def forget_secrets(variables: Iterable[str] = HIDDEN_VARIABLES) -> bool:
    """Remove ``variables`` from this process's environment, ``/proc/self/environ``
    included; True when that file is known to hold none of them any more.

    False when the original block could not be rewritten (it is not where the kernel
    says, or not writable): the variables are then gone from ``os.environ`` and from
    what children inherit, but ``/proc/self/environ`` may still show them. Other systems
    than Linux have no such file: there, what the system keeps of a process's original
    environment is left as it is.
    """
    names = set(variables)
    for name in names:
        if name in os.environ:
            del os.environ[name]  # also unsetenv(3): C code reading getenv sees it gone
    if not sys.platform.startswith("linux"):
        return True  # no /proc/self/environ to rewrite
    try:
        return _wipe_original_environment(names)
    except (OSError, ValueError):
        return False


def _wipe_original_environment(names: set[str]) -> bool:
    """Overwrite, with NUL bytes, the ``NAME=value`` strings of ``names`` in the block
    the kernel shows as ``/proc/self/environ`` (between ``env_start`` and ``env_end``
    of ``/proc/self/stat``).

    Why overwrite rather than re-execute: the pid, the command line, the open
    descriptors and the start-up time stay as they are, and nothing has to carry the
    secret across an ``exec``. The C library's own array of pointers may still point
    into this block, which is why each variable is unset first: no pointer is left to
    the bytes overwritten here. The block is checked to be the kernel's (the same bytes
    as the file) and inside a writable mapping before anything is written, and the file
    is read again after.
    """
    with open("/proc/self/environ", "rb") as handle:
        shown = handle.read()
    needles = tuple(name.encode() + b"=" for name in names)
    if not any(entry.startswith(needles) for entry in shown.split(b"\0")):
        return True
    with open("/proc/self/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    # Fields 50 and 51 of proc(5), counted from 1; fields[0] here is field 3.
    start, end = int(fields[47]), int(fields[48])
    if end - start != len(shown) or not _writable(start, end):
        return False
    if ctypes.string_at(start, end - start) != shown:
        return False
    offset = 0
    for entry in shown.split(b"\0"):
        if entry.startswith(needles):
            ctypes.memset(start + offset, 0, len(entry))
        offset += len(entry) + 1
    with open("/proc/self/environ", "rb") as handle:
        after = handle.read()
    return not any(entry.startswith(needles) for entry in after.split(b"\0"))


def _writable(start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies inside one writable mapping of this process."""
    with open("/proc/self/maps") as handle:
        for line in handle:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= start and end <= high:
                return perms[1] == "w"
    return False


def make_undumpable() -> bool:
    """``prctl(PR_SET_DUMPABLE, 0)``: no core dump, and a process of the same user
    without ``CAP_SYS_PTRACE`` can no longer open ``/proc/<pid>/environ``, ``mem`` or
    ``fd``, nor attach a debugger. The flag is reset in every program the bridge
    starts (at its ``exec``). True once set; False where it cannot be (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_dumpable = 4
        return int(libc.prctl(pr_set_dumpable, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
