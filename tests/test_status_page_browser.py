"""The status page in a real browser: Debian's chromium, headless, against the aggregator's app on
127.0.0.1 with a simulated fleet (tests/statusfleet.py: a quarantined node, a silent rack, a
degraded link).

Every host but 127.0.0.1 is unresolvable to the browser (``--host-resolver-rules``), and its net
log lists every URL it asked for: the page must need nothing from anywhere else. Without chromium
the test skips locally and fails in CI (CI=true), where scripts/setup installs it.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import missing_tool
from tests.statusfleet import (
    QUARANTINED,
    SILENT_RACK,
    Served,
    StatusFleet,
    chromium,
    chromium_binary,
    serving,
    status_fleet,
)

# The browser's own background services (updates, sign-in, autofill): asked for by chromium
# itself on start, never by a page; unresolvable here like every other host.
BROWSER_OWN_HOSTS = frozenset(
    {
        "clients2.google.com",
        "update.googleapis.com",
        "accounts.google.com",
        "content-autofill.googleapis.com",
        "redirector.gvt1.com",
        "safebrowsingohttpgateway.googleapis.com",
        "optimizationguide-pa.googleapis.com",
    }
)


@pytest.fixture(scope="module")
def fleet() -> StatusFleet:
    if chromium_binary() is None:
        missing_tool("chromium", "chromium")
    return status_fleet()


@pytest.fixture(scope="module")
def served(fleet: StatusFleet) -> Iterator[Served]:
    with serving(fleet) as s:
        yield s


def _page_urls(urls: list[str], base: str) -> list[str]:
    """The URLs that left for another host than the page's, less the browser's own services."""
    own = urlsplit(base).netloc
    return [
        u
        for u in urls
        if urlsplit(u).scheme in ("http", "https", "ws", "wss")
        and urlsplit(u).netloc != own
        and urlsplit(u).hostname not in BROWSER_OWN_HOSTS
    ]


def test_the_fleet_page_renders_and_links_the_quarantined_node(served: Served, tmp_path: Path) -> None:
    look = chromium(served.base + "/", tmp_path)
    assert "<h1>Fleet</h1>" in look.dom
    assert f'href="/nodes/{QUARANTINED}"' in look.dom
    assert SILENT_RACK in look.dom  # the silent rack is a systemic event on the glance
    assert _page_urls(look.urls, served.base) == []


def test_the_node_list_filter_shows_only_quarantined_nodes_with_their_reason(
    served: Served, tmp_path: Path
) -> None:
    look = chromium(served.base + "/nodes?state=quarantined", tmp_path)
    rows = re.findall(r'<a href="/nodes/([^"]+)">', look.dom)
    assert rows == [QUARANTINED]
    assert "XID 79" in look.dom
    everyone = chromium(served.base + "/nodes?q=gpu-00", tmp_path / "all")
    assert len(re.findall(r'<a href="/nodes/([^"]+)">', everyone.dom)) == 32


def test_the_node_page_says_why_what_next_and_the_runbook(served: Served, tmp_path: Path) -> None:
    look = chromium(served.base + f"/nodes/{QUARANTINED}", tmp_path)
    assert "XID 79" in look.dom and "fell off the bus" in look.dom
    assert "probation starts once the evidence has been gone" in look.dom
    assert "is an override" in look.dom
    assert re.search(r"Runbook:</strong> <a href=\"https?://", look.dom)
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", look.dom)  # times with date and zone
    assert "<polyline" in look.dom  # the sparklines drew


def test_the_page_asks_for_nothing_but_its_own_assets(served: Served, tmp_path: Path) -> None:
    served.requests.clear()
    look = chromium(served.base + f"/nodes/{QUARANTINED}", tmp_path)
    assert _page_urls(look.urls, served.base) == []
    # The stylesheet's address carries its version (?v=): the path is what is asked for.
    paths = sorted({r.split(" ", 1)[1].split("?", 1)[0] for r in served.requests})
    # The page and its stylesheet always; the favicon only when chromium asks for it before it
    # writes the DOM (it fetches the icon on its own timer): nothing else, and nothing elsewhere.
    assert {f"/nodes/{QUARANTINED}", "/static/status.css"} <= set(paths)
    assert set(paths) <= {f"/nodes/{QUARANTINED}", "/static/favicon.svg", "/static/status.css"}
    assert all(r.startswith("127.0.0.1:") for r in served.requests)


def _png_pixels(data: bytes) -> tuple[int, int, set[bytes]]:
    """Width, height and the distinct colours of a non-interlaced 8-bit RGB(A) PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, ihdr = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            ihdr = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", ihdr[:10])
    assert depth == 8 and colour in (2, 6)
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    colours: set[bytes] = set()
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        if y % 8 == 0:
            colours.update(bytes(line[i : i + 3]) for i in range(0, stride, bpp * 4))
        prev = line
    return width, height, colours


def test_the_screenshot_is_a_real_picture_of_the_page(served: Served, tmp_path: Path) -> None:
    shot = tmp_path / "fleet.png"
    chromium(served.base + "/", tmp_path, screenshot=shot, size=(1280, 900))
    data = shot.read_bytes()
    assert 20_000 < len(data) < 5_000_000
    width, height, colours = _png_pixels(data)
    assert (width, height) == (1280, 900)
    # Not blank: the header's navy, the states' colours and text make many distinct colours.
    assert len(colours) > 50
    assert bytes((0x14, 0x21, 0x3D)) in colours  # the header bar drew
