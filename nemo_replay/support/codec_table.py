"""The columns of the compact codec's per-buffer table: the integers a device decode reads, one row a
buffer, which :func:`~nemo_replay.support.codec._parse` lays out on the host and both device
decoders read (:func:`~nemo_replay.support.codec._decode`, :mod:`~nemo_replay.support.fused_kernels`).

First what each row takes from its buffer: the length parameter (``LB``), ``V``, 1 when the
sampled ids were dropped (``DROP``), the row width, the buffer's first row in the batch, the ids
a row is coded among (``UNIVERSE``: ``V - DROP``), the length parameter's mask, and where (in bits
of the streams) the length and the gap low-bit streams start. Then: the buffer's rows, coded ids,
the row after its last, the four streams' offsets and sizes in bytes, and for each unary stream
kind the seven integers :func:`~nemo_replay.support.codec._unary_columns` gives.
"""

LB, V, DROP, WIDTH, FIRST_ROW, UNIVERSE, MASK, LEN_LOW, GAP_LOW = range(9)
ROWS, IDS, END_ROW, AT, SIZE, LEN_UNARY, GAP_UNARY, COLUMNS = 9, 10, 11, 12, 16, 20, 27, 34
MAX_V = 2**31 - 1  # the largest vocabulary a buffer codes: ids and lengths fit int32
NEVER = 2**62  # a bound no bit position or id reaches
