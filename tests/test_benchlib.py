"""The benchmarks' TSV writer: results files stay readable as their columns grow."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchlib import Tsv  # noqa: E402


def _rows(path):
    return [line.split("\t") for line in path.read_text().splitlines()]


def test_tsv_grows_its_header_when_columns_are_added_at_the_end(tmp_path):
    p = tmp_path / "r.tsv"
    Tsv(p, ["a", "b"]).add(a=1, b=2)
    t = Tsv(p, ["a", "b", "c"])
    t.add(a=3, b=4, c=5)
    rows = _rows(p)
    assert rows[0] == ["run", "a", "b", "c"]
    assert rows[1][1:] == ["1", "2"] and rows[2][1:] == ["3", "4", "5"]
    assert not (tmp_path / "r.tsv.tmp").exists()


def test_tsv_refuses_columns_that_do_not_extend_the_file(tmp_path):
    p = tmp_path / "r.tsv"
    Tsv(p, ["a", "b"]).add(a=1, b=2)
    before = p.read_text()
    with pytest.raises(SystemExit, match="not these"):
        Tsv(p, ["a", "c"])
    assert p.read_text() == before


def test_afterstream_writes_a_row_per_probe_and_stream_size(tmp_path):
    import bench_afterstream
    out = tmp_path / "a.tsv"
    assert bench_afterstream.main(["--sizes", "0,1", "--pages", "4", "--iters", "3", "--reps", "1",
                                   "--tsv", str(out)]) == 0
    head, *rows = [line.split("\t") for line in out.read_text().splitlines()]
    rows = [dict(zip(head, r)) for r in rows]
    assert [(r["probe"], float(r["stream_mb"])) for r in rows] == [
        ("touch 4 pages", 0.0), ("touch 4 pages", 1.0), ("route_topk [1, 64] top-8", 0.0),
        ("route_topk [1, 64] top-8", 1.0)]
    assert all(float(r["first_us"]) > 0 and float(r["hot_us"]) > 0 for r in rows)
    assert rows[0]["stream_gbs"] == "nan" and float(rows[1]["stream_gbs"]) > 0


def test_oneregion_replays_a_decode_steps_calls_bit_for_bit(tmp_path):
    """bench_oneregion captures one decode step's one-token BF16 calls and times them as
    launches and as one region; a rep is written only when both give the same bits."""
    import bench_oneregion
    out = tmp_path / "o.tsv"
    assert bench_oneregion.main(["--arms", "tiny-k3", "--reps", "2", "--cache", str(tmp_path / "models"),
                                 "--tsv", str(out)]) == 0
    head, *rows = [line.split("\t") for line in out.read_text().splitlines()]
    rows = [dict(zip(head, r)) for r in rows]
    assert [r["rep"] for r in rows] == ["0", "1"]
    assert all(int(r["calls"]) > 0 and float(r["launches_ms"]) > 0 and float(r["region_ms"]) > 0 for r in rows)
