"""Active probes, the aggregator's side: which node tests what with whom, and when.

- ``config``: the ``probes:`` configuration section (``ProbesConfig``).
- ``scheduler``: ``ProbeScheduler``, pure and clock-free: rotation rounds, confirm re-probes,
  preflight, caps, coverage; signed ``Assignment``s (``agent/probes/protocol.py``).
- ``api``: the HTTP routes agents poll (assignments, the NCCL rendezvous).
- ``metrics``: coverage and probe counters for Prometheus, computed at scrape time.
"""
