"""Register-fragment views of warp-level MMA tiles (pure layout algebra, no instructions), and
reductions over the four lanes (a quad) that share an accumulator row."""


import cutlass.cute as cute


def mn_view(acc: cute.Tensor) -> cute.Tensor:
    """Re-view an m16n8 accumulator fragment ((2, 2), M, N) as (rows, cols).

    In the fragment's first mode, the inner 2 is a pair of adjacent columns and the outer 2 the
    rows r and r + 8, so rows = (outer 2, M) and cols = (inner 2, N).
    """
    shape = acc.layout.shape
    compact = cute.make_layout(shape)
    mn = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[2])),
        stride=((compact.stride[0][1], compact.stride[1]),
                (compact.stride[0][0], compact.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_as_operand_a(layout: cute.Layout) -> cute.Layout:
    """((2, 2), M, N) accumulator of m16n8 tiles -> ((2, 2, 2), M, N / 2) A operand of m16n8k16.

    Two neighbouring n8 accumulator tiles hold exactly the registers one k16 A tile needs.
    """
    split = cute.logical_divide(layout, (None, None, 2))
    return cute.make_layout(
        ((split.shape[0], split.shape[2][0]), split.shape[1], split.shape[2][1]),
        stride=((split.stride[0], split.stride[2][0]), split.stride[1], split.stride[2][1]),
    )


def acc_as_fp8_operand_a(layout: cute.Layout) -> cute.Layout:
    """((2, 2), M, N) accumulator -> the 16 values of m16n8k32 e4m3 A tiles, (16, M, N / 4).

    A register a_v holds (row g + 8·r, key 16·h + 4t + i) for v = i + 4r + 8h. From four
    neighbouring n8 tiles j the thread holds (row g + 8·r, key 8j + 2t + c). Taking
    a_v = tile (2h + i // 2), column c = i % 2, row r gives key 16h + 8(i // 2) + 2t + i % 2
    for position 16h + 4t + i: the permutation Vᵀ's keys are stored in
    (``flashcore.ops.fp8.key_permutation``).
    """
    (s_c, s_r), s_m, s_n = layout.stride
    _, m, n = layout.shape
    return cute.make_layout(
        (((2, 2), 2, 2), m, n // 4),
        stride=(((s_c, s_n), s_r, 2 * s_n), s_m, 4 * s_n),
    )


def quad_max(x):
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


def quad_sum(x):
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)
