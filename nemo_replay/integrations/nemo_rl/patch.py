"""The one source patch replay needs in NeMo-RL, and the command that applies it.

NeMo-RL's rollout code slices the vLLM worker's per-token outputs into each generated
assistant message inline, key by key (``generation_logprobs``, ``routed_experts``), in
``generate_responses``, ``generate_responses_async`` (``nemo_rl/experience/rollouts.py``)
and ``AsyncRolloutImpl._generate_response`` (``nemo_rl/experience/rollout_manager.py``).
There is no function boundary to wrap, so ``generation_support`` is sliced there by a
patch of 12 added lines (``patches/nemo_rl_7ea279a.patch``), written against
:data:`~.layout.NEMO_RL_COMMIT`. Everything else replay needs attaches at run time
(docs/design.md §9).

    python -m nemo_replay.integrations.nemo_rl.patch apply NEMO_RL_DIR
    python -m nemo_replay.integrations.nemo_rl.patch check NEMO_RL_DIR

What decides is the content of the two patched files, not the tree's commit: a branch on
top of the pinned commit (a user's own commits) is accepted while those files are byte for
byte the pinned commit's (SHA-256 in :data:`PATCHED_FILES`); any other tree is refused
naming the first file that differs.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from nemo_replay.integrations.nemo_rl.token_aligned import NEMO_RL_COMMIT

__all__ = ["PATCH_FILE", "PATCHED_FILES", "patch_state", "apply_patch", "main"]

PATCH_FILE = Path(__file__).with_name("patches") / f"nemo_rl_{NEMO_RL_COMMIT[:7]}.patch"

#: sha256 of each file the patch touches: (at the pinned commit, after the patch).
PATCHED_FILES = {
    "nemo_rl/experience/rollouts.py": (
        "7930275a3b15b86b85a12d1a64260a436ec443507b75134fe04317f0cac19193",
        "21600272c5399f1fe566d20b69e0aa0bffc271668d7c73abc0d29fc403b357c8",
    ),
    "nemo_rl/experience/rollout_manager.py": (
        "94f87f3478fa2f81c8adb5fc000a0690067d2000a8f67e1eaef0f2c18545d71b",
        "bcf332f249336bae36280ca6f1f338619b4812a68a04ad04c8936793a852b278",
    ),
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _git_head(tree: Path) -> str | None:
    """The tree's commit when it is a git checkout with git on PATH, else None."""
    if not (tree / ".git").exists() or shutil.which("git") is None:
        return None
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def patch_state(tree: str | Path) -> str:
    """``"pinned"`` (applies), ``"patched"`` (already applied); anything else raises.

    Raises:
        ValueError naming the directory and why it is not NeMo-RL at the pinned commit.
    """
    root = Path(tree).resolve()
    if not (root / "nemo_rl" / "__init__.py").is_file():
        raise ValueError(f"{root} is not a NeMo-RL source tree (no nemo_rl/__init__.py); pass the checkout's root")
    states = set()
    for name, (pinned, patched) in PATCHED_FILES.items():
        path = root / name
        digest = _sha256(path) if path.is_file() else None
        if digest == pinned:
            states.add("pinned")
        elif digest == patched:
            states.add("patched")
        else:
            what = "is missing" if digest is None else "differs from that commit's"
            head = _git_head(root)
            at = f" (the tree is at commit {head[:12]})" if head is not None and not head.startswith(NEMO_RL_COMMIT) else ""
            raise ValueError(
                f"{root}/{name} {what}{at}: the replay patch is written for that file as NeMo-RL "
                f"{NEMO_RL_COMMIT[:7]} has it. A branch on top of {NEMO_RL_COMMIT[:7]} is fine while it leaves "
                f"{' and '.join(PATCHED_FILES)} unchanged: restore {name} with `git -C {root} checkout "
                f"{NEMO_RL_COMMIT[:7]} -- {name}`, or use the nemo_replay release pinned to your NeMo-RL commit"
            )
    if len(states) > 1:
        raise ValueError(
            f"{root} holds the replay patch in some files only ({', '.join(PATCHED_FILES)}); restore them with "
            f"`git -C {root} checkout -- {' '.join(PATCHED_FILES)}` and apply again"
        )
    return states.pop()


def apply_patch(tree: str | Path) -> str:
    """Apply the patch to a NeMo-RL tree at the pinned commit; a no-op where it is applied.

    Returns:
        What was done, one line.

    Raises:
        ValueError for a tree at another commit (:func:`patch_state`) or when git cannot apply it.
    """
    root = Path(tree).resolve()
    if patch_state(root) == "patched":
        return f"{root}: the replay patch is already applied"
    if shutil.which("git") is None:
        raise ValueError(f"applying {PATCH_FILE.name} needs git on PATH (or run `patch -p1 -d {root} < {PATCH_FILE}`)")
    done = subprocess.run(["git", "apply", str(PATCH_FILE)], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"git apply {PATCH_FILE.name} failed in {root}: {done.stderr.strip()}")
    if patch_state(root) != "patched":  # pragma: no cover - git applied something else
        raise ValueError(f"{root}: after git apply the patched files do not match {PATCH_FILE.name}")
    return f"{root}: applied {PATCH_FILE.name} ({', '.join(PATCHED_FILES)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_replay.integrations.nemo_rl.patch",
        description=f"Apply (or check) replay's source patch to a NeMo-RL checkout at commit {NEMO_RL_COMMIT[:7]}.",
    )
    parser.add_argument("action", choices=["apply", "check"], help="apply the patch, or only report the tree's state")
    parser.add_argument("nemo_rl_dir", help="the NeMo-RL checkout's root (holds nemo_rl/)")
    args = parser.parse_args(argv)
    try:
        if args.action == "apply":
            print(apply_patch(args.nemo_rl_dir))
        else:
            state = patch_state(args.nemo_rl_dir)
            print(f"{Path(args.nemo_rl_dir).resolve()}: NeMo-RL {NEMO_RL_COMMIT[:7]}, replay patch "
                  f"{'applied' if state == 'patched' else 'not applied'}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
