"""The kernel log reader: record format, each record once, overruns, reopen, boot time."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from agent.kmsg import (
    KernelLogError,
    KmsgReader,
    MalformedRecord,
    open_kmsg,
    parse_record,
    read_boot_time,
)

FIXTURES = Path(__file__).parent / "fixtures" / "kmsg"


# --- record format -------------------------------------------------------------------------------


def test_parse_kernel_record() -> None:
    r = parse_record(
        b"3,10,400000200,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n"
    )
    assert (r.facility, r.level, r.seq, r.usec) == (0, 3, 10, 400000200)
    assert r.message == "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
    assert r.from_kernel


def test_parse_userspace_record_is_not_from_kernel() -> None:
    # The kernel forces LOG_USER (facility 1) on writes into /dev/kmsg without a facility.
    r = parse_record(b"12,6,350000000,-;NVRM: Xid (PCI:0000:00:05): 79, kmsg-injection-test\n")
    assert (r.facility, r.level) == (1, 4)
    assert not r.from_kernel


def test_parse_extra_header_fields_and_semicolons_in_text() -> None:
    r = parse_record(b"6,1093,4096000,-,caller=T1;a;b;c\n")
    assert (r.seq, r.usec, r.message) == (1093, 4096000, "a;b;c")


def test_parse_keeps_kernel_escapes_and_replaces_bad_utf8() -> None:
    r = parse_record(b"3,5,6,c;name=a\\x0ab \xff\n")
    assert r.message == "name=a\\x0ab \ufffd"


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"no header\n",
        b"6,1,2;three fields\n",
        b"6,x,2,-;bad seq\n",
        b"-1,1,2,-;negative\n",
        b"6,1,-2,-;neg ts\n",
    ],
)
def test_parse_malformed(line: bytes) -> None:
    with pytest.raises(MalformedRecord):
        parse_record(line)


# --- reading a recorded file ---------------------------------------------------------------------


def test_reads_fixture_records_dictionaries_and_skips_malformed() -> None:
    reader = KmsgReader(FIXTURES / "boot.kmsg")
    batch = reader.read()
    assert [r.seq for r in batch.records] == list(range(23))
    assert batch.backlog and batch.caught_up
    assert batch.malformed == 1
    assert batch.overwritten == 0
    by_seq = {r.seq: r for r in batch.records}
    assert by_seq[2].fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:3b:00.0"}
    assert by_seq[22].fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:85:00.0"}
    assert by_seq[22].message.startswith("nvidia-nvswitch0: SXid (PCI:0000:85:00.0): 12028,")
    assert by_seq[3].fields == {}
    # Nothing new: nothing again, and no longer the backlog.
    again = reader.read()
    assert again.records == () and not again.backlog and again.caught_up
    reader.close()


def _rec(seq: int, usec: int, text: str, prio: int = 3) -> str:
    return f"{prio},{seq},{usec},-;{text}\n"


def test_growing_file_each_record_once_even_when_cut_mid_record(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text(_rec(0, 1, "zero") + _rec(1, 2, "one"))
    reader = KmsgReader(path)
    assert [r.message for r in reader.read().records] == ["zero", "one"]

    whole = _rec(2, 3, "two") + " SUBSYSTEM=pci\n" + _rec(3, 4, "three")
    cut = whole.index("three") + 2
    with path.open("a") as f:
        f.write(whole[:cut])  # a writer caught half-way through the last record
    first = reader.read()
    assert [r.message for r in first.records] == ["two"]
    assert first.records[0].fields == {"SUBSYSTEM": "pci"}
    assert not first.backlog
    with path.open("a") as f:
        f.write(whole[cut:])
    assert [r.message for r in reader.read().records] == ["three"]
    assert reader.read().records == ()


def test_sequence_gap_counts_overwritten_records(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text(_rec(7, 1, "a") + _rec(8, 2, "b") + _rec(12, 3, "c"))
    batch = KmsgReader(path).read()
    assert [r.seq for r in batch.records] == [7, 8, 12]
    assert batch.overwritten == 3  # 9, 10, 11; nothing counted before the first record seen


def test_endless_line_is_dropped_not_buffered_forever(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(b"3,0,1,-;" + b"x" * 100_000)
    reader = KmsgReader(path)
    batch = reader.read()
    assert batch.records == () and batch.malformed == 1
    with path.open("ab") as f:
        f.write(b"\n" + _rec(1, 2, "after").encode())
    assert [r.message for r in reader.read().records] == ["after"]


# --- the device: one record per read, EAGAIN, EPIPE, reopen ------------------------------------


class FakeKernelLog:
    """The ring buffer behind /dev/kmsg: holds at most ``capacity`` records, each open starts at
    the oldest one held, and a reader whose next record was overwritten gets EPIPE once."""

    def __init__(self, capacity: int = 0) -> None:
        self.held: list[tuple[int, str]] = []
        self.next_seq = 0
        self.capacity = capacity
        self.files: list[FakeKmsgFile] = []
        self.open_error: KernelLogError | None = None

    def add(self, text: str, usec: int = 1_000_000, prio: int = 3) -> None:
        self.held.append((self.next_seq, f"{prio},{self.next_seq},{usec},-;{text}\n"))
        self.next_seq += 1
        if self.capacity and len(self.held) > self.capacity:
            self.held = self.held[-self.capacity :]

    def open(self, path: Path) -> FakeKmsgFile:
        if self.open_error is not None:
            raise self.open_error
        f = FakeKmsgFile(self, self.held[0][0] if self.held else self.next_seq)
        self.files.append(f)
        return f


class FakeKmsgFile:
    def __init__(self, log: FakeKernelLog, position: int) -> None:
        self.log = log
        self.position = position
        self.fail_next: OSError | None = None
        self.closed = False
        self.reads = 0

    def read(self, size: int) -> bytes:
        self.reads += 1
        if self.closed:
            raise OSError(errno.EBADF, "closed")
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        if self.position >= self.log.next_seq:
            raise BlockingIOError(errno.EAGAIN, "no new records")
        oldest = self.log.held[0][0]
        if self.position < oldest:
            self.position = oldest
            raise BrokenPipeError(errno.EPIPE, "overwritten")
        _, data = self.log.held[self.position - oldest]
        self.position += 1
        return data.encode()

    def close(self) -> None:
        self.closed = True


def _texts(reader: KmsgReader) -> list[str]:
    return [r.message for r in reader.read().records]


def test_device_one_record_per_read_until_eagain() -> None:
    log = FakeKernelLog()
    for text in ("a", "b", "c"):
        log.add(text)
    reader = KmsgReader(Path("/dev/kmsg"), opener=log.open)
    batch = reader.read()
    assert [r.message for r in batch.records] == ["a", "b", "c"]
    assert batch.caught_up and batch.backlog
    assert log.files[0].reads == 4  # three records, then EAGAIN
    log.add("d")
    assert _texts(reader) == ["d"]
    assert _texts(reader) == []


def test_overrun_epipe_resumes_at_oldest_and_counts_the_loss() -> None:
    log = FakeKernelLog(capacity=4)
    log.add("before the storm")
    reader = KmsgReader(Path("/dev/kmsg"), opener=log.open)
    assert _texts(reader) == ["before the storm"]
    for i in range(10):
        log.add(f"storm {i}")
    batch = reader.read()
    assert [r.message for r in batch.records] == ["storm 6", "storm 7", "storm 8", "storm 9"]
    assert batch.overwritten == 6
    log.add("after")
    after = reader.read()
    assert [r.message for r in after.records] == ["after"] and after.overwritten == 0


def test_failed_read_keeps_what_was_read_and_reopen_skips_seen_records() -> None:
    log = FakeKernelLog()
    log.add("one")
    log.add("two")
    reader = KmsgReader(Path("/dev/kmsg"), opener=log.open)
    assert _texts(reader) == ["one", "two"]

    log.add("three")
    # The device fails right after handing out "three".
    first = log.files[0]
    original_read = first.read

    def read_then_fail(size: int) -> bytes:
        data = original_read(size)
        first.fail_next = OSError(errno.EIO, "Input/output error")
        return data

    first.read = read_then_fail  # type: ignore[method-assign]
    batch = reader.read()
    assert [r.message for r in batch.records] == ["three"]
    assert batch.error is not None and "Input/output error" in batch.error
    assert first.closed

    log.add("four")
    # The reopened device starts at the oldest record again; only "four" is new.
    assert _texts(reader) == ["four"]
    assert len(log.files) == 2


def test_open_failure_is_reported_and_retried() -> None:
    log = FakeKernelLog()
    log.add("waiting")
    log.open_error = KernelLogError("/dev/kmsg is not readable: Permission denied")
    reader = KmsgReader(Path("/dev/kmsg"), opener=log.open)
    with pytest.raises(KernelLogError, match="Permission denied"):
        reader.read()
    log.open_error = None
    assert _texts(reader) == ["waiting"]


# --- opening the real thing ----------------------------------------------------------------------


def test_open_missing_path(tmp_path: Path) -> None:
    with pytest.raises(KernelLogError, match="not readable"):
        open_kmsg(tmp_path / "kmsg")


def test_open_refuses_another_character_device() -> None:
    # /dev/null bind-mounted over /dev/kmsg would read as a kernel that never logs anything.
    with pytest.raises(KernelLogError, match="1:3, not the kernel log"):
        open_kmsg(Path("/dev/null"))


def test_open_refuses_a_directory(tmp_path: Path) -> None:
    with pytest.raises(KernelLogError, match="neither the kernel log device nor a recorded log"):
        open_kmsg(tmp_path)


def test_open_is_nonblocking_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    shutil.copy(FIXTURES / "boot.kmsg", path)
    device = open_kmsg(path)
    try:
        assert device.read(16384).startswith(b"5,0,0,-;Linux version")
    finally:
        device.close()


# --- boot time -----------------------------------------------------------------------------------


def test_boot_time_from_procfs_stat() -> None:
    assert read_boot_time(FIXTURES / "proc") == 1764441000.0


def test_boot_time_missing(tmp_path: Path) -> None:
    with pytest.raises(KernelLogError, match="boot time unavailable: cannot read"):
        read_boot_time(tmp_path)


def test_boot_time_without_btime_line(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("cpu  1 2 3\nctxt 5\n")
    with pytest.raises(KernelLogError, match="no btime line"):
        read_boot_time(tmp_path)
