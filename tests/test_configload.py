"""Loading the aggregator's YAML configuration: defaults, overrides, and errors that say where."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import ConfigError
from aggregator.config import Config, HealthConfig, IngestConfig
from aggregator.configload import load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "aggregator.yaml"
    path.write_text(text)
    return path


def test_no_file_is_the_defaults() -> None:
    assert load_config(None) == Config()


@pytest.mark.parametrize("text", ["", "# all defaults\n", "---\n"])
def test_empty_file_is_the_defaults(tmp_path: Path, text: str) -> None:
    assert load_config(write(tmp_path, text)) == Config()


def test_values_override_defaults_and_the_rest_stay(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
rules_dir: /etc/gpuwarden/rules
ingest:
  max_body_bytes: 2097152
health:
  probation_seconds: 600      # an int where a float is expected is fine
  lemon_count: 4
""",
    )
    config = load_config(path)
    assert config.rules_dir == "/etc/gpuwarden/rules"
    assert config.ingest == IngestConfig(max_body_bytes=2 << 20)
    assert config.health == HealthConfig(probation_seconds=600.0, lemon_count=4)
    assert config.fleet == Config().fleet


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("helth:\n  probation_seconds: 60\n", "at the top level: unknown key `helth`"),
        ("health:\n  probation_secs: 60\n", "at health: unknown key `probation_secs`"),
        ("health:\n  probation_seconds: soon\n", "at health.probation_seconds: Expected `float`, got `str`"),
        ("health:\n  probation_seconds: -5\n", "at health.probation_seconds: Expected `float` > 0.0"),
        ("health:\n  lemon_count: yes\n", "at health.lemon_count: Expected `int`, got `bool`"),
        ("ingest:\n  max_body_bytes: 1.5\n", "at ingest.max_body_bytes: Expected `int`, got `float`"),
        ("silence:\n  pool_share: 1.5\n", "at silence.pool_share: Expected `float` <= 1.0"),
        # The API server accepts Events about a Node only in "default": another would lose them all.
        (
            "remediation:\n  events_namespace: gpuwarden\n",
            "at remediation.events_namespace: Invalid enum value 'gpuwarden'",
        ),
        ("health: 120\n", "at health: Expected `object`, got `int`"),
        ("health:\n  probation_seconds: .inf\n", "at health.probation_seconds: must be a finite number"),
        ("silence:\n  pool_share: .nan\n", "at silence.pool_share: must be a finite number"),
        ("- health\n", "the top level must be a mapping"),
        ("health:\n  120: 1\n", "at health: keys must be strings"),
        (
            "health:\n  lemon_count: 3\n  lemon_count: 4\n",
            "line 3: key 'lemon_count' is given twice (first on line 2)",
        ),
        ("health: {probation_seconds: 60\n", "line 2 column 1: not valid YAML"),
        ("health: !!python/object:os.system {}\n", "not valid YAML"),
    ],
)
def test_bad_config_names_the_file_and_the_key(tmp_path: Path, text: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"config file {path}")
    assert says in message


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_unreadable_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00health")
    with pytest.raises(ConfigError, match=r"cannot read config file .*binary\.yaml"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)  # a directory
