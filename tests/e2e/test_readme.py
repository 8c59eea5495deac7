"""The README's Python blocks run as written, on CPU, the way a new user runs them: without the
suite's ``FUSION_DECIDE=fuse``.  A block that cannot run here (CUDA, a fragment) is marked with
``<!-- readme-test: skip (why) -->`` on the line before it; every other block runs.  A block that
defines ``test_*`` functions has them called (``fusion_rewrites`` gets the fixture's value); a block
that starts with ``# NAME.py`` runs as that file, and where the README quotes its output (the next
fenced block, after "`python NAME.py` prints"), the output must match, line for line, but the timings."""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import runpy
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"(?P<marker><!-- readme-test: skip \((?P<why>[^)]*)\) -->\n)?```python\n(?P<code>.*?)```", re.S)
#: What the README holds now: a new runnable block raises the first number, a new marked one the second.
EXPECTED_RUN, EXPECTED_SKIPPED = 2, 3


def _blocks() -> list[tuple[str | None, str, int]]:
    text = README.read_text()
    return [(m.group("why"), m.group("code"), m.end()) for m in _BLOCK.finditer(text)]


def _quoted_output(end: int, name: str) -> list[str] | None:
    """The fenced block after "`python NAME.py` prints" that follows a block ending at ``end``."""
    rest = README.read_text()[end:]
    m = re.search(r"^```\w*\n(?P<out>.*?)^```", rest, re.S | re.M)
    if m is None or f"`python {name}` prints" not in rest[:m.start()]:
        return None
    return m.group("out").splitlines()


def test_every_runnable_python_block_of_the_readme_runs(tmp_path, monkeypatch, capsys):
    from fusion_backend.report import collect_reports
    from fusion_backend.testing import FusionRewrites

    monkeypatch.delenv("FUSION_DECIDE", raising=False)
    monkeypatch.chdir(tmp_path)
    ran, skipped = 0, 0
    for why, code, end in _blocks():
        if why is not None:
            skipped += 1
            continue
        first = code.splitlines()[0]
        name = first[2:].strip() if re.fullmatch(r"# \w+\.py", first) else f"readme_block_{ran}.py"
        path = tmp_path / name
        path.write_text(code)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            namespace = runpy.run_path(str(path), run_name="__main__")
        for test_name, fn in namespace.items():
            if test_name.startswith("test_") and callable(fn):
                if "fusion_rewrites" in inspect.signature(fn).parameters:
                    with collect_reports(FusionRewrites()) as reports:
                        fn(reports)
                else:
                    fn()
        quoted = _quoted_output(end, name)
        if quoted is not None:
            printed = out.getvalue().splitlines()
            def comparable(lines: list[str]) -> list[str]:  # graphs are numbered per process
                return [re.sub(r"graph \d+ \(graph_\d+\)", "graph N", line) for line in lines
                        if not line.strip().startswith("time:")]

            strip, got = comparable(quoted), comparable(printed)
            assert got == strip, f"{name} printed:\n" + "\n".join(printed)
        ran += 1
    print(f"README: {ran} python blocks ran, {skipped} marked as not runnable here")
    assert (ran, skipped) == (EXPECTED_RUN, EXPECTED_SKIPPED)


@pytest.mark.parametrize("why, code, end", _blocks())
def test_a_readme_block_is_runnable_or_says_why_not(why, code, end):
    assert why is None or why.strip(), "a skipped README block must say why"
