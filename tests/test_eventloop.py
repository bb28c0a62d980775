"""Which event loop the aggregator serves on (aggregator/eventloop.py) and the config key that says."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import uvloop

from agent.errors import ConfigError
from aggregator import eventloop
from aggregator.configload import load_config


async def _which() -> str:
    return eventloop.loop_name(asyncio.get_running_loop())


def test_auto_runs_on_uvloop_where_it_is_installed() -> None:
    assert eventloop.run(_which(), "auto") == "uvloop"
    assert eventloop.run(_which(), "uvloop") == "uvloop"


def test_asyncio_runs_on_asyncios_own_loop() -> None:
    assert eventloop.loop_factory("asyncio") is None
    assert eventloop.run(_which(), "asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert eventloop.loop_factory("auto") is None
    assert eventloop.run(_which(), "auto") == "asyncio"
    with pytest.raises(ConfigError, match=r"server\.event_loop is uvloop, but uvloop cannot be imported"):
        eventloop.run(_which(), "uvloop")


def test_the_loop_is_a_config_key_with_a_default_and_a_refusal(tmp_path: Path) -> None:
    assert load_config(None).server.event_loop == "auto"
    path = tmp_path / "c.yaml"
    path.write_text("server: {event_loop: asyncio}\n")
    assert load_config(path).server.event_loop == "asyncio"
    path.write_text("server: {event_loop: libuv}\n")
    with pytest.raises(ConfigError, match=r"server\.event_loop"):
        load_config(path)


def test_loop_name_tells_the_two_apart() -> None:
    loop = uvloop.new_event_loop()
    try:
        assert eventloop.loop_name(loop) == "uvloop"
    finally:
        loop.close()
    plain = asyncio.new_event_loop()
    try:
        assert eventloop.loop_name(plain) == "asyncio"
    finally:
        plain.close()
