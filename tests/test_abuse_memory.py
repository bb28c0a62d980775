"""What one node token can make the aggregator hold: bounded by construction (issue 16).

Rows: new NIC (device, port) names in every report (RSS 150 MB -> 1.85 GB in 300 s before), and
probe results naming new, unscheduled peers (+689 MB in 35 s, kept for 4 hours). Measured with
tracemalloc over a bounded run of the real pipeline: after the first window of reports the
memory stops growing, and what one node holds stays under ``NODE_BOUND``.
"""

from __future__ import annotations

import gc
import tracemalloc

import msgspec

from agent.report import Nic, Probe, Report
from aggregator.configload import load_config
from aggregator.decisions import DecisionLog
from aggregator.model import IngestOutcome
from aggregator.pipeline import Pipeline
from aggregator.rules import default_rules_dir, load_rules
from tests.test_service import NOW, make_report

RULES = load_rules([default_rules_dir()])
DEFAULTS = load_config(None)
NODE_BOUND = 2 << 20  # bytes one node may cost, whatever it sends (measured: see the docs)
INTERVAL = 10.0


def _hostile(seq: int) -> Report:
    """8 NICs with names never seen before, and 16 probe results with made-up peers."""
    base = make_report(seq=seq, boot_id="boot-a", time_=NOW + INTERVAL * seq)
    nics = [msgspec.structs.replace(n, device=f"evil{seq}_{i}") for i, n in enumerate(base.nics)]
    probes = [
        Probe(
            kind="nccl_allreduce_pair",
            time=NOW + INTERVAL * seq - 1.0,
            ok=True,
            peer=f"ghost-{seq}-{i}",
            size_bytes=1 << 30,
            busbw_bytes_per_second=4e10,
            duration_seconds=1.0,
        )
        for i in range(16)
    ]
    return msgspec.structs.replace(base, nics=nics, probes=probes, run="r", events=msgspec.UNSET)


def _held(pipeline: Pipeline) -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_one_token_sending_new_names_and_peers_cannot_grow_the_aggregator() -> None:
    pipeline = Pipeline(DEFAULTS, RULES, DecisionLog(None))
    # A window and a half of reports (1,800 s window at 10 s), then as many again.
    warm = int(DEFAULTS.fleet.window_seconds / INTERVAL * 1.5)
    tracemalloc.start()
    try:
        start = _held(pipeline)
        for seq in range(warm):
            assert pipeline.ingest(_hostile(seq), NOW + INTERVAL * seq) is IngestOutcome.ACCEPTED
        after_warm = _held(pipeline)
        for seq in range(warm, 2 * warm):
            pipeline.ingest(_hostile(seq), NOW + INTERVAL * seq)
        end = _held(pipeline)
    finally:
        tracemalloc.stop()
    history = pipeline.fleet.history("gpu-0001")
    assert history is not None
    assert len(history.nic_keys()) <= 2 * DEFAULTS.ingest.max_nics
    # No made-up peer reached the link localizer.
    for run in pipeline._detectors:
        samples = getattr(run.detector, "_samples", {})
        assert not any(k for k in samples if any(n.startswith("ghost-") for n in k[0]))
    frame = pipeline.frames.frame(pipeline.frames.pool_of("gpu-0001") or "")
    assert frame is not None and len(frame.nic_keys("gpu-0001")) <= DEFAULTS.ingest.max_nics
    assert end - start < NODE_BOUND, f"one node holds {(end - start) / 1e6:.2f} MB"
    # Flat once the window is full: the second half adds (almost) nothing.
    assert end - after_warm < NODE_BOUND / 8, f"grew {(end - after_warm) / 1e6:.2f} MB after the window"


def test_a_report_over_a_cap_is_refused_naming_the_cap() -> None:
    from aggregator.service import cap_errors

    report = make_report()
    extra = [msgspec.structs.replace(report.nics[0], device=f"mlx5_{i}") for i in range(8, 40)]
    over = msgspec.structs.replace(report, nics=[*report.nics, *extra])
    errors = cap_errors(over, DEFAULTS.ingest)
    assert errors == ["$.nics: 40 NICs, a node holds at most 32"]
    assert cap_errors(report, DEFAULTS.ingest) == []
    many_links = msgspec.structs.replace(report.gpus[0], nvlink=(*report.gpus[0].nvlink,) * 2)
    assert cap_errors(msgspec.structs.replace(report, gpus=[many_links]), DEFAULTS.ingest) == [
        "$.gpus[0].nvlink: 36 links, a GPU has at most 18"
    ]
    assert isinstance(report.nics[0], Nic)
