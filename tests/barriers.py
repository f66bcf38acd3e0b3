"""A static check of generated CUDA: no block-wide barrier under a branch on the thread index."""

import re


def divergent_barriers(src: str) -> list[str]:
    """Lines with `__syncthreads()` nested in an `if` whose condition reads threadIdx."""
    found, stack = [], []
    for number, line in enumerate(src.splitlines(), 1):
        text = line.strip()
        if "__syncthreads()" in text and any(stack):
            found.append(f"{number}: {text}")
        opens, closes = text.count("{"), text.count("}")
        for _ in range(closes):
            if stack:
                stack.pop()
        divergent = bool(re.match(r"(\} else )?if \(.*threadIdx", text))
        stack.extend([divergent] * opens)
    return found
