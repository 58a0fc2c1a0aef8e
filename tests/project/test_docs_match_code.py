"""The operator docs against the code: config defaults, config keys named in prose, metric
names and labels, and CLI flags. Operators configure and monitor the service from README.md and
docs/operations.md, and after many sessions of changes some of their statements had drifted
(module names that no longer existed, routes counted as `other`, bullets about work since
done); these checks keep the checkable facts true. Fast: no process, no server."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import pkgutil
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

import sigil_push
from sigil_push import cli
from sigil_push import config as config_module
from sigil_push.push import registry
from sigil_push.push.registry import TABLES

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
OPERATIONS = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
BRIDGE = (ROOT / "docs" / "bridge.md").read_text(encoding="utf-8")

NOTIFY_CHANNELS = {"sigil_push_devices", "sigil_push_auth_signers", "sigil_push_shards"}
"""PostgreSQL NOTIFY channels, named like metrics in the docs but not metrics."""
FILE_EXTENSIONS = {"key", "csv", "json", "pem", "db", "py", "md"}


def config_tables() -> dict[str, Any]:
    tables: dict[str, Any] = {
        "server": config_module.ServerConfig, "relay": config_module.RelayConfig,
        "limits": config_module.LimitsConfig, "bridge": config_module.BridgeConfig,
        "push": config_module.PushConfig, "canary": config_module.CanaryConfig,
        "iris": config_module.IrisConfig, "webhooks": config_module.WebhooksConfig,
    }
    tables.update({provider.name: provider.table for provider in registry.PROVIDERS})
    return tables


def code_defaults() -> dict[str, Any]:
    """Every config key as README names it, with its default (MISSING when required)."""
    keys: dict[str, Any] = {}
    for table, cls in config_tables().items():
        for spec in dataclasses.fields(cls):
            default = spec.default
            if spec.default_factory is not dataclasses.MISSING:
                default = spec.default_factory()
            keys[f"[[relay]] {spec.name}" if table == "relay" else f"{table}.{spec.name}"] = default
    return keys


def readme_config_rows() -> list[tuple[list[str], str]]:
    """(keys, default cell) of each row of README's configuration table."""
    section = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows.append(([key.strip().strip("`") for key in cells[0].split(",")], cells[1]))
    return rows


def same_value(documented: str, default: Any) -> bool:
    """A README default (TOML-ish, quoted or not) equals the code's default."""
    if isinstance(default, bool):
        return documented == str(default).lower()
    if isinstance(default, (int, float)):
        return float(documented) == float(default)
    if isinstance(default, tuple):
        return tomllib.loads(f"v = {documented}")["v"] == list(default)
    return documented.strip('"') == default


def test_readme_defaults_are_the_codes() -> None:
    """The default column says what the dataclasses say. A row whose default is prose (`unset`,
    `the configured read relays`, a derived value) or blank must be a key with no default or an
    empty one; a row of literals must list each key's default in order."""
    defaults = code_defaults()
    wrong = []
    for keys, cell in readme_config_rows():
        literals = re.fullmatch(r"`[^`]*`(?:, `[^`]*`)*", cell)
        for index, key in enumerate(keys):
            default = defaults[key]
            if literals is None:
                if default not in (dataclasses.MISSING, "", ()):
                    wrong.append((key, cell, default))
                continue
            values = re.findall(r"`([^`]*)`", cell)
            documented = values[index] if len(values) == len(keys) else values[0]
            if default is dataclasses.MISSING or not same_value(documented, default):
                wrong.append((key, cell, default))
    assert wrong == []


def test_every_config_key_in_the_docs_exists() -> None:
    """A `table.key` in README or docs/operations.md is a key the config accepts."""
    tables = "|".join(name for name in config_tables() if name != "relay")
    keys = set(code_defaults())
    named = {
        f"{table}.{key}"
        for text in (README, OPERATIONS)
        for table, key in re.findall(rf"`({tables})\.([a-z_]+)`", text)
        if key not in FILE_EXTENSIONS  # `bridge.key`, `canary.csv`: files, not keys
    }
    assert "server.admin_listen" in named
    assert sorted(named - keys) == []


