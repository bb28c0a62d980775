"""NCCL Inspector parsing and the per-cycle summary (agent/inspector.py), on the recorded examples."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from agent import inspector, report
from agent.inspector import InspectorError, MalformedRecord, Stream, Summarizer, UnknownVersion

FIXTURES = Path(__file__).parent / "fixtures" / "nccl-inspector"


def _lines(name: str) -> list[bytes]:
    return [ln for ln in (FIXTURES / name).read_bytes().split(b"\n") if ln.strip()]


def _v40(**coll: Any) -> bytes:
    perf = {
        "coll": "AllReduce",
        "coll_sn": 1,
        "coll_msg_size_bytes": 1 << 20,
        "coll_exec_time_us": 100,
        "coll_timing_source": "kernel_gpu",
        "coll_algobw_gbs": 10.0,
        "coll_busbw_gbs": 17.5,
    }
    perf.update(coll)
    return json.dumps(
        {
            "header": {"id": "0xabc", "rank": 0, "n_ranks": 8, "nnodes": 1},
            "metadata": {
                "inspector_output_format_version": "v4.0",
                "git_rev": "",
                "rec_mechanism": "nccl_profiler_interface",
                "dump_timestamp_us": 1,
                "hostname": "h",
                "pid": 7,
            },
            "coll_perf": perf,
        }
    ).encode()


def _marker(version: str = "v4.3", coll: int = 1, p2p: int = 0, proxy: int | None = None) -> bytes:
    stats: dict[str, int] = {"coll_records": coll, "coll_dropped_total": 0, "p2p_records": p2p}
    if proxy is not None:
        stats["proxy_records"] = proxy
    return json.dumps(
        {
            "header": {"id": "0xdef", "comm_name": "tp", "rank": 3, "n_ranks": 4, "nnodes": 2},
            "metadata": {"inspector_output_format_version": version, "hostname": "w-1", "pid": 9},
            "dump_stats": stats,
        }
    ).encode()


_BARE = (
    b'{"coll_perf":{"coll":"AllGather","coll_sn":5,"coll_msg_size_bytes":4096,"coll_exec_time_us":12,'
    b'"coll_timing_source":"kernel_gpu","coll_busbw_gbs":2.5}}'
)
_PROXY = b'{"proxy_trace":{"record_type":"proxy_op","record_sn":42,"parent_type":"coll","parent_sn":5}}'


def test_v40_examples_parse_with_every_field() -> None:
    records = [inspector.parse_line(ln) for ln in _lines("v4.0-examples.jsonl")]
    first, verbose, four_node = records
    assert first == inspector.InspectorRecord(
        comm="0x7f8c496ae9f661",
        collective="AllReduce",
        size_bytes=1 << 34,
        exec_time_us=61974.0,
        busbw_gbs=485.119099,
        timing_source="unknown",  # the README's first example predates coll_timing_source
        n_ranks=8,
        nnodes=1,
        rank=2,
        hostname="example-hostname",
        pid=1639453,
    )
    # The verbose example's event traces are skipped, not refused.
    assert verbose is not None and verbose.timing_source == "kernel_gpu"
    assert (verbose.collective, verbose.size_bytes, verbose.exec_time_us) == (
        "ReduceScatter",
        1 << 31,
        41057.0,
    )
    assert four_node is not None and (four_node.rank, four_node.n_ranks, four_node.nnodes) == (31, 32, 4)


def test_the_real_dump_line_parses_into_its_bucket() -> None:
    (line,) = _lines("v4.0-real-dump-line.jsonl")
    rec = inspector.parse_line(line)
    assert rec is not None
    assert rec.comm == "0xad56c683b0c4ef" and rec.hostname == "nanogpt-nccl-test-worker-0" and rec.pid == 48
    # 2,360,832 bytes falls in the 2 MiB bucket; the float execution time is read as written.
    assert (rec.size_bytes, rec.exec_time_us, rec.busbw_gbs) == (2097152, 5663.0, 0.55585)


def test_v43_records_take_header_and_metadata_from_their_marker() -> None:
    stream = Stream()
    marker, *ops = _lines("v4.3-marker-batch.jsonl")
    assert stream.parse_line(marker) is None
    records = [stream.parse_line(ln) for ln in ops]
    assert [(r.collective, r.rank, r.n_ranks, r.hostname, r.pid) for r in records if r] == [
        ("AllReduce", 2, 8, "example-hostname", 1639453),
        ("ReduceScatter", 2, 8, "example-hostname", 1639453),
    ]
    # The marker announced two records; a third bare one belongs to no batch.
    with pytest.raises(MalformedRecord, match="outside any dump_stats batch"):
        stream.parse_line(ops[0])


def test_a_bare_record_without_its_marker_is_malformed() -> None:
    with pytest.raises(MalformedRecord):
        inspector.parse_line(_BARE)
    stream = Stream()
    assert stream.parse_line(_marker(coll=0)) is None  # a zero-record marker: losses only
    with pytest.raises(MalformedRecord):
        stream.parse_line(_BARE)


def test_proxy_records_count_in_the_batch_but_are_not_summarized() -> None:
    stream = Stream()
    stream.parse_line(_marker(version="v4.4", coll=1, proxy=2))
    assert stream.parse_line(_PROXY) is None
    assert stream.parse_line(_PROXY) is None
    rec = stream.parse_line(_BARE)
    assert rec is not None and (rec.comm, rec.rank, rec.nnodes, rec.size_bytes) == ("0xdef", 3, 2, 4096)
    with pytest.raises(MalformedRecord):
        stream.parse_line(_PROXY)


def test_a_new_marker_replaces_an_unfinished_batch() -> None:
    stream = Stream()
    stream.parse_line(_marker(coll=5))
    stream.parse_line(_BARE)
    other = _marker(coll=1).replace(b'"0xdef"', b'"0x999"')
    stream.parse_line(other)
    rec = stream.parse_line(_BARE)
    assert rec is not None and rec.comm == "0x999"


def test_p2p_records_parse_with_the_writers_field_names() -> None:
    # Field names as inspector_json.cc writes a p2p_perf object.
    line = json.dumps(
        {
            "header": {"id": "0x1", "rank": 1, "n_ranks": 2, "nnodes": 2},
            "metadata": {"inspector_output_format_version": "v4.2", "hostname": "h", "pid": 3},
            "p2p_perf": {
                "p2p": "Send",
                "p2p_sn": 11,
                "p2p_peer": 0,
                "p2p_msg_size_bytes": 3 << 20,
                "p2p_exec_time_us": 250,
                "p2p_timing_source": "kernel_gpu",
                "p2p_algobw_gbs": 12.0,
                "p2p_busbw_gbs": 12.0,
            },
        }
    ).encode()
    rec = inspector.parse_line(line)
    assert rec is not None
    assert (rec.collective, rec.size_bytes, rec.busbw_gbs, rec.exec_time_us) == ("Send", 2 << 20, 12.0, 250.0)


def test_stand_alone_dump_stats_of_v41_are_not_records() -> None:
    stream = Stream()
    assert stream.parse_line(_marker(version="v4.1", coll=3)) is None
    with pytest.raises(MalformedRecord):  # v4.1 records are self-contained: no batch follows
        stream.parse_line(_BARE)


@pytest.mark.parametrize("version", ["v9.9", "v5.1", "v3.0", "4.0", ""])
def test_unknown_json_versions_are_refused(version: str) -> None:
    line = _v40().replace(b'"v4.0"', json.dumps(version).encode())
    with pytest.raises(UnknownVersion) as err:
        inspector.parse_line(line)
    assert err.value.kind == "unknown_version"
    with pytest.raises(UnknownVersion):
        Stream().parse_line(_marker(version=version))


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b'{"header":',
        b"[1, 2]",
        b"{}",
        b'{"coll_perf": 3}',
        _v40().replace(b'"rank": 0', b'"rank": 8'),  # outside a communicator of 8
        _v40().replace(b'"rank": 0', b'"rank": -1'),
        _v40().replace(b'"n_ranks": 8', b'"n_ranks": 0'),
        _v40(coll_busbw_gbs=-1.0),
        _v40(coll_busbw_gbs="fast"),
        _v40(coll_exec_time_us=None),
        _v40().replace(b'"coll_busbw_gbs": 17.5', b'"coll_busbw_gbs": 1e999'),
        _v40(coll="x" * 33),
        _v40().replace(b'"hostname": "h", ', b"").replace(b'"header": ', b'"headr": '),
        b'{"header":{"id":"0x1","rank":0,"n_ranks":1,"nnodes":1},"coll_perf":{}}',
    ],
)
def test_malformed_lines_raise_a_typed_error(line: bytes) -> None:
    with pytest.raises(MalformedRecord) as err:
        inspector.parse_line(line)
    assert err.value.kind == "malformed" and isinstance(err.value, InspectorError)


def test_blank_lines_are_nothing() -> None:
    assert inspector.parse_line(b"") is None
    assert inspector.parse_line(b"  \r") is None


def test_feed_summarizes_a_batch_and_reports_only_the_bad_lines() -> None:
    summ = Summarizer()
    stream = Stream()
    lines = [_v40(coll_exec_time_us=100 + i) for i in range(10)]
    lines[4] = b"garbage"
    lines.insert(7, _v40().replace(b'"v4.0"', b'"v9.9"'))
    errors = stream.feed(lines, summ)
    assert [e.kind for e in errors] == ["malformed", "unknown_version"]
    jobs = summ.take()
    assert (jobs.records, jobs.dropped) == (11, 2)
    (row,) = jobs.collectives
    assert row.count == 9 and row.exec_time_us.min == 100 and row.exec_time_us.max == 109


def test_feed_and_parse_line_agree_on_every_fixture() -> None:
    for name in ("v4.0-examples.jsonl", "v4.0-real-dump-line.jsonl", "v4.3-marker-batch.jsonl"):
        one, batch = Summarizer(), Summarizer()
        stream = Stream()
        for ln in _lines(name):
            rec = stream.parse_line(ln)
            if rec is not None:
                one.add_record(rec)
        assert Stream().feed(_lines(name), batch) == []
        assert one.take() == batch.take()


def test_v51_prometheus_textfile_parses_collectives_and_p2p() -> None:
    errors: list[InspectorError] = []
    records = inspector.parse_prometheus((FIXTURES / "v5.1-prometheus-textfile.prom").read_text(), errors)
    assert errors == []
    assert records == [
        inspector.InspectorRecord(
            comm="DP Group 0",
            collective="AllReduce",
            size_bytes=4 << 30,
            exec_time_us=9498.47,
            busbw_gbs=678.263,
            timing_source="unknown",
            n_ranks=4,
            nnodes=1,
            hostname="nvl72004-T01",
            gpu=0,
        ),
        inspector.InspectorRecord(
            comm="DP Group 0",
            collective="Send",
            size_bytes=512 << 20,
            exec_time_us=1154.87,
            busbw_gbs=464.9,
            timing_source="unknown",
            n_ranks=4,
            nnodes=1,
            hostname="nvl72004-T01",
            gpu=0,
        ),
    ]


_PROM = (
    'nccl_bus_bandwidth_gbs{version="v5.1",slurm_job_id="7",node="n1",gpu="GPU3",comm_name="DP \\"a\\"",'
    'n_nodes="2",nranks="16",collective="AllGather",message_size="3-4MB",algo_proto="Ring_simple"} 120.5\n'
    'nccl_collective_exec_time_microseconds{version="v5.1",slurm_job_id="7",node="n1",gpu="GPU3",'
    'comm_name="DP \\"a\\"",n_nodes="2",nranks="16",collective="AllGather",message_size="3-4MB",'
    'algo_proto="Ring_simple"} 77\n'
)


def test_prometheus_comments_counters_and_escapes() -> None:
    text = (
        "# HELP nccl_bus_bandwidth_gbs bus bandwidth\n# TYPE nccl_bus_bandwidth_gbs gauge\n"
        + _PROM
        + 'nccl_collectives_total{version="v5.1",slurm_job_id="7",node="n1",gpu="GPU3"} 1234\n\n'
    )
    (rec,) = inspector.parse_prometheus(text)
    assert (rec.comm, rec.gpu, rec.n_ranks, rec.nnodes) == ('DP "a"', 3, 16, 2)
    assert rec.size_bytes == 2 << 20  # the 3-4 MiB range starts at 3 MiB: in the 2 MiB bucket


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (_PROM.replace('"v5.1"', '"v9.9"'), "unknown_version"),
        (_PROM.splitlines()[0], "malformed"),  # a bandwidth without its time
        (_PROM.replace("} 77", "} fast"), "malformed"),
        (_PROM.replace("} 77", "} -3"), "malformed"),
        (_PROM.replace("} 77", "} NaN"), "malformed"),
        (_PROM.replace('"3-4MB"', '"huge"'), "malformed"),
        (_PROM.replace('nranks="16"', 'nranks="0"'), "malformed"),
        (_PROM.replace('comm_name="DP \\"a\\"",', ""), "malformed"),
        ('nccl_bus_bandwidth_gbs{version="v5.1" oops} 3\n', "malformed"),
        ("{}}} 3 4 5\n", "malformed"),
    ],
)
def test_bad_prometheus_series_are_errors(text: str, kind: str) -> None:
    with pytest.raises(InspectorError) as err:
        inspector.parse_prometheus(text)
    assert err.value.kind == kind
    errors: list[InspectorError] = []
    inspector.parse_prometheus(text, errors)
    assert errors and errors[0].kind == kind


@pytest.mark.parametrize(
    ("label", "size"),
    [
        ("0B", 0),
        ("1-2B", 1),
        ("1-2KB", 1024),
        ("512-513MB", 512 << 20),
        ("4-5GB", 4 << 30),
        ("1-2TB", 1 << 40),
    ],
)
def test_prometheus_size_ranges(label: str, size: int) -> None:
    assert inspector.prometheus_size_bytes(label) == size


def test_size_buckets_are_powers_of_two_below() -> None:
    assert [inspector.size_bucket(n) for n in (0, 1, 2, 3, 1023, 1024, 2360832)] == [
        0,
        1,
        2,
        2,
        512,
        1024,
        1 << 21,
    ]


def _key(comm: str = "c", kind: str = "AllReduce", size: int = 1024) -> inspector.Key:
    return (comm, 0, "h", 1, None, kind, size, "kernel_gpu", 2, 1)


def test_quantiles_of_a_cycle() -> None:
    summ = Summarizer()
    values = list(range(1, 101))
    random.Random(4).shuffle(values)
    for v in values:
        summ.add(_key(), float(v), float(1000 - v))
    (row,) = summ.take().collectives
    assert row.count == 100
    assert (row.busbw_gbs.min, row.busbw_gbs.max) == (1, 100)
    assert row.busbw_gbs.p10 == pytest.approx(11, abs=1) and row.busbw_gbs.p50 == pytest.approx(50, abs=1)
    assert row.busbw_gbs.p90 == pytest.approx(90, abs=1)
    assert row.exec_time_us.p90 == pytest.approx(990, abs=1) and row.exec_time_us.min == 900


def test_the_sample_is_bounded_and_stays_spread_over_the_cycle() -> None:
    summ = Summarizer(max_samples=64)
    for v in range(10_000):
        summ.add(_key(), float(v), 1.0)
    (acc,) = summ._rows.values()
    assert len(acc.busbw) <= 64 and acc.count == 10_000
    (row,) = summ.take().collectives
    assert (row.count, row.busbw_gbs.min, row.busbw_gbs.max) == (10_000, 0, 9999)
    assert row.busbw_gbs.p50 == pytest.approx(5000, rel=0.05)
    assert row.busbw_gbs.p10 == pytest.approx(1000, rel=0.2) and row.busbw_gbs.p90 == pytest.approx(
        9000, rel=0.05
    )


def test_rows_are_capped_and_the_rest_counted_dropped() -> None:
    summ = Summarizer(max_keys=2)
    assert summ.add(_key("a"), 1.0, 1.0) and summ.add(_key("b"), 1.0, 1.0)
    assert not summ.add(_key("c"), 1.0, 1.0)
    assert summ.add(_key("a"), 2.0, 1.0)  # an existing row still counts
    assert not summ.add(_key("a", kind="Invalid"), 1.0, 1.0)
    jobs = summ.take()
    assert (len(jobs.collectives), jobs.records, jobs.dropped) == (2, 5, 2)
    assert [c.count for c in jobs.collectives] == [2, 1]
    assert summ.take() == report.Jobs(format="gpuwarden/jobs/v1", collectives=(), records=0, dropped=0)
    with pytest.raises(ValueError):
        Summarizer(max_keys=report.MAX_COLLECTIVES + 1)


def test_a_full_summary_fits_the_report_and_its_schema() -> None:
    summ = Summarizer()
    for i in range(report.MAX_COLLECTIVES + 10):
        summ.add(_key(comm=f"0x{i:x}", size=i), 1.5, 2.5)
    summ.add((*_key()[:4], 5, *_key()[5:]), 1.0, 1.0)
    jobs = summ.take()
    assert len(jobs.collectives) == report.MAX_COLLECTIVES and jobs.dropped == 11
    r = report.Report(
        schema=report.SCHEMA_ID, node="n", time=1.0, seq=0, boot_id="b", gpus=(), nics=(), jobs=jobs
    )
    wire = report.encode(r)
    jsonschema.Draft202012Validator(report.json_schema()).validate(json.loads(wire))
    assert report.decode(wire).jobs == jobs


def test_a_null_line_and_merged_fragments_do_not_pass_as_records() -> None:
    summ = Summarizer()
    errors = Stream().feed([_v40(), b"null", _v40()], summ)
    assert [str(e) for e in errors] == ["not an Inspector record: Expected `object`, got `null`"]
    # Two halves of one object on two lines would decode joined by a comma: each is refused.
    whole = _v40()
    cut = whole.index(b'"coll_busbw_gbs"')
    errors = Stream().feed([whole[:cut].rstrip(b", "), whole[cut:]], summ)
    assert len(errors) == 2
    jobs = summ.take()
    assert (jobs.records, jobs.dropped, jobs.collectives[0].count) == (5, 3, 2)


def _random_lines(rng: random.Random, n: int) -> list[bytes]:
    """A stream of lines as Inspector writes them (self-contained v4.0-v4.2, v4.3/v4.4 markers
    with collective, P2P and proxy records, stand-alone dump_stats), now and then something it
    does not write (a bad line, an unknown version, an ``Invalid`` kind, a rank out of range, a
    record past its batch, a blank line)."""
    out: list[bytes] = []
    comms = [("0xa", 0, 8, 1, "w-0", 5), ("0xb", 3, 4, 2, "w-0", 5), ("0xc", 1, 2, 2, "w-1", 6)]
    kinds = ["AllReduce", "AllGather", "ReduceScatter"]
    timings = ["kernel_gpu", "kernel_cpu", None]
    while len(out) < n:
        comm, rank, n_ranks, nnodes, host, pid = rng.choice(comms)
        header = {"id": comm, "rank": rank, "n_ranks": n_ranks, "nnodes": nnodes}
        form = rng.random()
        if form < 0.45:  # self-contained
            perf: dict[str, Any] = {
                "coll": rng.choice(kinds),
                "coll_sn": len(out),
                "coll_msg_size_bytes": rng.choice([0, 1000, 1 << 20, 3 << 20]),
                "coll_exec_time_us": round(rng.uniform(10, 1000), 1),
                "coll_busbw_gbs": round(rng.uniform(0, 400), 6),
            }
            timing = rng.choice(timings)
            if timing is not None:
                perf["coll_timing_source"] = timing
            meta = {
                "inspector_output_format_version": rng.choice(["v4.0", "v4.1", "v4.2"]),
                "hostname": host,
                "pid": pid,
            }
            out.append(json.dumps({"header": header, "metadata": meta, "coll_perf": perf}).encode())
        elif form < 0.5:  # a stand-alone dump_stats
            meta = {"inspector_output_format_version": "v4.1", "hostname": host, "pid": pid}
            out.append(
                json.dumps({"header": header, "metadata": meta, "dump_stats": {"coll_records": 3}}).encode()
            )
        elif form < 0.95:  # a marker batch
            n_coll, n_p2p, n_proxy = rng.randint(0, 12), rng.choice([0, 0, 2]), rng.choice([0, 0, 1])
            meta = {
                "inspector_output_format_version": rng.choice(["v4.3", "v4.4"]),
                "hostname": host,
                "pid": pid,
            }
            stats = {"coll_records": n_coll, "p2p_records": n_p2p, "proxy_records": n_proxy}
            out.append(json.dumps({"header": header, "metadata": meta, "dump_stats": stats}).encode())
            body = [b"c"] * n_coll + [b"p"] * n_p2p + [b"x"] * n_proxy
            rng.shuffle(body)
            for what in body:
                if what == b"c":
                    line = _BARE.replace(b'"AllGather"', json.dumps(rng.choice(kinds)).encode())
                    out.append(
                        line.replace(b'"coll_busbw_gbs":2.5', b'"coll_busbw_gbs":%.3f' % rng.uniform(0, 9))
                    )
                elif what == b"p":
                    p2p = {
                        "p2p": rng.choice(["Send", "Recv"]),
                        "p2p_msg_size_bytes": 4096,
                        "p2p_exec_time_us": 9.0,
                    }
                    p2p["p2p_busbw_gbs"] = round(rng.uniform(0, 9), 3)
                    out.append(json.dumps({"p2p_perf": p2p}).encode())
                else:
                    out.append(_PROXY)
        else:  # something Inspector does not write
            out.append(
                rng.choice(
                    [
                        b"garbage",
                        b"",
                        _v40().replace(b'"v4.0"', b'"v9.9"'),
                        _v40(coll="Invalid"),
                        _v40().replace(b'"rank": 0', b'"rank": 8'),
                        _BARE,
                        _v40(coll_timing_source="gpu_magic"),
                    ]
                )
            )
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_path_agrees_with_the_line_by_line_reference(seed: int) -> None:
    """feed_chunk (columns when a chunk is ordinary, the exact path when not) summarizes and
    reports exactly what parsing each line on its own does, whatever the chunking."""
    rng = random.Random(seed)
    clean = seed % 2 == 0  # half the seeds: only what Inspector writes, so the fast path runs
    lines = [ln for ln in _random_lines(rng, 400) if not clean or _is_clean(ln)]
    # A third of the seeds start mid-file, as after a skip: the first batch's marker is gone.
    resync = seed % 3 == 0
    if resync:
        lines = lines[rng.randint(1, 30) :]
    ref, ref_errors, ref_stream = Summarizer(max_keys=20, max_samples=8), [], Stream(resyncing=resync)
    for ln in lines:
        try:
            rec = ref_stream.parse_line(ln)
        except InspectorError as exc:
            ref.malformed(1)
            if not (ref_stream.resyncing and isinstance(exc, inspector.OrphanRecord)):
                ref_errors.append((exc.kind, str(exc)))
            continue
        if rec is not None:
            ref.add_record(rec)
    got, got_errors, stream = Summarizer(max_keys=20, max_samples=8), [], Stream(resyncing=resync)
    i = 0
    while i < len(lines):
        size = rng.choice([1, 3, 17, 100, 400])
        got_errors += [(e.kind, str(e)) for e in stream.feed(lines[i : i + size], got)]
        i += size
    assert got_errors == ref_errors
    assert got.take() == ref.take()


def _is_clean(line: bytes) -> bool:
    return (
        bool(line)
        and b"garbage" not in line
        and b"v9.9" not in line
        and b"Invalid" not in line
        and (b"gpu_magic" not in line and b'"rank": 8' not in line and line != _BARE)
    )


def test_the_fast_path_takes_ordinary_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ordinary chunk of either form never goes line by line."""
    calls: list[int] = []
    monkeypatch.setattr(Stream, "resolve", lambda self, line: calls.append(1))
    for name in ("v4.0-examples.jsonl", "v4.3-marker-batch.jsonl"):
        lines = _lines(name)[:3] if name.startswith("v4.3") else _lines(name)
        summ = Summarizer()
        assert Stream().feed(lines, summ) == []
        assert summ.take().collectives
    assert calls == []


