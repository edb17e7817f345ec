"""check_nemo_rl_recipe and the overlays in configs/nemo_rl/, against NeMo-RL's own recipes.

NeMo-RL is not imported: its recipes' keys are facts in recipe_keys.txt (each with the
file and line it came from at NEMO_RL_COMMIT). Each overlay is merged over the recipe it
inherits, the way NeMo-RL's load_config merges ``defaults:``. With NEMO_RL_SRC naming a
NeMo-RL source tree, one more test resolves each overlay with NeMo-RL's own loader.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from nemo_replay.integrations.nemo_rl import NEMO_RL_COMMIT, check_nemo_rl_recipe

ROOT = Path(__file__).resolve().parents[3]
OVERLAYS = sorted((ROOT / "configs" / "nemo_rl").glob("*.yaml"))
KEYS = Path(__file__).with_name("recipe_keys.txt")
# Keys an overlay may set that NeMo-RL's recipe lacks: read with .get() from an open dict or with a default.
OPEN = {
    "grpo_math_1B_replay.yaml": ("policy.generation.vllm_kwargs.",),
    "grpo_math_1B_megatron_replay.yaml": ("policy.generation.vllm_kwargs.", "policy.sequence_packing.fuse_loss"),
}


def _facts() -> dict[str, dict[str, object]]:
    """{NeMo-RL recipe file: {dotted key: value}} from recipe_keys.txt."""
    facts: dict[str, dict[str, object]] = {}
    for line in KEYS.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        where, fact = line.split(" ", 1)
        key, value = fact.split(": ", 1)
        facts.setdefault(where.split(":")[0], {})[key] = yaml.safe_load(value)
    return facts


def _base(recipe: str):
    """NeMo-RL's recipe ``recipe`` (its keys replay reads), after its own ``defaults:``."""
    facts = _facts()
    cfg = OmegaConf.create({})
    chain = ["grpo_math_1B.yaml"] + (["grpo_math_1B_megatron.yaml"] if recipe == "grpo_math_1B_megatron.yaml" else [])
    for name in chain:
        for key, value in facts[name].items():
            OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def _leaves(cfg, prefix=""):
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path


def _overlay(path: Path):
    overlay = OmegaConf.load(path)
    return overlay.pop("defaults"), overlay


def _merged(path: Path) -> dict:
    parent, overlay = _overlay(path)
    return OmegaConf.to_container(OmegaConf.merge(_base(parent), overlay), resolve=True)


def replay_recipe(overlay: str = "grpo_math_1B_replay.yaml", **changes) -> dict:
    """An overlay merged over its base, then ``changes`` ({"a__b": value} sets a.b)."""
    cfg = OmegaConf.create(_merged(ROOT / "configs" / "nemo_rl" / overlay))
    for key, value in changes.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return OmegaConf.to_container(cfg)


def _refusal(config) -> list[str]:
    with pytest.raises(ValueError) as err:
        check_nemo_rl_recipe(config)
    header, *lines = str(err.value).split("\n")
    assert header == "NeMo-RL recipe cannot run replay:" and all(line.startswith("  ") for line in lines)
    return [line.strip() for line in lines]


def _one(config, start: str) -> str:
    """The single problem line of ``config``, which must start with ``start``."""
    lines = _refusal(config)
    assert len(lines) == 1 and lines[0].startswith(start), lines
    return lines[0]


# --- the overlays and the keys file ---------------------------------------------------------


def test_the_keys_file_names_the_nemo_rl_commit_and_each_line():
    header = KEYS.read_text().splitlines()[0]
    assert NEMO_RL_COMMIT in header and "7ea279a" in header
    for line in KEYS.read_text().splitlines():
        if not line.startswith("#"):
            assert re.fullmatch(r"grpo_math_1B(_megatron)?\.yaml:\d+ [\w.]+: .+", line), line


