"""The code blocks of README.md and docs/*.md run, so the docs cannot drift from the code.

The rule, for anyone writing docs (it is the whole rule):

- A ```` ```python ```` or ```` ```bash ```` (or ``sh``) block runs. The blocks of one file run in order, in
  one fresh Python process, in one empty temporary folder: a block sees the names and the files of the
  blocks before it. In shell blocks ``onnxtrain`` is this checkout's command line.
- What a reader need not see (a model to train, a batch) goes in a hidden setup comment right before the
  block's fence, run as Python just before the block, in the same process::

      <!-- setup:
      model = torch.nn.Linear(4, 2)
      -->

  The setup sees ``REPO`` (this checkout's root, a ``pathlib.Path``).
- A block that must not run says so, and why, in its fence: ```` ```bash no-run: installs packages ````
  (renderers take the first word as the language and ignore the rest). The reason is the test's skip
  reason (``pytest -rs``).
- Blocks in other languages (``text``, ``json``, ``diff``, ``js``, ...) are not programs this test runs;
  they are listed as skipped with that reason. A fence without a language fails the test: say what it is.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"python": "python", "bash": "bash", "sh": "bash"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
SETUP = re.compile(r"<!--\s*setup:\s*\n(?P<code>.*?)-->\s*$", re.S)


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    info: str
    code: str
    setup: str = ""

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def skip_reason(self) -> str | None:
        """Why this block does not run, or None when it runs."""
        marker = re.search(r"\bno-run\b:?\s*(.*)", self.info)
        if marker:
            return f"{self.where}: marked no-run: {marker.group(1).strip() or '(no reason given)'}"
        if self.language not in RUNNABLE:
            return f"{self.where}: a {self.language} block, not a program this test runs"
        return None


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, start = match.group("fence"), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        before = "\n".join(lines[max(0, start - 40):start])
        setup = SETUP.search(before)
        found.append(Block(path, start + 1, match.group("info").strip(),
                           textwrap.dedent("\n".join(lines[start + 1:end])) + "\n",
                           setup.group("code") if setup else ""))
        i = end + 1
    return found


ALL_BLOCKS = [b for path in DOC_FILES for b in blocks_of(path)]

RUNNER = textwrap.dedent("""
    import json, os, pathlib, subprocess, sys
    blocks = json.loads(sys.stdin.read())
    namespace = {"__name__": "__main__", "REPO": pathlib.Path(os.environ["DOCS_REPO"])}
    shell_prelude = f'set -euo pipefail\\nonnxtrain() {{ "{sys.executable}" -m onnxtrain "$@"; }}\\n'
    for block in blocks:
        print(f"--- {block['where']}", flush=True)
        if block["setup"]:
            exec(compile(block["setup"], block["where"] + " (setup)", "exec"), namespace)
        if block["language"] == "python":
            exec(compile(block["code"], block["where"], "exec"), namespace)
        else:
            subprocess.run(["bash", "-c", shell_prelude + block["code"]], check=True)
""")


def test_every_fence_says_what_it_is():
    unmarked = [b.where for b in ALL_BLOCKS if not b.language]
    assert unmarked == [], ("fences without a language (use python/bash to run it, `bash no-run: why` to "
                            "show a command that must not run here, or text/json/...): " + ", ".join(unmarked))


SWITCH = re.compile(r"""["'](ONNXTRAIN_[A-Z0-9_]+)["']""")  # an environment variable's name, as src/ spells it


def test_every_environment_switch_is_documented():
    """Every ``ONNXTRAIN_*`` environment variable that src/ names as a string is named in README.md or docs/ (a
    history file, a record of what was, does not count)."""
    switches = {name for path in sorted((REPO / "src").rglob("*.py"))
                for name in SWITCH.findall(path.read_text(encoding="utf-8"))}
    assert "ONNXTRAIN_BACKEND" in switches, sorted(switches)  # the scan finds them: this check cannot pass empty
    docs = "\n".join(path.read_text(encoding="utf-8") for path in DOC_FILES if not path.stem.endswith("history"))
    undocumented = sorted(name for name in switches if not re.search(rf"\b{name}\b", docs))
    assert undocumented == [], f"environment switches read in src/ but named in no doc: {undocumented}"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.skip_reason() and b.language],
                         ids=lambda b: b.where)
def test_block_not_run(block):
    pytest.skip(block.skip_reason())


@pytest.mark.parametrize("path", [p for p in DOC_FILES if any(not b.skip_reason() for b in blocks_of(p))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_doc_blocks_run(path, tmp_path):
    import json
    import os

    runnable = [{"where": b.where, "language": RUNNABLE[b.language], "code": b.code, "setup": b.setup}
                for b in blocks_of(path) if not b.skip_reason()]
    env = {**os.environ, "DOCS_REPO": str(REPO), "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(runnable), capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, f"{path.name}: a block failed\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
