"""StridedView: every layout op against NumPy doing the same op on real arrays, and the cases
that only a copy could give (where it must say None)."""

import numpy as np
import pytest

from tvm_ext.schedules.strided_view import StridedView


def gathered(source: np.ndarray, view: StridedView) -> np.ndarray:
    """The elements `view` names, read from `source`'s memory."""
    return source.reshape(-1)[view.element(*np.indices(view.shape))]


B, S, H, D = 2, 5, 3, 4
PACKED = np.arange(B * S * 3 * H * D).reshape(B, S, 3 * H * D)  # BERT's qkv projection, [b, s, 3 * heads * dim]


def bert_q(index):
    """q (index 0), k (1) or v (2) of the packed projection, as the imported model slices it."""
    view = StridedView.contiguous(PACKED.shape).reshape([B, S, 3, H, D]).permute([2, 0, 3, 1, 4])
    return view.slice(0, index, 1, 1).squeeze([0]).broadcast([B, H, S, D]).reshape([B * H, S, D])


@pytest.mark.parametrize("index", [0, 1, 2])
def test_heads_sliced_from_a_packed_projection(index):
    want = PACKED.reshape(B, S, 3, H, D).transpose(2, 0, 3, 1, 4)[index].reshape(B * H, S, D)
    view = bert_q(index)
    np.testing.assert_array_equal(gathered(PACKED, view), want)
    assert view.offset == index * H * D and view.axes[0] == ((B, S * 3 * H * D), (H, D))  # batch x heads: 2 strides


def test_a_transposed_key_read_back_untransposed():
    kt = bert_q(1).reshape([B, H, S, D]).permute([0, 1, 3, 2]).reshape([B * H, D, S])
    np.testing.assert_array_equal(gathered(PACKED, kt.permute([0, 2, 1])), gathered(PACKED, bert_q(1)))


def test_merged_heads_written_where_the_rows_are():
    """The output [b * heads, s, dim] as a view of [b, s, heads * dim]: the inverse ops, last first."""
    out = StridedView.contiguous([B, S, H * D]).reshape([B, S, H, D]).permute([0, 2, 1, 3]).reshape([B * H, S, D])
    rows = np.arange(B * S * H * D).reshape(B, S, H * D)
    merged = rows.reshape(B, S, H, D).transpose(0, 2, 1, 3).reshape(B * H, S, D)
    np.testing.assert_array_equal(gathered(rows, out), merged)


def test_grouped_query_heads_broadcast_with_stride_zero():
    kv = np.arange(B * 2 * S * D).reshape(B, 2, S, D)
    view = StridedView.contiguous(kv.shape).expand_dims([2]).broadcast([B, 2, 3, S, D]).reshape([B * 6, S, D])
    np.testing.assert_array_equal(gathered(kv, view), np.broadcast_to(kv[:, :, None], (B, 2, 3, S, D)).reshape(B * 6, S, D))
    assert (3, 0) in view.axes[0]


def test_reshapes_of_transposes_are_views_until_sizes_do_not_divide():
    source = np.arange(24).reshape(6, 4)
    transposed = StridedView.contiguous([6, 4]).permute([1, 0])
    for shape in ([24], [4, 2, 3], [2, 12]):  # axes of two strides where a run crosses a transposed axis
        np.testing.assert_array_equal(gathered(source, transposed.reshape(shape)), source.T.reshape(shape))
    assert transposed.reshape([3, 8]) is None  # 8 is neither a multiple nor a divisor of the inner 6


def test_what_only_a_copy_gives_is_none():
    merged = StridedView.contiguous([6, 4]).permute([1, 0]).reshape([24])
    assert merged.slice(0, 0, 1, 4) is None  # slicing an axis of two strides
    assert StridedView.contiguous([3, 4]).broadcast([3, 5]) is None


def test_sixteen_byte_rows_need_unit_stride_and_aligned_starts():
    assert bert_q(1).unit_stride_rows(-1, 4)
    assert not bert_q(1).unit_stride_rows(-1, 8)  # rows start every 4 elements (D = 4)
    assert not StridedView.contiguous([8, 16]).permute([1, 0]).unit_stride_rows(-1, 8)
    assert not StridedView.contiguous([8, 16]).slice(1, 1, 1, 8).unit_stride_rows(-1, 8)  # starts at element 1
