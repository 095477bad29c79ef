"""`LoopCache`: the one cache engine. A `transformers.Cache` whose layers are a looped model's cells, each stored as a
`CachePlan` says. `FullLoopCache`, `RIPECache` and `LoopKVCache` are presets of it."""

from __future__ import annotations

import contextlib
import operator
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from hf_loopcache.attention import AttentionInputs, VPrecision
from hf_loopcache.cache.layers import CodedLayer, DenseLayer, LoopLayerBase, SharedLayer
from hf_loopcache.cache.layers.static import StaticDenseLayer, static_mask
from hf_loopcache.cache.layers.static_coded import FlushGroup, StaticCodedLayer, StaticCodedSharedLayer
from hf_loopcache.cache.plan import CachePlan
from hf_loopcache.cache.pytree import register_loop_cache_pytree
from hf_loopcache.cache.read import ReadState, VPrecisionStats
from hf_loopcache.cache.rows import group_cache, merge_group, widen_rows
from hf_loopcache.layout import Cell, LoopLayout

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["LoopCache", "resolve_layout"]

_LENGTH = operator.attrgetter("length")


def resolve_layout(model_or_layout: Any, num_loops: int | None = None) -> LoopLayout:
    """The `LoopLayout` of a native model, a config, or a layout itself (optionally with another loop count)."""
    if isinstance(model_or_layout, LoopLayout):
        layout = model_or_layout
    elif hasattr(model_or_layout, "loop_layout"):
        layout = model_or_layout.loop_layout
    elif hasattr(model_or_layout, "model_type"):
        layout = LoopLayout.from_config(model_or_layout)
    else:
        raise TypeError(
            "expected a native looped model (hf_loopcache OuroForCausalLM / HuginnForCausalLM), its config, or a "
            f"LoopLayout; got {type(model_or_layout).__name__}"
        )
    if num_loops is not None:
        if isinstance(num_loops, bool) or not isinstance(num_loops, int) or num_loops < 1:
            raise ValueError(f"`num_loops` must be a positive int, got {num_loops!r}")
        layout = layout.with_loops(num_loops)
    return layout


