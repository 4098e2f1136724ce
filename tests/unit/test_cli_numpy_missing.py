"""The library needs torch alone, the application numpy too: a command run where numpy is missing ends
in one line naming the fix, not a traceback (found by a fresh-user trial in a torch-only venv)."""

from __future__ import annotations

import subprocess
import sys


def test_a_command_without_numpy_is_one_line():
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'numpy' or name.startswith('numpy.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from raggedfsdp.app.cli import main\n"
        "from raggedfsdp.app.commands import train\n"
        "train.run_train = lambda args: __import__('numpy')\n"
        "sys.exit(main(['train', '--steps', '1']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs numpy" in lines[0] and "pip install numpy" in lines[0], r.stderr
