"""`h3ctl`, the operator's command line for a running `h3d serve`; `main` is its entry point.

- `app`: the usage (its docstring), the global options, the parser assembled from the command
  groups, and `main`: ids resolved before a command runs, errors turned into exit codes.
- `client`: the channel and stubs (`Client`), `connect`, the files the user names, the errors
  commands raise (`UsageError`, `NoSuchSession`).
- `output`: JSON lines, error reports, and the human-readable formatters.
- `options`: the argument types and help that several groups share.
- One module per command group, each with its handlers and `add_parsers(sub)`: `stats` (health,
  stats, top), `sessions` (session create|list|show|close; id lookups), `streams` (append,
  generate), `admin` (evict, pin, policy, drain, resume, config).
"""

from h3d.ctl.app import main

__all__ = ["main"]
