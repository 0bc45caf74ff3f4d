"""What of a generation's growing text can be shown yet: `generate --stream` and the server's streams both end at a
stop string as the runner does, and hold back what may still become one (or half a UTF-8 character)."""

from __future__ import annotations


class _StopTail:
    """The longest ending of a growing text that starts `stop`, kept up to date by KMP's automaton over the new
    characters only: each step costs what it adds, not the stop string's length squared."""

    def __init__(self, stop: str):
        self.stop, self.state = stop, 0  # state: the length of that ending
        self.fail = [0] * len(stop)  # fail[i]: the longest proper border of stop[: i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, chars: str) -> None:
        stop, fail, k = self.stop, self.fail, self.state
        for c in chars:
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
            if k == len(stop):  # a whole stop string: the caller ends the text there; keep its longest border
                k = fail[k - 1]
        self.state = k


class TextStream:
    """A row's growing text -> pieces safe to send: holds back an incomplete UTF-8 ending ("\\ufffd") and an
    ending that may still grow into a stop string, and ends at a stop string as the engine does."""

    def __init__(self, stops: list[str]):
        self.stops, self.sent, self.done = stops, "", False
        self.tails = [_StopTail(s) for s in stops if len(s) > 1]
        self.scanned = ""  # the text the tails have read

    def update(self, text: str) -> str:
        if self.done:
            return ""
        hits = [text.index(s) for s in self.stops if s in text]
        if hits:
            text, self.done = text[: min(hits)], True
        else:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._partial_stop(text)]
        if not text.startswith(self.sent):  # earlier text decoded differently: wait for the final text
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece

    def finish(self, final: str) -> str:
        return final[len(self.sent) :] if final.startswith(self.sent) else ""

    def _partial_stop(self, text: str) -> int:
        """Length of the longest ending of `text` that starts some stop string (read incrementally: a text that
        does not extend the last one, re-decoded, is read again from the tail a stop string can reach)."""
        if not self.tails:
            return 0
        if text.startswith(self.scanned):
            new = text[len(self.scanned) :]
        else:
            for t in self.tails:
                t.state = 0
            new = text[-max(len(t.stop) for t in self.tails) :]
        for t in self.tails:
            t.feed(new)
        self.scanned = text
        return max(t.state for t in self.tails)