def exported_metrics() -> dict[str, set[str]]:
    """Every sigil_push metric a module defines, as exposed (counters with `_total`), with
    its label names. Every module is imported, so a new metric module is found unasked."""
    for module in pkgutil.walk_packages(sigil_push.__path__, "sigil_push."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    metrics: dict[str, set[str]] = {}
    for collector in list(REGISTRY._collector_to_names):  # prometheus_client has no public listing
        labels = set(getattr(collector, "_labelnames", ()))
        if getattr(collector, "_label", None):
            labels.add(collector._label)  # BatchHistogram's one label
        for family in collector.collect():
            if family.name.startswith("sigil_push_"):
                suffix = "_total" if family.type == "counter" else ""
                metrics[family.name + suffix] = labels
    return metrics


def named_in(text: str, known: set[str]) -> set[str]:
    """The metric names a document mentions (`{a,b}` shorthand expanded, sample suffixes off)."""
    names = set()
    for match in re.finditer(r"sigil_push_[a-z_]*(?:\{[a-z_,]+\}[a-z_]*)?", text):
        name = match.group(0)
        brace = re.search(r"\{([a-z_,]+)\}(?=[a-z_])", name)
        if brace:
            variants = [name.replace(brace.group(0), part) for part in brace.group(1).split(",")]
        else:
            variants = [re.sub(r"\{.*", "", name)]
        for variant in variants:
            for suffix in ("_bucket", "_count", "_sum"):
                if variant.endswith(suffix) and variant.removesuffix(suffix) in known:
                    variant = variant.removesuffix(suffix)
            names.add(variant)
    return names - NOTIFY_CHANNELS


def metrics_reference() -> dict[str, set[str]]:
    """docs/operations.md's "Metrics reference" table: metric -> its labels."""
    section = OPERATIONS.split("## Metrics reference", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        match = re.match(r"\| `(sigil_push_[a-z_]+)` \|([^|]*)\|", line)
        if match:
            table[match.group(1)] = set(re.findall(r"`([a-z_]+)`", match.group(2)))
    return table


def test_the_metrics_reference_lists_every_metric_with_its_labels() -> None:
    exported = exported_metrics()
    assert "sigil_push_pushes_total" in exported and "sigil_push_push_latency_seconds" in exported
    assert metrics_reference() == exported


@pytest.mark.parametrize(
    "document", ["README.md", "docs/operations.md", "docs/bridge.md", "docs/performance.md"]
)
def test_every_metric_the_docs_name_exists(document: str) -> None:
    """A renamed or removed metric leaves no name behind in the docs (alerts and dashboards
    built from them would show nothing)."""
    exported = exported_metrics()
    text = (ROOT / document).read_text(encoding="utf-8")
    assert sorted(named_in(text, set(exported)) - set(exported)) == []


def test_every_metric_label_the_docs_name_exists() -> None:
    """`metric{label,...}` in the docs names labels the metric has (`worker` is added to every
    series on PostgreSQL)."""
    exported = exported_metrics()
    wrong = []
    for text in (README, OPERATIONS, BRIDGE):
        for name, labels in re.findall(r"(sigil_push_[a-z_]+)\{([a-z_,]+)\}", text):
            if name in exported and not set(labels.split(",")) <= exported[name] | {"worker"}:
                wrong.append((name, labels))
    assert wrong == []


def help_text(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([*argv, "--help"]) == 0
    return out.getvalue()


@pytest.mark.parametrize("command", ["serve", "migrate", "analytics"])
def test_readme_cli_flags_are_the_parsers(command: str) -> None:
    """README's "Running" block shows each command with exactly the flags its parser has."""
    block = README.split("## Running", 1)[1].split("```", 2)[1]
    documented = {
        flag
        for line in block.splitlines()
        if line.startswith(f"sigil-push {command} ")
        for flag in re.findall(r"--[a-z-]+", line.split("#", 1)[0])
    }
    actual = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text(command))) - {"--help"}
    assert documented == actual
    top_level = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text())) - {"--help"}
    assert top_level <= set(re.findall(r"--[a-z-]+", block))


@pytest.mark.parametrize("shipped", ["relays.toml", "deploy/systemd/relays.toml"])
def test_the_shipped_configs_load(shipped: str) -> None:
    """The configs the README and the systemd kit tell operators to copy are valid as shipped,
    and the default one keeps /metrics off the public listener, as README says."""
    config = config_module.load_config(ROOT / shipped, TABLES)
    assert config.server.admin_listen == "127.0.0.1:9464"
