"""The one error type a user can cause, and the notice a user should see. Messages say what to do; the CLIs
print each on one line."""

import warnings


class InfinigenError(Exception):
    """A user-facing error (bad path, corrupt bundle, unsupported model, impossible option)."""


class InfinigenWarning(UserWarning):
    """Something changed from what the user asked for (a value capped, a default taken); the work goes on."""


def notice(message: str) -> None:
    """Tell the user (the CLIs print `warning: MESSAGE` on one line; a library caller sees a warning)."""
    warnings.warn(message, InfinigenWarning, stacklevel=2)
