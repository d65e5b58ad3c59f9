"""The prompt cache: which token ids the engine's KV cache holds, and K-1 saved sequences.

Batch 1 and one engine: the backend's cache holds one sequence, the "live" one.  A request
whose prompt shares a prefix with it truncates the cache to the common prefix and prefills
only the rest, as `nq chat` does between turns (nq/chat.py); an editor that re-sends the same
file with a few lines changed, or a chat client that re-sends the whole conversation, pays
only for what changed.

With `--cache-slots K > 1` and a backend that offers `snapshot()` / `restore(state)` (the
NumPy reference), up to K-1 other sequences are kept as saved copies, least recently used
evicted first: before the live sequence is cut or replaced, a copy of it is saved, and a
request that matches a saved sequence better than the live one restores it.  Two editors or
two conversations taking turns then both keep their prefixes.  The GPU engine's copies are
pinned host buffers (nq/runtime/kv_snapshot.py), recycled through `discard(state)` and bounded
by `keep_snapshots(n)`: K of them at most (K-1 saved, one more while the live sequence and a
saved one change places), `pinned_bytes` in all.

At least one prompt token is always prefilled, because the loop needs its logits.
"""
from __future__ import annotations

import sys

from nq.chat import common_prefix


class PromptCache:
    def __init__(self, backend, slots: int = 1):
        self.backend = backend
        self.can_save = hasattr(backend, "snapshot") and hasattr(backend, "restore")
        self.slots = max(1, slots) if self.can_save else 1
        self.ids: list[int] = []               # the ids in the backend's cache, in order
        self.saved: list[tuple[list[int], object]] = []  # (ids, state), most recent last
        self.pinned_bytes = 0                  # host memory the saved copies may take at most
        if self.slots > 1 and hasattr(backend, "keep_snapshots"):
            self.pinned_bytes = backend.keep_snapshots(self.slots)

    def prepare(self, prompt: list[int]) -> int:
        """Make the backend hold the longest cached prefix of `prompt` (all but its last token
        at most); returns how many tokens that is."""
        limit = len(prompt) - 1
        live = min(common_prefix(self.ids, prompt), limit)
        best, best_n = None, live
        for i, (ids, _) in enumerate(self.saved):
            n = min(common_prefix(ids, prompt), limit)
            if n > best_n:
                best, best_n = i, n
        if best is not None:
            ids, state = self.saved.pop(best)
            self._save_live()
            self.backend.restore(state)
            self._discard(state)
            self.ids = ids
        elif live < len(self.ids):  # the live sequence is about to be cut: keep a copy
            self._save_live()
        if best_n < len(self.ids):
            self.backend.truncate(best_n)
            self.ids = self.ids[:best_n]
        return best_n

    def _save_live(self) -> None:
        if self.slots < 2 or not self.ids:
            return
        ids = self.ids
        if any(common_prefix(s, ids) == len(ids) for s, _ in self.saved):
            return  # a saved sequence already holds all of it
        # a saved prefix of the live sequence serves no prompt the live one would not; the
        # least recently used go before the copy is taken, so no more than K-1 are kept
        keep = []
        for s, st in self.saved:
            if common_prefix(s, ids) < len(s):
                keep.append((s, st))
            else:
                self._discard(st)
        while len(keep) >= self.slots - 1:
            self._discard(keep.pop(0)[1])
        self.saved = keep
        try:
            state = self.backend.snapshot()
        except RuntimeError as e:  # the cache is an optimisation: the request goes on without it
            print(f"nq: warning: prompt cache copy not kept: {e}", file=sys.stderr)
            return
        self.saved.append((list(ids), state))

    def _discard(self, state) -> None:
        if hasattr(self.backend, "discard"):
            self.backend.discard(state)

    def hold(self, ids: list[int]) -> None:
        """After a request: the backend's cache now holds `ids`."""
        self.ids = list(ids)

    def forget(self) -> None:
        """After an error the cache's contents are unknown: start empty (saved copies stay)."""
        self.ids = []
        self.backend.reset()

    @property
    def saved_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.saved)
