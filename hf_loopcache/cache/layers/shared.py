"""`SharedLayer`: a windowed cell whose history is another cell's storage (option `share`; RIPE's and LoopKV's
loop sharing)."""

from __future__ import annotations

from hf_loopcache.cache.layers.base import LoopLayerBase
from hf_loopcache.cache.layers.windowed import WindowedLayer

__all__ = ["SharedLayer"]


class SharedLayer(WindowedLayer):
    """Sink and window of its own at full precision; the history is read from `source` (the final loop's cell of the
    same layer): its code pages (a `CodedLayer`) or its full-precision buffer (a `DenseLayer`), handed to attention
    as they are stored. It stores no history of its own.

    In a partial-depth forward (`ReadState.draft_loops`), the source is not written, so the cell keeps at full
    precision every position the source cannot serve yet.

    Args:
        source (`LoopLayerBase`): the cell whose history this one reads (dense or coded, with the same sink and page).
        sink, window, page_size, rollback: see `WindowedLayer`.
    """

    option = "share"

    def __init__(self, source: LoopLayerBase, *, sink: int, window: int, page_size: int, rollback: int = 0) -> None:
        super().__init__(sink=sink, window=window, page_size=page_size, rollback=rollback)
        if isinstance(source, SharedLayer) or not isinstance(source, LoopLayerBase):
            raise TypeError(f"`source` must be a dense or coded cell layer, got {type(source).__name__}")
        self.source = source

    def _history_limit(self, length, read):
        return min(length, self.source.readable_limit())

    def _history_view(self, end):
        return self.source.history_view(self.sink, end)

    def _store(self, key, value, first, new_len, read):
        keep = self._keep_boundary(new_len, read)
        # never drop a position the source will not serve after this forward (it is written later in a complete
        # forward, not at all in a draft)
        cap = self.source.readable_limit(new_len) if read.complete else self.source.readable_limit()
        return max(self.recent.start, min(keep, cap))

    def truncate(self, length: int) -> None:
        """Keep `[0, length)`. Crop shared cells before their sources (`LoopCache.crop` does): below the rollback
        reserve, the part of the source's history it can no longer serve is copied into the window as the source
        will hold it."""
        if length >= self.length:
            return
        if length <= self.sink:
            self._truncate_sink(length)
        elif length >= self.recent.start:
            self.recent.truncate(length)
        else:
            served = self.source.readable_limit(length)
            self.recent.reset(min(served, length))
            if served < length:
                k, v = self.source.decoded(served, length)
                self.recent.append(k, v)
        self._finish_truncate(length)