def test_overlay_headers_give_the_launcher_command_and_an_override():
    assert [p.name for p in OVERLAYS] == sorted(OPEN)
    for path in OVERLAYS:
        text = path.read_text()
        head = text.split("\n\n")[0]
        assert text.startswith("#") and "\ndefaults: " in text
        run = f"python -m nemo_replay.integrations.nemo_rl.run_grpo --config examples/configs/{path.name}"
        assert run in head and "uv run" in head and "Override example:" in head, head
        assert "examples/run_grpo.py" not in text


def test_every_overlay_key_is_one_of_the_recipe_it_inherits():
    for path in OVERLAYS:
        parent, overlay = _overlay(path)
        assert parent in ("grpo_math_1B.yaml", "grpo_math_1B_megatron.yaml")
        base = set(_leaves(OmegaConf.to_container(_base(parent))))
        extra = [key for key in _leaves(OmegaConf.to_container(overlay)) if key not in base]
        assert extra and all(key.startswith(OPEN[path.name]) for key in extra), (path.name, extra)
        header = path.read_text().split("\ndefaults:")[0]
        for key in extra:  # each exception is said in the overlay's header
            assert ("vllm_kwargs" if ".vllm_kwargs." in key else key.split(".", 1)[1]) in header, key


def test_each_overlay_over_its_base_is_accepted():
    for path in OVERLAYS:
        merged = _merged(path)
        check_nemo_rl_recipe(merged)
        generation = merged["policy"]["generation"]
        assert generation["top_k"] == 64 and generation["vllm_kwargs"]["max_logprobs"] == generation["top_k"] + 17  # ties shown whole
        assert generation["vllm_cfg"]["logprobs_mode"] == "processed_logprobs"
    megatron = _merged(ROOT / "configs" / "nemo_rl" / "grpo_math_1B_megatron_replay.yaml")
    assert megatron["policy"]["sequence_packing"]["fuse_loss"] is False
    assert megatron["cluster"] == {"gpus_per_node": 4, "num_nodes": 1}
    dtensor = _merged(ROOT / "configs" / "nemo_rl" / "grpo_math_1B_replay.yaml")
    assert "fuse_loss" not in dtensor["policy"]["sequence_packing"]  # NeMo-RL reads it only on its Megatron path


def test_plain_nemo_rl_recipes_are_refused_naming_top_k_and_max_logprobs_at_once():
    """The stock recipe once reported top_k alone, and max_logprobs only on the run after top_k
    was fixed (about 25 s a round): both come in the first refusal."""
    for recipe in ("grpo_math_1B.yaml", "grpo_math_1B_megatron.yaml"):
        # NeMo-RL's recipes already set processed_logprobs, the sync engine and a cluster that fits TP=CP=1.
        top_k, max_logprobs = _refusal(OmegaConf.to_container(_base(recipe), resolve=True))
        assert top_k.startswith("policy.generation.top_k=None: set an int > 1") and "bounded" in top_k
        assert max_logprobs.startswith("policy.generation.vllm_kwargs.max_logprobs absent (vLLM's default 20): set it "
                                       "with top_k, to top_k + 17 (at least top_k + 1; e.g. 81 for top_k 64)"), max_logprobs


# --- the checks kept from before ------------------------------------------------------------


def test_raw_logprobs_are_refused():
    line = _one(replay_recipe(policy__generation__vllm_cfg__logprobs_mode="raw_logprobs"), "policy.generation.vllm_cfg.")
    assert line.startswith("policy.generation.vllm_cfg.logprobs_mode='raw_logprobs': set processed_logprobs")


def test_the_fused_megatron_paths_are_refused():
    bad = replay_recipe(
        "grpo_math_1B_megatron_replay.yaml",
        policy__megatron_cfg__use_fused_linear_logprobs=True,
        policy__sequence_packing__fuse_loss=True,
    )
    lines = _refusal(bad)
    assert len(lines) == 2
    assert lines[0].startswith("policy.megatron_cfg.use_fused_linear_logprobs=true: set false (the fused kernel")
    assert lines[1].startswith("policy.sequence_packing.fuse_loss=true: set false (the fused packed loss ignores")
    # The DTensor path never reads fuse_loss: nothing to refuse there.
    check_nemo_rl_recipe(replay_recipe(policy__sequence_packing__fuse_loss=True))


