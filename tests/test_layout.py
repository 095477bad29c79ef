import pytest

from hf_loopcache import Cell, LoopLayout

OURO_14B = LoopLayout(n_core=24, num_loops=4, num_kv_heads=16, head_dim=128, name="ouro")
OURO_26B = LoopLayout(n_core=48, num_loops=4, num_kv_heads=16, head_dim=128, name="ouro")
HUGINN = LoopLayout(n_core=4, num_loops=32, num_kv_heads=55, head_dim=96, n_prelude=2, n_coda=2, name="huginn_raven")
RAVEN_LLAMA = LoopLayout(n_core=6, num_loops=32, num_kv_heads=8, head_dim=64, n_prelude=4, n_coda=4, name="raven_llama")


def test_bytes_per_token_match_the_papers():
    assert OURO_14B.full_bytes_per_token() == 768 * 1024
    assert OURO_26B.full_bytes_per_token() == 1536 * 1024
    assert round(HUGINN.full_bytes_per_token() / 1000) == 2788  # RIPE Sec. 2: 2,788 KB
    assert round(HUGINN.plane_bytes_per_token() / 1000) == 169  # and 169 KB for one plane
    assert round(RAVEN_LLAMA.full_bytes_per_token() / 1000) == 410
    assert round(RAVEN_LLAMA.plane_bytes_per_token() / 100) == 287  # 28.7 KB


@pytest.mark.parametrize(
    "layout, window, megabytes, fraction",
    [
        pytest.param(HUGINN, 0, 173, 0.061, id="huginn-deepest"),
        pytest.param(HUGINN, 16, 215, 0.075, id="huginn-W16"),
        pytest.param(HUGINN, 64, 341, 0.119, id="huginn-W64"),
        pytest.param(HUGINN, 256, 843, 0.295, id="huginn-W256"),
        pytest.param(RAVEN_LLAMA, 0, 29, 0.070, id="raven-deepest"),
        pytest.param(RAVEN_LLAMA, 64, 54, 0.128, id="raven-W64"),
        pytest.param(RAVEN_LLAMA, 256, 127, 0.302, id="raven-W256"),
    ],
)
def test_ripe_table2_at_1024_tokens(layout, window, megabytes, fraction):
    full = layout.full_bytes(1024)
    ripe = layout.ripe_bytes(1024, window)
    assert round(ripe / 1e6) == megabytes
    assert round(ripe / full, 3) == fraction


def test_slot_cell_round_trip_ouro():
    layout = OURO_14B
    for slot in range(layout.num_cells):
        cell = layout.cell(slot)
        assert layout.slot(cell) == slot == layout.flat_index(cell)
        assert slot == cell.loop * 24 + cell.layer
    assert layout.cell(30) == Cell("core", 1, 6)


def test_slot_cell_round_trip_huginn():
    layout = HUGINN
    assert layout.cell(0) == Cell("prelude", 0, 0)
    assert layout.cell(1) == Cell("prelude", 0, 1)
    assert layout.cell(2 + 4 * 5 + 3) == Cell("core", 5, 3)
    assert layout.cell(-1) == Cell("coda", 0, 0)
    assert layout.cell(-2) == Cell("coda", 0, 1)
    assert layout.flat_index(Cell("coda", 0, 1)) == 2 + 4 * 32 + 1
    for flat in range(layout.num_cells):
        cell = layout.cell_at(flat)
        assert layout.flat_index(cell) == flat
        assert layout.cell(layout.slot(cell)) == cell
    assert [str(c) for c in layout.cells()[:3]] == ["prelude.layer0", "prelude.layer1", "loop0.layer0"]
    assert Cell.parse("loop31.layer3") == Cell("core", 31, 3)
    assert layout.source_cell(Cell("core", 4, 2)) == Cell("core", 31, 2)


@pytest.mark.parametrize("slot", [-3, 2 + 4 * 32, 10_000])
def test_unknown_slot_is_a_clear_error(slot):
    with pytest.raises(IndexError, match="unknown slot index"):
        HUGINN.cell(slot)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_core=0, num_loops=4, num_kv_heads=1, head_dim=8), "n_core"),
        (dict(n_core=2, num_loops=0, num_kv_heads=1, head_dim=8), "num_loops"),
        (dict(n_core=2, num_loops=2, num_kv_heads=1, head_dim=8, n_coda=-1), "n_coda"),
    ],
)
def test_invalid_layout_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoopLayout(**kwargs)


def test_cells_and_dict_round_trip():
    assert LoopLayout.from_dict(HUGINN.to_dict()) == HUGINN
    with pytest.raises(ValueError, match="stage"):
        Cell("middle", 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loop"):
        Cell("coda", 1, 0)
    with pytest.raises(ValueError, match="unknown LoopLayout fields"):
        LoopLayout.from_dict({**HUGINN.to_dict(), "extra": 1})
