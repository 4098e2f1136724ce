"""``import raggedfsdp`` -- and importing every one of its submodules -- changes nothing global
(issue 18): no optimizer hook, no c10 flag, no torch patch, no module hook, default dtype, thread
count, signal handler, excepthook or warnings filter changed; the global optimizer step post-hook is
registered by the first ``fully_shard`` call, once.

Run in a fresh interpreter (this test process has long since called ``fully_shard``); the reference
is torch's own hook tables, c10's flag and the interpreter's state read before and after.
"""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = r"""
import ctypes, glob, json, os
import torch, torch.distributed as dist
import torch.optim.optimizer as o

def flag():
    lib = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")))[0]
    return bool(ctypes.c_bool.in_dll(ctypes.CDLL(lib), "FLAGS_caffe2_report_cpu_memory_usage").value)

import importlib, pkgutil, signal, sys, warnings
import torch.nn.modules.module as mm

def world():
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    return {
        "module_hooks": [len(getattr(mm, n)) for n in sorted(dir(mm)) if n.startswith("_global_") and
                         n.endswith("hooks")],
        "optim_hooks": [len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks)],
        "flag": flag(), "dtype": str(torch.get_default_dtype()), "threads": torch.get_num_threads(),
        "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)],
        "excepthook": repr(sys.excepthook), "warnings": len(warnings.filters),
        "propagate": ShardingPropagator.propagate.__code__.co_filename,
        "grad": torch.is_grad_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
    }

out = {"before": [len(o._global_optimizer_post_hooks), flag()]}
w0 = world()
import raggedfsdp, raggedfsdp.fsdp, raggedfsdp.app.models, raggedfsdp.app.train.trainer  # noqa: E401
raggedfsdp.fully_shard  # the lazy public name resolves
names = sorted(m.name for m in pkgutil.walk_packages(raggedfsdp.__path__, "raggedfsdp."))
for name in names:
    importlib.import_module(name)
out["modules"] = len(names)
out["world"] = [k for k, v in world().items() if v != w0[k]]
out["import"] = [len(o._global_optimizer_post_hooks), flag()]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
raggedfsdp.fully_shard(m[0])
out["first"] = [len(o._global_optimizer_post_hooks), flag()]
raggedfsdp.fully_shard(m)
out["second"] = [len(o._global_optimizer_post_hooks), flag()]
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_import_registers_nothing_first_fully_shard_registers_one_hook():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got.pop("modules") > 100  # every submodule was imported
    assert got.pop("world") == [], "importing these changed global state"
    assert got == {"before": [0, False], "import": [0, False], "first": [1, False], "second": [1, False]}, got


def test_help_and_version_import_no_torch():
    code = ("import sys; from raggedfsdp.app.cli import build_parser, main; build_parser(); "
            "assert main(['--version']) == 0; print('torch' in sys.modules)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"