@pytest.mark.parametrize(
    "cp, named",
    [
        ("2", "'2': set an int >= 1 (1: no context parallelism)"),
        (0, "0: set an int >= 1"),
        (None, "None: set an int >= 1"),
        (2, "2: set 1, or use the Megatron backend"),
    ],
)
def test_dtensor_context_parallelism_is_refused(cp, named):
    lines = _refusal(replay_recipe(policy__dtensor_cfg__context_parallel_size=cp))
    assert lines[0].startswith(f"policy.dtensor_cfg.context_parallel_size={named}"), lines
    assert len(lines) == (2 if cp == 2 else 1)  # CP=2 on one GPU: the cluster line too


def test_dtensor_v1_is_refused():
    _one(replay_recipe(policy__dtensor_cfg___v2=False), "policy.dtensor_cfg._v2=false: set true")


# --- the new refusals -----------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.nan, math.inf, True, "1.0", None])
def test_temperature_must_be_a_finite_positive_number(value):
    line = _one(replay_recipe(policy__generation__temperature=value), f"policy.generation.temperature={value!r}: ")
    assert "set a finite number > 0" in line and "greedy" in line and "top_k=1" in line


@pytest.mark.parametrize("backend", ["megatron", "sglang", None])
def test_the_generation_backend_must_be_vllm(backend):
    line = _one(replay_recipe(policy__generation__backend=backend), f"policy.generation.backend={backend!r}: set vllm")
    assert "vLLM worker" in line


@pytest.mark.parametrize("value", [True, "false"])
def test_the_async_vllm_engine_is_refused(value):
    bad = replay_recipe(policy__generation__vllm_cfg__async_engine=value)
    line = _one(bad, f"policy.generation.vllm_cfg.async_engine={value!r}: set false")
    assert "asserts top_k is unset" in line and "synchronous" in line


def test_max_logprobs_must_cover_top_k_plus_one():
    path = "policy.generation.vllm_kwargs.max_logprobs"
    absent = replay_recipe()
    del absent["policy"]["generation"]["vllm_kwargs"]["max_logprobs"]
    line = _one(absent, f"{path} absent (vLLM's default 20): set an int >= 65 = top_k + 1")
    assert "best 81" in line and "logprobs = min(top_k + 17, max_logprobs)" in line and "tied with the k-th" in line
    _one(replay_recipe(policy__generation__vllm_kwargs__max_logprobs=64), f"{path}=64: set an int >= 65")
    _one(replay_recipe(policy__generation__vllm_kwargs__max_logprobs="65"), f"{path}='65': set an int >= 65")
    _one(replay_recipe(policy__generation__top_k=128), f"{path}=81: set an int >= 129")
    check_nemo_rl_recipe(replay_recipe(policy__generation__vllm_kwargs__max_logprobs=-1))  # vLLM: the whole vocabulary
    small = replay_recipe(policy__generation__top_k=16)
    del small["policy"]["generation"]["vllm_kwargs"]["max_logprobs"]
    check_nemo_rl_recipe(small)  # 17 <= vLLM's default 20


def test_a_quantized_generation_worker_is_refused():
    bad = replay_recipe(policy__generation__quant_cfg="nvfp4.yaml")
    line = _one(bad, "policy.generation.quant_cfg='nvfp4.yaml': set null")
    assert "resolve_generation_worker_cls" in line
    line = _one(replay_recipe(policy__quant_cfg="nvfp4.yaml"), "policy.quant_cfg='nvfp4.yaml': set null")
    assert "resolve_policy_worker_cls" in line


