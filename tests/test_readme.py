"""Every Python block of README.md runs as written (on llvm), so the guide's examples cannot rot."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_python_block_runs(index, tmp_path, monkeypatch):
    if "torch" in BLOCKS[index]:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)  # what a block writes (an export) lands here
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {"__name__": "readme"})  # noqa: S102