class LoopCache(Cache):
    """A looped model's key/value cache: one layer per cell, stored by a `CachePlan`.

    Native models (`hf_loopcache.models`) call `begin_forward(...)` once per forward and then `attend(slot, ...)` per
    cell, which reads each cell's storage as stored (full precision, codes, or another cell's storage) through
    `triton_ops.coded_attention`; everything a read depends on reaches the cell as one `ReadState` argument. Foreign
    code can use the plain `update(k, v, slot)` path, which returns every position as the cell reads it (decoded).
    Slots follow `LoopLayout` (Ouro: `loop * n_layers + layer`; Huginn: prelude `0..P-1`, core
    `P + n_core * step + layer`, coda `-1, -2`).

    Self-speculation: a forward with fewer loops than the cache holds is a draft (`draft_loops`); `rollback(length)`
    cuts every cell back (exact within `max_rollback`), and rows may hold *holes* (padded positions after a row's
    first real token) that the reading rule skips per row.

    Args:
        model_or_layout: a native looped model, its config, or a `LoopLayout`.
        plan (`CachePlan`, *optional*): per-cell storage; defaults to full precision everywhere.
        num_loops (`int`, *optional*): most loops a forward may run (defaults to the plan's, else the model's).
        max_rollback (`int`, *optional*, defaults to 0): recent positions kept at full precision beyond the window so
            that `crop` by up to this many positions restores exactly the state sequential decoding would have.
        v_precision (`VPrecision` or `float`, *optional*): LoopKV read-time value precision (a float is `tau`).
        static (`bool`, *optional*, defaults to False): preallocate every cell for `max_batch_size` rows and
            `max_cache_len` positions and keep the write position and key validity as device tensors, so that a
            one-token decode step has the same shapes and addresses every step (`is_compileable`; captured in a CUDA
            graph by `generate` on CUDA). Every plan: `bf16` cells are `StaticDenseLayer`s; `int4` / `int2` cells
            are `StaticCodedLayer`s (BF16 sink, a ring of recent positions, the codes of every page preallocated, the
            page flush inside the step); `share` cells (`StaticCodedSharedLayer`) keep their own recent positions in
            a ring sized by the window and `max_rollback` and read their source's codes or BF16 buffer in place.
            Every cell takes holes (rows' rejected draft tokens), so self-speculation runs batched and captured.
        max_batch_size (`int`, *optional*): rows of a static cache (required with `static=True`).
        max_cache_len (`int`, *optional*): positions of a static cache, prompt and generated tokens (required with
            `static=True`).

    Example:

    ```python
    >>> from hf_loopcache import LoopCache, CachePlan, load_fixture
    >>> model, tok = load_fixture("tiny-ouro")
    >>> cache = LoopCache(model, CachePlan.ripe(model.loop_layout, window=64))
    >>> out = model.generate(**tok("The cat", return_tensors="pt"), cache=cache, max_new_tokens=8)
    >>> cache.layout.cell(5)   # slot 5 of Ouro = loop 0, layer 5
    Cell(stage='core', loop=0, layer=5)
    ```
    """

    is_loop_cache = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_loop_cache_pytree(cls)  # every preset can be a `torch.export` input and output

    def __init__(
        self,
        model_or_layout: Any,
        plan: CachePlan | None = None,
        *,
        num_loops: int | None = None,
        max_rollback: int = 0,
        v_precision: VPrecision | float | None = None,
        static: bool = False,
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
    ) -> None:
        model_layout = resolve_layout(model_or_layout)
        if plan is None:
            plan = CachePlan.full(resolve_layout(model_layout, num_loops))
        elif not isinstance(plan, CachePlan):
            raise TypeError(f"`plan` must be a CachePlan or None (every cell full), got {type(plan).__name__}")
        elif not plan.layout.same_architecture(model_layout):
            raise ValueError(f"the plan is for {plan.layout.describe()}, but the model is {model_layout.describe()}")
        if num_loops is not None and num_loops != plan.layout.num_loops:
            raise ValueError(f"`num_loops` ({num_loops}) differs from the plan's loop count ({plan.layout.num_loops})")
        if isinstance(max_rollback, bool) or not isinstance(max_rollback, int) or max_rollback < 0:
            raise ValueError(f"`max_rollback` must be a non-negative int, got {max_rollback!r}")
        if isinstance(v_precision, (int, float)) and not isinstance(v_precision, bool):
            v_precision = VPrecision(tau=float(v_precision), page_size=plan.page_size)
        if v_precision is not None and not isinstance(v_precision, VPrecision):
            raise TypeError(f"`v_precision` must be a VPrecision, a float tau, or None; got {v_precision!r}")
        _check_static(plan, static, max_batch_size, max_cache_len)
        self.static = bool(static)
        # not `self.max_batch_size = ...`: transformers 5.17's `Cache` has read-only properties of those names
        self._static_rows, self._static_len = max_batch_size, max_cache_len
        self._length_t: torch.Tensor | None = None  # static: positions held, on the device (advanced in the step)
        self._valid_t: torch.Tensor | None = None  # static: key validity [max_batch_size, max_cache_len]
        self._source_length_t: torch.Tensor | None = None  # static: positions the final loop holds [1], on the device
        self._graphs: dict[Any, Any] = {}  # static: captured decode steps (see `hf_loopcache.models._graphs`)
        self._graph_pool: Any = None  # static: the memory pool the captured steps share
        self.plan = plan
        self.layout = plan.layout
        self.max_rollback = max_rollback
        self.v_precision = v_precision
        self._v_precision_stats: VPrecisionStats | None = None  # set by `track_v_precision()`
        self._draft_loops: int | None = None  # loops of the current forward when fewer than the cache holds
        self._speculating = False  # inside `speculating()`: forwards of a self-speculative decode
        # the current forward's read state, one per device its cells sit on (a model split by `device_map`), keyed by
        # the device's name (string keys: the cache stays a pytree, see `pytree.py`)
        self._read: tuple[AttentionInputs, dict[str, ReadState]] | None = None
        layers: list[LoopLayerBase] = [None] * self.layout.num_cells  # type: ignore[list-item]
        for cell in self.layout.cells():  # sources first: shared cells point at them
            if plan.option(cell) != "share":
                layers[self.layout.flat_index(cell)] = self._make_layer(cell, None)
        for cell in self.layout.cells():
            if plan.option(cell) == "share":
                source = layers[self.layout.flat_index(self.layout.source_cell(cell))]
                layers[self.layout.flat_index(cell)] = self._make_layer(cell, source)
        super().__init__(layers=list(layers))
        self.cells: list[LoopLayerBase] = layers  # the same objects as `self.layers`, typed
        # a dense cell whose read rule stands for every dense cell's in a captured step's key (`_step_mode`)
        self._dense_cell = next((layer for layer in layers if isinstance(layer, StaticDenseLayer)), None)
        coded = [layer for layer in layers if isinstance(layer, StaticCodedLayer)]
        if coded:  # a complete forward flushes them in one launch per code format
            group = FlushGroup(coded)
            for layer in coded:
                layer.flush_group = group

    def _make_layer(self, cell: Cell, source: LoopLayerBase | None) -> LoopLayerBase:
        option = self.plan.option(cell)
        sizes = dict(
            sink=self.plan.sink, window=self.plan.window, page_size=self.plan.page_size, rollback=self.max_rollback
        )
        if option == "bf16":
            if self.static:
                return StaticDenseLayer(self.max_batch_size, self.max_cache_len)  # type: ignore[arg-type]
            return DenseLayer()
        static_sizes = dict(
            sink=self.plan.sink,
            window=self.plan.window,
            page_size=self.plan.page_size,
            rollback=self.max_rollback,
            max_batch_size=self._static_rows,
            max_cache_len=self._static_len,
        )
        if option == "share":
            if source is None:
                raise ValueError(f"cell {cell} shares, but no source cell was given")
            if self.static:  # reads the source in place: its codes, or its BF16 buffer (RIPE) as a BF16 history
                return StaticCodedSharedLayer(source, **static_sizes)  # type: ignore[arg-type]
            return SharedLayer(source, **sizes)
        nbits = 4 if option == "int4" else 2
        if self.static:
            return StaticCodedLayer(nbits, group_size=self.plan.group_size, **static_sizes)  # type: ignore[arg-type]
        return CodedLayer(nbits, group_size=self.plan.group_size, **sizes)

    # ----------------------------------------------------------------------------- addressing
    def _flat(self, slot: int | torch.Tensor) -> int:
        if isinstance(slot, torch.Tensor):
            if slot.numel() != 1:
                raise ValueError(f"a slot index tensor must hold one value, got shape {tuple(slot.shape)}")
            slot = int(slot.item())
        return self.layout.slot_to_flat(slot)

    def _check_states(self, key_states: torch.Tensor) -> None:
        if (
            key_states.dim() != 4
            or key_states.shape[1] != self.layout.num_kv_heads
            or key_states.shape[3] != self.layout.head_dim
        ):
            raise ValueError(
                f"this cache is built for {self.layout.describe()}: keys must be [batch, {self.layout.num_kv_heads}, "
                f"seq, {self.layout.head_dim}], got {tuple(key_states.shape)}"
            )

    def layer_for(self, cell: Cell) -> LoopLayerBase:
        return self.cells[self.layout.flat_index(cell)]

    # ----------------------------------------------------------------------------- model-facing
    def begin_forward(self, layout: LoopLayout, num_loops: int, query_length: int) -> None:
        """Called by native models before a forward pass: the cache must fit the model and the loop count."""
        if not self.layout.same_architecture(layout):
            raise ValueError(
                f"this cache was built for {self.layout.describe()}, but the model is {layout.describe()}; "
                f"build the cache from this model"
            )
        if num_loops > self.layout.num_loops:
            raise ValueError(
                f"the forward runs {num_loops} loops but this cache holds {self.layout.num_loops}; build it with "
                f"`num_loops={num_loops}`"
            )
        self._draft_loops = None if num_loops == self.layout.num_loops else num_loops
        self._read = None

    @property
    def draft_loops(self) -> int | None:
        """Loops of the current forward if it runs fewer than the cache holds (a partial-depth draft), else None."""
        return self._draft_loops

    @contextlib.contextmanager
    def speculating(self) -> Iterator[LoopCache]:
        """Run the forwards inside as a self-speculative decode's (drafts, verification blocks): the state is part of
        every forward's `ReadState`, and a captured step is keyed by it. It changes one read: LoopKV's V precision in
        forwards of several tokens when `VPrecision.blocks` is None (the default), which a verification block then
        reads at both planes (`VPrecision.in_blocks`). `self_speculative_generate` and the `self_speculative`
        strategy enter it for their decode loop."""
        previous, self._speculating = self._speculating, True
        try:
            yield self
        finally:
            self._speculating = previous

    @property
    def is_speculating(self) -> bool:
        """Whether forwards now run as a self-speculative decode's (see `speculating`)."""
        return self._speculating

    def read_state(self, inputs: AttentionInputs, device: torch.device | None = None) -> ReadState:
        """The `ReadState` of the current forward on `device` (built once per forward and device from its
        `AttentionInputs`; the key mask is copied once to each device the model's cells sit on). `device` defaults to
        the mask's own."""
        if self._read is None or self._read[0] is not inputs:
            self._read = (inputs, {})
        states = self._read[1]
        key_valid = inputs.key_valid
        anchor = key_valid if key_valid is not None else inputs.static_valid  # a static cache's state has its own
        home = anchor.device if anchor is not None else None
        device = torch.device(device) if device is not None and anchor is not None else home

        def to(t: torch.Tensor | None, where: torch.device | None) -> torch.Tensor | None:
            return None if t is None else t.to(where)

        for where in (home, device):  # the mask's own device first: other devices copy its hole positions
            if str(where) not in states:
                states[str(where)] = ReadState(
                    key_valid=to(key_valid, where),
                    scaling=inputs.scaling,
                    draft_loops=self._draft_loops,
                    v_precision_tau=None if self.v_precision is None else self.v_precision.tau,
                    v_precision_blocks=self.v_precision is None or self.v_precision.in_blocks(self._speculating),
                    v_precision_stats=self._v_precision_stats,
                    home=None if where == home else states[str(home)],
                    positions=to(inputs.positions, where),
                    static_valid=to(inputs.static_valid, where),
                    static_mask=to(inputs.static_mask, where),
                    length=inputs.length,
                    source_length=to(inputs.source_length, where),
                )
        return states[str(device)]

    def _cell_on(self, slot: int | torch.Tensor, key_states: torch.Tensor) -> LoopLayerBase:
        """The layer of `slot`, after checking that the new keys are on the cell's device (a cell is placed on the
        device of the first keys it is handed: the device of the model layer that writes it) and, for a shared cell,
        that its source sits there too. Nothing moves a cell's storage to another device."""
        flat = self._flat(slot)
        layer = self.cells[flat]
        if layer.is_initialized and layer.device != key_states.device:
            raise ValueError(
                f"cell {self.layout.cell_at(flat)} of this cache is stored on {layer.device}, but the keys to write "
                f"are on {key_states.device}; a cache stays on the devices its first forward placed it on (build a "
                f"new cache for another placement)"
            )
        source = getattr(layer, "source", None)  # a shared cell, growable or static
        if source is not None and source.is_initialized and source.device != key_states.device:
            raise ValueError(
                f"cell {self.layout.cell_at(flat)} shares the history of cell "
                f"{self.layout.source_cell(self.layout.cell_at(flat))}, which is stored on {source.device}, but its "
                f"keys are on {key_states.device}; a shared cell and its source (the same layer's final loop) must be "
                f"written by the same layer on one device"
            )
        return layer

    def cell_devices(self) -> list[torch.device | None]:
        """The device of each cell's storage, by flat index (`LoopLayout.flat_index`); None for a cell not written
        yet. A cell is placed on the device of the first keys it is handed, i.e. that of the model layer that
        writes it (with a `device_map`, every loop of a layer sits on that layer's device)."""
        return [layer.device if layer.is_initialized else None for layer in self.cells]

    def write_target(
        self, slot: int, batch: int, query_length: int, inputs: AttentionInputs, device: torch.device
    ) -> tuple[torch.Tensor, ...] | None:
        """Where the new keys and values of cell `slot` go in this forward, `(k, v, positions)`, for a projection
        kernel that stores them itself: a static dense cell in a one-token step after the prefill (storage on
        `device`); None for every other cell and step. The forward then passes `written=True` to `attend`."""
        layer = self.cells[self._flat(slot)]
        if not isinstance(layer, StaticDenseLayer) or not layer.is_initialized or layer.device != device:
            return None
        return layer.write_target(batch, query_length, self.read_state(inputs, device))

    def attend(
        self,
        slot: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        inputs: AttentionInputs,
        written: bool = False,
    ) -> torch.Tensor:
        """Attention of the new tokens of cell `slot` over its stored history and themselves; stores the new keys and
        values. `query` `[B, H_q, q, D]`, `key`/`value` `[B, H_kv, q, D]` -> `[B, H_q, q, D]`. Into an empty growable
        cell (a prefill) `query` may hold only the last `p < q` new tokens' queries (the last query piece of a long
        prefill, `hf_loopcache.models._common.attention_half`): every new key and value is stored, `[B, H_q, p, D]`
        is returned. `written`: a projection kernel already stored them where `write_target` said."""
        self._check_states(key)
        layer = self._cell_on(slot, key)
        if written:
            if not isinstance(layer, StaticDenseLayer):
                raise ValueError(f"`written=True` is for a static dense cell (`write_target`), not a {type(layer).__name__}")
            return layer.attend(query, key, value, self.read_state(inputs, key.device), written=True)
        if query.shape[2] != key.shape[2] and (self.static or layer.get_seq_length() != 0):
            raise ValueError(
                f"`query` holds {query.shape[2]} tokens but `key` {key.shape[2]}: only a prefill into an empty growable "
                f"cell may pass the queries of its last new tokens alone (cell {self.layout.cell_at(self._flat(slot))} "
                f"holds {layer.get_seq_length()} positions)"
            )
        return layer.attend(query, key, value, self.read_state(inputs, key.device))

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int | torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain `Cache.update` for foreign models: `layer_idx` is the model's slot index (int or 0-d tensor)."""
        self._check_states(key_states)
        return self._cell_on(layer_idx, key_states).update(key_states, value_states)

    # ----------------------------------------------------------------------------- Cache contract
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not 0 <= layer_idx < len(self.cells):
            return 0
        return self.cells[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        return self.cells[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len if self.static else -1  # type: ignore[return-value]

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_cache_len if self.static else -1  # type: ignore[return-value]

    @property
    def batch_size(self) -> int:
        for layer in self.cells:
            if layer.is_initialized:
                return layer._batch
        return -1

    @property
    def is_compileable(self) -> bool:
        return self.static

    @property
    def is_linear(self) -> list[bool]:
        """No cell is a linear-attention (state-space) layer. transformers' `prepare_inputs_for_generation` reads this
        at every step; its `Cache.is_linear` tests every layer against two abstract classes (12 us for 96 cells on a
        busy CPU), this is a list of as many `False`."""
        return [False] * len(self.cells)

    @property
    def max_batch_size(self) -> int:  # type: ignore[override]
        """Rows of a static cache's storage; a growable cache's current rows (-1 before its first write)."""
        return self._static_rows if self.static else self.batch_size  # type: ignore[return-value]

    @property
    def max_cache_len(self) -> int:  # type: ignore[override]
        """Positions of a static cache's storage; -1 for a growable cache (no maximum)."""
        return self._static_len if self.static else -1  # type: ignore[return-value]

    # ----------------------------------------------------------------------------- static mode
    def static_inputs(
        self,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        *,
        batch_size: int,
        query_length: int,
        device: torch.device,
        scaling: float,
        keep_mask: bool = False,
    ) -> tuple[AttentionInputs, torch.Tensor]:
        """A static cache's inputs of one forward, from device state only: the storage positions of the new tokens
        (`positions`, from the device length, which this advances), key validity over the storage (the mask's new
        columns written at `positions`; a mask covering cache and new tokens is copied whole, which is how holes of
        a batched verification arrive), the read mask, and `position_ids` (the real tokens before each new one,
        counted on the device). Nothing here reads a device value on the host, so the step can be captured.

        `attention_mask` `[B, past + q]` or `[B, q]` (the new tokens' columns only), or None (every token real).
        `keep_mask`: a prefill without padding keeps the masked read (a group of a grouped prefill whose batch has
        padding elsewhere). Returns the `AttentionInputs` and `position_ids` `[B, q]`."""
        if batch_size > self.max_batch_size:  # type: ignore[operator]
            raise ValueError(
                f"the batch has {batch_size} rows but this static cache was built with "
                f"`max_batch_size={self.max_batch_size}`"
            )
        if self._length_t is None or self._valid_t is None or self._length_t.device != torch.device(device):
            self._length_t = torch.zeros((), dtype=torch.long, device=device)
            self._valid_t = torch.zeros(self.max_batch_size, self.max_cache_len, dtype=torch.bool, device=device)  # type: ignore[arg-type]
            self._source_length_t = torch.zeros(1, dtype=torch.long, device=device)
            self._sync_device_length()
        length, q = self.get_seq_length(), query_length
        if length + q > self.max_cache_len:  # type: ignore[operator]
            raise ValueError(
                f"this static cache holds at most `max_cache_len={self.max_cache_len}` positions; the forward adds {q} "
                f"to {length} (build it with a larger `max_cache_len`)"
            )
        positions = self._length_t + torch.arange(q, device=device)
        self._length_t.add_(q)
        if self._draft_loops is None:  # every loop runs: the final loop's cells hold the new positions too
            self._source_length_t.copy_(self._length_t.view(1))  # type: ignore[union-attr]
        valid = self._valid_t[:batch_size]
        if attention_mask is None:
            valid.index_fill_(1, positions, True)
        else:
            if not isinstance(attention_mask, torch.Tensor):
                raise ValueError(
                    f"a static cache takes a 2-D padding `attention_mask` [batch, past + new], got "
                    f"{type(attention_mask).__name__}"
                )
            width = attention_mask.shape[-1]
            if attention_mask.dim() != 2 or width not in (q, length + q):
                raise ValueError(
                    f"`attention_mask` for a static cache must be [batch, past + new] ({length + q} columns) or "
                    f"[batch, new] ({q}), got shape {tuple(attention_mask.shape)}"
                )
            mask = attention_mask.to(device=device, dtype=torch.bool)
            if width == length + q and width != q:
                valid[:, :width].copy_(mask)
            else:
                valid.index_copy_(1, positions, mask)
        if position_ids is None:
            position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0).index_select(1, positions)
        elif position_ids.dim() == 1:
            position_ids = position_ids[None].expand(batch_size, -1)
        key_valid: torch.Tensor | None = valid
        if (
            q > 1
            and length == 0
            and not keep_mask
            and not torch.compiler.is_compiling()
            and (attention_mask is None or bool(valid[:, :q].all()))
        ):
            # a prefill of real tokens only: the unmasked fast path (a prefill is never captured; after it, static
            # cells read `static_mask` / `static_valid` only, so a block never reads the mask on the host)
            key_valid = None
        inputs = AttentionInputs(
            key_valid=key_valid,
            scaling=scaling,
            positions=positions,
            static_valid=valid,
            static_mask=static_mask(positions, valid) if length > 0 else None,
            length=length,
            source_length=self._source_length_t,
        )
        return inputs, position_ids

    def _step_mode(self, query_length: int, cuda: bool) -> tuple[bool, str]:
        """What a static cache's forward of `query_length` new tokens reads by, besides shapes and addresses, from host
        state a captured step fixes: whether it runs as a self-speculative decode's (`speculating`) and which read its
        dense cells run (`StaticDenseLayer.read_kind_at`, asked of one of them: with `"auto"`, the kernel or cuDNN by
        how full the storage is; every dense cell of a cache has the same storage; `"none"` without dense cells).
        `DecodeGraphs` keys a captured step by it."""
        if self._dense_cell is None:
            return self._speculating, "none"
        return self._speculating, self._dense_cell.read_kind_at(self.get_seq_length(), query_length, cuda)

    def captured_steps(self) -> list[dict[str, Any]]:
        """The steps captured for this static cache (`generate`'s decode steps, self-speculation's drafts and
        verifications): batch size, tokens per step and capture seconds (its eager warm-up step plus the capture),
        one entry per graph."""
        return [
            {"batch": key[0], "tokens": key[1], "capture_s": round(entry.capture_s, 3)}
            for key, entry in self._graphs.items()
            if entry is not None  # None: the step could not be captured and decodes eagerly
        ]

    def _advance_host(self, written: list[int]) -> None:
        """After a replayed step: the host length of each cell advances by what the step wrote into it (`written`,
        positions per cell by flat index: the query length for the cells of the loops it ran, 0 for the others)."""
        for advance, n in self._host_advances(written):
            advance(n)

    def _host_advances(self, written: list[int]) -> list[tuple[Any, int]]:
        """`(cell.advance, n)` of the cells `written` names (`_advance_host`'s calls, bound once: a captured step keeps
        them and runs no per-cell test per replay)."""
        return [(layer.advance, n) for layer, n in zip(self.cells, written) if n]  # type: ignore[attr-defined]

    def _host_lengths(self) -> list[int]:
        return list(map(_LENGTH, self.cells))

    def _host_state(self) -> list[dict[str, Any]]:
        """Every cell's host-side scalars (length, ring bounds, floor: the ints, bools and floats a step's host code
        reads and writes), for `_restore_host_state` after a CUDA graph's recording, which runs the step's host side
        once more than the device side (a ring bound left advanced there would send a later crop down the deep path)."""
        return [{k: v for k, v in vars(layer).items() if type(v) in (int, bool, float)} for layer in self.cells]

    def _restore_host_state(self, state: list[dict[str, Any]]) -> None:
        for layer, saved in zip(self.cells, state):
            vars(layer).update(saved)

    def _sync_device_length(self) -> None:
        if self._length_t is not None:
            self._length_t.fill_(self.get_seq_length())
        if self._source_length_t is not None:
            last = self.layout.num_loops - 1
            self._source_length_t.fill_(min(self.layer_for(cell).length for cell in self.layout.core_cells(last)))

    def write_key_valid(self, start: int, valid: torch.Tensor) -> None:
        """A static cache's key validity of positions `[start, start + n)` per row, `valid` `[B, n]` bool on the
        device (no host read): how a batched verification's rejected positions become holes without a new mask."""
        if self._valid_t is None:
            raise ValueError("`write_key_valid` needs a static cache that has run a forward")
        self._valid_t[: valid.shape[0], start : start + valid.shape[1]].copy_(valid)

    def _select_static_rows(self, index: torch.Tensor) -> None:
        if self._valid_t is not None:
            rows = int(index.shape[0])
            index = index.to(self._valid_t.device)
            selected = self._valid_t[: self.batch_size].index_select(0, index)
            self._valid_t[:rows].copy_(selected)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.static:
            self._select_static_rows(beam_idx)
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.static and self.batch_size > 0:
            self._select_static_rows(torch.arange(self.batch_size).repeat_interleave(repeats))
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.static:
            self._select_static_rows(indices.nonzero().flatten() if indices.dtype == torch.bool else indices)
        super().batch_select_indices(indices)

    def reset(self) -> None:
        """Empty every cell (a static cache keeps its storage, and with it the captured decode steps)."""
        super().reset()
        self._sync_device_length()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` positions (transformers >= 5.16: `tokens_to_remove <= 0`); a positive
        value is the absolute length to keep (the older convention). Every cell is cut to that length. A 0-d tensor
        (transformers 5.17's assisted decoding passes one) is read as its int."""
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove == 0:  # transformers' deferred stop check crops by 0 after every step it keeps
            return
        length = self.get_seq_length()
        target = length + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        self.rollback(max(0, min(length, target)))

    def exact_crop(self, positions: int) -> bool:
        """Whether `crop(-positions)` right after a forward gives back exactly the state before the last `positions`
        positions: always for cells without a window, within `max_rollback` for windowed and coded cells (a growable
        cell's cut past it restores a page from its codes), and for a static cache's windowed cells also where their
        ring still holds what the next forward reads or codes from it (`_StaticWindowed.exact_crop`: every static
        preset and plan takes one position back exactly without a reserve). transformers' deferred stop check asks
        this (`_compat.deferred_stop_check`)."""
        return all(layer.exact_crop(positions) for layer in self.cells)

    def rollback(self, length: int) -> None:
        """Cut every cell to at most `length` positions (a cell holding fewer, e.g. a deep cell after a partial-depth
        draft, is left alone). Exact for cuts of up to `max_rollback` positions below the longest length reached
        since; deeper cuts restore the straddling page from its codes. Shared cells are cut before their sources."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"`length` must be a non-negative int, got {length!r}")
        for layer in self._shared_first():
            if layer.get_seq_length() > length:  # every cell's `truncate` leaves a cell holding <= `length` alone
                layer.truncate(length)
        self._sync_device_length()

    def _shared_first(self) -> list[LoopLayerBase]:
        """The cells in rollback order: shared cells before their sources (a static coded shared cell cut below its
        ring reads its source as it was). Sorted once per cell list (self-speculation rolls back twice per block)."""
        cached = self.__dict__.get("_rollback_order")
        if cached is None or cached[0] is not self.cells or len(cached[1]) != len(self.cells):
            order = sorted(self.cells, key=lambda layer: not isinstance(layer, (SharedLayer, StaticCodedSharedLayer)))
            cached = self.__dict__["_rollback_order"] = (self.cells, order)
        return cached[1]

    def _floor_groups(self) -> tuple[int, ...]:
        """Which static windowed cells have a ring floor above their sink (`floor`: below it a cell reads its history,
        not its ring; it leaves the sink only after a crop past the ring), and which of those share one: for each
        such cell the index of the first one with the same floor, -1 for a cell at its sink; `()` while every cell
        is at its sink. A captured step holds both: a cell at its sink skips the raise to its floor (a host branch,
        `_floored`), and a shared cell's cuDNN read builds one history bias per forward for the cells of one geometry
        and floor (`StaticCodedSharedLayer._history_bias`); a crop past the rings after a partial-depth draft moves
        the drafted plane's floors only. `DecodeGraphs` keys its graphs by this."""
        cached = self.__dict__.get("_floor_cells")
        if cached is None or cached[0] is not self.cells:
            cached = self.__dict__["_floor_cells"] = (self.cells, [c for c in self.cells if hasattr(c, "floor_t")])
        if all(cell.floor == cell.sink for cell in cached[1]):
            return ()
        first: dict[int, int] = {}
        return tuple(first.setdefault(c.floor, i) if c.floor > c.sink else -1 for i, c in enumerate(cached[1]))

    def loop_lengths(self) -> list[int]:
        """Positions each core plane holds, `[plane 0, ..., plane R-1]` (the fewest over the plane's cells). After a
        draft of depth `d`, planes `< d` hold the draft positions and planes `>= d` do not."""
        return [
            min(self.layer_for(cell).get_seq_length() for cell in self.layout.core_cells(loop))
            for loop in range(self.layout.num_loops)
        ]

    def set_max_rollback(self, max_rollback: int) -> None:
        """Keep the last `max_rollback` positions of every windowed cell at full precision from now on (positions that
        already left the window stay coded)."""
        if isinstance(max_rollback, bool) or not isinstance(max_rollback, int) or max_rollback < 0:
            raise ValueError(f"`max_rollback` must be a non-negative int, got {max_rollback!r}")
        self.max_rollback = max_rollback
        for layer in self.cells:
            if hasattr(layer, "rollback"):
                layer.rollback = max_rollback
            if isinstance(layer, (StaticCodedLayer, StaticCodedSharedLayer)):
                old = layer.capacity
                layer.resize(max_rollback)
                if layer.capacity != old:
                    self._graphs.clear()  # the captured steps read the old rings
        self._sync_device_length()

    def reserve(self, max_length: int) -> None:
        """Allocate every empty cell's storage for `max_length` positions at its first write (full-precision buffers,
        code pages, windows), so that decoding never regrows them (regrowing every cell in turn fragments the
        allocator at long contexts and holds two copies of a cell while it copies). `generate` calls this with its
        maximum length. A static cache checks that `max_length` fits its `max_cache_len`."""
        if self.static and int(max_length) > self.max_cache_len:  # type: ignore[operator]
            raise ValueError(
                f"generation may reach {int(max_length)} positions, but this static cache holds at most "
                f"`max_cache_len={self.max_cache_len}`; build it with `max_cache_len >= {int(max_length)}`"
            )
        for layer in self.cells:
            layer.reserve(int(max_length))

    def row_group(self, start: int, end: int, batch: int) -> LoopCache:
        """The cache that rows `[start, end)` of a prefill of `batch` rows in groups write (the model's
        `prefill_rows`; `hf_loopcache.cache.rows`): this cache for the first group (it must be empty), else a new
        cache of the same plan whose largest buffers are views of this cache's rows. Hand it back with
        `merge_row_group` after the group's forward."""
        if not 0 <= start < end <= batch:
            raise ValueError(f"rows [{start}, {end}) are not a group of a batch of {batch} rows")
        if start == 0:
            if self.get_seq_length() != 0:
                raise ValueError(
                    f"a prefill in groups of rows fills an empty cache, but this one holds {self.get_seq_length()} "
                    f"positions; pass `prefill_rows=None` for a forward after cached positions"
                )
            if self.static and batch > self.max_batch_size:
                raise ValueError(
                    f"the batch has {batch} rows but this static cache was built with "
                    f"`max_batch_size={self.max_batch_size}`"
                )
            return self
        return group_cache(self, start, end)

    def merge_row_group(self, group: LoopCache, start: int, end: int, batch: int) -> None:
        """Rows `[start, end)` of this cache take what `group` (from `row_group`) stored in a grouped prefill of
        `batch` rows: after the first group, every cell is widened to `batch` rows; after a later one, its rows are
        copied where the group did not write them in place. Afterwards the cache holds what a prefill of the whole
        batch at once stores."""
        if start == 0:
            if group is not self:
                raise ValueError("the first group of a grouped prefill writes the cache itself (`row_group(0, ...)`)")
            widen_rows(self, batch)
        else:
            merge_group(self, group, start, end)
        if self.static:  # every static cell counts the rows held so far and sees their validity (its first rows)
            for layer in self.cells:
                if layer.is_initialized:
                    layer.rows = end
                if getattr(layer, "valid", None) is not None and self._valid_t is not None:
                    layer.valid = self._valid_t[:end]
        self._read = None

    def activate_past_recording(self) -> None:
        """Nothing to do: every cell keeps what `crop` needs (see `max_rollback` for exactness beyond the window)."""

    # ----------------------------------------------------------------------------- inspection
    def cell_states(self, cell: Cell | int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one cell (a `Cell` or a slot) as it reads them, `[B, H_kv, T, D]`."""
        layer = self.cells[self._flat(cell)] if isinstance(cell, int) else self.layer_for(cell)
        return layer.full_states()

    def track_v_precision(self) -> VPrecisionStats:
        """Start counting, per query row, head and token, the INT4 history values read (`"history"`) and those read
        cold (`"cold"`). Counts accumulate on the device; reading one syncs. Returns the live counter (a mapping)."""
        self._v_precision_stats = VPrecisionStats()
        self._read = None
        return self._v_precision_stats

    def nbytes(self) -> int:
        """Bytes of GPU/CPU memory the cache's tensors occupy (allocated capacity, including growth slack)."""
        return sum(layer.allocated_bytes() for layer in self.cells)

    def stored_bytes(self) -> int:
        """Bytes of the positions currently held (what `CachePlan.expected_stored_bytes` predicts)."""
        return sum(layer.stored_bytes() for layer in self.cells)

    def bytes_per_token(self) -> tuple[int, int]:
        """(stored, read) bytes per history token over all cells (see `CachePlan.bytes_per_token`)."""
        return self.plan.bytes_per_token()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout.describe()}; {self.plan.summary()}; length {self.get_seq_length()})"


register_loop_cache_pytree(LoopCache)


def _check_static(plan: CachePlan, static: Any, max_batch_size: Any, max_cache_len: Any) -> None:
    if not isinstance(static, bool):
        raise ValueError(f"`static` must be True or False, got {static!r}")
    if not static:
        if max_batch_size is not None or max_cache_len is not None:
            raise ValueError("`max_batch_size` and `max_cache_len` size a static cache; pass them with `static=True`")
        return
    for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int with `static=True`, got {value!r}")