def test_the_transfer_queue_and_async_grpo_trainers_are_refused():
    line = _one(replay_recipe(data_plane__enabled=True), "data_plane.enabled=True: set false")
    assert "grpo_train_sync" in line
    line = _one(replay_recipe(grpo__async_grpo__enabled=True), "grpo.async_grpo.enabled=True: set false")
    assert "async vLLM engine" in line


@pytest.mark.parametrize("megatron, dtensor, state", [(True, True, "both true"), (False, False, "both false")])
def test_exactly_one_training_backend(megatron, dtensor, state):
    bad = replay_recipe(policy__megatron_cfg__enabled=megatron, policy__dtensor_cfg__enabled=dtensor)
    lines = [line for line in _refusal(bad) if line.startswith("policy.megatron_cfg.enabled and")]
    assert lines == [
        f"policy.megatron_cfg.enabled and policy.dtensor_cfg.enabled are {state}: set exactly one true (NeMo-RL's "
        f"Policy trains with one backend)"
    ]


MEGATRON = "grpo_math_1B_megatron_replay.yaml"


@pytest.mark.parametrize(
    "changes, came, world, fix",
    [
        ({"cluster__gpus_per_node": 1}, "cluster.gpus_per_node=1, cluster.num_nodes=1", "1 x 1 = 1",
         "cluster.gpus_per_node=4"),
        ({"cluster__gpus_per_node": 6}, "cluster.gpus_per_node=6, cluster.num_nodes=1", "1 x 6 = 6",
         "cluster.gpus_per_node=8"),
        ({"policy__megatron_cfg__pipeline_model_parallel_size": 2}, "cluster.gpus_per_node=4, cluster.num_nodes=1",
         "1 x 4 = 4", "cluster.gpus_per_node=8"),
        # Non-colocated on one node: generation takes resources.gpus_per_node of the node.
        ({"policy__generation__colocated__enabled": False,
          "policy__generation__colocated__resources__gpus_per_node": 1},
         "cluster.gpus_per_node=4, cluster.num_nodes=1, policy.generation.colocated.enabled=false, "
         "policy.generation.colocated.resources.gpus_per_node=1", "1 x 3 = 3", "cluster.gpus_per_node=5"),
        # Non-colocated on several nodes: generation takes whole nodes (its gpus_per_node follows the cluster's).
        ({"cluster__num_nodes": 3, "cluster__gpus_per_node": 1, "policy__generation__colocated__enabled": False,
          "policy__generation__colocated__resources__num_nodes": 1},
         "cluster.gpus_per_node=1, cluster.num_nodes=3, policy.generation.colocated.enabled=false, "
         "policy.generation.colocated.resources.num_nodes=1", "2 x 1 = 2",
         "cluster.gpus_per_node=2 and policy.generation.colocated.resources.gpus_per_node=2"),
        # A reward-model environment on a one-node cluster takes its GPUs from the policy.
        ({"data__default__env_name": "reward_model", "env__reward_model__resources__gpus_per_node": 1,
          "env__reward_model__resources__num_nodes": 1},
         "cluster.gpus_per_node=4, cluster.num_nodes=1, env.reward_model.resources.gpus_per_node=1, "
         "env.reward_model.resources.num_nodes=1", "1 x 3 = 3", "cluster.gpus_per_node=5"),
    ],
)
def test_the_training_gpus_must_be_a_multiple_of_the_model_parallel_size(changes, came, world, fix):
    line = _one(replay_recipe(MEGATRON, **changes), f"{came}: the policy trains on {world} GPU(s), not a multiple of ")
    assert "(policy.megatron_cfg)" in line and f"; e.g. set {fix} (NeMo-RL's Policy refuses" in line


