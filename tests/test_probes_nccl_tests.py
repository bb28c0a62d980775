"""The all_reduce_perf parser against real published outputs (tests/fixtures/nccl_tests/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.probes.nccl_tests import NcclTestsError, parse

FIXTURES = Path(__file__).parent / "fixtures" / "nccl_tests"
OCI = (FIXTURES / "oci_a100x16_nccl2.21.5.txt").read_text()
CSCS = (FIXTURES / "cscs_gh200x2_nccltests2.18.2.txt").read_text()
GCP = (FIXTURES / "gcp_a3mega_h100x16.txt").read_text()


def test_oci_a100_single_size_row_and_average() -> None:
    result = parse(OCI)
    assert result.ranks == 16
    (row,) = result.rows
    assert row.size_bytes == 10737418240 and row.count == 2684354560
    assert (row.type, row.redop) == ("float", "sum")
    assert row.out_of_place.time_us == 90330
    assert row.out_of_place.algbw_bytes_per_second == pytest.approx(118.87e9)
    assert row.out_of_place.busbw_bytes_per_second == pytest.approx(222.88e9)
    assert row.in_place.busbw_bytes_per_second == pytest.approx(218.96e9)
    assert row.out_of_place.wrong == 0
    assert result.avg_busbw_bytes_per_second == pytest.approx(220.921e9)
    # nccl-tests' average is the mean over both placements; here that is one row's mean.
    assert row.busbw_bytes_per_second == pytest.approx(result.avg_busbw_bytes_per_second, rel=1e-4)


def test_cscs_gh200_recent_layout_with_version() -> None:
    result = parse(CSCS)
    assert result.version == "2.18.2"
    assert result.ranks == 2
    assert [r.size_bytes for r in result.rows] == [1048576 << i for i in range(8)]
    last = result.row(134217728)
    assert last.out_of_place.time_us == pytest.approx(5871.07)
    assert last.in_place.busbw_bytes_per_second == pytest.approx(22.88e9)
    # Two ranks: 2(n-1)/n = 1, so busbw equals algbw in every row.
    for row in result.rows:
        assert row.out_of_place.busbw_bytes_per_second == row.out_of_place.algbw_bytes_per_second
    assert result.avg_busbw_bytes_per_second == pytest.approx(14.9966e9)


def test_gcp_h100_sweep_and_bus_factor() -> None:
    result = parse(GCP)
    assert len(result.rows) == 31
    assert result.largest.size_bytes == 8589934592
    assert result.largest.out_of_place.busbw_bytes_per_second == pytest.approx(338.82e9)
    # busbw = algbw x 2(n-1)/n with n = 16 ranks, within the table's two decimals.
    for row in result.rows[20:]:
        m = row.out_of_place
        assert m.busbw_bytes_per_second == pytest.approx(m.algbw_bytes_per_second * 30 / 16, rel=2e-3)
    mean = sum(r.busbw_bytes_per_second for r in result.rows) / len(result.rows)
    assert mean == pytest.approx(result.avg_busbw_bytes_per_second, rel=1e-3)


def test_mpirun_prefixes_and_nccl_info_lines_are_ignored() -> None:
    noisy = "\n".join(
        f"[1,0]<stdout>:{line}" if i % 2 else line for i, line in enumerate(OCI.splitlines())
    ).replace("#  Rank  3", "host:417:417 [3] NCCL INFO Using network IB\n#  Rank  3")
    assert parse(noisy).rows == parse(OCI).rows


def test_truncated_output_is_a_clear_failure() -> None:
    cut = GCP[: GCP.index("  1073741824")]
    with pytest.raises(NcclTestsError, match="without '# Avg bus bandwidth': the run was cut short"):
        parse(cut)


def test_garbled_row_names_its_line() -> None:
    lines = CSCS.splitlines()
    lines[13] = lines[13].replace("  8.81    8.81", "  8.81")
    with pytest.raises(NcclTestsError, match=r"line 14: a table row with 12 fields, the header has 13"):
        parse("\n".join(lines))
    lines = CSCS.splitlines()
    lines[13] = lines[13].replace("476.28", "47x.28")
    with pytest.raises(NcclTestsError, match="line 14: garbled measurement"):
        parse("\n".join(lines))


def test_wrong_elements_fail_the_run() -> None:
    lines = OCI.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith(" 10737418240"))
    lines[row] = lines[row][: -len("      0")] + "   4096"
    with pytest.raises(NcclTestsError, match="4096 wrong elements \\(in-place, 10737418240 bytes\\)"):
        parse("\n".join(lines))


def test_out_of_bounds_and_test_failures() -> None:
    with pytest.raises(NcclTestsError, match="out of bounds values: 3 FAILED"):
        parse(OCI.replace("# Out of bounds values : 0 OK", "# Out of bounds values : 3 FAILED"))
    crashed = OCI.replace(
        "\n 10737418240", "\n" + "node1: Test NCCL failure common.cu:1005 'unhandled system error'\n 1"
    )
    with pytest.raises(NcclTestsError, match=r"Test NCCL failure common\.cu:1005"):
        parse(crashed)


def test_no_table_at_all() -> None:
    with pytest.raises(NcclTestsError, match="no all_reduce_perf table"):
        parse("all_reduce_perf: error while loading shared libraries: libnccl.so.2\n")
    header_only = OCI[: OCI.index("\n 10737418240")]
    with pytest.raises(NcclTestsError, match="has no rows"):
        parse(header_only)


def test_validation_off_reads_na_as_unknown() -> None:
    unchecked = OCI.replace("222.88      0", "222.88    N/A").replace("218.96      0", "218.96    N/A")
    (row,) = parse(unchecked).rows
    assert row.out_of_place.wrong is None and row.in_place.wrong is None
