"""The fused decode (nemo_replay/support/codec/fused.py) against the reference's array steps
(decode_steps): the same fixed-width rows bit for bit and the same flags, on clean batches and
on every corruption the codec tests make.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
Triton compiles anything): the same kernels, executed with numpy. The main environment has no
Triton, so this file skips there; ``.ci/run`` runs it in an environment with Triton installed.
With CUDA the kernels are compiled and run on the device.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("NEMO_REPLAY_REQUIRE_TRITON") == "1":
    import triton  # noqa: F401  (.ci/run's Triton phase: an import error fails it instead of skipping the file)
pytest.importorskip("triton", reason="Triton is not installed here; .ci/run runs this file where it is")

from nemo_replay.support.codec import CodecError, CompactRows, encode_support, fused, header, header_of  # noqa: E402
from nemo_replay.support.codec.decode import decode_steps  # noqa: E402
from nemo_replay.support.codec.parse import parse_buffers  # noqa: E402
from nemo_replay.support.ragged import RaggedSupport  # noqa: E402
from tests.support.test_codec import _forged, _recrc, random_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _both(buffers, sampled=None, width=None):
    """``(fused rows, fused flag names, reference rows, reference flag names)`` of one batch."""
    batch = parse_buffers(list(buffers), None, ())
    width = max(batch.width, width or 0, 1)
    s = None if sampled is None else torch.as_tensor(sampled).to(DEVICE, torch.int64)
    values, flags, cu = fused.decode_fused(batch, s, DEVICE, width)
    assert cu.tolist() == batch.cu.tolist()
    d = decode_steps(batch, s, DEVICE)
    ref = d.place(None, batch.rows * width, width).reshape(batch.rows, width)
    return values.cpu(), [n for n, f in zip(fused.FLAGS, flags.tolist()) if f], ref.cpu(), d.failed()


def test_clean_batches_decode_to_the_reference_s_rows():
    """Buffers of different V (up to 2**31 - 1), dropped and kept sampled ids, buffers without rows
    first, between and last, rows all empty, rows longer than a program's step (up to k = 4096),
    decoded wider than the widest row."""
    specs = ((11, 97, 9), (12, 128256, 64), (13, 50, 5), (14, 2**31 - 1, 30), (15, 300000, 4096), (16, 5000, 100))
    parts = [random_rows(s, V, 3 if L > 100 else 4, L) for s, V, L in specs]
    buffers = [encode_support(sup, vocab_size=V, sampled_ids=sampled if i % 2 else None)
               for i, ((sup, sampled, _), (_, V, _)) in enumerate(zip(parts, specs))]
    # Dropped tokens next to the ids around them (each id above one is coded one lower: equal to it).
    nothing, empty_rows = (encode_support(RaggedSupport.from_rows(r), vocab_size=7) for r in ([], [[[], []], [[]]]))
    neighbours = RaggedSupport.from_rows([[[4, 5, 6], [0, 1], [8, 9], [7], [2, 3]]])
    near = torch.tensor([5, 0, 9, 7, 2])
    parts.append((neighbours, near, [[4, 5, 6], [0, 1], [8, 9], [7], [2, 3]]))
    buffers.append(encode_support(neighbours, vocab_size=10, sampled_ids=near))
    batch = [nothing, *buffers[:2], nothing, empty_rows, *buffers[2:], nothing]
    sampled = torch.cat([parts[0][1], parts[1][1], torch.zeros(3, dtype=torch.int64), *(p[1] for p in parts[2:])])
    assert max(len(r) for r in parts[4][2]) > 2 * fused._ID_BLOCK  # several steps of one row's program
    for width in (None, 4200):
        got, flags, want, ref_flags = _both(batch, sampled, width)
        assert flags == ref_flags == [] and torch.equal(got, want)
    for i, (buf, (_, sampled_i, rows)) in enumerate(zip(buffers, parts)):  # each alone, against the rows coded
        got, flags, want, _ = _both([buf], sampled_i)
        assert flags == [] and torch.equal(got, want)
        assert [sorted(r) for r in rows] == [[t for t in row if t >= 0] for row in got.tolist()]
    assert _both([nothing])[0].shape == (0, 1)
    # Through CompactRows: the kernels chosen, the flag read, the rows the reference gives.
    rows = CompactRows(batch, sampled_ids=sampled).decode(DEVICE, check=True, fused=True)
    assert torch.equal(rows.values.cpu(), CompactRows(batch, sampled_ids=sampled).decode(DEVICE, fused=False).values.cpu())
    assert rows.cu_seqlens.cpu().tolist() == parse_buffers(batch, None, ()).cu.tolist()


def test_every_bit_flip_sets_the_reference_s_flags():
    """Bits flipped past the header (CRC recomputed: a writer's bug, not transit), two a byte, both
    encodings: the kernels set exactly the checks the reference sets, and where none is set the
    rows are the reference's. Both outcomes occur, so the test can fail either way."""
    support, sampled, _ = random_rows(21, 300, 3, 12)
    seen = {"flagged": 0, "clean": 0}
    for dropped in (False, True):
        buf = encode_support(support, vocab_size=300, sampled_ids=sampled if dropped else None)
        start = header.HEAD.size + 8 * (header_of(buf).trajectories + 1)
        for byte in range(start, len(buf)):
            for bit in (byte % 8, (byte + 3) % 8):
                bad = buf.copy()
                bad[byte] ^= 1 << bit
                bad = _recrc(bad)
                try:
                    parse_buffers([bad], None, ())
                except CodecError:
                    continue  # refused on the host: no decode runs
                got, flags, want, ref_flags = _both([bad], sampled if dropped else None)
                assert flags == ref_flags, (dropped, byte, bit)
                if flags:
                    seen["flagged"] += 1
                else:
                    seen["clean"] += 1
                    assert torch.equal(got, want), (dropped, byte, bit)
    assert seen["flagged"] > 50 and seen["clean"] > 50, seen


def test_a_flagged_batch_is_named_as_the_reference_names_it():
    """Consistent but wrong headers, a unary stream with a bit added, a sampled token outside V: the
    flag reads set and the error is the reference's, naming the buffer and the row."""
    support = RaggedSupport.from_rows([[[1, 5, 9], [4]], [[2, 3]]])
    good = encode_support(support, vocab_size=10)
    cases = [
        ([good, _forged(support, 10, max_length=2)], None, r"^b: compact support: row 0 decodes to 3 ids, past the header's row width 2"),
        ([good, _forged(RaggedSupport.from_rows([[[0, 15]]]), 16, V=15)], None,
         r"^b: compact support: row 0 decodes id 15, past the 15 ids it is coded among"),
    ]
    h = header_of(good)
    extra = good.copy()
    extra[header.HEAD.size + 8 * (h.trajectories + 1) + 1] |= 1  # a fourth set bit in the length stream
    cases.append(([good, _recrc(extra)], None, r"^b: compact support: the length stream holds 4 values, the header says 3"))
    dropped = encode_support(support, vocab_size=10, sampled_ids=torch.tensor([5, 4, 2]))
    cases.append(([good, dropped], torch.tensor([1, 4, 2, 5, 4, 10]), r"^b: compact support: sampled token 10 of row 2 is outside"))
    for buffers, sampled, message in cases:
        rows = CompactRows(buffers, sampled_ids=sampled, labels=["a", "b"]).decode(DEVICE, fused=True)
        assert bool(rows.decode_flag)
        with pytest.raises(CodecError, match=message):
            rows.raise_decode_error()
        assert _both(buffers, sampled)[1] == _both(buffers, sampled)[3] != []


def test_flags_the_reference_does_not_set_are_a_bug_report_not_a_silent_pass():
    compact = CompactRows([encode_support(RaggedSupport.from_rows([[[1, 5, 9]]]), vocab_size=10)])
    flags = torch.zeros(len(fused.FLAGS), dtype=torch.int32)
    flags[fused.FLAGS.index("id range")] = 1
    with pytest.raises(RuntimeError, match=r"fused decode flagged \['id range'\], the reference decode finds every "
                                           r"check holds; decode with the reference \(NEMO_REPLAY_FUSED_DECODE=0\)"):
        compact._name_fused(None, DEVICE, flags)


def test_the_kernels_serve_cuda_unless_switched_off(monkeypatch):
    assert fused.importable() and not fused.available(torch.device("cpu"))
    assert fused.available(torch.device("cuda"))  # Triton imports here: CUDA decodes take the kernels
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv("NEMO_REPLAY_FUSED_DECODE", off)
        assert not fused.available(torch.device("cuda"))
    assert np.array_equal(CompactRows([encode_support(RaggedSupport.from_rows([[[3]]]), vocab_size=5)])
                          .decode("cpu").values.numpy(), [[3]])


_COMPILE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nemo_replay.support.codec import fused, fused_kernels as k

# Triton 3.0-3.3 take the constexprs' values as `constants`, 3.4 on as `constexprs`.
values = "constexprs" if "constexprs" in inspect.signature(ASTSource.__init__).parameters else "constants"

pointers = dict(raw="*u8", out="*i32", flags="*i32")  # the other pointers are int64
scalars = {"n_raw", "R", "B", "I", "search_steps", "width", "total"}
for arch in (80, 90):
    for fn, block in ((k.rows_kernel, fused._ROW_BLOCK), (k.ids_kernel, fused._ID_BLOCK)):
        for has in (False, True):
            consts = dict(HAS_SAMPLED=has, BLOCK=block)
            names = fn.arg_names
            sig = {n: "constexpr" if n in consts else "i64" if n in scalars else pointers.get(n, "*i64") for n in names}
            out = triton.compile(ASTSource(fn=fn, signature=sig, **{values: consts}), target=GPUTarget("cuda", arch, 32))
            print(arch, fn.__name__, has, len(out.asm["cubin"]))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the tests above compile the kernels and run them")
def test_the_kernels_compile_for_ampere_and_hopper():
    """What the interpreter does not check: Triton's compiler takes both kernels, with and without
    sampled tokens, down to a cubin for sm_80 and sm_90 (Triton's own ptxas, no GPU needed)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 8 and all(int(size) > 10000 for *_, size in lines), done.stdout


def test_the_kernels_serve_by_default_only_after_decoding_a_known_batch(monkeypatch):
    """The once-a-device check before the kernels serve: passes here; a kernel that fails (a Triton
    that cannot compile them) or decodes wrongly, in either compiled form (with sampled ids, and
    without as NeMo-RL's and verl's batches decode), is named in a warning and the reference serves."""
    fused.known_batch_passes.cache_clear()
    assert fused.known_batch_passes(DEVICE)

    def broken(*args, **kwargs):
        raise RuntimeError("PTX JIT compilation failed")

    def wrong(raw, table, ones_len, ones_gap, sampled, width):
        values, flags = real(raw, table, ones_len, ones_gap, sampled, width)
        return values.flip(1), flags

    def wrong_without_sampled(raw, table, ones_len, ones_gap, sampled, width):
        # the form NeMo-RL's and verl's batches decode with: compiled apart, checked apart
        values, flags = real(raw, table, ones_len, ones_gap, sampled, width)
        return (values if sampled is not None else values.flip(1)), flags

    def broken_without_sampled(raw, table, ones_len, ones_gap, sampled, width):
        if sampled is None:
            raise RuntimeError("ptxas fatal")
        return real(raw, table, ones_len, ones_gap, sampled, width)

    real = fused.decode_fixed
    for fake, said in ((broken, "with sampled ids, RuntimeError: PTX JIT compilation failed"),
                       (wrong, "with sampled ids, rows that differ from the reference"),
                       (wrong_without_sampled, "without sampled ids, rows that differ from the reference"),
                       (broken_without_sampled, "without sampled ids, RuntimeError: ptxas fatal")):
        fused.known_batch_passes.cache_clear()
        monkeypatch.setattr(fused, "decode_fixed", fake)
        with pytest.warns(RuntimeWarning, match=f"fused compact decode failed its check on {DEVICE.type}.*{said}"):
            assert not fused.known_batch_passes(DEVICE)
    fused.known_batch_passes.cache_clear()
