"""The one error type a user can cause. Its message says what to do; the CLIs print it on one line."""


class InfinigenError(Exception):
    """A user-facing error (bad path, corrupt bundle, unsupported model, impossible option)."""


def read_utf8(path, label: str) -> tuple[str, str]:
    """A UTF-8 text file's text and sha256; `label` names it in the one-line error when it is not UTF-8."""
    import hashlib

    data = open(path, "rb").read()
    try:
        return data.decode("utf-8"), hashlib.sha256(data).hexdigest()
    except UnicodeDecodeError:
        raise InfinigenError(f"{label} is not UTF-8 text") from None