def test_cluster_sizes_that_fit_are_accepted():
    check_nemo_rl_recipe(replay_recipe(MEGATRON, cluster__gpus_per_node=2, cluster__num_nodes=2))
    check_nemo_rl_recipe(replay_recipe(MEGATRON, policy__generation__colocated__enabled=False,
                                 policy__generation__colocated__resources__gpus_per_node=4, cluster__gpus_per_node=8))
    check_nemo_rl_recipe(replay_recipe(policy__dtensor_cfg__tensor_parallel_size=1, cluster__gpus_per_node=3))
    bad = replay_recipe(policy__dtensor_cfg__tensor_parallel_size=2, cluster__gpus_per_node=3)
    line = _one(bad, "cluster.gpus_per_node=3")
    assert "PP*CP*TP = 1*1*2 = 2 (policy.dtensor_cfg)" in line and "e.g. set cluster.gpus_per_node=4" in line


def test_no_gpu_left_for_training_is_refused():
    bad = replay_recipe(MEGATRON, policy__generation__colocated__enabled=False,
                  policy__generation__colocated__resources__gpus_per_node=4)
    line = _one(bad, "cluster.gpus_per_node=4, cluster.num_nodes=1, policy.generation.colocated.enabled=false")
    assert line.endswith("leave training at least one node and one GPU (NeMo-RL's setup gives the policy 1 node(s) "
                         "x 0 GPU(s))")


@pytest.mark.parametrize(
    "key, value",
    [
        ("cluster.gpus_per_node", "4"), ("cluster.num_nodes", 0), ("cluster.gpus_per_node", None),
        ("policy.megatron_cfg.tensor_model_parallel_size", "2"), ("policy.megatron_cfg.context_parallel_size", 2.0),
        ("policy.megatron_cfg.pipeline_model_parallel_size", True),
        ("policy.generation.colocated.resources.gpus_per_node", "1"),
        ("env.reward_model.resources.gpus_per_node", "one"),
    ],
)
def test_malformed_sizes_are_named_not_a_type_error(key, value):
    changes = {key.replace(".", "__"): value}
    if key.startswith("policy.generation.colocated"):
        changes["policy__generation__colocated__enabled"] = False
    if key.startswith("env.reward_model"):
        changes["data__default__env_name"] = "reward_model"
    _one(replay_recipe(MEGATRON, **changes), f"{key}={value!r}: set an int >= ")


_ALL_BAD = {
    "policy__generation__temperature": 0,
    "policy__generation__backend": "sglang",
    "policy__generation__vllm_cfg__logprobs_mode": "raw_logprobs",
    "policy__generation__vllm_cfg__async_engine": True,
    "policy__generation__quant_cfg": "fp8",
    "data_plane__enabled": True,
    "grpo__async_grpo__enabled": True,
}
_ALL_BAD_LINES = [
    "policy.generation.temperature=0: set a finite number > 0",
    "policy.generation.backend='sglang': set vllm",
    "policy.generation.vllm_cfg.logprobs_mode='raw_logprobs': set processed_logprobs",
    "policy.generation.vllm_cfg.async_engine=True: set false",
    "policy.generation.quant_cfg='fp8': set null",
    "policy.generation.vllm_kwargs.max_logprobs=81: set an int >= 129",
    "data_plane.enabled=True: set false",
    "grpo.async_grpo.enabled=True: set false",
]


