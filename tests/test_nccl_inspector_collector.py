"""The NCCL Inspector collector on a real directory: files that grow, break, rotate and vanish."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import pytest

from agent import report
from agent.clock import FakeClock
from agent.collectors import build_collectors
from agent.collectors.base import CollectorContext, Paths
from agent.collectors.nccl_inspector import InspectorOptions, NcclInspectorCollector
from agent.report import Jobs
from agent.runner import Agent

FIXTURES = Path(__file__).parent / "fixtures" / "nccl-inspector"


def line(comm: str = "0xa", rank: int = 0, exec_us: float = 100.0, version: str = "v4.0") -> bytes:
    return (
        json.dumps(
            {
                "header": {"id": comm, "rank": rank, "n_ranks": 8, "nnodes": 2},
                "metadata": {
                    "inspector_output_format_version": version,
                    "git_rev": "",
                    "rec_mechanism": "nccl_profiler_interface",
                    "dump_timestamp_us": 1752867229276385,
                    "hostname": "trainer-0",
                    "pid": 48,
                },
                "coll_perf": {
                    "coll": "AllReduce",
                    "coll_sn": 1,
                    "coll_msg_size_bytes": 1 << 24,
                    "coll_exec_time_us": exec_us,
                    "coll_timing_source": "kernel_gpu",
                    "coll_algobw_gbs": 100.0,
                    "coll_busbw_gbs": 175.0,
                },
            },
            separators=(",", ":"),
        ).encode()
        + b"\n"
    )


def collector(root: Path, **options: object) -> NcclInspectorCollector:
    opts = InspectorOptions(directory=root, **options)  # type: ignore[arg-type]
    return NcclInspectorCollector(CollectorContext(clock=FakeClock(), nccl_inspector=opts))


def started(root: Path, **options: object) -> NcclInspectorCollector:
    """A collector past its first scan: files created from now on are read from their start."""
    c = collector(root, **options)
    assert c.supported().supported
    c.collect()
    return c


def jobs_of(c: NcclInspectorCollector) -> tuple[Jobs, tuple[str, ...]]:
    out = c.collect()
    assert out.jobs is not None
    return out.jobs, tuple(str(e) for e in out.errors)


def counts(jobs: Jobs) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in jobs.collectives:
        out[row.comm] = out.get(row.comm, 0) + row.count
    return out


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def test_not_enabled_and_not_present_are_states_not_errors(tmp_path: Path) -> None:
    off = NcclInspectorCollector(CollectorContext())
    assert not off.supported().supported and "--nccl-inspector-dir" in off.supported().reason
    missing = tmp_path / "inspector"
    c = collector(missing)
    support = c.supported()
    assert not support.supported and "not present" in support.reason
    agent = Agent(node="n", collectors=[c], clock=FakeClock(), boot_id="b")
    r = agent.cycle().report
    assert r.jobs is msgspec_unset() and r.errors is msgspec_unset()
    missing.mkdir()
    r = agent.cycle().report
    assert r.jobs == Jobs(format="gpuwarden/jobs/v1", collectives=(), records=0, dropped=0)


def msgspec_unset() -> object:
    from msgspec import UNSET

    return UNSET


def test_it_is_one_of_the_agents_collectors(tmp_path: Path) -> None:
    names = [c.name for c in build_collectors(CollectorContext(paths=Paths(sysfs=tmp_path)))]
    assert "nccl_inspector" in names


def test_history_from_before_the_agent_started_is_not_this_cycle(tmp_path: Path) -> None:
    old = tmp_path / "old-pid1.log"
    old.write_bytes(line("0xold") * 10)
    c = collector(tmp_path)
    jobs, errors = jobs_of(c)
    assert jobs.records == 0 and errors == ()
    append(old, line("0xold") * 2)
    new = tmp_path / "new-pid2.log"
    new.write_bytes(line("0xnew") * 3)
    jobs, _ = jobs_of(c)
    assert counts(jobs) == {"0xold": 2, "0xnew": 3}


def test_a_line_appended_in_pieces_is_read_once_whole(tmp_path: Path) -> None:
    c = started(tmp_path)
    f = tmp_path / "h-pid1.log"
    whole = line("0xa", exec_us=123.0)
    f.write_bytes(whole[:50])
    assert jobs_of(c)[0].records == 0
    append(f, whole[50:-1])  # everything but the newline
    assert jobs_of(c)[0].records == 0
    append(f, b"\n" + line("0xa", exec_us=7.0)[:10])
    jobs, errors = jobs_of(c)
    assert errors == () and jobs.records == 1 and jobs.collectives[0].exec_time_us.max == 123.0
    append(f, line("0xa", exec_us=7.0)[10:])
    jobs, errors = jobs_of(c)
    assert errors == () and jobs.records == 1 and jobs.collectives[0].exec_time_us.max == 7.0
    assert jobs_of(c)[0].records == 0  # nothing new


def test_a_marker_batch_written_in_pieces(tmp_path: Path) -> None:
    c = started(tmp_path)
    data = (FIXTURES / "v4.3-marker-batch.jsonl").read_bytes()
    f = tmp_path / "h-pid2.log"
    cut = data.index(b"\n") + 40  # the marker and part of the first record
    f.write_bytes(data[:cut])
    assert jobs_of(c)[0].records == 0
    append(f, data[cut:] + b"\n")
    jobs, errors = jobs_of(c)
    assert errors == ()
    assert sorted((r.collective, r.rank, r.pid) for r in jobs.collectives) == [
        ("AllReduce", 2, 1639453),
        ("ReduceScatter", 2, 1639453),
    ]


def test_truncation_starts_over(tmp_path: Path) -> None:
    c = started(tmp_path)
    f = tmp_path / "h-pid1.log"
    f.write_bytes(line("0xa") * 5)
    assert jobs_of(c)[0].records == 5
    f.write_bytes(line("0xb") * 2)  # truncated and rewritten, shorter than before
    jobs, errors = jobs_of(c)
    assert errors == () and counts(jobs) == {"0xb": 2}


def test_rotation_reads_the_new_file_from_its_start(tmp_path: Path) -> None:
    c = started(tmp_path)
    f = tmp_path / "h-pid1.log"
    f.write_bytes(line("0xa") * 4)
    assert jobs_of(c)[0].records == 4
    f.rename(tmp_path / "h-pid1.log.1")  # not a name Inspector writes: no longer followed
    f.write_bytes(line("0xb") * 3)
    jobs, errors = jobs_of(c)
    assert errors == () and counts(jobs) == {"0xb": 3}
    assert len(c._files) == 1


def test_a_deleted_file_is_forgotten(tmp_path: Path) -> None:
    c = started(tmp_path)
    for i in range(3):
        (tmp_path / f"h-pid{i}.log").write_bytes(line(f"0x{i}"))
    assert jobs_of(c)[0].records == 3
    (tmp_path / "h-pid1.log").unlink()
    jobs, errors = jobs_of(c)
    assert jobs.records == 0 and errors == () and len(c._files) == 2


def test_fifty_files_at_once_share_the_cycle_fairly(tmp_path: Path) -> None:
    c = started(tmp_path, max_records=2_500)
    for i in range(50):
        (tmp_path / f"w{i}-pid{i}.log").write_bytes(line(f"0x{i:02x}") * 100)
    (tmp_path / "small-pid99.log").write_bytes(line("0xsmall") * 3)
    jobs, errors = jobs_of(c)
    per_file = counts(jobs)
    assert errors == () and jobs.records == 2_500
    # The small file is read whole; the others split what is left evenly.
    assert per_file.pop("0xsmall") == 3
    assert min(per_file.values()) >= 49 and max(per_file.values()) <= 50
    jobs, _ = jobs_of(c)
    assert jobs.records == 2_500
    jobs, _ = jobs_of(c)
    assert jobs.records == 5_003 - 5_000


def test_a_large_file_is_read_across_cycles_under_the_byte_cap(tmp_path: Path) -> None:
    c = started(tmp_path, max_bytes=16 << 20, max_records=10**6, max_backlog_bytes=256 << 20)
    f = tmp_path / "big-pid7.log"
    one = line("0xbig")
    n = (100 << 20) // len(one)
    with f.open("wb") as out:
        block = one * 10_000
        for _ in range(n // 10_000):
            out.write(block)
        out.write(one * (n % 10_000))
    size = f.stat().st_size
    assert size > 95 << 20
    total = 0
    offsets = [0]
    rows = 0
    while offsets[-1] < size and len(offsets) < 12:
        jobs, errors = jobs_of(c)
        assert errors == ()
        total += jobs.records
        rows = max(rows, len(jobs.collectives))
        (state,) = c._files.values()
        offsets.append(state.offset)
    assert total == n and offsets[-1] == size and rows == 1
    steps = [b - a for a, b in itertools.pairwise(offsets)]
    # Seven cycles of (almost) 16 MiB each: every cycle uses its cap, none goes over it.
    assert len(steps) == -(-size // (16 << 20))
    assert max(steps) <= 16 << 20 and min(steps[:-1]) > (16 << 20) - len(one)


def test_a_file_too_far_behind_skips_ahead_and_says_so(tmp_path: Path) -> None:
    c = started(tmp_path, max_bytes=2_000, max_backlog_bytes=8_000)
    f = tmp_path / "fast-pid3.log"
    f.write_bytes(line("0xf") * 100)
    size = f.stat().st_size
    jobs, errors = jobs_of(c)
    assert len(errors) == 1 and f"skipped {size - 8_000} bytes" in errors[0]
    # The line the skip landed in is not an error, and what follows it is read.
    assert jobs.records >= 1 and jobs.dropped == 0


def test_a_v43_file_skipped_into_the_middle_of_a_batch_drops_its_orphans_quietly(tmp_path: Path) -> None:
    marker, *ops = (FIXTURES / "v4.3-marker-batch.jsonl").read_bytes().splitlines()
    batch = b"\n".join([marker.replace(b'"coll_records":2', b'"coll_records":40'), *(ops * 20)]) + b"\n"
    c = started(tmp_path, max_bytes=len(batch), max_backlog_bytes=len(batch))
    f = tmp_path / "h-pid5.log"
    f.write_bytes(batch * 3)
    jobs, errors = jobs_of(c)
    assert all("skipped" in e for e in errors), errors
    assert jobs.records > 0 and sum(r.count for r in jobs.collectives) > 0


def test_unknown_versions_and_garbage_are_reported_and_counted(tmp_path: Path) -> None:
    c = started(tmp_path)
    f = tmp_path / "h-pid1.log"
    f.write_bytes(line("0xa") + line("0xa", version="v9.9") * 3 + b"garbage\n\n{}\n" + line("0xa"))
    jobs, errors = jobs_of(c)
    assert (jobs.records, jobs.dropped) == (7, 5)
    (msg,) = errors
    assert msg.startswith("h-pid1.log: 2 malformed, 3 unknown_version (first: unknown Inspector format")
    assert counts(jobs) == {"0xa": 2}


def test_errors_are_one_entry_per_file_and_bounded(tmp_path: Path) -> None:
    c = started(tmp_path)
    for i in range(20):
        (tmp_path / f"bad{i:02d}-pid{i}.log").write_bytes(b"not json\n" * 100)
    jobs, errors = jobs_of(c)
    assert jobs.dropped == 2_000 and len(errors) == 9
    assert errors[-1] == "12 more Inspector files with errors"
    r = Agent(node="n", collectors=[c], clock=FakeClock(), boot_id="b").cycle().report
    report.decode(report.encode(r))


def test_an_over_long_line_is_skipped_and_reading_goes_on(tmp_path: Path) -> None:
    c = started(tmp_path, chunk_bytes=4096, max_line_bytes=4096)
    f = tmp_path / "h-pid1.log"
    f.write_bytes(line("0xa") + b"x" * 10_000 + b"\n" + line("0xb"))
    jobs, errors = jobs_of(c)
    assert counts(jobs) == {"0xa": 1, "0xb": 1}
    assert len(errors) == 1 and "longer than 4096" in errors[0]


def test_prometheus_files_are_read_once_per_rewrite(tmp_path: Path) -> None:
    c = started(tmp_path)
    prom = tmp_path / "nccl_inspector_metrics_GPU-0f1e.prom"
    text = (FIXTURES / "v5.1-prometheus-textfile.prom").read_bytes()
    prom.write_bytes(text)
    jobs, errors = jobs_of(c)
    assert errors == () and jobs.records == 2
    assert {(r.collective, r.gpu, r.hostname) for r in jobs.collectives} == {
        ("AllReduce", 0, "nvl72004-T01"),
        ("Send", 0, "nvl72004-T01"),
    }
    assert jobs_of(c)[0].records == 0  # unchanged: not read again
    prom.write_bytes(text.replace(b"678.263", b"600.5"))
    st = prom.stat()
    os.utime(prom, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    jobs, _ = jobs_of(c)
    assert jobs.records == 2 and 600.5 in {r.busbw_gbs.max for r in jobs.collectives}
    prom.write_bytes(text.replace(b'"v5.1"', b'"v9.9"'))
    os.utime(prom, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    jobs, errors = jobs_of(c)
    assert jobs.dropped == 4 and len(errors) == 1 and "unknown_version" in errors[0]


def test_prometheus_files_present_at_start_are_read(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "v5.1-prometheus-textfile.prom", tmp_path / "nccl_inspector_metrics_x.prom")
    jobs, errors = jobs_of(collector(tmp_path))
    assert errors == () and jobs.records == 2


def test_subdirectories_are_read_and_links_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "token.log"
    secret.write_bytes(line("0xsecret"))
    root = tmp_path / "root"
    (root / "job-7").mkdir(parents=True)
    c = started(root)
    (root / "job-7" / "h-pid1.log").write_bytes(line("0xjob"))
    (root / "link-pid2.log").symlink_to(secret)
    (root / "linked-dir").symlink_to(outside, target_is_directory=True)
    jobs, errors = jobs_of(c)
    assert errors == () and counts(jobs) == {"0xjob": 1}


def test_files_over_the_cap_are_named_and_idle_files_are_not_followed(tmp_path: Path) -> None:
    c = started(tmp_path, max_files=3)
    for i in range(5):
        p = tmp_path / f"h-pid{i}.log"
        p.write_bytes(line(f"0x{i}"))
        os.utime(p, ns=(0, 1_764_441_600_000_000_000 - i * 10**9))  # pid0 is the newest
    jobs, errors = jobs_of(c)
    assert counts(jobs) == {"0x0": 1, "0x1": 1, "0x2": 1}
    assert errors == ("2 more Inspector files than the 3 followed: not read",)
    for i in range(5):  # finished jobs: a day and more without a write
        p = tmp_path / f"h-pid{i}.log"
        os.utime(p, ns=(0, 1_764_441_600_000_000_000 - 90_000 * 10**9))
    jobs, errors = jobs_of(c)
    assert errors == () and jobs.records == 0
    # A finished job's file that is written again goes on from where it was, not from its start.
    append(tmp_path / "h-pid1.log", line("0x1"))
    jobs, errors = jobs_of(c)
    assert errors == () and counts(jobs) == {"0x1": 1}


def test_a_file_that_falls_behind_the_cap_and_comes_back_is_not_read_twice(tmp_path: Path) -> None:
    c = started(tmp_path, max_files=2)
    paths = [tmp_path / f"h-pid{i}.log" for i in range(3)]
    for i, p in enumerate(paths):
        p.write_bytes(line(f"0x{i}") * 5)
        os.utime(p, ns=(0, 1_764_441_600_000_000_000 + i * 10**9))  # pid2 is the newest
    jobs, _ = jobs_of(c)
    assert counts(jobs) == {"0x1": 5, "0x2": 5}
    append(paths[0], line("0x0"))
    os.utime(paths[0], ns=(0, 1_764_441_600_000_000_000 + 10 * 10**9))  # pid0 newest: pid1 drops out
    jobs, _ = jobs_of(c)
    assert counts(jobs) == {"0x0": 6}  # never read before: from its start
    append(paths[1], line("0x1"))
    os.utime(paths[1], ns=(0, 1_764_441_600_000_000_000 + 20 * 10**9))  # pid1 back in, pid2 out
    jobs, _ = jobs_of(c)
    assert counts(jobs) == {"0x1": 1}  # on from its offset


def test_a_file_there_at_start_but_idle_then_is_read_from_its_end_later(tmp_path: Path) -> None:
    old = tmp_path / "h-pid1.log"
    old.write_bytes(line("0xold") * 5)
    os.utime(old, ns=(0, 1_764_441_600_000_000_000 - 100_000 * 10**9))
    c = started(tmp_path)
    append(old, line("0xold"))  # its mtime is now
    jobs, errors = jobs_of(c)
    assert errors == () and counts(jobs) == {"0xold": 1}


def test_a_renamed_file_goes_on_from_its_offset(tmp_path: Path) -> None:
    c = started(tmp_path)
    f = tmp_path / "h-pid1.log"
    f.write_bytes(line("0xa") * 3)
    assert jobs_of(c)[0].records == 3
    moved = tmp_path / "job-1" / "h-pid1.log"
    moved.parent.mkdir()
    f.rename(moved)
    append(moved, line("0xa"))
    jobs, errors = jobs_of(c)
    assert errors == () and jobs.records == 1


def test_options_are_checked() -> None:
    with pytest.raises(ValueError):
        InspectorOptions(directory=Path("/x"), max_bytes=0)
    with pytest.raises(ValueError):
        InspectorOptions(directory=Path("/x"), max_bytes=100 << 20, max_backlog_bytes=1 << 20)


def test_the_report_carries_the_section_through_the_schema(tmp_path: Path) -> None:
    import jsonschema

    c = started(tmp_path)
    (tmp_path / "h-pid1.log").write_bytes(b"".join(line("0xa", rank=r, exec_us=100 + r) for r in range(8)))
    r = Agent(node="n", collectors=[c], clock=FakeClock(), boot_id="b").cycle().report
    assert r.jobs is not None and not isinstance(r.jobs, type(msgspec_unset()))
    wire = report.encode(r)
    jsonschema.Draft202012Validator(report.json_schema()).validate(json.loads(wire))
    back = report.decode(wire).jobs
    assert isinstance(back, Jobs) and len(back.collectives) == 8 and back.records == 8


def test_agent_once_reports_what_the_directory_holds(tmp_path: Path) -> None:
    import subprocess
    import sys

    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    inspector_dir = tmp_path / "inspector"
    inspector_dir.mkdir()
    shutil.copy(FIXTURES / "v4.0-examples.jsonl", inspector_dir / "example-hostname-pid1639453.log")
    shutil.copy(FIXTURES / "v4.3-marker-batch.jsonl", inspector_dir / "example-hostname-pid1.log")
    (inspector_dir / "broken-pid2.log").write_bytes(line(version="v9.9"))
    argv = [sys.executable, "-m", "gpuwarden", "agent", "--once", "--print", "--node", "node-1"]
    argv += ["--gpu-backend", "none", "--sysfs-root", str(sysfs), "--kmsg-path", str(tmp_path / "kmsg")]
    out = subprocess.run(
        [*argv, "--nccl-inspector-dir", str(inspector_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    r = report.decode(out.stdout)
    assert isinstance(r.jobs, Jobs) and (r.jobs.records, r.jobs.dropped) == (6, 1)
    assert len(r.jobs.collectives) == 4
    assert isinstance(r.errors, tuple)
    (err,) = [e for e in r.errors if e.collector == "nccl_inspector"]
    assert err.message.startswith("broken-pid2.log: 1 unknown_version")
    bad = subprocess.run(
        [*argv, "--nccl-inspector-dir", str(inspector_dir), "--nccl-inspector-max-bytes", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode != 0 and "--nccl-inspector" in bad.stderr
