"""What a per-node detector (the rule engine) sees of one node after one report."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from agent.report import Report


class RateAsks(NamedTuple):
    """Many counter rates asked at once (``NodeView.rates``), by series key, answered in this
    order: every ``gpu`` ask, then every ``nvlink`` ask, then every ``nic`` ask."""

    gpu: tuple[tuple[int, str], ...] = ()  # (GPU index, GPU counter field)
    nvlink: tuple[tuple[int, str], ...] = ()  # (GPU index, NVLink counter field)
    nic: tuple[tuple[str, int | None, str], ...] = ()  # (device, port, NIC counter)


class NodeView(Protocol):
    """One node's latest report and its recent past, with reset-safe counter rates.

    Rates are per second over the reports of the current boot inside ``[now - window_s, now]``
    (now = the latest report's time). A counter that goes down within one boot is a reset: the new
    value counts from zero. A gap (lost reports) spreads the delta over the real elapsed time.
    ``None`` when fewer than two samples of the current boot fall in the window, or the field is
    null/unsupported in them.
    """

    @property
    def node(self) -> str: ...

    @property
    def report(self) -> Report: ...

    @property
    def previous(self) -> Report | None:
        """The previous report of the same boot, None after a reboot or for the first report (and
        in a view taken once the history settled, which keeps only the latest in full)."""
        ...

    @property
    def added(self) -> Report:
        """The report this update took in: ``report`` unless it arrived late (older than the latest)."""
        ...

    @property
    def rebooted(self) -> bool:
        """True when this report's boot_id differs from the one before it."""
        ...

    def gpu_rate(self, gpu: int, field: str, window_s: float) -> float | None:
        """Rate of a cumulative GPU field (e.g. ``ecc_sbe_volatile_total``, ``pcie_replay_total``)."""
        ...

    def nvlink_rate(self, gpu: int, field: str, window_s: float) -> float | None:
        """Rate of an NVLink error counter (e.g. ``crc_flit_errors_total``), summed over the GPU's links."""
        ...

    def nic_rate(self, device: str, port: int | None, counter: str, window_s: float) -> float | None:
        """Rate of a NIC counter: a key of ``Nic.counters`` or ``rx_bytes_total`` and friends."""
        ...

    def rates(self, asks: RateAsks, window_s: float) -> npt.NDArray[np.float64]:
        """The rates of ``asks`` over one window, each what its single-rate method answers, NaN
        for None: what a caller needing a hundred rates a report asks instead (the pool frames)."""
        ...

    def last_rates(self, asks: RateAsks) -> npt.NDArray[np.float64]:
        """The rates of ``asks`` over the last interval: from ``previous`` to ``report``, NaN for
        every ask without a previous report and where either report has no value. What the pool
        frames ask each report, answered from the history's two newest rows."""
        ...

    def gpu_samples(self, gpu: int, field: str, window_s: float) -> list[tuple[float, float | None]]:
        """(time, value) of a GPU gauge or flag over the window, oldest first (flags as 0.0/1.0)."""
        ...
