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

        def sizes(cfg):
            # This strategy shards each sequence over parallel.context ranks and nothing else.
            return {"context": cfg.parallel.context}

        def checks(cfg, world_size):
            out = []
            if cfg.replay.scorer.source != "hidden":
                out.append(f"replay.scorer.source={cfg.replay.scorer.source!r}: core-plugin scores hidden states "
                           f"only; set replay.scorer.source=hidden")
            if world_size > 4:
                out.append(f"core-plugin runs on at most 4 ranks, got world size {world_size}")
            return out

        SPEC = StrategySpec("core-plugin", make, "a third-party strategy", parallel_sizes=sizes,
                            check_config=checks, supports_route_replay=True)
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


def test_a_plugin_strategy_brings_its_own_recipe_rules(plugin_dir):
    """Validation asks the plugin's spec; it never treats a plugin as one of the built-ins."""
    from nemo_replay.trainer.config import ConfigError, load_config
    from nemo_replay.trainer.config.validation import collect_problems, model_parallel_size

    base = ["replay.strategy=core-plugin", "parallel.context=3", "replay.route_replay=true"]
    cfg = load_config(overrides=base, validate=False)
    problems = collect_problems(cfg, world_size=6)
    text = "\n".join(problems)
    # Its own checks ran, with the world size...
    assert any("core-plugin scores hidden states only" in p for p in problems), text
    assert any("core-plugin runs on at most 4 ranks, got world size 6" in p for p in problems), text
    # ...its sizes are the ones counted (3 context ranks: 2 data-parallel ranks, not an fsdp-style 6)...
    assert model_parallel_size(cfg) == 3
    # ...and no built-in rule fired: CP without packing is megatron's rule, TP/CP refusals are fsdp's,
    # route replay is allowed because the spec says it replays routes.
    assert not any("packing" in p or "fsdp" in p or "route_replay" in p for p in problems), text
    assert not any("do not divide the world" in p for p in problems), text
    uneven = collect_problems(load_config(overrides=base + ["replay.scorer.source=hidden"], validate=False), world_size=4)
    assert len(uneven) == 1 and "parallel sizes do not divide the world: context = 3 = 3" in uneven[0], uneven
    assert "the core-plugin strategy" in uneven[0]
    ok = load_config(overrides=base + ["replay.scorer.source=hidden", "trainer.prompts_per_step=2"], validate=False)
    assert collect_problems(ok, world_size=3) == []
    with pytest.raises(ConfigError, match="cannot be loaded: entry point core_replay_plugin:NOT_A_SPEC"):
        load_config(overrides=["replay.strategy=broken-plugin"])


def test_runtime_asks_the_spec_for_its_backend_and_process_group():
    from nemo_replay.trainer.backends.hf import HFBackend
    from nemo_replay.trainer.backends.megatron import MegatronBackend

    assert nemo_replay.get_strategy("fsdp").load_trainer_backend() is HFBackend
    assert nemo_replay.get_strategy("megatron").load_trainer_backend() is MegatronBackend
    assert nemo_replay.get_strategy("megatron").needs_process_group and not nemo_replay.get_strategy("fsdp").needs_process_group
    bare = StrategySpec("bare", _factory)
    assert bare.model_parallel_size(None) == 1 and bare.check_config(None, 8) == []
    with pytest.raises(ValueError, match=r"strategy 'bare' provides no model backend for the reference trainer.*"
                                         r"GRPOTrainer\(cfg, backend=...\)"):
        bare.load_trainer_backend()
    with pytest.raises(ValueError, match=r"strategy 'bad': trainer_backend must be 'module:attribute' or None"):
        StrategySpec("bad", _factory, trainer_backend="nemo_replay.trainer.backends.hf.HFBackend")
    with pytest.raises(ValueError, match=r"strategy 'bad': check_config must be callable, got list"):
        StrategySpec("bad", _factory, check_config=[])
