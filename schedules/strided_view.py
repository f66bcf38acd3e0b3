"""Where each element of a tensor lies in another tensor's memory, across reshapes, transposes, slices and broadcasts.

Lets a kernel read operands where their producer left them and write where the consumer wants
them, instead of after copy kernels. A view gives each logical axis as (size, stride) pieces,
outer first; broadcast axes have stride 0; size-1 pieces are dropped."""

from __future__ import annotations

import math
from dataclasses import dataclass

Piece = tuple[int, int]  # (size, stride in elements)


@dataclass(frozen=True)
class StridedView:
    axes: tuple[tuple[Piece, ...], ...]
    offset: int = 0

    @staticmethod
    def contiguous(shape) -> StridedView:
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        return StridedView(tuple(_pieces([(n, s)]) for n, s in zip(shape, strides)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(math.prod(size for size, _ in axis) for axis in self.axes)

    def reshape(self, shape) -> StridedView | None:
        """The view of a reshape, or None where one new axis would need two unrelated strides
        that do not divide into each other's pieces (only a copy could give it)."""
        pieces = [p for axis in self.axes for p in axis]
        new_axes = []
        for n in reversed(list(shape)):
            taken = []
            while n > 1:
                if not pieces:
                    return None
                size, stride = pieces.pop()
                if n % size == 0:
                    taken.insert(0, (size, stride))
                    n //= size
                elif size % n == 0:  # split the piece: its inner n here, the rest for outer axes
                    taken.insert(0, (n, stride))
                    pieces.append((size // n, stride * n))
                    n = 1
                else:
                    return None
            new_axes.insert(0, tuple(taken))
        return None if pieces else StridedView(tuple(new_axes), self.offset)

    def permute(self, order) -> StridedView:
        return StridedView(tuple(self.axes[a] for a in order), self.offset)

    def slice(self, axis: int, begin: int, step: int, size: int) -> StridedView | None:
        """Elements begin, begin + step, ... (size of them) of one axis; None for a merged axis."""
        pieces = self.axes[axis]
        if len(pieces) > 1 or step < 1:
            return None
        stride = pieces[0][1] if pieces else 0
        axes = list(self.axes)
        axes[axis] = _pieces([(size, stride * step)])
        return StridedView(tuple(axes), self.offset + begin * stride)

    def squeeze(self, axes) -> StridedView:
        return StridedView(tuple(a for i, a in enumerate(self.axes) if i not in set(axes)), self.offset)

    def expand_dims(self, axes) -> StridedView:
        new = list(self.axes)
        for a in sorted(axes):
            new.insert(a, ())
        return StridedView(tuple(new), self.offset)

    def broadcast(self, shape) -> StridedView | None:
        """`broadcast_to(shape)`: new leading axes and size-1 axes repeat with stride 0."""
        lead = len(shape) - len(self.axes)
        if lead < 0:
            return None
        axes = [_pieces([(n, 0)]) for n in shape[:lead]]
        for axis, have, want in zip(self.axes, self.shape, shape[lead:]):
            if have != want and have != 1:
                return None
            axes.append(axis if have == want else _pieces([(want, 0)]))
        return StridedView(tuple(axes), self.offset)

    def element(self, *indices):
        """The flat offset of the element at these logical indices (ints, numpy arrays or TIR
        expressions: only +, *, // and % are used); sizes and strides may be TIR expressions too
        (a view over a symbolic length, tvm_ext/relax/attention.py)."""
        total = self.offset
        for index, pieces in zip(indices, self.axes):
            for i, (size, stride) in enumerate(pieces):
                inner = math.prod(n for n, _ in pieces[i + 1:])  # a product, not a quotient: symbolic sizes stay exact
                if stride == 0:
                    continue
                term = index if isinstance(inner, int) and inner == 1 else index // inner
                term = term % size if i > 0 else term
                total = total + term * stride
        return total

    def covers(self, shape) -> bool:
        """Whether the view reaches every element of a contiguous tensor of `shape`: its pieces
        other than broadcasts hold as many elements as the tensor, from its start."""
        return self.offset == 0 and math.prod(size for axis in self.axes for size, stride in axis if stride != 0) \
            == math.prod(shape)

    def first_of_repeats(self, axis: int, index) -> list:
        """Conditions (one per broadcast piece of `axis`) that `index` is the first of the indices
        along `axis` that the broadcast gives the same elements: the one that writes them."""
        pieces = self.axes[axis]
        return [index // math.prod(n for n, _ in pieces[i + 1:]) % size == 0
                for i, (size, stride) in enumerate(pieces) if stride == 0]

    def unit_stride_rows(self, axis: int, alignment: int) -> bool:
        """Whether `axis` is one piece of stride 1 and every other element of the view starts
        on a multiple of `alignment` (what 16-byte vector copies of that axis need)."""
        others = [stride for i, axis_pieces in enumerate(self.axes) if i != axis % len(self.axes)
                  for _, stride in axis_pieces]
        return len(self.axes[axis]) == 1 and self.axes[axis][0][1] == 1 and self.offset % alignment == 0 \
            and all(stride % alignment == 0 for stride in others)


def _pieces(pieces) -> tuple[Piece, ...]:
    return tuple((size, stride) for size, stride in pieces if size != 1)