@pytest.mark.parametrize(
    "overlay, changes, lines",
    [
        (MEGATRON,
         {"policy__megatron_cfg__use_fused_linear_logprobs": True, "policy__sequence_packing__fuse_loss": True,
          "cluster__gpus_per_node": 2},
         ["policy.megatron_cfg.use_fused_linear_logprobs=true: set false",
          "policy.sequence_packing.fuse_loss=true: set false",
          "cluster.gpus_per_node=2, cluster.num_nodes=1: the policy trains on 1 x 2 = 2 GPU(s), not a multiple of "
          "PP*CP*TP = 1*2*2 = 4 (policy.megatron_cfg); e.g. set cluster.gpus_per_node=4"]),
        ("grpo_math_1B_replay.yaml",
         {"policy__dtensor_cfg___v2": False, "policy__dtensor_cfg__context_parallel_size": 2},
         ["policy.dtensor_cfg._v2=false: set true",
          "policy.dtensor_cfg.context_parallel_size=2: set 1, or use the Megatron backend",
          "cluster.gpus_per_node=1, cluster.num_nodes=1: the policy trains on 1 x 1 = 1 GPU(s), not a multiple of "
          "PP*CP*TP = 1*2*1 = 2 (policy.dtensor_cfg); e.g. set cluster.gpus_per_node=2"]),
    ],
)
def test_every_bad_setting_is_listed_at_once(overlay, changes, lines):
    bad = replay_recipe(overlay, policy__generation__top_k=128, **_ALL_BAD, **changes)
    got = _refusal(bad)
    want = _ALL_BAD_LINES + lines
    assert len(got) == len(want) and all(line.startswith(s) for line, s in zip(got, want)), got
    # An unbounded top_k is named too; max_logprobs, sized from it, waits for a valid one.
    bad["policy"]["generation"]["top_k"] = None
    got = _refusal(bad)
    want = ["policy.generation.top_k=None: set an int > 1"] + [s for s in want if "max_logprobs" not in s]
    assert len(got) == len(want) and all(line.startswith(s) for line, s in zip(got, want)), got


def test_a_config_without_a_policy_section_is_a_value_error():
    for config in (None, [], {"grpo": {}}, {"policy": "vllm"}):
        with pytest.raises(ValueError, match="expected NeMo-RL's resolved recipe, a mapping with a 'policy' section"):
            check_nemo_rl_recipe(config)


# --- NeMo-RL's own loader -------------------------------------------------------------------

_LOAD = textwrap.dedent(
    """
    import json, sys
    from omegaconf import OmegaConf
    from nemo_rl.utils import config as nrl
    if hasattr(nrl, "register_omegaconf_resolvers"):  # ${mul:...} in NeMo-RL's recipes
        nrl.register_omegaconf_resolvers()
    print(json.dumps(OmegaConf.to_container(nrl.load_config(sys.argv[1]), resolve=True)))
    """
)


def _nemo_rl(*args: str, src: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)


def _resolve(path: Path, src: Path) -> dict:
    out = _nemo_rl("-c", _LOAD, str(path), src=src)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not os.environ.get("NEMO_RL_SRC"),
    reason="set NEMO_RL_SRC to a NeMo-RL source tree to resolve the overlays with its load_config",
)
def test_nemo_rls_loader_resolves_each_overlay_to_an_accepted_recipe(tmp_path):
    src = Path(os.environ["NEMO_RL_SRC"])
    probe = _nemo_rl("-c", "import nemo_rl.utils.config", src=src)
    if probe.returncode:
        reason = probe.stderr.strip().splitlines()[-1]
        pytest.skip(f"nemo_rl.utils.config does not import with {sys.executable}: {reason}")
    configs = tmp_path / "configs"
    shutil.copytree(src / "examples" / "configs", configs)
    for path in OVERLAYS:
        shutil.copy(path, configs / path.name)
        check_nemo_rl_recipe(_resolve(configs / path.name, src))
        # The facts of recipe_keys.txt are what NeMo-RL resolves its own recipe to.
        parent, _ = _overlay(path)
        theirs = _resolve(configs / parent, src)
        ours = OmegaConf.to_container(_base(parent), resolve=True)
        for key in _leaves(ours):
            got, want = theirs, ours
            for part in key.split("."):
                got, want = got[part], want[part]
            assert got == want, (parent, key, got, want)


def test_with_the_engines_sampling_masks_max_logprobs_is_not_asked():
    """vLLM >= 0.33 started with return_sampling_mask returns exact sets: no log-prob list to size."""
    recipe = replay_recipe()
    del recipe["policy"]["generation"]["vllm_kwargs"]["max_logprobs"]
    with pytest.raises(ValueError, match="max_logprobs absent"):
        check_nemo_rl_recipe(recipe)
    recipe["policy"]["generation"]["vllm_kwargs"]["return_sampling_mask"] = True
    check_nemo_rl_recipe(recipe)
