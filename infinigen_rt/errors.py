"""The one error type a user can cause. Its message says what to do; the CLIs print it on one line."""


class InfinigenError(Exception):
    """A user-facing error (bad path, corrupt bundle, unsupported model, impossible option)."""
