"""A tiny recipe for trainer tests: a few short rollouts per step, no progress bar, no plot."""

TINY = [
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
    "trainer.micro_batch_size=8",
    "trainer.minibatches_per_step=2",
    "trainer.progress_bar=false",
    "trainer.plot=false",
    "trainer.accelerator=cpu",
    "generation.max_new_tokens=4",
    "model.hidden_size=32",
    "model.intermediate_size=64",
]


def tiny(tmp_path, *extra: str, steps: int = 2) -> list[str]:
    """TINY plus ``steps`` and an output folder under ``tmp_path``."""
    return [*TINY, f"trainer.steps={steps}", f"trainer.output_dir={tmp_path}", *extra]
