"""The strategy registry: frozen specs, duplicates, lookups, lazy built-ins, entry points."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nemo_replay
from nemo_replay.strategies import registry as registry_module
from nemo_replay.strategies.registry import ENTRY_POINT_GROUP, StrategyRegistry, StrategySpec

ROOT = Path(__file__).resolve().parents[2]


def _factory(**options):
    return ("made", options)


DEMO_SPEC = StrategySpec("demo", _factory, "a spec for lazy-loading tests")


def test_register_and_get():
    reg = StrategyRegistry(builtins={}, entry_point_group=None)
    spec = StrategySpec("alpha", _factory, "first")
    assert reg.register(spec) is spec
    assert reg.get("alpha") is spec and reg.get("alpha").factory(x=1) == ("made", {"x": 1})
    reg.register(StrategySpec("beta-2", _factory))
    assert reg.names() == ["alpha", "beta-2"]


def test_duplicates_are_rejected_and_listed():
    reg = StrategyRegistry(builtins={"megatron": "nowhere:SPEC"}, entry_point_group=None)
    reg.register(StrategySpec("alpha", _factory))
    with pytest.raises(ValueError, match=r"strategy 'alpha' is already registered; pick another name \(registered: "
                                         r"alpha, megatron\)"):
        reg.register(StrategySpec("alpha", lambda: None))
    with pytest.raises(ValueError, match=r"strategy 'megatron' is already registered"):
        reg.register(StrategySpec("megatron", _factory))  # reserved by a lazy built-in
    with pytest.raises(ValueError, match=r"register\(\) takes a StrategySpec, got dict"):
        reg.register({"name": "x", "factory": _factory})


def test_unknown_name_lists_registered_ones():
    reg = StrategyRegistry(builtins={"megatron": "nowhere:SPEC", "fsdp": "nowhere:SPEC"}, entry_point_group=None)
    reg.register(StrategySpec("mine", _factory))
    with pytest.raises(ValueError, match=r"unknown replay strategy 'megatorn'; registered strategies: fsdp, megatron, "
                                         r"mine\. Set replay.strategy to one of them, or register a plugin under the "
                                         r"'nemo_replay.strategies' entry-point group"):
        reg.get("megatorn")
    with pytest.raises(ValueError, match=r"registered strategies: \(none\)"):
        StrategyRegistry(builtins={}, entry_point_group=None).get("x")
    with pytest.raises(ValueError, match=r"unknown replay strategy 'nope'; registered strategies: .*fsdp.*megatron"):
        nemo_replay.get_strategy("nope")


def test_spec_is_frozen_and_validated():
    spec = StrategySpec("alpha", _factory)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "beta"
    for bad in ("Alpha", "", "1st", "has space", "dot.name", 3, None):
        with pytest.raises(ValueError, match=r"strategy name must be lower-case letters, digits, '_' or '-'"):
            StrategySpec(bad, _factory)
    with pytest.raises(ValueError, match=r"strategy 'alpha': factory must be callable, got str"):
        StrategySpec("alpha", "module:function")


def test_builtins_load_lazily_and_are_checked():
    module = __name__
    reg = StrategyRegistry(builtins={"demo": f"{module}:DEMO_SPEC", "wrong": f"{module}:DEMO_SPEC"},
                           entry_point_group=None)
    assert reg.names() == ["demo", "wrong"]
    assert reg.get("demo") is DEMO_SPEC
    assert reg.get("demo") is DEMO_SPEC  # cached after the first load
    with pytest.raises(ValueError, match=rf"{module}:DEMO_SPEC must provide a StrategySpec named 'wrong'"):
        reg.get("wrong")


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """An installed-looking plugin: a module plus a dist-info with entry_points.txt on sys.path."""
    (tmp_path / "core_replay_plugin.py").write_text(textwrap.dedent("""
        from nemo_replay.strategies.registry import StrategySpec

        def make(**options):
            return ("plugin", options)

        SPEC = StrategySpec("core-plugin", make, "a third-party strategy")
        NOT_A_SPEC = object()
    """))
    dist_info = tmp_path / "core_replay_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: core-replay-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ncore-plugin = core_replay_plugin:SPEC\nbroken-plugin = core_replay_plugin:NOT_A_SPEC\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # A fresh default registry, so the plugin does not stay registered for other tests.
    monkeypatch.setattr(registry_module, "default_registry", StrategyRegistry(registry_module._BUILTINS))
    monkeypatch.delitem(sys.modules, "core_replay_plugin", raising=False)
    yield tmp_path
    sys.modules.pop("core_replay_plugin", None)


def test_entry_point_plugin_is_found(plugin_dir):
    names = nemo_replay.available_strategies()
    assert {"core-plugin", "broken-plugin", "megatron", "fsdp"} <= set(names)
    assert "core_replay_plugin" not in sys.modules  # listing does not import plugins
    spec = nemo_replay.get_strategy("core-plugin")
    assert sys.modules["core_replay_plugin"].SPEC is spec
    assert spec.factory(tp=2) == ("plugin", {"tp": 2}) and spec.description == "a third-party strategy"
    with pytest.raises(ValueError, match=r"strategy 'core-plugin' is already registered"):
        nemo_replay.register_strategy(StrategySpec("core-plugin", _factory))
    with pytest.raises(ValueError, match=r"entry point core_replay_plugin:NOT_A_SPEC must provide a StrategySpec named "
                                         r"'broken-plugin'"):
        nemo_replay.get_strategy("broken-plugin")


def test_plugins_register_in_the_default_registry(plugin_dir):
    spec = nemo_replay.register_strategy(StrategySpec("in-process", _factory))
    assert nemo_replay.get_strategy("in-process") is spec
    assert "in-process" in nemo_replay.available_strategies()


def test_importing_the_package_imports_neither_megatron_nor_transformers():
    code = textwrap.dedent("""
        import json, sys
        import nemo_replay
        before = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformers'))
        names = nemo_replay.available_strategies()
        after = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformers'))
        strategies = sorted(m for m in sys.modules if m.startswith(('nemo_replay.strategies.megatron',
                                                                   'nemo_replay.strategies.fsdp')))
        print(json.dumps({'before': before, 'after': after, 'names': names, 'strategies': strategies}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["before"] == [] and res["after"] == [], res
    assert {"megatron", "fsdp"} <= set(res["names"])
    assert res["strategies"] == [], res  # built-ins load on lookup only
