"""Stop strings on streamed text.

A stop string can arrive split over several deltas, so the tail of the text that could still
grow into a stop string is held back until it either completes one (generation stops, the stop
string itself is not emitted, as in the OpenAI API) or cannot any more.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]):
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # text received but not yet emitted
        self.stopped = False

    def feed(self, text: str) -> str:
        """Take new text; return what is safe to emit. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        if not self._stop:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        hold = self._longest_partial_match()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out) :]
        return out

    def flush(self) -> str:
        """At the end of generation: emit what was held back."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _longest_partial_match(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best
