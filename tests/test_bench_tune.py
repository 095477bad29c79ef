"""`benchmarks.tune_coded_attention`'s static views (`--static-capacity`): stored as a static cache's captured step
stores a cell (the length on the device, every page of the capacity preallocated, the window as a ring), they read
what the host-length view of the same positions reads, so the two timings compare the same work."""

from __future__ import annotations

import pytest
import torch

from benchmarks import tune_coded_attention as tune
from triton_ops.coded_attention import reference_coded_attention


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("nbits", [4, 2])
def test_static_view_reads_what_the_host_view_reads(queries, nbits):
    torch.set_num_threads(1)
    d = tune._data(2, 1400, "cpu", torch.Generator().manual_seed(0))
    host, n_hist = tune._view(d, 2, 1024, nbits, queries=queries)
    static, n_static = tune._view(d, 2, 1024, nbits, queries=queries, capacity=1400)
    assert n_static == n_hist and isinstance(static.length, torch.Tensor)
    assert static.history_key.codes.shape[2] > n_hist  # pages past the history: preallocated, unread
    q = d["q"][:2, :, :queries]
    want, want_lse = reference_coded_attention(q, host, scaling=tune.D**-0.5, v_precision_tau=1.0 if nbits == 4 else None)
    got, got_lse = reference_coded_attention(q, static, scaling=tune.D**-0.5, v_precision_tau=1.0 if nbits == 4 else None)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # fp32: the two reads sum in different orders
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-5)


def test_tuning_values_read_from_the_command_line():
    """`--configs`' `key=value` fields and `--row1-tuning` read values one way: the kernel's constexprs need real
    bools and ints (`vprec_lookback=true` must not arrive as the truthy string "true", nor `maxnreg=none` as "none")."""
    from triton_ops.coded_attention.ops import tuning_value

    assert tuning_value("none") is None and tuning_value("None") is None
    assert tuning_value("true") is True and tuning_value("FALSE") is False
    assert tuning_value("168") == 168 and tuning_value("-1") == -1 and isinstance(tuning_value("0"), int)
    assert tuning_value("scores") == "scores"


def test_plot_draws_every_timed_setting_and_refuses_an_empty_file(tmp_path, monkeypatch):
    """`--plot`: one bar per (setting, provider) and shape of a results file, errors left out; a file with nothing
    timed is refused by name instead of drawing an empty chart."""
    import json

    import matplotlib.axes

    rows = [
        dict(config="1,2,1,8,1", provider="int4", batch=8, context=1280, queries=5, us=47.2),
        dict(config="1,2,1,8,1", provider="int4", batch=1, context=8192, queries=5, us=34.5),
        dict(config="1,2,1,8,1,mma_one_wave=0", provider="int4-vprec", batch=8, context=1280, queries=5, us=96.4),
        dict(config="sdpa-bf16", provider="sdpa-bf16", batch=8, context=1280, us=47.1),
        dict(config="bad", provider="int4", error="did not compile"),
    ]
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(dict(device="GPU", torch="2.11", rows=rows)))
    bars = []
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "bar",
        lambda ax, x, h, *a, **k: bars.append((list(h), k["label"])) or real_bar(ax, x, h, *a, **k),
    )
    tune.main(["--plot", str(path)])
    assert (tmp_path / "ab.png").stat().st_size > 0
    assert sorted(bars) == sorted(
        [([47.2, 34.5], "int4 1,2,1,8,1"), ([96.4], "int4-vprec 1,2,1,8,1,mma_one_wave=0"), ([47.1], "sdpa-bf16")]
    )
    path.write_text(json.dumps(dict(device="GPU", torch="2.11", rows=rows[-1:])))
    with pytest.raises(SystemExit, match="no timed rows"):
        tune.main(["--plot", str(path)])


def test_byte_count_keeps_cold_lo_words_where_v9_loads_them_ahead():
    """The tools' V-precision byte count leaves cold tokens' `lo` words out unless the call reads them:
    `mma_lo_ahead` on a block the launcher takes to v9 (`mma_rows_min` queries or more, or `mma`), not decode."""
    from benchmarks.bench_coded_attention import vprec_reads_cold_lo

    assert not vprec_reads_cold_lo(None, 5)
    assert vprec_reads_cold_lo({"mma_lo_ahead": True}, 5)
    assert not vprec_reads_cold_lo({"mma_lo_ahead": True}, 1)
    assert vprec_reads_cold_lo({"mma_lo_ahead": True, "mma": True}, 1)
    assert not vprec_reads_cold_lo({"mma_lo_ahead": True, "mma_rows_min": 0}, 5)  # 0: v8 / v9 only when asked