def test_after_a_skip_a_self_contained_chunk_ends_the_resync_on_both_paths() -> None:
    """Bare records whose marker was skipped are dropped quietly only until a header line; the
    fast path must end the resync where the exact path does."""
    for fast in (True, False):
        stream, summ = Stream(resyncing=True), Summarizer()
        first = [_v40(), _v40()] if fast else [_v40(), b"garbage"]
        errors = stream.feed(first, summ)
        assert not stream.resyncing
        errors += stream.feed([_BARE], summ)
        assert [e.kind for e in errors][-1] == "malformed"  # an orphan now, reported


def test_stand_alone_dump_stats_among_v41_records_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [_v40().replace(b'"v4.0"', b'"v4.1"'), _marker(version="v4.1", coll=3), _v40(), _marker(coll=1)]
    ref = Summarizer()
    Stream()._resolve_all([inspector._LINE.decode(ln) for ln in lines], ref)
    calls: list[int] = []
    monkeypatch.setattr(Stream, "resolve", lambda self, line: calls.append(1))
    stream, summ = Stream(), Summarizer()
    assert stream.feed(lines, summ) == []
    assert calls == [] and summ.take() == ref.take()
    monkeypatch.undo()
    # The v4.3 marker at the end: its batch goes on in the next chunk.
    summ = Summarizer()
    assert stream.feed([_BARE], summ) == [] and summ.take().collectives[0].comm == "0xdef"
