"""KV positions of the history's tokens. A token's position is its index, except after an image chunk that a
model places by M-RoPE (Qwen2-VL and its successors): its n rows all stand at the chunk's first position
(their grid row and column in the other sections) and the chunk takes n_pos positions, its grid's longer
side, so every token after it stands n - n_pos positions below its index. The evaluated history's M-RoPE
chunks are kept here, so that a cut, a batch and a loaded state place each token where llama.cpp has it."""

from __future__ import annotations

import bisect


class Positions:
    def __init__(self) -> None:
        self.starts: list[int] = []  # each M-RoPE chunk's first token index, in order
        self.ends: list[int] = []  # the index after its last row
        self.skipped: list[int] = []  # positions its rows do not take, it and every chunk before it

    def at(self, index: int) -> int:
        """The position of the token at `index` (text, or a chunk's first row: where all its rows stand)."""
        if not self.ends:
            return index
        k = bisect.bisect_right(self.ends, index)
        before = self.skipped[k - 1] if k else 0
        if k < len(self.starts) and self.starts[k] < index:  # a row inside a chunk: at the chunk's start
            return self.starts[k] - before
        return index - before

    def record(self, start: int, end: int, n_pos: int) -> None:
        """An M-RoPE chunk evaluated at token indexes [start, end), taking n_pos positions."""
        self.forget_from(start)
        self.starts.append(start)
        self.ends.append(end)
        self.skipped.append((self.skipped[-1] if self.skipped else 0) + (end - start) - n_pos)

    def forget_from(self, index: int) -> None:
        """The KV is cut back to its first `index` tokens: chunks at or after it are gone (a cut never
        falls inside a chunk)."""
        k = bisect.bisect_left(self.starts, index)
        del self.starts[k:], self.ends[k:], self.skipped[k:]

    def clear(self) -> None:
        self.starts, self.ends, self.skipped = [], [], []
