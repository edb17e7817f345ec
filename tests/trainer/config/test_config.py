"""Recipe loading: defaults inheritance, overrides, typed flags, and one error listing every problem."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from nemo_replay.trainer.config import ConfigError, RecipeConfig, flag_docs, load_config, to_yaml

REPO = Path(__file__).resolve().parents[3]


def test_default_recipe_is_valid_and_matches_the_schema_defaults():
    cfg = load_config()
    assert isinstance(cfg, RecipeConfig)
    assert cfg.replay.enabled and cfg.replay.strategy == "fsdp" and cfg.generation.top_k == 8
    # The embedded YAML spells out the schema defaults, except where it says otherwise.
    assert cfg.model == RecipeConfig().model


@pytest.mark.parametrize(
    "name, world",
    [("default.yaml", 1), ("megatron_moe_gpu.yaml", 8), ("fsdp_gpu.yaml", 8), ("vllm.yaml", 1)],
)
def test_shipped_recipes_validate_and_open_with_their_command(name, world):
    path = REPO / "configs" / name
    cfg = load_config(path, world_size=world)
    text = path.read_text().splitlines()
    assert text[0].startswith("#")
    header = "\n".join(line for line in text if line.startswith("#"))
    assert "nemo-replay train" in header or "-m nemo_replay train" in header
    assert "=" in header  # an override example
    if name == "megatron_moe_gpu.yaml":
        p = cfg.parallel
        assert (cfg.replay.strategy, p.tensor > 1, p.context > 1, p.packing, cfg.replay.route_replay) == (
            "megatron", True, True, True, True,
        )
        assert cfg.model.num_experts > 0
    if name == "fsdp_gpu.yaml":
        assert cfg.replay.strategy == "fsdp" and cfg.parallel.sequence > 1 and cfg.replay.scorer.source == "hidden"


def test_defaults_chain_later_layers_win(tmp_path):
    (tmp_path / "base.yaml").write_text("defaults: [pkg://default]\ntrainer: {steps: 7, lr: 0.5}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "run.yaml").write_text("defaults:\n  - ../base.yaml\ntrainer: {steps: 9}\n")
    cfg = load_config(tmp_path / "sub" / "run.yaml", ["trainer.seed=5"])
    assert (cfg.trainer.steps, cfg.trainer.lr, cfg.trainer.seed) == (9, 0.5, 5)
    assert cfg.generation.top_k == 8  # from the package default
    cfg = load_config(tmp_path / "sub" / "run.yaml", ["trainer.steps=3", "generation.top_k=null", "replay.sample_support.top_k=null"])
    assert cfg.trainer.steps == 3 and cfg.generation.top_k is None


def test_defaults_cycle_and_missing_file_are_reported(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: [b.yaml]\n")
    (tmp_path / "b.yaml").write_text("defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("defaults: [nowhere.yaml]\n")
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="shipped recipes: default"):
        load_config("pkg://no_such_recipe")


@pytest.mark.parametrize("text, name", [
    ("vm\n", "hostname"),  # /etc/hostname: once read back as the flag 'vm'
    ("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n", "passwd"),
    ("- trainer.steps=3\n", "list.txt"),
    ("trainer: {steps: 3}\n", "recipe.txt"),  # flags, but not named as a recipe
])
def test_a_defaults_entry_that_is_not_a_recipe_is_named_not_echoed(tmp_path, text, name):
    (tmp_path / name).write_text(text)
    (tmp_path / "r.yaml").write_text(f"defaults: [{tmp_path / name}]\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "r.yaml")
    (problem,) = info.value.problems
    assert problem.startswith(f"the defaults entry '{tmp_path / name}' of {tmp_path / 'r.yaml'} is not a recipe: "), problem
    assert "not a YAML file named *.yaml or *.yml" in problem and "pkg://default" in problem, problem
    assert text.split(":")[0].strip() not in problem.replace(str(tmp_path), "")  # the content is not echoed
    with pytest.raises(ConfigError, match=rf"'{tmp_path / name}' is not a recipe: "):
        load_config(tmp_path / name)  # as the CONFIG itself


@pytest.mark.parametrize("text, kind", [("vm\n", "str"), ("- a\n- b\n", "list"), ("3\n", "int")])
def test_a_yaml_file_that_holds_no_mapping_is_not_a_recipe(tmp_path, text, kind):
    (tmp_path / "s.yaml").write_text(text)
    (tmp_path / "r.yaml").write_text("defaults: [s.yaml]\n")
    with pytest.raises(ConfigError, match=rf"is not a recipe: {tmp_path / 's.yaml'} holds a YAML {kind}, not a mapping"):
        load_config(tmp_path / "r.yaml")


def test_unknown_flags_and_bad_types_are_collected_with_hints():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["trainer.stpes=3", "trainer.lr=fast", "model", "replay.scorer=3"])
    problems = info.value.problems
    assert len(problems) == 4, problems
    text = "\n".join(problems)
    assert "unknown flag trainer.stpes; did you mean trainer.steps?" in text
    assert "trainer.lr='fast'" in text
    assert "override 'model' is not key=value" in text
    assert "replay.scorer is a section" in text


# Each rule of the issue, alone: (overrides, world size, text the single problem must contain).
RULES = [
    (["replay.sample_support.enabled=false"], 1, "replay.sample_support.enabled=true"),
    (["generation.temperature=null"], 1, "generation.temperature is missing"),
    (["generation.temperature=0"], 1, "generation.temperature=0.0 must be > 0"),
    (["generation.temperature=-1.5"], 1, "generation.temperature=-1.5 must be > 0"),
    (["generation.temperature=0.001"], 1, "generation.temperature=0.001 must be in [0.01, 100.0]"),  # as capture serves
    (["generation.temperature=1e308"], 1, "generation.temperature=1e+308 must be in [0.01, 100.0]"),
    (["generation.top_k=1"], 1, "generation.top_k=1 must be > 1"),
    (["replay.sample_support.top_k=1"], 1, "replay.sample_support.top_k=1 must be > 1"),
    (["replay.sample_support.top_k=4"], 1, "narrower than generation.top_k=8"),
    (["generation.repetition_penalty=1.2"], 1, "set generation.repetition_penalty=1.0"),
    (["replay.strategy=vllm_magic"], 1, "registered strategies: fsdp, megatron"),
    (["replay.strategy=megatron", "parallel.context=2"], 2, "parallel.context=2 needs packed sequences"),
    (["replay.strategy=megatron", "parallel.sequence=2"], 2, "parallel.sequence=2 is Ulysses"),
    (["parallel.sequence=2"], 3, "sequence = 2 = 2 (the ranks the fsdp strategy needs for one copy of the data) does not divide world size 3"),
    (["replay.strategy=megatron", "parallel.tensor=2"], 3, "tensor*pipeline*context = 2*1*1 = 2 (the ranks the megatron strategy"),
    (["parallel.tensor=2"], 2, "parallel.tensor=2 is not available with the fsdp strategy"),
    (["replay.route_replay=true"], 1, "replay.route_replay=true needs a strategy that replays MoE routes; replay.strategy='fsdp' does not"),
    (["replay.strategy=megatron", "replay.route_replay=true"], 1, "replay.route_replay=true needs an MoE model (model.num_experts=0)"),
    (["trainer.prompts_per_step=3"], 2, "does not split over 2 data-parallel ranks"),
    (["trainer.grad_clip=-1"], 1, "trainer.grad_clip=-1.0 must be >= 0"),
    # Every float flag refuses NaN and infinity, once (not again by its range check).
    (["trainer.kl_coef=nan"], 1, "trainer.kl_coef=nan must be a finite number"),
    (["trainer.grad_clip=nan"], 1, "trainer.grad_clip=nan must be a finite number"),
    (["trainer.lr=inf"], 1, "trainer.lr=inf must be a finite number"),
    (["trainer.weight_decay=nan"], 1, "trainer.weight_decay=nan must be a finite number"),
    (["trainer.clip_eps=inf"], 1, "trainer.clip_eps=inf must be a finite number"),
    (["trainer.collective_timeout_s=-inf"], 1, "trainer.collective_timeout_s=-inf must be a finite number"),
    (["generation.top_p=nan"], 1, "generation.top_p=nan must be a finite number"),
    (["generation.temperature=inf"], 1, "generation.temperature=inf must be a finite number"),
    (["trainer.lr=1e38"], 1, "trainer.lr=1e+38 must be in (0, 1e+30]"),
    # The long-run flags.
    (["trainer.seed=-1"], 1, "trainer.seed=-1 must be in [0, 4294967295]"),
    (["trainer.seed=4294967296"], 1, "trainer.seed=4294967296 must be in [0, 4294967295]"),
    (["trainer.resume=sometimes"], 1, "trainer.resume='sometimes' must be one of auto, never, must"),
    (["trainer.resume=yes"], 1, "trainer.resume=True (a YAML boolean: yes, no, on, off, true and false read as one) must be one of auto, never, must"),
    (["trainer.resume=must"], 1, "trainer.resume=must needs trainer.output_dir"),
    (["trainer.checkpoint_every=-1"], 1, "trainer.checkpoint_every=-1 must be >= 0"),
    (["trainer.keep_checkpoints=-2"], 1, "trainer.keep_checkpoints=-2 must be >= 0"),
    (["trainer.collective_timeout_s=0"], 1, "trainer.collective_timeout_s=0.0 must be > 0"),
    (["model.pretrained=/nonexistent/llama"], 1, "model.pretrained='/nonexistent/llama': nothing exists at that path"),
    (["model.pretrained=meta-llama/Llama-3.1-8B"], 1, "nothing exists at that path (relative to the working directory"),
    # Experiment loggers: known names, each once, jsonl always among them.
    (["trainer.loggers=[jsonl,tensorbord]"], 1,
     "trainer.loggers: unknown logger 'tensorbord' (did you mean tensorboard?); known loggers: jsonl, csv, tensorboard, wandb, mlflow"),
    (["trainer.loggers=[csv]"], 1, "trainer.loggers=['csv'] leaves out jsonl, which every run writes"),
    (["trainer.loggers=[jsonl,csv,csv]"], 1, "trainer.loggers lists csv 2 times; list each logger once"),
    # The vllm engine (it needs no vLLM to be checked).
    (["generation.engine=vllm", "generation.top_k=null"], 1, "set generation.top_k (> 1)"),
    (["generation.engine=vllm"], 2, "this recipe has 2 processes"),
    (["generation.engine=vllm", "generation.vllm.memory_share=0"], 1, "generation.vllm.memory_share=0.0 must be in (0, 1]"),
    (["generation.engine=vllm", "generation.vllm.memory_share=1.5"], 1, "generation.vllm.memory_share=1.5 must be in (0, 1]"),
    (["generation.engine=vllm", "replay.strategy=megatron", "parallel.tensor=2"], 2, "generation.engine=vllm runs one vLLM beside one trainer process; this recipe has 2"),
    (["generation.engine=vllm", "replay.strategy=megatron", "model.num_experts=4"], 1, "which an MoE model (model.num_experts=4) has no form of"),
    (["generation.engine=vllm-server", "generation.top_k=null"], 1, "generation.engine=vllm-server reads each support"),
    (["generation.engine=vllm", "generation.vllm.url=http://127.0.0.1:8000"], 1, "with generation.engine=vllm-server (generation.engine=vllm)"),
    (["generation.engine=vllm-server", "generation.vllm.url=127.0.0.1:8000"], 1, "generation.vllm.url='127.0.0.1:8000': a running vLLM server's http://host:port"),
    (["generation.engine=vllm-server", "generation.vllm.start_timeout=0"], 1, "generation.vllm.start_timeout=0.0 must be > 0"),
    (["trainer.loggers=csv"], 1, "trainer.loggers='csv': trainer.loggers takes a list; write it in brackets, e.g. trainer.loggers=[csv]"),
    # What check passed and train could not run: an OverflowError, a SIGSEGV, libgomp's abort at 16384.
    (["replay.scorer.chunk_size=100000000000000000000"], 1,
     "replay.scorer.chunk_size=100000000000000000000 must be in [1, 2147483647] (pairs projected per chunk; the default is 8192)"),
    (["replay.scorer.chunk_size=2147483648"], 1, "replay.scorer.chunk_size=2147483648 must be in [1, 2147483647]"),
    (["replay.scorer.chunk_size=0"], 1, "replay.scorer.chunk_size=0 must be in [1, 2147483647]"),
    (["trainer.num_threads=1000000"], 1,
     f"trainer.num_threads=1000000 must be in [1, {os.cpu_count()}] (this machine's cores, os.cpu_count()) or null"),
    (["trainer.num_threads=16384"], 1, "trainer.num_threads=16384 must be in [1, "),
    ([f"trainer.num_threads={os.cpu_count() + 1}"], 1, f"trainer.num_threads={os.cpu_count() + 1} must be in [1, "),
    (["trainer.num_threads=0"], 1, "trainer.num_threads=0 must be in [1, "),
]


def test_the_largest_chunk_and_every_core_are_accepted():
    cfg = load_config(overrides=["replay.scorer.chunk_size=2147483647", f"trainer.num_threads={os.cpu_count()}"])
    assert cfg.replay.scorer.chunk_size == 2**31 - 1 and cfg.trainer.num_threads == os.cpu_count()


def test_check_refuses_what_train_cannot_run(capsys):
    from nemo_replay.cli import main

    assert main(["check", "replay.scorer.chunk_size=100000000000000000000", "trainer.num_threads=1000000"]) == 2
    err = capsys.readouterr().err
    assert "2 problem(s)" in err and "replay.scorer.chunk_size=" in err and "trainer.num_threads=1000000" in err


@pytest.mark.parametrize("overrides, world, expected", RULES, ids=[r[2][:40] for r in RULES])
def test_each_rule_names_its_flag(overrides, world, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, world_size=world)
    assert len(info.value.problems) == 1, info.value.problems
    assert expected in info.value.problems[0]


def test_one_error_lists_every_problem():
    overrides = [
        "replay.strategy=megatron",
        "replay.sample_support.enabled=false",
        "generation.temperature=0",
        "generation.top_k=1",
        "generation.repetition_penalty=1.3",
        "parallel.context=2",
        "parallel.sequence=2",
        "parallel.tensor=4",
        "trainer.stepz=1",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, world_size=6)
    err = info.value
    assert isinstance(err, ValueError)
    flags = [
        "trainer.stepz", "replay.sample_support.enabled", "generation.temperature", "generation.top_k",
        "generation.repetition_penalty", "parallel.context=2", "parallel.sequence=2", "does not divide world size 6",
    ]
    message = str(err)
    for flag in flags:
        assert flag in message, flag
    assert f"{len(err.problems)} problem(s)" in message
    assert len(err.problems) >= len(flags)


def _checkpoint_folder(path: Path, *, weights: bool = True, config: str = "{}") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(config)
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def test_paths_are_checked_naming_what_is_there(tmp_path):
    """model.pretrained must be a local checkpoint folder, trainer.output_dir must not be a file."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "holder").mkdir()
    (tmp_path / "holder" / "weights.bin").write_bytes(b"")
    (tmp_path / "holder" / "readme.txt").write_text("x")
    cases = [
        ([f"model.pretrained={a_file}"], f"model.pretrained='{a_file}' is a file, not a checkpoint folder"),
        ([f"model.pretrained={tmp_path / 'empty'}"], "is a folder without config.json (it is empty)"),
        ([f"model.pretrained={tmp_path / 'holder'}"], "is a folder without config.json (it holds readme.txt, weights.bin)"),
        ([f"model.pretrained={_checkpoint_folder(tmp_path / 'noweights', weights=False)}"], "has config.json but no weights"),
        ([f"model.pretrained={_checkpoint_folder(tmp_path / 'badjson', config='{oops')}"], "config.json is not valid JSON"),
        ([f"trainer.output_dir={a_file}"], f"trainer.output_dir='{a_file}' is a file, not a folder"),
        ([f"trainer.output_dir={a_file}/run"], f"is under '{a_file}', which is a file"),
    ]
    for overrides, expected in cases:
        with pytest.raises(ConfigError) as info:
            load_config(overrides=overrides)
        assert len(info.value.problems) == 1, info.value.problems
        assert expected in info.value.problems[0], info.value.problems[0]
        assert "model.pretrained=null" in info.value.problems[0] or "trainer.output_dir=null" in info.value.problems[0]
    good = _checkpoint_folder(tmp_path / "llama")
    assert load_config(overrides=[f"model.pretrained={good}", f"trainer.output_dir={tmp_path / 'new' / 'run'}"])


def test_empty_recipe_is_an_error(tmp_path):
    for text in ("", "# comments only\n"):
        (tmp_path / "empty.yaml").write_text(text)
        with pytest.raises(ConfigError, match="is empty .*defaults: \\[pkg://default\\]"):
            load_config(tmp_path / "empty.yaml")


def test_every_flag_is_documented_and_yaml_round_trips(tmp_path):
    docs = flag_docs()
    assert len(docs) > 40
    undocumented = [path for path, _, doc in docs if not doc]
    assert not undocumented
    ckpt = _checkpoint_folder(tmp_path / "llama")
    cfg = load_config(overrides=["trainer.steps=11", "generation.top_p=0.8", f"model.pretrained={ckpt}"])
    out = tmp_path / "dump.yaml"
    out.write_text(to_yaml(cfg))
    assert dataclasses.asdict(load_config(out)) == dataclasses.asdict(cfg)
