"""Exit statuses of the ``zensync`` command and the checks of paths named on its command line.

- 0: success.
- 1: the command failed while it ran (``CommandFailed``): a worker crashed or hung, an optional
  dependency is missing (matplotlib for ``--png``), a result could not be written after the work.
- 2: usage error: a bad flag or value (argparse prints the usage line and the error), or a file named
  on the command line that cannot be read, parsed or written (``UsageError``: one line, checked
  before any work starts).

Errors are one line ``zensync <command>: error: <message>`` on stderr, never a traceback.
"""

from __future__ import annotations

import os
import pathlib

__all__ = [
    "EXIT_FAILURE",
    "EXIT_STATUS_HELP",
    "EXIT_USAGE",
    "CommandFailed",
    "UsageError",
    "check_input",
    "check_output_dir",
    "check_output_file",
    "read_input",
    "write_failed",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_STATUS_HELP = """\
exit status:
  0  success
  1  the command failed while running: a worker crashed or hung, an optional dependency
     is missing (matplotlib for --png), or a result could not be written after the work
  2  usage error: a bad flag or value, or a file named on the command line that cannot be
     read, parsed or written (paths are checked before any work starts)
Errors are one line "zensync COMMAND: error: ..." on stderr (plus the usage line for a bad flag)."""
"""The ``zensync --help`` epilog (README: "Exit status")."""


class UsageError(Exception):
    """A path on the command line cannot be used: one line on stderr, exit status 2."""


class CommandFailed(Exception):
    """The command failed while it ran: the message on stderr, exit status 1."""


def check_output_file(path: str, flag: str) -> None:
    """Raise ``UsageError`` unless ``path`` can be created or replaced as a file (its directory must exist).

    Example::

        check_output_file("/nonexistent/dir/p.json", "-o")
        # UsageError: -o /nonexistent/dir/p.json: directory /nonexistent/dir does not exist
    """
    target = pathlib.Path(path)
    parent = target.parent
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if not parent.exists():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable (permission denied or read-only file system)")


def check_output_dir(path: str, flag: str) -> None:
    """Raise ``UsageError`` unless ``path`` is, or can be created as, a writable directory."""
    target = pathlib.Path(path)
    existing = next(p for p in (target, *target.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {existing} is not writable (permission denied or read-only file system)")


def read_input(path: str, what: str) -> str:
    """The text of an input file named on the command line; ``UsageError`` if it cannot be read."""
    try:
        return pathlib.Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise _unreadable(path, what, err) from err


def check_input(path: str, what: str) -> None:
    """Raise ``UsageError`` (the reason alone) unless ``path`` can be opened for reading; reads nothing."""
    try:
        open(path, "rb").close()
    except OSError as err:
        raise _unreadable(path, what, err) from err


def write_failed(path: str, err: OSError) -> CommandFailed:
    """The ``CommandFailed`` of a result that cannot be written to ``path`` after the work."""
    return CommandFailed(f"cannot write {path}: {err.strerror or err}")


def _unreadable(path: str, what: str, err: OSError | UnicodeDecodeError) -> UsageError:
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return UsageError(f"cannot read {what} {path}: {reason}")
